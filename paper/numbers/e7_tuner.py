"""E7's grouped tuner: what its variants of the kernel won (tail tiles, merged tails, K split in TMA tiles,
extra rows), from its tables."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from experiments.runs_archive import runs_dir

from .common import Numbers


def tune_cell(df: pd.DataFrame) -> list[str]:
    """The grouped tuner's unit of comparison: a (model, projection, T) cell, under one load where the
    tuner timed several (its older CSVs hold the uniform load only, without a load column)."""
    return ["model", "proj", "tokens"] + (["load"] if "load" in df.columns else [])


def tuner_rows(path: Path) -> pd.DataFrame | None:
    """The correct, timed rows of a grouped tuner CSV's screen (results/<gpu>/tune_grouped.csv, or a kept
    run's), or None without it. The screen times every candidate under one protocol; the final's second
    timing of a cell's few fastest (stage "final", in newer CSVs) is left out, so that no config counts
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


def newest_tuning_with(results: Path, has) -> list[float]:
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
            return ratios
    return []


def tma_splits(n: Numbers, results: Path) -> None:
    """K split inside TMA tiles in the grouped tuner's table: the best split config against the best
    unsplit one, per tuning cell where both were timed (same process, same inputs), from the newest tuner
    table that offered it (the tuner no longer does)."""
    ratios = newest_tuning_with(
        results,
        # a split config names its split_k (> 1); configs without the key (the tuner's since) are unsplit
        lambda c: (
            c.str.contains("'tma': True", regex=False)
            & (c.str.extract(r"'split_k': (\d+)")[0].fillna(1).astype(int) > 1)
        ),
    )
    if ratios:
        n.add("SplitCells", len(ratios), "{}")
        n.add("SplitWins", sum(r > 1 for r in ratios), "{}")
        n.add("SplitLo", min(ratios))
        n.add("SplitHi", max(ratios))


def extra_rows(n: Numbers, results: Path) -> None:
    """Row tiles with extra rows (extra_m) in the grouped tuner's table, against the best config without
    them, per tuning cell where both were timed, from the newest tuner table that offered them."""
    ratios = newest_tuning_with(
        results, lambda c: c.str.extract(r"'extra_m': (\d+)")[0].fillna(0).astype(int) > 0
    )
    if ratios:
        n.add("ExtraCells", len(ratios), "{}")
        n.add("ExtraWins", sum(r > 1 for r in ratios), "{}")
        n.add("ExtraLo", min(ratios))
        n.add("ExtraHi", max(ratios), "{:.3f}")


def tails(n: Numbers, results: Path) -> None:
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
    n.add("TailCells", len(gains), "{}")
    n.add("TailWins", sum(w for *_, w in gains), "{}")
    n.add("TailGainMax", max(gn for _, gn, _ in gains), "{:.0f}")


def merged_tails(n: Numbers, results: Path) -> None:
    """Merged tails in the grouped tuner's table: in how many of the cells where they were offered a config
    with them won, and by how much against the best config without them, on 64-row tiles (the cells whose
    merged configs have 128-row tiles left out)."""
    df = tuner_rows(results / "tune_grouped.csv")
    if df is None:
        return
    merged = df.config.str.contains("'merge_tail': True", regex=False)
    big = df.config.str.contains("'block_m': 128,", regex=False)
    mid = []
    for key, r in with_against_without(df, merged):
        cell = (df[tune_cell(df)] == pd.Series(key, index=tune_cell(df))).all(axis=1)
        if not (cell & merged & big).any():
            mid.append(r)
    if mid:
        n.add("MergedCells", len(mid), "{}")
        n.add("MergedWins", sum(x > 1 for x in mid), "{}")
        n.add("MergedGainMax", 100 * (max(mid) - 1), "{:.0f}")
