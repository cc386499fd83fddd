"""E4: latency vs the split count S (U-curves) per variant and M=N, one line per K."""

from __future__ import annotations

import matplotlib.pyplot as plt
import seaborn as sns

from paper.figures.common import args, finish, load, save, setup

VARIANTS = ["two_stage", "flat", "single_launch", "pytorch:decompose_k"]


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "split_sweep.csv")
    df = df[df.status == "ok"]
    m = int(df.m.min())  # the shape class of the router at decode; the other M = N are in the CSV
    fig, axes = plt.subplots(1, len(VARIANTS), figsize=(7.0, 2.3), sharey=True)
    for ax, v in zip(axes, VARIANTS):
        sub = df[(df.variant == v) & (df.m == m)]
        sns.lineplot(
            sub,
            x="split_k",
            y="graph_us",
            hue="k",
            marker="o",
            ax=ax,
            palette="viridis",
            legend=ax is axes[0],
            markersize=3,
        )
        ax.set_xscale("log", base=2)
        ax.set_title(v)
        ax.set_xlabel("split count S")
        ax.set_ylabel("GPU time [us]" if ax is axes[0] else "")
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].get_legend().remove()
    finish(fig, handles, [f"K = {lab}" for lab in labels], ncol=len(labels))
    save(fig, a.out)


if __name__ == "__main__":
    main()
