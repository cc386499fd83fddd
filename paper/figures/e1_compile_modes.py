"""E1: latency of each torch.compile mode per function and shape, both clocks, plus compile time."""

from __future__ import annotations

import matplotlib.pyplot as plt

from paper.figures.common import args, finish, load, save, setup

MODE_ORDER = ["eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "compile_modes.csv")
    df["shape"] = df.apply(lambda r: f"{r.m}x{r.n}x{r.k}", axis=1)
    df["panel"] = df["function"] + "\n" + df["shape"]
    df["compile_mode"] = df["compile_mode"].fillna("eager")
    panels = sorted(df["panel"].unique())
    fig, axes = plt.subplots(1, 3, figsize=(7.0, 2.6))
    for ax, metric, label in zip(
        axes,
        ["graph_us", "launch_us", "compile_s"],
        ["GPU time [us]", "launch-inclusive [us]", "first-call compile [s]"],
    ):
        p = df.pivot_table(index="panel", columns="compile_mode", values=metric).reindex(panels)
        p = p.reindex(
            columns=[m for m in MODE_ORDER if m in df["compile_mode"].unique()]
        )  # same bars everywhere
        p.plot.barh(ax=ax, width=0.8, legend=False, colormap="viridis")
        ax.set_xlabel(label)
        ax.set_ylabel("")
        if metric != "graph_us":
            ax.set_xscale("log")
        if ax is not axes[0]:
            ax.set_yticklabels([])
    handles, labels = axes[0].get_legend_handles_labels()
    finish(fig, handles, labels, ncol=5)
    save(fig, a.out)


if __name__ == "__main__":
    main()
