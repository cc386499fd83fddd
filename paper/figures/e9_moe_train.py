"""E9: the expert layer in training, on the held-out models, per model and tokens per step T (geomean over the
loads). Left: each peer's forward + backward GPU time over ours (bars) and its backward's alone (crosses).
Right: the peak memory of one step over ours."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from paper.figures.common import args, finish, geomean, load, save, setup
from paper.numbers.e9 import HF_COMPILED, OURS_RECOMPUTE, TORCH, TORCH_COMPILED, UNSLOTH, e9_frame, ratios

PEERS = {
    TORCH: "#d62728",
    TORCH_COMPILED: "#ff9896",
    HF_COMPILED: "#9467bd",
    UNSLOTH: "#2ca02c",
    OURS_RECOMPUTE: "#6baed6",
}
# the legend's names
NAMES = {
    TORCH: "torch._grouped_mm pipeline",
    TORCH_COMPILED: "torch._grouped_mm pipeline, compiled",
    HF_COMPILED: "transformers grouped_mm, compiled",
    UNSLOTH: "Unsloth's kernels",
    OURS_RECOMPUTE: "ours, recomputing gate/up",
}


def main():
    a = args(__doc__)
    setup()
    raw = load(a.results, "moe_train.csv")
    f = e9_frame(raw)
    held = f[f.split == "heldout"] if (f.split == "heldout").any() else f
    peers = [c for c in PEERS if (held.contender == c).any()]
    # the x axis: one group per (model, T), models in the order of their experts where the CSV has them
    experts = held.groupby("model").experts.first() if "experts" in held else None
    models = sorted(held.model.unique(), key=lambda m: (experts[m] if experts is not None else 0, m))
    ts = sorted(held.tokens.unique())
    cells = [(m, t) for m in models for t in ts if ((held.model == m) & (held.tokens == t)).any()]
    names = [m if len(ts) == 1 else f"{m}\nT={int(t)}" for m, t in cells]
    x = np.arange(len(cells))
    width = 0.8 / max(len(peers), 1)
    fig, axes = plt.subplots(1, 2, figsize=(6.7, 2.8))
    for j, c in enumerate(peers):
        at = x + (j - (len(peers) - 1) / 2) * width
        sel = [held[(held.model == m) & (held.tokens == t)] for m, t in cells]
        step = [geomean(ratios(s, c, "step_us")) for s in sel]
        bwd = [geomean(ratios(s, c, "bwd_us")) for s in sel]
        mem = [geomean(ratios(s, c, "peak_bytes")) for s in sel]
        axes[0].bar(at, step, width, color=PEERS[c], label=NAMES[c])
        axes[0].plot(at, bwd, "x", ms=4, color="black")
        axes[1].bar(at, mem, width, color=PEERS[c])
    for ax, lab, title in (
        (axes[0], "their GPU time / ours", "forward + backward (x: backward)"),
        (axes[1], "their peak memory / ours", "peak memory of a step"),
    ):
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(x, names)
        ax.set_ylabel(lab)
        ax.set_title(f"held out, {title}")
    h, lab = axes[0].get_legend_handles_labels()
    finish(fig, h, lab, ncol=3)
    save(fig, a.out)


if __name__ == "__main__":
    main()
