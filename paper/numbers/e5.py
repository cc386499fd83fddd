"""E5 Decompose-K grid: the numbers and tables, the heuristic against the tuned table, and the kernel-design probes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text
from .common import Numbers, OURS, SEEDS, commits_of, gm, table


E5_RIVALS = ("eager", *SEEDS, "pytorch:decompose_k", "compiled", "custom-op-autotuned")


def vs_ours(g: pd.DataFrame, clock: str) -> tuple[pd.DataFrame, pd.Series, dict]:
    """One suite of E5 on one clock: the (m, k) x contender times, our best kernel's per shape, and each
    rival's geomean of (its time / ours) where it was measured."""
    p = g.pivot_table(index=["m", "k"], columns="contender", values=clock)
    ours = p[OURS].min(axis=1)
    return p, ours, {c: gm(p[c] / ours) for c in E5_RIVALS if c in p}


def e5(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "decompose_k_grid.csv")
    df = df[df.status == "ok"]
    n.add("EFiveRows", len(df), "{}")
    n.add("EFiveCompiledShapes", len(df[df.contender == "compiled"].drop_duplicates(["suite", "m", "k"])), "{}")
    rows = []
    for suite, g in df.groupby("suite", sort=False):
        for clock in ("graph_us", "launch_us"):
            p, ours, vs = vs_ours(g, clock)
            row = {"suite": suite, "clock": "GPU" if clock == "graph_us" else "launch", "ours med [us]": ours.median()}
            rows.append({**row, **{c: vs.get(c, float("nan")) for c in E5_RIVALS}})
            tag = {"bf16-relu": "BfRelu", "bf16": "Bf", "fp16": "Fp", "fp32": "FpThirtyTwo"}[suite]
            ctag = "Graph" if clock == "graph_us" else "Launch"
            for c, ct in (("eager", "Eager"), ("compiled", "Compiled"), ("custom-op-autotuned", "CustomOp"),
                          ("seed: optimized", "SeedOpt"), ("seed: original", "SeedOrig")):
                if c in vs:
                    n.add(f"EFive{tag}{ctag}Vs{ct}", vs[c])
                    n.add(f"EFive{tag}{ctag}Vs{ct}Min", (p[c] / ours).min())
            if "cpu_us" in g:
                cpu = g.pivot_table(index=["m", "k"], columns="contender", values="cpu_us")
                if ctag == "Graph":
                    n.add(f"EFive{tag}CpuOurs", cpu[OURS[0]].median(), "{:.0f}")
                    n.add(f"EFive{tag}CpuOursMax", cpu[OURS[0]].max(), "{:.0f}")
                    n.add(f"EFive{tag}CpuEager", cpu["eager"].median(), "{:.0f}")
                    if "seed: optimized" in cpu:
                        n.add(f"EFive{tag}CpuSeedOpt", cpu["seed: optimized"].median(), "{:.0f}")
            if clock == "graph_us":
                floor = g.drop_duplicates(["m", "k"]).set_index(["m", "k"])["floor_us"]
                n.add(f"EFive{tag}PctFloor", 100 * gm(floor / ours), "{:.0f}")
                n.add(f"EFive{tag}OverFloorMax", (ours / floor).max())
                wins = (ours <= p.drop(columns=[c for c in p if c.startswith("ours")]).min(axis=1)).sum()
                n.add(f"EFive{tag}Wins", int(wins), "{}")
                n.add(f"EFive{tag}Shapes", len(p), "{}")
    t = pd.DataFrame(rows)
    t = t.rename(columns={"pytorch:decompose_k": "seed PyTorch", "custom-op-autotuned": "custom-op",
                          "seed: optimized": "seed opt.", "seed: original": "seed orig."})
    shapes = df.groupby("suite").apply(lambda g: len(g.drop_duplicates(["m", "k"]))).max()
    write_text(gen / "table_e5.tex", table(t, "E5: geomean of each contender's time over our default's "
                                         "(\\texttt{kernel=\"auto\"}; $>$ 1: ours is faster), "
                                         f"{shapes} shapes per suite; compiled contenders only where measured; the "
                                         "seed's Triton kernels at the configs of their own search (bf16's for "
                                         "fp16 and fp32).", "tab:e5", "llrrrrrrrr"))
    shape_table(n, df, gen)


