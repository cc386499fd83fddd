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
    n.add("EFourMs", ", ".join(str(int(v)) for v in sorted(df.m.unique())))  # every M = N the sweep ran
    n.add("EFourAllKs", ", ".join(str(int(k)) for k in sorted(df.k.unique())))
    # launch-inclusive at that M: each reducer at its fastest S on that clock; the two-launch reducers
    # (two_stage, flat) as a range over them and the K measured, the single launch alone
    at_m = df[(df.m == m) & df.launch_us.notna()]
    fast = at_m.groupby(["k", "variant"]).launch_us.min().reset_index()
    two = fast[fast.variant.isin(["two_stage", "flat"])].launch_us
    one = fast[fast.variant == "single_launch"].launch_us
    if len(two) and len(one):
        n.add("EFourLaunchTwoLo", float(two.min()), "{:.0f}")
        n.add("EFourLaunchTwoHi", float(two.max()), "{:.0f}")
        n.add("EFourLaunchSingle", float(one.max()), "{:.1f}")
    best = df.loc[df.groupby(["m", "k", "variant"])["graph_us"].idxmin()]
    for v, tag in {"two_stage": "TwoStage", "flat": "Flat", "single_launch": "SingleLaunch"}.items():
        b = best[best.variant == v]  # the range of the per-shape fastest S of each of our reducers
        lo, hi = int(b.split_k.min()), int(b.split_k.max())
        n.add(f"EFourBestS{tag}", f"{lo}--{hi}" if hi > lo else str(lo))
