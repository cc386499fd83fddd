"""E4 split sweep: the numbers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .common import Numbers, gm


def e4(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "split_sweep.csv")
    df = df[df.status == "ok"]
    best = df.loc[df.groupby(["m", "k", "variant"])["graph_us"].idxmin()]
    for v, tag in {
        "two_stage": "TwoStage",
        "flat": "Flat",
        "single_launch": "SingleLaunch",
        "seed:original": "SeedOrig",
        "seed:optimized": "SeedOpt",
        "pytorch:decompose_k": "Pytorch",
    }.items():
        b = best[best.variant == v]
        if b.empty:  # the seed's Triton kernels: only where their source was at hand when E4 ran
            continue
        n.add(f"EFourBestS{tag}", f"{int(b.split_k.min())}--{int(b.split_k.max())}")
    # Penalty of a fixed S=64 against the per-shape best, for our flat kernel.
    flat = df[df.variant == "flat"]
    p = flat.pivot_table(index=["m", "k"], columns="split_k", values="graph_us")
    if 64 in p.columns:
        n.add("EFourFixedSixtyFourPenalty", gm(p[64] / p.min(axis=1)))
