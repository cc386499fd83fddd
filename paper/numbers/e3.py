"""E3 epilogue fusion: the numbers and table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import Numbers, gm, paired_rounds, ratio_ci_text, table


def default_fusion(n: Numbers, df: pd.DataFrame) -> None:
    """What fusing ReLU into the store buys our default kernel (single_launch), unfused time over fused, with
    its 95% interval over shapes (and rounds), both clocks: EThreeSingleLaunch<Graph|Launch>Ci. The paper's
    and the README's fusion headline."""
    default = df[df.variant == "single_launch"].assign(
        contender=lambda d: d.epilogue_fused.astype(str).map({"True": "fused", "False": "unfused"})
    )
    for clock, ctag in (("graph", "Graph"), ("launch", "Launch")):
        theirs, ours, cells = paired_rounds(default, ["m", "k"], "unfused", "fused", clock)
        if len(cells):
            n.add(f"EThreeSingleLaunch{ctag}Ci", ratio_ci_text(theirs, ours))


def e3(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "epilogue_fusion.csv")
    rows = []
    names = {  # variant -> the tag of its GPU-clock macro (our default's is default_fusion's, with interval)
        "two_stage": "TwoStage",
        "flat": "Flat",
        "single_launch": "",
        "seed:original": "",
        "seed:optimized": "",
        "pytorch:decompose_k": "",
    }
    for v, tag in names.items():
        sub = df[df.variant == v]
        if sub.empty:  # the seed's Triton kernels: only where their source was at hand when E3 ran
            continue
        f = sub[sub.epilogue_fused.astype(str) == "True"].set_index(["m", "k"])
        u = sub[sub.epilogue_fused.astype(str) == "False"].set_index(["m", "k"])
        row = {"variant": v}
        for clock in ("graph_us", "launch_us"):
            r = (u[clock] / f[clock]).dropna()
            row[f"{clock[:-3]} geomean"] = gm(r)
            row[f"{clock[:-3]} min"] = r.min()
            row[f"{clock[:-3]} max"] = r.max()
            if tag and clock == "graph_us":  # the two-launch reducers' gains the text quotes, with intervals
                pair = sub.assign(
                    contender=sub.epilogue_fused.astype(str).map({"True": "fused", "False": "unfused"})
                )
                theirs, ours, cells = paired_rounds(pair, ["m", "k"], "unfused", "fused", "graph")
                if len(cells):
                    n.add(f"EThree{tag}Graph", ratio_ci_text(theirs, ours))
        rows.append(row)
    default_fusion(n, df)
    t = pd.DataFrame(rows)
    write_text(
        gen / "table_e3.tex",
        table(
            t,
            "E3: speedup of ReLU fused into the reduction's store over ReLU as a "
            f"separate op (unfused/fused), {len(df.drop_duplicates(['m', 'k']))} "
            "shapes, bf16.",
            "tab:e3",
            "lrrrrrr",
        ),
    )
    seed = pd.read_csv(
        results.parent / "reference" / "seed-h100" / "original_triton" / "epilogue_relu_bf16.csv"
    )
    n.add("EThreeSeed", gm(seed.decompose_k_fused_vs_unfused_speedup))
