"""E7's grouped tuner (robust tuning over loads, tails, merged tails, K split in TMA tiles, extra rows) and
the order the harness times contenders in (rotated against balanced rounds): their numbers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.report import runs_dir

from .common import Numbers, gm
from .e7 import VLLM


def tune_cell(df: pd.DataFrame) -> list[str]:
    """The grouped tuner's unit of comparison: a (model, projection, T) cell, under one load where the
    tuner timed several (its CSVs before the S7 runs hold the uniform load only, without a load column)."""
    return ["model", "proj", "tokens"] + (["load"] if "load" in df.columns else [])


def tuner_rows(path: Path) -> pd.DataFrame | None:
    """The correct, timed rows of a grouped tuner CSV's screen (results/<gpu>/tune_grouped.csv, or a kept
    run's), or None without it. The screen times every candidate under one protocol; the final's second
    timing of a cell's few fastest (stage "final", from the S11 runs on) is left out, so that no config counts
    twice."""
    if not path.exists():
        return None
    df = pd.read_csv(path)
    if "stage" in df.columns:
        df = df[df.stage.fillna("screen") == "screen"]
    return df[df.status == "ok"].copy()


def with_against_without(df: pd.DataFrame, has: pd.Series) -> list[tuple[tuple, float]]:
    """(tuning cell, best time without the feature / best time with it) for every tuning cell where the
    tuner timed configs with the feature (``has``) and without it, side by side: > 1 where it won."""
    return [
        (key, g[~has[g.index]].graph_us.min() / g[has[g.index]].graph_us.min())
        for key, g in df.groupby(tune_cell(df))
        if has[g.index].any() and (~has[g.index]).any()
    ]


def robust_tuning(n: Numbers, results: Path) -> None:
    """The grouped tuner keeps per cell the config of the least geometric-mean time over its loads: in how
    many cells tuned on several loads that differs from the uniform load's fastest, and what the choice
    costs on the uniform load and saves on the others, against that config (same process, same inputs)."""
    df = tuner_rows(results / "tune_grouped.csv")
    if df is None or "load" not in df.columns:
        return
    cost, save, differ, cells, loads = [], [], 0, 0, set()
    for _, g in df.groupby(["model", "proj", "tokens"]):
        t = g.pivot_table(index="config", columns="load", values="graph_us").dropna()
        if t.shape[1] < 2 or "uniform" not in t.columns or t.empty:
            continue
        cells += 1
        loads |= set(t.columns)
        robust = np.exp(np.log(t).mean(axis=1)).idxmin()
        fastest = t["uniform"].idxmin()
        if robust != fastest:
            differ += 1
        cost.append(t.loc[robust, "uniform"] / t.loc[fastest, "uniform"])
        save += [t.loc[fastest, c] / t.loc[robust, c] for c in t.columns if c != "uniform"]
    if not cells:
        return
    n.add("TuneCells", cells, "{}")
    n.add("TuneLoads", ", ".join(sorted(loads - {"uniform"})))
    n.add("TuneDiffers", differ, "{}")
    n.add("TuneUniformCostMax", 100 * (max(cost) - 1), "{:.1f}")
    n.add("TuneSkewGainMax", 100 * (max(save) - 1), "{:.0f}")
    n.add("TuneSkewGainGeo", gm(save), "{:.2f}")


def newest_tuning_with(results: Path, has) -> tuple[list[float], str | None]:
    """(best time without the feature / best time with it, per tuning cell where the tuner timed both;
    None or the name of the kept run read) from the newest grouped tuner CSV whose configs include the
    feature (``has``: config column -> bool): results/<gpu>/tune_grouped.csv, else the runs kept under
    results/<gpu>/runs/, newest first (the tuner stops offering a feature that lost)."""
    runs = sorted(
        runs_dir(results).glob("*/tune_grouped.csv"),
        reverse=True,
        key=lambda p: [int(v) if v.isdigit() else v for v in re.split(r"(\d+)", p.parent.name)],
    )
    for path in [results / "tune_grouped.csv", *runs]:
        df = tuner_rows(path)
        if df is None:
            continue
        ratios = [r for _, r in with_against_without(df, has(df.config))]
        if ratios:
            return ratios, None if path.parent == results else path.parent.name
    return [], None


def tma_splits(n: Numbers, results: Path) -> None:
    """K split inside TMA tiles in the grouped tuner's table: the best split config against the best
    unsplit one, per tuning cell where both were timed (same process, same inputs). The tuner stopped
    offering it in the S8 runs; SplitRun names the kept run read then."""
    ratios, run = newest_tuning_with(
        results,
        lambda c: c.str.contains("'tma': True", regex=False) & ~c.str.contains("'split_k': 1,", regex=False),
    )
    if ratios:
        n.add("SplitCells", len(ratios), "{}")
        n.add("SplitWins", sum(r > 1 for r in ratios), "{}")
        n.add("SplitLo", min(ratios))
        n.add("SplitHi", max(ratios))
        if run:
            n.add("SplitRun", run)


def extra_rows(n: Numbers, results: Path) -> None:
    """Row tiles with extra rows (extra_m) in the grouped tuner's table, against the best config without
    them, per tuning cell where both were timed; ExtraRun names the kept run read once the tuner no
    longer offers them."""
    ratios, run = newest_tuning_with(
        results, lambda c: c.str.extract(r"'extra_m': (\d+)")[0].fillna(0).astype(int) > 0
    )
    if ratios:
        n.add("ExtraCells", len(ratios), "{}")
        n.add("ExtraWins", sum(r > 1 for r in ratios), "{}")
        n.add("ExtraLo", min(ratios))
        n.add("ExtraHi", max(ratios), "{:.3f}")
        if run:
            n.add("ExtraRun", run)


def tails(n: Numbers, results: Path, gen: Path) -> None:
    """Tail tiles of their own in the grouped tuner's table (side by side, same process and data; configs
    with merged tails left out): in how many of the cells where they were offered one won, and the time
    saved against the best config without them."""
    df = tuner_rows(results / "tune_grouped.csv")
    if df is None:
        return
    df = df[~df.config.str.contains("'merge_tail': True", regex=False)]  # see merged_tails
    tail = df.config.str.extract(r"'tail_m': (\d+)")[0].fillna(0).astype(int) > 0
    gains = [(key, 100 * max(0.0, 1 - 1 / r), r > 1) for key, r in with_against_without(df, tail)]
    if not gains:
        return
    best = max(gains, key=lambda x: x[1])
    n.add("TailCells", len(gains), "{}")
    n.add("TailWins", sum(w for *_, w in gains), "{}")
    n.add("TailGainMax", best[1], "{:.0f}")
    n.add("TailGainCell", f"{best[0][0]} {best[0][1]}, $T={best[0][2]}$")
    n.add("TailGainMedian", float(np.median([gn for _, gn, w in gains if w])), "{:.1f}")


def merged_tails(n: Numbers, results: Path) -> None:
    """Merged tails in the grouped tuner's table: in how many of the cells where they were offered a config
    with them won, and by how much against the best config without them; on 64-row tiles (Merged*) and,
    offered from the S11 runs on, on 128-row prefill tiles (MergedBig*: the cells whose merged configs have
    128-row tiles)."""
    df = tuner_rows(results / "tune_grouped.csv")
    if df is None:
        return
    merged = df.config.str.contains("'merge_tail': True", regex=False)
    big = df.config.str.contains("'block_m': 128,", regex=False)
    mid, wide = [], []
    for key, r in with_against_without(df, merged):
        cell = (df[tune_cell(df)] == pd.Series(key, index=tune_cell(df))).all(axis=1)
        (wide if (cell & merged & big).any() else mid).append(r)
    for tag, gains in (("", mid), ("Big", wide)):
        if gains:
            n.add(f"Merged{tag}Cells", len(gains), "{}")
            n.add(f"Merged{tag}Wins", sum(x > 1 for x in gains), "{}")
            n.add(f"Merged{tag}GainMax", 100 * (max(gains) - 1), "{:.0f}")
            n.add(f"Merged{tag}Lo", min(gains))


# Per experiment, its last run under the harness's earlier order (each round the list rotated by one place)
# and the first in balanced pairs, at the same commit otherwise (both kept under runs/), read cell by cell.
ROTATED_RUNS = {
    "E7": ("S15-1", "S21-2", "grouped_skew.csv", ["model", "proj", "tokens", "load"]),
    "E8": ("S20-2", "S21-3", "moe_layer.csv", ["model", "tokens", "load"]),
}


def rotation_runs(n: Numbers, results: Path) -> None:
    """Per experiment (E7, E8), its last run measured under rotation against its first in balanced order
    (ROTATED_RUNS), over the cells and contenders both hold: the geomean of the balanced run's GPU time over
    the earlier one's, for ours (E7: every "ours" contender; E8: moe_ffn) and for the peers (E7:
    torch._grouped_mm and vLLM's kernel; E8: the torch._grouped_mm pipeline, transformers' compiled
    grouped_mm backend and vLLM's fused_experts), and the held-out headline of the earlier run (E7: ours, no
    config, over torch._grouped_mm at T >= 1024; E8: moe_ffn over the faster of the pipeline and the
    compiled backend)."""
    peers = {
        "E7": ("torch._grouped_mm", VLLM),
        "E8": ("torch._grouped_mm pipeline", "hf:grouped_mm:compiled", "vllm:fused_experts"),
    }
    for exp, (run, balanced, name, key) in ROTATED_RUNS.items():
        old_path, new_path = runs_dir(results) / run / name, runs_dir(results) / balanced / name
        if not (old_path.exists() and new_path.exists()):
            continue
        old, new = (pd.read_csv(p) for p in (old_path, new_path))
        if not all(
            set(key + ["split", "status", "contender", "graph_us"]) <= set(d.columns) for d in (old, new)
        ):
            continue
        both = [
            d[d.status == "ok"].pivot_table(index=key + ["split"], columns="contender", values="graph_us")
            for d in (old, new)
        ]
        o, c = both[0].align(both[1], join="inner")
        headline = (
            ["ours:auto", "torch._grouped_mm"]
            if exp == "E7"
            else ["ours:moe_ffn", "torch._grouped_mm pipeline", "hf:grouped_mm:compiled"]
        )
        if (
            not len(o)
            or not all(h in o for h in headline)
            or "heldout" not in set(o.index.get_level_values("split"))
        ):
            continue
        ours = [x for x in o.columns if x.startswith("ours")] if exp == "E7" else ["ours:moe_ffn"]
        ratio = c / o
        tag = "Rot" + {"E7": "ESeven", "E8": "EEight"}[exp]
        n.add(f"{tag}Run", run, "{}")
        n.add(f"{tag}Balanced", balanced, "{}")
        n.add(f"{tag}Commit", str(old.git_commit.iloc[0])[:7], "{}")
        n.add(f"{tag}OursTime", gm(ratio[ours].stack().dropna()), "{:.3f}")
        n.add(f"{tag}PeerTime", gm(ratio[[p for p in peers[exp] if p in ratio]].stack().dropna()), "{:.3f}")
        held = o.xs("heldout", level="split")
        if exp == "E7":
            pre = held[held.index.get_level_values("tokens") >= 1024]
            n.add("RotESevenHeldPrefillVsTorch", gm((pre["torch._grouped_mm"] / pre["ours:auto"]).dropna()))
        else:
            best = held[["torch._grouped_mm pipeline", "hf:grouped_mm:compiled"]].min(axis=1)
            n.add("RotEEightHeldVsPeer", gm((best / held["ours:moe_ffn"]).dropna()))
