"""Shared plotting helpers: loading results, the clocks' labels, the print check, saving PDF+PNG."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from PIL import Image  # noqa: E402

CLOCKS = {
    "graph_us": "GPU time (CUDA-graph replay)",
    "launch_us": "launch-inclusive latency (do_bench, L2 flushed)",
}
# What a user gets: kernel="auto" (the tuned table, else the heuristic; our kernel or cuBLAS). The headline
# ratios compare it, not the per-shape best of our kernels picked afterwards.
OURS = ["ours:auto"]
PALETTE = {
    "eager": "#555555",
    "compiled": "#d62728",
    "custom-op-autotuned": "#ff7f0e",
    "custom-op-range-dispatch": "#ff7f0e",
    "pytorch:decompose_k": "#8c564b",
    "ours:two_stage": "#9ecae1",
    "ours:flat": "#08519c",
    "ours:single_launch": "#3182bd",
    "ours:auto": "#2ca02c",
    "seed: optimized": "#e377c2",
    "seed: original": "#f7b6d2",
}
# The Decompose-K contenders' legend names (E5, E6): what each is, not the CSVs' ids
DK_NAMES = {
    "eager": "cuBLAS (eager)",
    "compiled": "torch.compile",
    "custom-op-autotuned": "custom-op autotuning",
    "custom-op-range-dispatch": "custom-op range dispatch",
    "pytorch:decompose_k": "seed: PyTorch decomposeK",
    "ours:two_stage": "ours: two-stage reducer",
    "ours:flat": "ours: flat reducer",
    "ours:single_launch": "ours: single launch",
    "ours:auto": "ours: default (auto)",
    "seed: optimized": "seed: optimized kernel",
    "seed: original": "seed: original kernel",
}


def args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--results", required=True, help="results/<gpu-slug>")
    ap.add_argument("--out", required=True, help="output stem: writes <out>.pdf and <out>.png")
    return ap.parse_args()


def load(results: str | Path, name: str) -> pd.DataFrame:
    df = pd.read_csv(Path(results) / name)
    return df


def gpu_name(df: pd.DataFrame) -> str:
    """The GPU that measured ``df`` (its ``gpu`` column) without the vendor: "H200" for "NVIDIA H200"."""
    names = list(dict.fromkeys(str(g) for g in df["gpu"].dropna())) if "gpu" in df else []
    return " / ".join(n.removeprefix("NVIDIA ").strip() for n in names) or "this GPU"


def geomean(x) -> float:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x) & (x > 0)]
    return float(np.exp(np.log(x).mean())) if x.size else float("nan")


# The paper prints every figure at the text width (paper.tex's \fig: \linewidth of a letter page with 2 cm
# margins). save() refuses a figure that would print a font below MIN_PT there, or that has more than
# MAX_PANELS panels.
TEXT_WIDTH_IN = 8.5 - 2 * 2 / 2.54
MIN_PT, MAX_PANELS = 7.0, 4
# The PNGs (the README's and a reader's quick look; the paper prints the PDFs) at a modest resolution
PNG_DPI = 120


def setup() -> None:
    sns.set_theme(style="whitegrid", context="paper")
    plt.rcParams.update(
        {
            "font.size": 7.5,
            "axes.titlesize": 8,
            "axes.labelsize": 7.5,
            "xtick.labelsize": 7,
            "ytick.labelsize": 7,
            "legend.fontsize": 7,
            "legend.title_fontsize": 7,
            "figure.titlesize": 8.5,
        }
    )


def finish(fig, handles=None, labels=None, ncol: int = 4) -> None:
    """Lay ``fig`` out: its panels and, where given, one legend for all panels below them. A figure carries no
    title: what it shows goes into the paper's caption, the versions it was measured with into the paper's
    reproducibility table."""
    fig.tight_layout()
    if handles:
        fig.legend(handles, labels, ncol=ncol, loc="upper center", bbox_to_anchor=(0.5, 0.0), frameon=False)


def print_check(fig) -> tuple[float, int]:
    """(the smallest font of ``fig`` in pt as printed at the text width, its panels): the saved (tight)
    figure is scaled to TEXT_WIDTH_IN; panels are the axes that draw data (not colour bars)."""
    import matplotlib.text

    fig.canvas.draw()
    width = fig.get_tightbbox(fig.canvas.get_renderer()).width  # inches
    scale = TEXT_WIDTH_IN / width
    sizes = [
        t.get_fontsize()
        for t in fig.findobj(matplotlib.text.Text)
        if t.get_visible() and t.get_text().strip() and t.get_figure() is not None
    ]
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]
    return min(sizes) * scale, len(panels)


def save(fig, out: str | Path) -> None:
    out = Path(out)
    smallest, panels = print_check(fig)
    if smallest < MIN_PT - 1e-6 or panels > MAX_PANELS:
        raise ValueError(
            f"{out.name}: prints its smallest font at {smallest:.1f} pt (at least {MIN_PT} wanted) "
            f"with {panels} panels (at most {MAX_PANELS}) at the paper's text width"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # No time stamps in the files: the same inputs give the same bytes (the committed figures are checked
    # against the hashes of what they were drawn from, paper/manifest.py).
    fig.savefig(out.with_suffix(".pdf"), bbox_inches="tight", metadata={"CreationDate": None})
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", dpi=PNG_DPI)
    plt.close(fig)
    # a palette of 256 colours: a plot has few, and the file is a third of the size (the tree stays small)
    png = Image.open(buf).convert("RGB")
    png = png.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    png.save(out.with_suffix(".png"), optimize=True)


def floors(results: str | Path) -> dict:
    return json.loads((Path(results) / "floors.json").read_text())
