"""Shared plotting helpers: loading results, labels that name the GPU and the clock, saving PDF+PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

CLOCKS = {
    "graph_us": "GPU time (CUDA-graph replay)",
    "launch_us": "launch-inclusive latency (do_bench, L2 flushed)",
}
# What a user gets: kernel="auto" (the tuned table, else the heuristic; our kernel or cuBLAS). The headline
# ratios compare it, not the per-shape best of our kernels picked afterwards.
OURS = ["ours:auto"]
PALETTE = {
    "eager": "#555555", "compiled": "#d62728", "custom-op-autotuned": "#ff7f0e",
    "custom-op-range-dispatch": "#ff7f0e", "pytorch:decompose_k": "#8c564b",
    "ours:two_stage": "#9ecae1", "ours:flat": "#08519c", "ours:single_launch": "#3182bd", "ours:auto": "#2ca02c",
    "seed: optimized": "#e377c2", "seed: original": "#f7b6d2",
}


def args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--results", required=True, help="results/<gpu-slug>")
    ap.add_argument("--out", required=True, help="output stem: writes <out>.pdf and <out>.png")
    return ap.parse_args()


def load(results: str | Path, name: str) -> pd.DataFrame:
    df = pd.read_csv(Path(results) / name)
    return df


def gpu_label(df: pd.DataFrame) -> str:
    row = df.iloc[0]
    return f"{row['gpu']}, torch {row['torch']}, triton {row['triton']}"


def geomean(x) -> float:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x) & (x > 0)]
    return float(np.exp(np.log(x).mean())) if x.size else float("nan")


def setup() -> None:
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.05)


def save(fig, out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".pdf"), bbox_inches="tight")
    fig.savefig(out.with_suffix(".png"), bbox_inches="tight", dpi=130)
    plt.close(fig)


def floors(results: str | Path) -> dict:
    return json.loads((Path(results) / "floors.json").read_text())
