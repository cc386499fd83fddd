"""E9: the expert layer in training. Left: on the held-out models, each peer's forward + backward GPU time
over ours against the tokens per step (geomean over models and loads; dashed: the backward alone). Right: the
peak memory of one step over ours."""

from __future__ import annotations

import matplotlib.pyplot as plt

from figures.common import args, finish, geomean, load, save, setup
from paper.numbers.e9 import HF_COMPILED, OURS_RECOMPUTE, TORCH, TORCH_COMPILED, UNSLOTH, e9_frame, ratios

PEERS = {
    TORCH: "#d62728",
    TORCH_COMPILED: "#ff9896",
    HF_COMPILED: "#9467bd",
    UNSLOTH: "#2ca02c",
    OURS_RECOMPUTE: "#6baed6",
}


def main():
    a = args(__doc__)
    setup()
    raw = load(a.results, "moe_train.csv")
    f = e9_frame(raw)
    held = f[f.split == "heldout"] if (f.split == "heldout").any() else f
    peers = [c for c in PEERS if (held.contender == c).any()]
    fig, axes = plt.subplots(1, 2, figsize=(6.7, 2.8))
    ts = sorted(held.tokens.unique())
    for c in peers:
        for col, ls in (("step_us", "-"), ("bwd_us", "--")):
            ys = [geomean(ratios(held[held.tokens == t], c, col)) for t in ts]
            axes[0].plot(ts, ys, ls, marker="o", ms=2, color=PEERS[c], label=c if ls == "-" else None)
        mem = [geomean(ratios(held[held.tokens == t], c, "peak_bytes")) for t in ts]
        axes[1].plot(ts, mem, marker="o", ms=2, color=PEERS[c])
    for ax, lab, title in (
        (axes[0], "their GPU time / ours", "fwd+bwd (dashed: bwd)"),
        (axes[1], "their peak memory / ours", "peak memory of a step"),
    ):
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per step T")
        ax.set_ylabel(lab)
        ax.set_title(f"held out, {title}")
    h, lab = axes[0].get_legend_handles_labels()
    finish(fig, h, lab, ncol=3)
    save(fig, a.out)


if __name__ == "__main__":
    main()
