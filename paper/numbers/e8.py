"""E8 the expert FFN end to end (experiments/e8_moe_layer.py): the numbers and the table, when measured."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text
from .common import Numbers, gm, table

OURS, UNFUSED = "ours:moe_ffn", "ours:unfused-swiglu"
HF_COMPILED, TORCH, VLLM = "hf:grouped_mm:compiled", "torch._grouped_mm pipeline", "vllm:fused_experts"
OURS_HF, OURS_HF_COMPILED = "ours:hf-backend", "ours:hf-backend:compiled"
PREFILL = 1024


def e8_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, split, tokens, load): each contender's GPU time as a column (rows that failed: absent),
    and ``best_peer``, the faster of transformers' compiled grouped_mm backend (where measured) and the
    torch._grouped_mm pipeline."""
    ok = df[df.status == "ok"]
    p = ok.pivot_table(index=["model", "split", "tokens", "load"], columns="contender", values="graph_us")
    peers = [c for c in (HF_COMPILED, TORCH) if c in p]
    p["best_peer"] = p[peers].min(axis=1) if peers else float("nan")
    return p.reset_index()


def e8(n: Numbers, results: Path, gen: Path) -> None:
    path = results / "moe_layer.csv"
    if not path.exists():
        return
    o = e8_frame(pd.read_csv(path))
    if o.empty or OURS not in o:
        return
    held = o[o.split == "heldout"]
    n.add("EEightModels", o.model.nunique(), "{}")
    n.add("EEightCells", len(o), "{}")
    for tag, c in (("Held", held), ("All", o)):
        r = (c.best_peer / c[OURS]).dropna()
        if len(r):
            n.add(f"EEight{tag}VsPeer", gm(r))
            n.add(f"EEight{tag}VsPeerMin", float(r.min()))
            n.add(f"EEight{tag}SlowerPeer", int((r < 1).sum()), "{}")
            n.add(f"EEight{tag}PeerCells", len(r), "{}")
    pre = held[held.tokens >= PREFILL]
    if VLLM in o and len(pre):
        v = (pre[VLLM] / pre[OURS]).dropna()
        n.add("EEightHeldPrefillVsVllm", gm(v))
        n.add("EEightHeldPrefillVsVllmMin", float(v.min()))
    if UNFUSED in o:
        f = (o[UNFUSED] / o[OURS]).dropna()
        n.add("EEightFusionGain", gm(f))
        n.add("EEightFusionGainMin", float(f.min()))
        n.add("EEightFusionSlower", int((f < 1).sum()), "{}")
    if OURS_HF_COMPILED in o and OURS_HF in o:
        cmp = (o[OURS_HF] / o[OURS_HF_COMPILED]).dropna()
        if len(cmp):
            n.add("EEightCompiledVsEager", gm(cmp))
            n.add("EEightCompiledVsEagerMin", float(cmp.min()))
    rows = []
    for model, m in held.groupby("model", sort=False):
        r = m.best_peer / m[OURS]
        row = {"model": model, "vs best peer": f"{gm(r):.2f} ({r.min():.2f})"}
        if VLLM in m:
            pm = m[m.tokens >= PREFILL]
            row["prefill vs vLLM"] = f"{gm(pm[VLLM] / pm[OURS]):.2f}"
        if UNFUSED in m:
            row["fused SwiGLU gain"] = f"{gm(m[UNFUSED] / m[OURS]):.2f}"
        rows.append(row)
    if rows:
        write_text(gen / "table_e8.tex", table(
            pd.DataFrame(rows), "E8, held-out models: the whole expert FFN (\\texttt{moe\\_ffn}) against the faster of "
            "transformers' compiled \\texttt{grouped\\_mm} backend and the \\texttt{torch.\\_grouped\\_mm} pipeline, "
            "and against vLLM's kernel at prefill; their time over ours, geomean (lowest) over token counts and "
            "loads; GPU time. Last column: our time with SwiGLU as a separate op over the fused one.",
            "tab:e8", "l" + "r" * (len(rows[0]) - 1)))
