"""E6: DeepSeek-V3 router [T,7168]@[7168,256] latency vs T, per epilogue and clock."""

from __future__ import annotations

import matplotlib.pyplot as plt

from figures.common import CLOCKS, OURS, PALETTE, args, gpu_label, load, save, setup


def main():
    a = args(__doc__)
    setup()
    df = load(a.results, "router_gemm.csv")
    df = df[df.status == "ok"]
    epis = list(dict.fromkeys(df.epilogue))
    fig, axes = plt.subplots(2, len(epis), figsize=(6 * len(epis), 7), sharex=True)
    for i, clock in enumerate(["graph_us", "launch_us"]):
        for j, e in enumerate(epis):
            ax = axes[i, j]
            sub = df[df.epilogue == e]
            for c, g in sub.groupby("contender"):
                g = g.sort_values("m")
                ax.plot(g.m, g[clock], marker="o", ms=3, color=PALETTE.get(c), label=c,
                        lw=1.8 if c in OURS else 1.0, ls="-" if c.startswith(("ours", "seed:")) else "--")
            if clock == "graph_us":
                fl = sub.drop_duplicates("m").sort_values("m")
                ax.plot(fl.m, fl.floor_us, color="black", lw=2, label="floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"epilogue={e}: {CLOCKS[clock]}", fontsize=8)
            ax.set_xlabel("tokens T")
            ax.set_ylabel("time [us]")
    axes[0, 0].legend(fontsize=7, ncol=2)
    p = df[df.epilogue == epis[-1]].pivot_table(index="m", columns="contender", values="graph_us")
    ours = p[[c for c in OURS if c in p]].min(axis=1)
    ahead = ours < 0.97 * p["eager"]
    wins = p.index[ahead.cummin()]  # the run of token counts from T=1 up where ours is ahead
    worst = (p["eager"] / ours).min()
    fig.suptitle(f"E6: ours (auto) beats cuBLAS by > 3% for T <= {int(max(wins)) if len(wins) else 0} "
                 f"(epilogue {epis[-1]}), GPU clock, and dispatches to it beyond (worst {worst:.2f}x)\n"
                 f"{gpu_label(df)}", fontsize=9)
    fig.tight_layout()
    save(fig, a.out)


if __name__ == "__main__":
    main()
