"""E7: the grouped GEMM against torch._grouped_mm and vLLM's kernel. Left: on the held-out models (never
tuned on), the default path's speed over theirs per model, at prefill and at decode. Right: on the tuned
models, % of the physical floor per contender as the load grows more skewed (loads ordered by Gini), at
decode and at prefill, with each cell's practical ceiling where E7 measured it (the slower of a kernel that
only moves the cell's bytes and the cell's FLOPs as one dense cuBLAS GEMM)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from paper.figures.common import args, finish, geomean, load, save, setup
from paper.numbers.e7 import practical_ceiling, tune_split
from paper.numbers.e7_heldout import heldout_frame, vllm_work

STYLE = {
    "ours": ("#08519c", "-"),
    "torch._grouped_mm": ("#d62728", "--"),
    "vllm:fused_moe": ("#ff7f0e", "-."),
    "padded-bmm:cf1.25": ("#9467bd", ":"),
    "practical ceiling": ("#7f7f7f", (0, (1, 1))),
}
OURS = ["ours:contiguous", "ours:persistent"]
# the legend's names for the contenders and loads whose CSV names a reader does not know
NAMES = {
    "padded-bmm:cf1.25": "padded batched GEMM, capacity 1.25",
    "vllm:fused_moe": "vLLM fused_moe",
}


def load_name(load: str) -> str:
    """A load as the legend writes it: "uniform", "Zipf 1.2", "90% to one expert" (hot0.9)."""
    if load.startswith("zipf"):
        return f"Zipf {load[4:]}"
    if load.startswith("hot"):
        return f"{float(load[3:]):.0%} to one expert"
    return load


def heldout_panel(ax, o: pd.DataFrame, phase: str, labels: bool) -> None:
    """Per held-out model, their time over ours (geomean over projections, loads and the phase's T); against
    vLLM's kernel, which gathers its rows, ours with its gather timed."""
    sub = o[o.tokens >= 1024] if phase == "prefill" else o[o.tokens <= 256]
    models = list(dict.fromkeys(o.model))
    y = np.arange(len(models))
    for i, (col, name) in enumerate((("tg_us", "torch._grouped_mm"), ("vl_us", "vllm:fused_moe"))):
        if col not in sub:
            continue
        ours = sub.us if col == "tg_us" else vllm_work(sub)  # vLLM's kernel gathers its rows: ours with ours
        vals = [geomean(sub[sub.model == m][col] / ours[sub.model == m]) for m in models]
        ax.barh(y + (i - 0.5) * 0.4, vals, 0.4, color=STYLE[name][0], label=f"vs {NAMES.get(name, name)}")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y, models if labels else [""] * len(models))
    ax.invert_yaxis()
    ax.set_xlabel("their GPU time / ours")
    ax.set_title(f"held out, {phase}")


def skew_panel(ax, df: pd.DataFrame, t: int, label: str) -> None:
    """% of floor per contender and load at ``t`` tokens, geomean over the tuned models and projections."""
    cell = df[df.tokens == t].copy()
    cell.loc[cell.contender.isin(OURS), "contender"] = "ours"
    order = cell.groupby("load")["gini"].mean().sort_values().index.tolist()
    for c, (color, ls) in STYLE.items():
        g = cell[cell.contender == c].groupby(["load", "model", "proj"]).pct_floor_graph.max()
        if g.empty:
            continue
        vals = [
            geomean(g.xs(ld, level="load")) if ld in g.index.get_level_values("load") else np.nan
            for ld in order
        ]
        ax.plot(range(len(order)), vals, marker="o", ms=2, color=color, ls=ls, label=NAMES.get(c, c))
    ax.set_xticks(range(len(order)), [load_name(ld) for ld in order], rotation=90)
    ax.set_ylim(0, 100)
    ax.set_title(f"tuned, {label} T={t}")


def main():
    a = args(__doc__)
    setup()
    raw = load(a.results, "grouped_skew.csv")
    o = heldout_frame(raw)
    df = tune_split(raw)
    df = df[(df.status == "ok") & df.proj.isin(["up", "down"])]
    c = practical_ceiling(df)
    df = pd.concat(
        [
            df,
            c.drop(columns="ceil_us").assign(
                contender="practical ceiling",
                graph_us=c.ceil_us,
                pct_floor_graph=100 * c.floor_us / c.ceil_us,
            ),
        ],
        ignore_index=True,
    )
    # each phase's panel at the T with the most loads measured (the larger T where they tie): the skew's
    # question is asked where the skewed loads ran
    loads = df[df.contender.isin(OURS)].groupby("tokens").load.nunique()
    dec, pre = loads[loads.index <= 256], loads[loads.index >= 1024]
    dec_t = int(max(dec.index, key=lambda t: (dec[t], t))) if len(dec) else int(df.tokens.min())
    pre_t = int(max(pre.index, key=lambda t: (pre[t], t))) if len(pre) else int(df.tokens.max())
    fig, axes = plt.subplots(
        1,
        4 if len(o) else 2,
        figsize=(6.5, 2.9),
        gridspec_kw={"width_ratios": [1, 1, 1.1, 1.1] if len(o) else [1, 1]},
    )
    right = axes[2:] if len(o) else axes
    if len(o):
        heldout_panel(axes[0], o, "prefill", True)
        heldout_panel(axes[1], o, "decode", False)
        axes[1].sharex(axes[0])
        # one x range for both phases, wide enough for the longer bar of either (shared axes keep the range
        # autoscaled from the first panel's bars alone, which clipped the decode panel's)
        axes[0].set_xlim(0, 1.05 * max(ax.dataLim.x1 for ax in axes[:2]))
    skew_panel(right[0], df, dec_t, "decode")
    skew_panel(right[1], df, pre_t, "prefill")
    right[0].set_ylabel("% of floor (GPU time)")
    right[1].set_yticklabels([])
    h, lab = right[0].get_legend_handles_labels()
    if len(o):
        h0, l0 = axes[0].get_legend_handles_labels()
        h, lab = h0 + h, l0 + lab
    finish(fig, h, lab, ncol=4)
    save(fig, a.out)


if __name__ == "__main__":
    main()
