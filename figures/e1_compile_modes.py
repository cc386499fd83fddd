"""E1: latency of each torch.compile mode per function and shape, both clocks, plus compile time."""

from __future__ import annotations

import matplotlib.pyplot as plt

from figures.common import CLOCKS, args, gpu_label, load, save, setup

MODE_ORDER = ["eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "compile_modes.csv")
    df["shape"] = df.apply(lambda r: f"{r.m}x{r.n}x{r.k}", axis=1)
    df["panel"] = df["function"] + "\n" + df["shape"]
    df["compile_mode"] = df["compile_mode"].fillna("eager")
    panels = sorted(df["panel"].unique())
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for ax, metric, label in zip(axes, ["graph_us", "launch_us", "compile_s"],
                                 [CLOCKS["graph_us"] + " [us]", CLOCKS["launch_us"] + " [us]",
                                  "first-call compile time [s]\n(autotuning paid by the first\nmax-autotune mode measured)"]):
        p = df.pivot_table(index="panel", columns="compile_mode", values=metric).reindex(panels)
        p = p[[m for m in MODE_ORDER if m in p.columns]]
        p = p.reindex(columns=[m for m in MODE_ORDER if m in df["compile_mode"].unique()])  # same bars everywhere
        p.plot.bar(ax=ax, width=0.8, legend=ax is axes[1], colormap="viridis")
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel("")
    axes[1].legend(ncol=5, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    axes[-1].tick_params(axis="x", labelrotation=0, labelsize=7)
    best = (df[df.compile_mode != "eager"].groupby("panel")["graph_us"].min()
            / df[df.compile_mode == "eager"].set_index("panel")["graph_us"])
    launch = (df[df.compile_mode != "eager"].groupby("panel")["launch_us"].min()
              / df[df.compile_mode == "eager"].set_index("panel")["launch_us"])
    fig.suptitle(f"E1: on the GPU clock the best compile mode takes {best.min():.2f}-{best.max():.2f}x eager's time; "
                 f"on the launch clock {launch.min():.2f}-{launch.max():.2f}x\n(modes with CUDA graphs of their own "
                 f"have no GPU-clock bar; {gpu_label(df)})", fontsize=9)
    save(fig, a.out)


if __name__ == "__main__":
    main()
