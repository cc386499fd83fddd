"""E5 Decompose-K grid: the numbers and tables, and the heuristic against the tuned table (the kernel-design
probes' numbers are in paper/numbers/probes.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import OURS, SEEDS, Numbers, cell_ratios, gm, paired_rounds, ratio_ci_text, table

E5_RIVALS = ("eager", *SEEDS, "pytorch:decompose_k", "compiled", "custom-op-autotuned")


def vs_ours(g: pd.DataFrame, clock: str) -> tuple[pd.DataFrame, pd.Series, dict]:
    """One suite of E5 on one clock: the (m, k) x contender times, our default's per shape, and each rival's
    geomean of (its time / ours) where it was measured, each shape's ratio that of the two sides' times as
    their rows state them (common.cell_ratios, the point of the headline intervals)."""
    p = g.pivot_table(index=["m", "k"], columns="contender", values=clock)
    ours = p[OURS[0]]
    name = clock.removesuffix("_us")
    vs = {}
    for c in E5_RIVALS:
        if c in p:
            theirs, mine, cells = paired_rounds(g, ["m", "k"], c, OURS[0], name)
            if len(cells):
                vs[c] = gm(pd.Series(cell_ratios(theirs, mine)))
    return p, ours, vs


def seed_fp32_searched(results: Path) -> bool:
    """Whether the seed's own search ran in fp32 (tune_seed.csv holds fp32 winners), so that E5's fp32 suite
    runs the seed's kernels at fp32 configs, not at bf16's."""
    path = results / "tune_seed.csv"
    if not path.exists():
        return False
    t = pd.read_csv(path, usecols=lambda c: c in ("dtype", "best"))
    return bool(((t.get("dtype") == "float32") & (t.get("best").astype(str) == "True")).any())


def seed_fp32_configs_text(results: Path) -> str:
    """Which configs the seed's kernels ran at in E5's fp32 suite, as the text says it."""
    if seed_fp32_searched(results):
        return "at the configs of its own fp32 search"
    return "at the configs its search found for bf16"


def e5(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "decompose_k_grid.csv")
    df = df[df.status == "ok"]
    fp32_own = seed_fp32_searched(results)
    n.add("EFiveSeedFpThirtyTwoConfigs", seed_fp32_configs_text(results), "{}")
    rows, seed_opt = [], {}
    for suite, g in df.groupby("suite", sort=False):
        for clock in ("graph_us", "launch_us"):
            p, ours, vs = vs_ours(g, clock)
            row = {
                "suite": suite,
                "clock": "GPU" if clock == "graph_us" else "launch",
                "ours med [us]": ours.median(),
            }
            rows.append({**row, **{c: vs.get(c, float("nan")) for c in E5_RIVALS}})
            if "seed: optimized" in vs:
                seed_opt[suite, clock] = vs["seed: optimized"]
    # the seed's optimized kernel's time over ours per suite (geomeans; the intervals are bf16-relu's below)
    for suite, tag in (("bf16", "Bf"), ("fp16", "Fp")):  # with intervals over shapes (and rounds)
        theirs, ours_r, cells = paired_rounds(df[df.suite == suite], ["m", "k"], "seed: optimized", OURS[0])
        if len(cells):
            n.add(f"EFive{tag}GraphVsSeedOpt", ratio_ci_text(theirs, ours_r))
    if ("fp32", "graph_us") in seed_opt:
        n.add("EFiveFpThirtyTwoGraphVsSeedOpt", seed_opt["fp32", "graph_us"])
    if ("fp32", "launch_us") in seed_opt:
        n.add("EFiveFpThirtyTwoLaunchVsSeedOpt", seed_opt["fp32", "launch_us"])
    relu = df[df.suite == "bf16-relu"]
    p, ours, vs = vs_ours(relu, "graph_us")
    theirs, ours_r, cells = paired_rounds(relu, ["m", "k"], "seed: original", OURS[0])
    if len(cells):  # with its interval over shapes (and rounds)
        n.add("EFiveBfReluGraphVsSeedOrig", ratio_ci_text(theirs, ours_r))
    floor = relu.drop_duplicates(["m", "k"]).set_index(["m", "k"])["floor_us"]
    n.add("EFiveBfReluPctFloor", 100 * gm(floor / ours), "{:.0f}")
    if "cpu_us" in relu:  # Python's cost of one call, medians over the grid
        cpu = relu.pivot_table(index=["m", "k"], columns="contender", values="cpu_us")
        n.add("EFiveBfReluCpuOurs", cpu[OURS[0]].median(), "{:.0f}")
        n.add("EFiveBfReluCpuEager", cpu["eager"].median(), "{:.0f}")
        if "seed: optimized" in cpu:
            n.add("EFiveBfReluCpuSeedOpt", cpu["seed: optimized"].median(), "{:.0f}")
    intervals(n, df[df.suite == "bf16-relu"])
    comp = relu[relu.contender == "compiled"]  # the shapes the compiled contenders ran at (config.yaml)
    if len(comp):
        n.add("EFiveCompiledK", ", ".join(str(int(k)) for k in sorted(comp.k.unique())))
        n.add("EFiveCompiledMN", ", ".join(str(int(m)) for m in sorted(comp.m.unique())))
    seed_outliers(n, df[df.suite == "fp32"])
    t = pd.DataFrame(rows)
    t = t.rename(
        columns={
            "pytorch:decompose_k": "seed PyTorch",
            "custom-op-autotuned": "custom-op",
            "seed: optimized": "seed opt.",
            "seed: original": "seed orig.",
        }
    )
    shapes = df.groupby("suite").apply(lambda g: len(g.drop_duplicates(["m", "k"]))).max()
    write_text(
        gen / "table_e5.tex",
        table(
            t,
            "E5: geomean of each contender's time over our default's "
            '(\\texttt{kernel="auto"}; $>$ 1: ours is faster), '
            f"{shapes} shapes per suite; compiled contenders only where measured; the "
            "seed's Triton kernels at the configs of their own search (bf16's for "
            + ("fp16)." if fp32_own else "fp16 and fp32)."),
            "tab:e5",
            "llrrrrrrrr",
        ),
    )
    shape_table(n, df, gen)


def intervals(n: Numbers, g: pd.DataFrame) -> None:
    """E5's bf16-ReLU headline with its 95% bootstrap interval over shapes (and rounds, where the rows carry
    them), on both clocks: each rival's time over ours, as text ("parity" where the interval holds 1.0).
    Macros EFiveBfRelu<Graph|Launch>Vs<Rival>Ci."""
    for c, ct in (
        ("eager", "Eager"),
        ("compiled", "Compiled"),
        ("custom-op-autotuned", "CustomOp"),
        ("seed: optimized", "SeedOpt"),
    ):
        for clock, tag in (("graph", "Graph"), ("launch", "Launch")):
            theirs, ours, cells = paired_rounds(g, ["m", "k"], c, OURS[0], clock)
            if len(cells):
                n.add(f"EFiveBfRelu{tag}Vs{ct}Ci", ratio_ci_text(theirs, ours))


OUTLIER = 10.0  # a seed cell this many times slower than ours: its config, not its kernel's design


def seed_outliers(n: Numbers, g: pd.DataFrame) -> None:
    """The fp32 suite against the seed's optimized kernel, which runs the configs its own search found for
    bf16: the median of its time over ours beside the geomean (both clocks), and the cells where it takes
    more than OUTLIER times our GPU time (how many, the range, their M and K) with the geomean without
    them."""
    for clock, tag in (("graph_us", "Graph"), ("launch_us", "Launch")):
        p = g.pivot_table(index=["m", "k"], columns="contender", values=clock)
        if "seed: optimized" not in p:
            return
        r = (p["seed: optimized"] / p[OURS[0]]).dropna()
        n.add(f"EFiveFpThirtyTwo{tag}VsSeedOptMedian", float(r.median()))
        if tag == "Graph":
            out = r[r > OUTLIER]
            n.add("EFiveFpThirtyTwoSeedOutliers", len(out), "{}")
            if len(out):
                n.add("EFiveFpThirtyTwoSeedOutlierLo", float(out.min()), "{:.0f}")
                n.add("EFiveFpThirtyTwoSeedOutlierHi", float(out.max()), "{:.0f}")
                n.add(
                    "EFiveFpThirtyTwoSeedOutlierM",
                    ", ".join(str(m) for m in sorted({m for m, _ in out.index})),
                )
                n.add(
                    "EFiveFpThirtyTwoSeedOutlierK",
                    ", ".join(str(k) for k in sorted({k for _, k in out.index})),
                )
                n.add("EFiveFpThirtyTwoGraphVsSeedOptRest", gm(r[r <= OUTLIER]))


def shape_table(n: Numbers, df: pd.DataFrame, gen: Path, suite: str = "bf16-relu") -> None:
    """E5's bf16-ReLU grid shape by shape: each contender's GPU time, ours and cuBLAS's launch-inclusive
    time and Python's cost per call."""
    g = df[df.suite == suite]
    names = {
        OURS[0]: "ours",
        "seed: optimized": "seed opt.",
        "seed: original": "seed orig.",
        "eager": "cuBLAS",
        "custom-op-autotuned": "custom-op",
    }
    gpu = [c for c in (OURS[0], *SEEDS, "eager", "custom-op-autotuned") if c in set(g.contender)]
    gt = g.pivot_table(index=["m", "k"], columns="contender", values="graph_us")
    lt = g.pivot_table(index=["m", "k"], columns="contender", values="launch_us").reindex(gt.index)
    parts = [("M=N", [str(m) for m, _ in gt.index]), ("K", [str(k) for _, k in gt.index])]
    parts += [(names[c], gt[c].values) for c in gpu]
    parts += [(names[c], lt[c].values) for c in (OURS[0], "eager")]
    host = []
    if "cpu_us" in g:
        ct = g.pivot_table(index=["m", "k"], columns="contender", values="cpu_us").reindex(gt.index)
        host = [c for c in (OURS[0], "seed: optimized", "eager") if c in ct]
        parts += [(names[c], ct[c].values) for c in host]
    parts.append(
        ("floor", g.drop_duplicates(["m", "k"]).set_index(["m", "k"]).loc[gt.index, "floor_us"].values)
    )
    t = pd.DataFrame({i: v for i, (_, v) in enumerate(parts)})
    t.columns = [name for name, _ in parts]
    groups = [("", 2), ("GPU time", len(gpu)), ("launch-inclusive", 2)]
    groups += [("host, one call", len(host))] if host else []
    write_text(
        gen / "table_e5_shapes.tex",
        table(
            t,
            f"E5, {suite}, shape by shape, in $\\mu$s: GPU time (CUDA-graph replay) of each contender, "
            "launch-inclusive time (\\texttt{do\\_bench}, L2 flushed) and Python's cost of one call (the "
            "host time of calls issued back to back, no sync); cuBLAS is eager "
            "$\\mathrm{ReLU}(\\mathrm{mm})$; "
            "custom-op only at the $K$ where it was compiled; floor: the physical floor.",
            "tab:e5shapes",
            "ll" + "r" * (len(parts) - 2),
            groups=groups + [("", 1)],
            colsep=4,
        ),
    )


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
