"""E4 split sweep: the numbers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .common import Numbers


def e4(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "split_sweep.csv")
    df = df[df.status == "ok"]
    m = int(df.m.min())  # the M = N Figure e4 draws (figures/e4_split_sweep.py), one line per K
    n.add("EFourM", m, "{}")
    n.add("EFourKs", ", ".join(str(int(k)) for k in sorted(df[df.m == m].k.unique())))
    best = df.loc[df.groupby(["m", "k", "variant"])["graph_us"].idxmin()]
    for v, tag in {"two_stage": "TwoStage", "flat": "Flat", "single_launch": "SingleLaunch"}.items():
        b = best[best.variant == v]  # the range of the per-shape fastest S of each of our reducers
        lo, hi = int(b.split_k.min()), int(b.split_k.max())
        n.add(f"EFourBestS{tag}", f"{lo}--{hi}" if hi > lo else str(lo))