def shape_table(n: Numbers, df: pd.DataFrame, gen: Path, suite: str = "bf16-relu") -> None:
    """E5's bf16-ReLU grid shape by shape: each contender's GPU time, ours and cuBLAS's launch-inclusive
    time and Python's cost per call."""
    g = df[df.suite == suite]
    cols = [c for c in (OURS[0], *SEEDS, "eager", "custom-op-autotuned") if c in set(g.contender)]
    gt = g.pivot_table(index=["m", "k"], columns="contender", values="graph_us")
    lt = g.pivot_table(index=["m", "k"], columns="contender", values="launch_us")
    t = pd.DataFrame({"M=N": [str(m) for m, _ in gt.index], "K": [str(k) for _, k in gt.index]})
    names = {OURS[0]: "ours", "seed: optimized": "seed opt.", "seed: original": "seed orig.", "eager": "cuBLAS",
             "custom-op-autotuned": "custom-op"}
    for c in cols:
        t[f"{names[c]} GPU"] = gt[c].values
    for c in (OURS[0], "eager"):
        t[f"{names[c]} launch"] = lt[c].values
    if "cpu_us" in g:
        ct = g.pivot_table(index=["m", "k"], columns="contender", values="cpu_us")
        for c in (OURS[0], "seed: optimized", "eager"):
            if c in ct:
                t[f"{names[c]} cpu"] = ct[c].values
    t["floor"] = g.drop_duplicates(["m", "k"]).set_index(["m", "k"]).loc[gt.index, "floor_us"].values
    write_text(gen / "table_e5_shapes.tex", table(
        t, f"E5, {suite}, shape by shape [us]: GPU time (CUDA-graph replay) of each contender, launch-inclusive "
        "time (do\\_bench, L2 flushed) and Python's cost of one call (cpu: the host time of 200 calls back to "
        "back, no sync); cuBLAS is eager relu(mm); custom-op only at the K where it was compiled.",
        "tab:e5shapes", "ll" + "r" * (len(t.columns) - 2)))


def heuristic_vs_tuned(n: Numbers, results: Path) -> None:
    """The Decompose-K heuristic's config against the tuner's fastest, on the 16-bit shapes where the tuner
    timed that config (in-sample: the rule was read off this table)."""
    import ast

    import torch

    from moegemm.decompose_k.configs import heuristic_config

    path = results / "tune_decompose_k.csv"
    if not path.exists():
        return
    d = pd.read_csv(path)
    d = d[(d.status == "ok") & (d.kernel == "single_launch") & (d.dtype == "bfloat16")]
    fields = ("split_k", "block_m", "block_n", "block_k", "num_warps")
    ratios = []
    for (m, nn, k), g in d.groupby(["m", "n", "k"]):
        h = heuristic_config(int(m), int(nn), int(k), torch.bfloat16, int(g.sm_count.iloc[0])).as_dict()
        times = {tuple(ast.literal_eval(c)[f] for f in fields): t for c, t in zip(g.config, g.graph_us)}
        t = times.get(tuple(h[f] for f in fields))
        if t is not None:
            ratios.append(t / g.graph_us.min())
    if ratios:
        n.add("DkHeuristicShapes", len(ratios), "{}")
        n.add("DkHeuristicGm", gm(pd.Series(ratios)))
        n.add("DkHeuristicMax", max(ratios))


DK_LATENCY_RATIO = 1.3  # the speed-up over the seed's optimized kernel the latency budget is worked out for


