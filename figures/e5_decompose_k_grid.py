"""E5: per-shape GPU time of every contender on the M=N x K grid, per suite, with the physical floor, and
the seed's H100 two-stage kernel as a reference series."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from figures.common import CLOCKS, OURS, PALETTE, args, geomean, gpu_label, load, save, setup

SEED_FILES = {"bf16-relu": "epilogue_relu_bf16.csv", "bf16": "plain_matmul_bf16.csv",
              "fp16": "plain_matmul_fp16.csv", "fp32": "plain_matmul_fp32.csv"}
SEED_COL = {"bf16-relu": "decompose_k_fused_ms"}


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "decompose_k_grid.csv")
    df = df[df.status == "ok"]
    suites = list(dict.fromkeys(df.suite))
    ms = sorted(df.m.unique())
    seed_dir = Path(a.results).parent / "reference" / "seed-h100" / "optimized_triton_tlx"
    fig, axes = plt.subplots(len(suites), len(ms), figsize=(15, 3.0 * len(suites)), sharex=True)
    for i, suite in enumerate(suites):
        seed = pd.read_csv(seed_dir / SEED_FILES[suite]) if (seed_dir / SEED_FILES.get(suite, "x")).exists() else None
        for j, m in enumerate(ms):
            ax = axes[i, j]
            sub = df[(df.suite == suite) & (df.m == m)]
            for c, g in sub.groupby("contender"):
                g = g.sort_values("k")
                ax.plot(g.k, g.graph_us, marker="o", ms=3, lw=1.8 if c in OURS else 1.0,
                        color=PALETTE.get(c), label=c, ls="-" if c.startswith(("ours", "seed:")) else "--")
            fl = sub.drop_duplicates("k").sort_values("k")
            ax.plot(fl.k, fl.floor_us, color="black", lw=2.0, label="floor (datasheet + 1 tiny kernel)")
            if seed is not None:
                s = seed[seed.m == m].sort_values("k")
                col = SEED_COL.get(suite, "decompose_k_ms")
                ax.plot(s.k, s[col] * 1000, color="#e377c2", lw=1, ls=":", marker="x", ms=3,
                        label="seed, H100: optimized two-stage (launch-incl.)")
            ax.set_title(f"{suite}, M=N={m}", fontsize=8)
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("time [us]")
            if i == len(suites) - 1:
                ax.set_xlabel("K")
    h, lab = axes[0, 0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=6, fontsize=7, bbox_to_anchor=(0.5, -0.02))
    p = df[df.suite == suites[0]].pivot_table(index=["m", "k"], columns="contender", values="graph_us")
    ours = p[[c for c in OURS if c in p]].min(axis=1)
    vs = {c: geomean(p[c] / ours) for c in ("seed: optimized", "seed: original", "custom-op-autotuned", "eager")
          if c in p}
    fig.suptitle(f"E5 ({suites[0]}): ours (auto) is " + ", ".join(f"{v:.2f}x faster than {c}" for c, v in vs.items())
                 + f" (geomean)\nlines: {CLOCKS['graph_us']}; seed series: H100, launch-inclusive; {gpu_label(df)}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save(fig, a.out)


if __name__ == "__main__":
    main()
