"""E3: speedup of fusing ReLU into the reduction's store (unfused / fused) per variant over (M=N, K), in GPU
time on our GPU, beside the seed's two-stage kernel as its study reported it on an H100 (launch-inclusive):
another GPU and clock, in a panel and colour map of its own, titled as such."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from paper.figures.common import args, finish, geomean, gpu_name, load, save, setup

VARIANTS = ["two_stage", "flat", "single_launch", "pytorch:decompose_k"]


def speedups(df: pd.DataFrame, clock: str) -> pd.DataFrame:
    rows = []
    for v in VARIANTS:
        sub = df[df.variant == v]
        f = sub[sub.epilogue_fused.astype(str) == "True"].set_index(["m", "k"])[clock]
        u = sub[sub.epilogue_fused.astype(str) == "False"].set_index(["m", "k"])[clock]
        for (m, k), s in (u / f).dropna().items():
            rows.append({"variant": v, "m": m, "k": k, "speedup": s})
    return pd.DataFrame(rows)


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "epilogue_fusion.csv")
    seed = pd.read_csv(
        Path(a.results).parent / "reference" / "seed-h100" / "original_triton" / "epilogue_relu_bf16.csv"
    )
    sp = speedups(df, "graph_us")
    gpu = gpu_name(df)
    shown = VARIANTS[:3]  # our three kernels; the seed's PyTorch decomposeK is in the paper's table
    # each panel as wide as its columns of K, so that every cell's value fits in it, and at least two wide, so
    # that its title does
    widths = [max(2, sp[sp.variant == v].k.nunique()) for v in shown] + [seed.k.nunique()]
    fig, axes = plt.subplots(1, 4, figsize=(7.0, 2.3), gridspec_kw={"width_ratios": widths})
    for ax, v in zip(axes, shown):
        p = sp[sp.variant == v].pivot(index="m", columns="k", values="speedup")
        sns.heatmap(
            p,
            ax=ax,
            annot=True,
            fmt=".2f",
            cmap="Blues",
            vmin=0.9,
            vmax=2.0,
            cbar=False,
            annot_kws={"fontsize": 7},
        )
        ax.set_title(f"ours: {v}\n{geomean(p.values.ravel()):.2f}x, {gpu}\nGPU time", fontsize=8)
        ax.set_xlabel("K")
        ax.set_ylabel("M = N" if ax is axes[0] else "")
    p = seed.pivot(index="m", columns="k", values="decompose_k_fused_vs_unfused_speedup")
    sns.heatmap(
        p,
        ax=axes[-1],
        annot=True,
        fmt=".2f",
        cmap="Oranges",
        vmin=0.9,
        vmax=2.0,
        cbar=False,
        annot_kws={"fontsize": 7},
    )
    axes[-1].set_title(
        f"seed: two-stage\n{geomean(p.values.ravel()):.2f}x, H100\nlaunch-incl. (reported)", fontsize=8
    )
    axes[-1].set_xlabel("K")
    axes[-1].set_ylabel("")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=90)
    finish(fig)
    save(fig, a.out)


if __name__ == "__main__":
    main()
