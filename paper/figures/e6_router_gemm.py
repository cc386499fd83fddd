"""E6: DeepSeek-V3 router [T,7168]@[7168,256] latency vs T, per epilogue and clock: without an epilogue and
with the sigmoid. The ReLU rows (ours against the seed's kernels, like for like, at decode) are in E6's
table."""

from __future__ import annotations

import matplotlib.pyplot as plt

from paper.figures.common import DK_NAMES, OURS, PALETTE, args, finish, load, save, setup


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "router_gemm.csv")
    df = df[df.status == "ok"]
    epis = [e for e in ("none", "sigmoid") if e in set(df.epilogue)]
    fig, axes = plt.subplots(1, 2 * len(epis), figsize=(7.0, 2.5), sharex=True)
    for i, clock in enumerate(["graph_us", "launch_us"]):
        for j, e in enumerate(epis):
            ax = axes[i * len(epis) + j]
            sub = df[df.epilogue == e]
            for c, g in sub.groupby("contender"):
                g = g.sort_values("m")
                ax.plot(
                    g.m,
                    g[clock],
                    marker="o",
                    ms=2,
                    color=PALETTE.get(c),
                    label=DK_NAMES.get(c, c),
                    lw=1.6 if c in OURS else 0.9,
                    ls="-" if c.startswith(("ours", "seed:")) else "--",
                )
            if clock == "graph_us":
                fl = sub.drop_duplicates("m").sort_values("m")
                ax.plot(fl.m, fl.floor_us, color="black", lw=1.6, label="floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{e}, {'GPU time' if clock == 'graph_us' else 'launch-incl.'}")
            ax.set_xlabel("tokens T")
            ax.set_ylabel("time [us]" if ax is axes[0] else "")
    h, lab = axes[0].get_legend_handles_labels()
    finish(fig, h, lab, ncol=4)
    save(fig, a.out)


if __name__ == "__main__":
    main()
