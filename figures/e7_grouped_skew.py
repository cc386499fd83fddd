"""E7: grouped GEMM under skewed expert loads: % of the physical floor per contender vs load, for decode
and prefill, and decode latency vs tokens (gate/up projection, w as [E, N, K]); with each cell's practical
ceiling where E7 measured it: the slower of a kernel that only moves the cell's bytes and the cell's FLOPs as
one dense cuBLAS GEMM."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from figures.common import args, geomean, gpu_label, load, save, setup
from paper.numbers.e7 import practical_ceiling, tune_split

STYLE = {"ours:contiguous": ("#08519c", "-"), "ours:persistent": ("#3182bd", "-"), "ours:masked": ("#2ca02c", "-"),
         "ours:masked-pointer": ("#98df8a", "--"),
         "torch._grouped_mm": ("#d62728", "--"), "vllm:fused_moe": ("#ff7f0e", "-."),
         "per-expert-loop": ("#555555", "--"),
         "padded-bmm:cf1.0": ("#c7a0cb", ":"), "padded-bmm:cf1.25": ("#9467bd", ":"),
         "padded-bmm:cf2.0": ("#6a3d9a", ":"),
         "practical ceiling": ("#7f7f7f", (0, (1, 1)))}


def main():
    a = args(__doc__)
    setup()
    df = tune_split(load(a.results, "grouped_skew.csv"))
    df = df[(df.status == "ok") & (df.proj == "up")]
    c = practical_ceiling(df)
    df = pd.concat([df, c.drop(columns="ceil_us").assign(contender="practical ceiling", graph_us=c.ceil_us,
                                                         pct_floor_graph=100 * c.floor_us / c.ceil_us)],
                   ignore_index=True)
    models = list(dict.fromkeys(df.model))
    dec_t = 64 if (df.tokens == 64).any() else int(df.tokens.min())
    pre_t = 4096 if (df.tokens == 4096).any() else int(df.tokens.max())
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        sub = df[df.model == model]
        for j, (t, label) in enumerate(((dec_t, "decode"), (pre_t, "prefill"))):
            ax = axes[i, j]
            cell = sub[sub.tokens == t]
            order = cell.groupby("load")["gini"].first().sort_values().index.tolist()
            for c, g in cell.groupby("contender"):
                if c not in STYLE:
                    continue
                g = g.set_index("load").reindex(order)
                color, ls = STYLE[c]
                ax.plot(range(len(order)), g.pct_floor_graph, marker="o", ms=3, color=color, ls=ls, label=c)
            ax.set_xticks(range(len(order)), order, rotation=45, fontsize=7)
            ax.set_ylabel("% of floor (GPU time)")
            ax.set_title(f"{model}, {label} T={t}: loads by Gini", fontsize=8)
            ax.set_ylim(bottom=0)
        ax = axes[i, 2]
        uni = sub[(sub.load == "uniform")]
        for c, g in uni.groupby("contender"):
            if c in STYLE:
                color, ls = STYLE[c]
                g = g.sort_values("tokens")
                ax.plot(g.tokens, g.graph_us, marker="o", ms=3, color=color, ls=ls, label=c)
        fl = uni.drop_duplicates("tokens").sort_values("tokens")
        ax.plot(fl.tokens, fl.floor_us, color="black", lw=2, label="floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("GPU time [us]")
        ax.set_title(f"{model}: uniform load, latency vs T", fontsize=8)
    axes[0, 2].legend(fontsize=6, ncol=2)
    def best(t, contenders):  # per cell, the better of the given contenders; geomean of % of floor
        c = df[df.contender.isin(contenders) & (df.tokens == t)]
        return geomean(c.groupby(["model", "load"]).pct_floor_graph.max())

    ours = ["ours:contiguous", "ours:persistent"]
    vllm = (f"; vLLM's fused_moe {best(dec_t, ['vllm:fused_moe']):.0f}% and {best(pre_t, ['vllm:fused_moe']):.0f}%"
            if (df.contender == "vllm:fused_moe").any() else "")
    fig.suptitle(f"E7 (gate/up): our grouped kernel reaches {best(dec_t, ours):.0f}% of the floor at decode T={dec_t} "
                 f"and {best(pre_t, ours):.0f}% at prefill T={pre_t}; torch._grouped_mm "
                 f"{best(dec_t, ['torch._grouped_mm']):.0f}% and {best(pre_t, ['torch._grouped_mm']):.0f}%"
                 f"{vllm} (geomeans over models and loads)\nGPU time (CUDA-graph replay); floor = max(bytes / HBM peak, "
                 f"FLOPs / bf16 peak); {gpu_label(df)}", fontsize=9)
    fig.tight_layout()
    save(fig, a.out)


if __name__ == "__main__":
    main()
