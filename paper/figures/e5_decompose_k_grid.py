"""E5: per-shape GPU time of every contender on the M=N x K grid (bf16 ReLU), with the physical floor, and
the seed's optimized kernel as its study reported it on an H100 (launch-inclusive): another GPU and another
clock, so drawn in a style of its own (grey, dotted, crosses) and labelled as such."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from paper.figures.common import DK_NAMES, OURS, PALETTE, args, finish, gpu_name, load, save, setup

SEED_FILES = {
    "bf16-relu": "epilogue_relu_bf16.csv",
    "bf16": "plain_matmul_bf16.csv",
    "fp16": "plain_matmul_fp16.csv",
    "fp32": "plain_matmul_fp32.csv",
}
SEED_COL = {"bf16-relu": "decompose_k_fused_ms"}
# The reported series: measured on another GPU with another clock, so in no colour or line of ours
SEED_REPORTED = dict(color="#7f7f7f", lw=1.0, ls=":", marker="x", ms=3.5, mew=0.9)
SEED_LABEL = "seed's optimized kernel, H100, launch-inclusive (reported)"


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "decompose_k_grid.csv")
    df = df[df.status == "ok"]
    suites = list(dict.fromkeys(df.suite))
    suite = suites[0]  # bf16-relu, the seed's problem; the other suites are in the tables
    ms = sorted(df.m.unique())
    gpu = gpu_name(df)
    seed_dir = Path(a.results).parent / "reference" / "seed-h100" / "optimized_triton_tlx"
    seed = (
        pd.read_csv(seed_dir / SEED_FILES[suite])
        if (seed_dir / SEED_FILES.get(suite, "x")).exists()
        else None
    )
    fig, axes = plt.subplots(1, len(ms), figsize=(7.0, 2.5), sharex=True)
    for ax, m in zip(axes, ms):
        sub = df[(df.suite == suite) & (df.m == m)]
        for c, g in sub.groupby("contender"):
            g = g.sort_values("k")
            ax.plot(
                g.k / 1024,
                g.graph_us,
                marker="o",
                ms=2,
                lw=1.6 if c in OURS else 0.9,
                color=PALETTE.get(c),
                label=DK_NAMES.get(c, c),
                ls="-" if c.startswith(("ours", "seed:")) else "--",
            )
        fl = sub.drop_duplicates("k").sort_values("k")
        ax.plot(fl.k / 1024, fl.floor_us, color="black", lw=1.6, label="floor")
        if seed is not None:
            s = seed[seed.m == m].sort_values("k")
            col = SEED_COL.get(suite, "decompose_k_ms")
            ax.plot(s.k / 1024, s[col] * 1000, label=SEED_LABEL, **SEED_REPORTED)
        ax.set_title(f"M = N = {m}")
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"{gpu}: GPU time [us]" if ax is axes[0] else "")
        ax.set_xlabel("K / 1024")
    h, lab = axes[0].get_legend_handles_labels()
    if SEED_LABEL in lab:  # the other GPU's series last in the legend
        i = lab.index(SEED_LABEL)
        h, lab = h[:i] + h[i + 1 :] + h[i : i + 1], lab[:i] + lab[i + 1 :] + lab[i : i + 1]
    finish(fig, h, lab, ncol=3)
    save(fig, a.out)


if __name__ == "__main__":
    main()
