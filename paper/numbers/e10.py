"""E10's numbers: block-scaled FP8 experts (results/<gpu>/fp8_grouped.csv) against the peers that serve them
and against our bf16 path, per phase (decode and prefill, never pooled) and on both clocks, with intervals;
the held-out models and DeepSeek-V3 (the tune split) apart; each GEMM alone (gate/up and down) and the whole
layer apart; the peers that could not run, named with why; how many of our cells passed their check."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import CLOCKS, Numbers, phase_ci_text, phase_headline, table

KEYS = ["model", "proj", "tokens", "load"]
OURS_GEMM, OURS_MASKED, OURS_BF16 = "ours:fp8", "ours:fp8-masked", "ours:bf16"
OURS_LAYER, LAYER_BF16, VLLM_LAYER = "ours:moe_ffn-fp8", "ours:moe_ffn-bf16", "vllm:fused_experts-fp8"
# each GEMM peer as the numbers' names and the table's rows call it (experiments/fp8_peers.py's names)
GEMM_PEERS = {
    "vllm:fused_moe-fp8": ("Vllm", "vLLM fused\\_moe (block FP8)"),
    "deepgemm:contiguous": ("DeepgemmContiguous", "DeepGEMM contiguous"),
    "deepgemm:masked": ("DeepgemmMasked", "DeepGEMM masked"),
    "torch._scaled_grouped_mm": ("Torch", "torch.\\_scaled\\_grouped\\_mm"),
    "tk:matmul_ogs-fp8": ("Tk", "triton\\_kernels matmul\\_ogs"),
    OURS_BF16: ("Bf", "ours, bf16"),
}
LAYER_PEERS = {VLLM_LAYER: ("Vllm", "vLLM fused\\_experts (block FP8)"), LAYER_BF16: ("Bf", "ours, bf16")}
SPLITS = (("Held", "held-out models"), ("Dsv", "DeepSeek-V3"))


def split_of(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """The rows of the held-out models ("Held") or of DeepSeek-V3 ("Dsv")."""
    return df[df.split == "heldout"] if name == "Held" else df[df.model == "deepseek-v3"]


def headline_rows(df: pd.DataFrame) -> list[dict]:
    """Per part (each GEMM alone, the layer), peer and phase: their time over ours with its interval on both
    clocks and the cells (phase_headline's rows, with ``part`` and the peer's ``tag`` and ``label``); only
    rows with cells. Our contiguous FP8 GEMM is the one compared (at decode the masked layout is a peer's
    question: DeepGEMM's masked GEMM against ours, below)."""
    out = []
    for part, ours, peers, sub in (
        ("Gemm", OURS_GEMM, GEMM_PEERS, df[df.proj.isin(["up", "down"])]),
        ("Layer", OURS_LAYER, LAYER_PEERS, df[df.proj == "ffn"]),
    ):
        for peer, (tag, label) in peers.items():
            for r in phase_headline(sub, KEYS, peer, ours):
                if any(r[f"{c}_cells"] for c in CLOCKS):
                    out.append(dict(r, part=part, tag=tag, label=label))
    masked = df[df.proj.isin(["up", "down"])]
    for r in phase_headline(masked, KEYS, "deepgemm:masked", OURS_MASKED):
        if r["phase"] == "decode" and any(r[f"{c}_cells"] for c in CLOCKS):
            out.append(dict(r, part="Masked", tag="DeepgemmMasked", label="DeepGEMM masked"))
    return out


def unrunnable(df: pd.DataFrame) -> dict[str, str]:
    """{contender: why} of the contenders that could not run here (the first reason each row gives)."""
    bad = df[df.status == "not runnable"]
    return {c: str(g.note.iloc[0]) for c, g in bad.groupby("contender", sort=True)}


def e10(n: Numbers, results: Path, gen: Path) -> None:
    path = results / "fp8_grouped.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    ours = df[df.contender.isin([OURS_GEMM, OURS_MASKED, OURS_LAYER])]
    n.add("ETenOursCells", len(ours), "{}")
    n.add("ETenOursPassed", int((ours.status == "ok").sum()), "{}")
    why = unrunnable(df)
    n.add("ETenUnrunnable", "; ".join(f"{c}: {w}" for c, w in why.items()) or "none", "{}")
    rows = []
    for name, split in SPLITS:
        for r in headline_rows(split_of(df, name)):
            phase = r["phase"].capitalize()
            for clock, word in (("graph", "Gpu"), ("launch", "Launch")):
                n.add(f"ETen{name}{r['part']}{phase}Vs{r['tag']}{word}", phase_ci_text(r, clock), "{}")
            rows.append(
                {
                    "models": split,
                    "part": {"Gemm": "GEMM", "Layer": "layer", "Masked": "GEMM, masked"}[r["part"]],
                    "peer": r["label"],
                    "phase": r["phase"],
                    "GPU time": phase_ci_text(r, "graph"),
                    "launch-inclusive": phase_ci_text(r, "launch"),
                    "cells": r["graph_cells"],
                }
            )
    if rows:
        write_text(
            gen / "table_e10.tex",
            table(
                pd.DataFrame(rows),
                "E10: block-scaled FP8 experts (e4m3; a scale per token and 128 channels of the "
                "activations, per 128 x 128 block of the weights). Each peer's time over ours, geomean over "
                "the cells of the phase with its 95\\% bootstrap interval (``parity'' where it holds 1.0), "
                "on both clocks; each GEMM alone against our contiguous FP8 GEMM (the masked rows: against "
                "our masked one), the layer against our FP8 \\texttt{moe\\_ffn}; the held-out models and "
                "DeepSeek-V3 apart.",
                "tab:e10",
                "llllrrr",
                raw=("peer",),
                long=True,
            ),
        )
