"""README hero: our Decompose-K default (kernel="auto") vs the seed's optimized Triton kernel, eager and
custom-op autotuning on the bf16+ReLU grid, and (once E7 is measured) the grouped GEMM's % of the physical
floor against torch._grouped_mm, vLLM's fused-MoE kernel (where measured) and capacity padding; GPU time
(CUDA-graph replay)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from paper.figures.common import OURS, args, finish, geomean, load, save, setup


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "decompose_k_grid.csv")
    df = df[(df.status == "ok") & (df.suite == "bf16-relu")]
    p = df.pivot_table(index=["m", "k"], columns="contender", values="graph_us")
    ours = p[[c for c in OURS if c in p]].min(axis=1)
    rivals = [c for c in ("seed: optimized", "eager", "custom-op-autotuned") if c in p]
    grouped = (Path(a.results) / "grouped_skew.csv").exists()
    fig, axes = plt.subplots(1, 1 + grouped, figsize=(6.7, 2.6), squeeze=False)
    axes = axes[0]
    if grouped:
        grouped_panel(axes[-1], load(a.results, "grouped_skew.csv"))
    ax = axes[0]
    ms = sorted(p.index.get_level_values("m").unique())
    width = 0.8 / len(rivals)
    for i, c in enumerate(rivals):
        r = (p[c] / ours).dropna()  # the compiled ones: only where measured
        at = set(r.index.get_level_values("m"))
        vals = [geomean(r.xs(m, level="m")) if m in at else float("nan") for m in ms]
        ks = sorted(r.index.get_level_values("k").unique())  # a rival measured at fewer K says which
        all_k = len(ks) == p.index.get_level_values("k").nunique()
        where = "" if all_k else f", K = {', '.join(map(str, ks))}"
        bars = ax.bar(
            [x + i * width for x in range(len(ms))], vals, width, label=f"vs {c} ({geomean(r):.2f}x{where})"
        )
        labels = [f"{v:.2f}" if v == v else "" for v in vals]  # none where a rival was not measured
        ax.bar_label(bars, labels=labels, fontsize=7, rotation=90, padding=2)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + width * (len(rivals) - 1) / 2 for x in range(len(ms))], [f"M = N = {m}" for m in ms])
    ax.set_ylabel("their GPU time / ours, geomean over K")
    ax.set_ylim(0, 3.8)  # room for the legend above the bar labels
    ax.legend(loc="upper right")
    ax.set_title("Decompose-K, relu(A@B) bf16, K = 8192..32768")
    finish(fig)
    save(fig, a.out)


def grouped_panel(ax, df) -> None:
    """Geomean % of floor over E7's cells (models, projections, loads): decode and prefill; the held-out
    models' cells (ours: the default path, autotuned on its first call) where E7 has them."""
    df = df[(df.status == "ok") & df.proj.isin(["up", "down"])].copy()
    held = "split" in df and (df.split == "heldout").any()
    if held:
        df = df[df.split == "heldout"]
    df["phase"] = ["decode (T<=256)" if t <= 256 else "prefill (T>=1024)" for t in df.tokens]
    key = ["model", "proj", "tokens", "load", "phase"]
    ours = ["ours:auto"] if held else ["ours:contiguous", "ours:persistent"]
    series = {
        "ours": df[df.contender.isin(ours)].groupby(key).pct_floor_graph.max(),
        "torch._grouped_mm": df[df.contender == "torch._grouped_mm"].groupby(key).pct_floor_graph.max(),
        "vLLM fused_moe": df[df.contender == "vllm:fused_moe"].groupby(key).pct_floor_graph.max(),
        "padded bmm, cf 1.25 (drops rows)": df[df.contender == "padded-bmm:cf1.25"]
        .groupby(key)
        .pct_floor_graph.max(),
    }
    series = {name: s for name, s in series.items() if len(s)}  # vLLM's kernel only where it was measured
    phases = ["decode (T<=256)", "prefill (T>=1024)"]
    width = 0.8 / len(series)
    for i, (name, s) in enumerate(series.items()):
        vals = [geomean(s.xs(ph, level="phase").values) for ph in phases]
        bars = ax.bar([x + i * width for x in range(len(phases))], vals, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(phases))], ["decode", "prefill"])
    ax.set_ylabel("% of floor (GPU time), geomean")
    ax.set_ylim(0, 135)  # room for the legend above the bars
    ax.set_yticks(range(0, 101, 20))
    ax.legend(fontsize=7, loc="upper left", ncol=1)
    ax.set_title(f"grouped GEMM, {df.model.nunique()} {'held-out ' if held else ''}models")


if __name__ == "__main__":
    main()
