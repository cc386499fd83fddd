"""E9 the expert layer in training, forward + backward (experiments/e9_moe_train.py): the numbers and the
table, when measured."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import Numbers, gm, table

OURS, OURS_SAVE = "ours:moe_ffn", "ours:moe_ffn:save-gate-up"
TORCH, TORCH_COMPILED = "torch._grouped_mm pipeline", "torch._grouped_mm pipeline:compiled"
HF_COMPILED, UNSLOTH, LOOP = "hf:grouped_mm:compiled", "unsloth:grouped_gemm", "per-expert-loop"
PEERS = (TORCH, TORCH_COMPILED, HF_COMPILED, UNSLOTH)  # timed on the GPU clock (the loop: launch clock only)


def e9_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, split, tokens, load) and contender: GPU time and launch-inclusive time of the step
    (fwd+bwd), of the forward alone (fwd) and of the backward (their difference), and the step's peak
    memory; rows that failed are absent."""
    ok = df[df.status == "ok"]
    keys = ["model", "split", "tokens", "load", "contender"]
    out = None
    for phase, tag in (("fwd+bwd", "step"), ("fwd", "fwd")):
        cols = {"graph_us": f"{tag}_us", "launch_us": f"{tag}_launch_us"}
        if tag == "step":
            cols["peak_mem_bytes"] = "peak_bytes"
        part = ok[ok.phase == phase][keys + [c for c in cols if c in ok]].rename(columns=cols)
        out = part if out is None else out.merge(part, on=keys, how="outer")
    if out is None or out.empty:
        return pd.DataFrame(columns=keys)
    for c in ("step_us", "fwd_us", "step_launch_us", "fwd_launch_us", "peak_bytes"):
        if c not in out:
            out[c] = float("nan")
    out["bwd_us"] = out.step_us - out.fwd_us
    return out


def ratios(f: pd.DataFrame, peer: str, col: str) -> pd.Series:
    """Per cell, ``peer``'s ``col`` over ours (their time / ours: above 1, ours is faster or smaller)."""
    cell = ["model", "split", "tokens", "load"]
    a = f[f.contender == peer].set_index(cell)[col]
    b = f[f.contender == OURS].set_index(cell)[col]
    return (a / b).dropna()


def e9(n: Numbers, results: Path, gen: Path) -> None:
    path = results / "moe_train.csv"
    if not path.exists():
        return
    f = e9_frame(pd.read_csv(path))
    if f.empty or not (f.contender == OURS).any():
        return
    held = f[f.split == "heldout"]
    n.add("ENineModels", f.model.nunique(), "{}")
    n.add("ENineHeldModels", held.model.nunique(), "{}")
    peers = [p for p in PEERS if (held.contender == p).any()]
    if peers:
        cell = ["model", "split", "tokens", "load"]
        piv = held.pivot_table(index=cell, columns="contender", values="step_us")
        best = piv[peers].min(axis=1)
        r = (best / piv[OURS]).dropna()
        pb = held.pivot_table(index=cell, columns="contender", values="bwd_us")
        rb = (pb[peers].min(axis=1) / pb[OURS]).dropna()
        if len(r):
            n.add("ENineHeldVsPeer", gm(r))
            n.add("ENineHeldVsPeerMin", float(r.min()))
            n.add("ENineHeldCells", len(r), "{}")
            n.add("ENineHeldCellsAboveTarget", int((r >= 1.05).sum()), "{}")
        if len(rb):
            n.add("ENineHeldBwdVsPeer", gm(rb))
    mem = ratios(f, TORCH, "peak_bytes")
    if len(mem):
        n.add("ENineMemVsTorch", gm(mem))
        n.add("ENineMemVsTorchMin", float(mem.min()))
        n.add("ENineMemCellsNotAbove", int((mem >= 1).sum()), "{}")
        n.add("ENineMemCells", len(mem), "{}")
    save = ratios(f, OURS_SAVE, "step_us")
    if len(save):
        n.add("ENineSaveOverRecompute", gm(save))
    rows = []
    for t in sorted(held.tokens.unique()):
        h = held[held.tokens == t]
        row = {"T": int(t)}
        for p in peers + ([LOOP] if (h.contender == LOOP).any() else []):
            row[f"{p} GPU"] = gm(ratios(h, p, "step_us")) if p != LOOP else float("nan")
            row[f"{p} launch"] = gm(ratios(h, p, "step_launch_us"))
            row[f"{p} mem"] = gm(ratios(h, p, "peak_bytes")) if p != LOOP else float("nan")
        rows.append(row)
    if rows:
        tab = pd.DataFrame(rows)
        write_text(
            gen / "table_e9.tex",
            table(
                tab,
                "E9, held-out models: each peer's forward + backward time over ours (GPU clock, "
                "launch-inclusive clock) and its step's peak memory over ours, geomean over models and loads, "
                "by tokens per step T.",
                "tab:e9",
                "r" + "r" * (len(tab.columns) - 1),
            ),
        )
