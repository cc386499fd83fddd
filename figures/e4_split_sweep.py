"""E4: latency vs the split count S (U-curves) per variant and M=N, one line per K."""

from __future__ import annotations

import matplotlib.pyplot as plt
import seaborn as sns

from figures.common import CLOCKS, args, gpu_label, load, save, setup

VARIANTS = ["two_stage", "flat", "single_launch", "pytorch:decompose_k"]


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "split_sweep.csv")
    df = df[df.status == "ok"]
    ms = sorted(df.m.unique())
    fig, axes = plt.subplots(len(VARIANTS), len(ms), figsize=(14, 11), sharex=True, sharey="row")
    for i, v in enumerate(VARIANTS):
        for j, m in enumerate(ms):
            ax = axes[i, j]
            sub = df[(df.variant == v) & (df.m == m)]
            sns.lineplot(sub, x="split_k", y="graph_us", hue="k", marker="o", ax=ax, palette="viridis",
                         legend=(i == 0 and j == len(ms) - 1), markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{v}, M=N={m}", fontsize=8)
            ax.set_xlabel("split count S")
            ax.set_ylabel("GPU time [us]" if j == 0 else "")
    best = df.loc[df.groupby(["m", "k", "variant"])["graph_us"].idxmin()]
    med = best.groupby("variant")["split_k"].median()
    fig.suptitle("E4: each variant has its own best S (median best S: "
                 + ", ".join(f"{v} {int(med[v])}" for v in VARIANTS if v in med)
                 + f")\n{CLOCKS['graph_us']}; {gpu_label(df)}", fontsize=9)
    fig.tight_layout()
    save(fig, a.out)


if __name__ == "__main__":
    main()
