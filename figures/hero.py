"""README hero: our best Decompose-K kernel vs eager, torch.compile and custom-op autotuning on the
bf16+ReLU grid, GPU time (CUDA-graph replay)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import seaborn as sns

from figures.common import OURS, args, geomean, gpu_label, load, save, setup


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "decompose_k_grid.csv")
    df = df[(df.status == "ok") & (df.suite == "bf16-relu")]
    p = df.pivot_table(index=["m", "k"], columns="contender", values="graph_us")
    ours = p[[c for c in OURS if c in p]].min(axis=1)
    rivals = [c for c in ("eager", "compiled", "custom-op-autotuned") if c in p]
    fig, axes = plt.subplots(1, len(rivals), figsize=(5 * len(rivals), 3.2))
    for ax, c in zip(axes, rivals):
        sp = (p[c] / ours).unstack("k")
        sns.heatmap(sp, ax=ax, annot=True, fmt=".2f", cmap="RdBu", center=1.0, vmin=0.5, vmax=2.0, cbar=False,
                    annot_kws={"fontsize": 7})
        ax.set_title(f"vs {c}: geomean {geomean(sp.values.ravel()):.2f}x", fontsize=9)
        ax.set_xlabel("K")
        ax.set_ylabel("M = N")
    fig.suptitle("Speedup of our best Decompose-K kernel, relu(A@B) bf16, GPU time (CUDA-graph replay); "
                 f"> 1 means ours is faster\n{gpu_label(df)}", fontsize=9)
    fig.tight_layout()
    save(fig, a.out)


if __name__ == "__main__":
    main()