def dk_latency_probe(n: Numbers, results: Path) -> None:
    """experiments/probe_dk_latency.py: where the single-launch kernel's time goes (lower bounds of its grid:
    no work; the K loop with no exchange, at its config and at the fastest of the tuner's space), beside the
    seed's optimized kernel; and its earlier run (runs/S18-1) with two other waits and a compile-time M."""
    path = results / "probe_dk_latency.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df[df.status == "ok"].pivot_table(index=["m", "n", "k"], columns="contender", values="graph_us")
    need = ("ours:auto", "seed: optimized", "direct:coop", "direct:no-attribute", "ceiling:empty",
            "ceiling:empty:no-attribute", "ceiling:load:no-attribute", "ceiling:load:fastest-config")
    if any(c not in p for c in need):
        return
    n.add("DkLatShapes", len(p), "{}")
    n.add("DkLatCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("DkLatOursVsSeed", gm(p["seed: optimized"] / p["ours:auto"]))
    n.add("DkLatEmptyUs", float(p["ceiling:empty:no-attribute"].median()))
    n.add("DkLatEmptyCoopUs", float(p["ceiling:empty"].median()))
    n.add("DkLatCoopCost", gm(p["direct:coop"] / p["direct:no-attribute"]))
    n.add("DkLatCoopCostMax", float((p["direct:coop"] / p["direct:no-attribute"]).max()))
    x = p["direct:no-attribute"] - p["ceiling:load:no-attribute"]  # the exchange: ours less its K loop alone
    n.add("DkLatExchangeUs", float(x.median()))
    n.add("DkLatExchangeMinUs", float(x.min()))
    n.add("DkLatExchangeMaxUs", float(x.max()))
    b = p["seed: optimized"] / p["ceiling:load:fastest-config"]
    n.add("DkLatBoundGm", gm(b))
    n.add("DkLatBoundMin", float(b.min()))
    n.add("DkLatBoundMax", float(b.max()))
    # what a kernel 1.3x the seed's may spend above the exchange-free bound, per shape, against our exchange
    room = p["seed: optimized"] / DK_LATENCY_RATIO - p["ceiling:load:fastest-config"]
    n.add("DkLatRatio", DK_LATENCY_RATIO, "{:.1f}")
    n.add("DkLatRoomUs", float(room.median()))
    n.add("DkLatRoomMinUs", float(room.min()))
    n.add("DkLatRoomMaxUs", float(room.max()))
    n.add("DkLatRoomFits", int((x <= room).sum()), "{}")
    n.add("DkLatBoundConfigs", int(df.loc[df.contender == "ceiling:load:fastest-config", "configs_timed"].sum()),
          "{}")
    early = results / "runs" / "S18-1" / "probe_dk_latency.csv"
    if early.exists():
        e = pd.read_csv(early)
        q = e[e.status == "ok"].pivot_table(index=["m", "n", "k"], columns="contender", values="graph_us")
        if all(c in q for c in ("wait:0", "wait:1", "wait:2", "wait:0:mconst")):
            n.add("DkLatEarlyCommit", str(e.git_commit.iloc[0])[:7], "{}")
            n.add("DkLatWaitOne", gm(q["wait:1"] / q["wait:0"]))
            n.add("DkLatWaitTwo", gm(q["wait:2"] / q["wait:0"]))
            n.add("DkLatMconst", gm(q["wait:0:mconst"] / q["wait:0"]))


def dk_design_probe(n: Numbers, results: Path) -> None:
    """probe_dk_design.csv: the single-launch kernel's best config launched cooperatively, the same kernel
    without the cooperative attribute, and its last-arriver form, side by side; and probe_dk_seed.csv: ours
    against the seed's optimized kernel, each after its own search."""
    path = results / "probe_dk_design.csv"
    if path.exists():
        df = pd.read_csv(path)
        p = df[(df.status == "ok") & ~df.contender.str.startswith("screen:")].pivot_table(
            index=["m", "n", "k"], columns="contender", values="graph_us")
        n.add("DkProbeShapes", len(p), "{}")
        n.add("DkCoopAttrCost", gm(p["coop"] / p["coop-no-attribute"]))
        n.add("DkLastArriverMin", (p["last-arriver"] / p["coop"]).min(), "{:.1f}")
        n.add("DkLastArriverMax", (p["last-arriver"] / p["coop"]).max(), "{:.1f}")
        n.add("DkScreened", int(df.contender.str.startswith("screen:").sum()), "{}")
    path = results / "probe_dk_seed.csv"
    if path.exists():
        df = pd.read_csv(path)
        p = df[df.status == "ok"].pivot_table(index=["m", "n", "k"], columns="contender", values="graph_us")
        r = p["seed: optimized"] / p["ours:single_launch"]
        n.add("DkSeedProbeShapes", len(r), "{}")
        n.add("DkSeedProbeGm", gm(r))
        n.add("DkSeedProbeMin", r.min())
        n.add("DkSeedProbeMax", r.max())
    heuristic_vs_tuned(n, results)
    dk_latency_probe(n, results)
    for name, tag in (("epilogue_fusion", "EThree"), ("split_sweep", "EFour"), ("decompose_k_grid", "EFive"),
                      ("router_gemm", "ESix")):
        c = commits_of(results / f"{name}.csv") if (results / f"{name}.csv").exists() else None
        if c is not None:
            n.add(f"{tag}Commit", ", ".join(sorted({x[:7] for x in c})))
