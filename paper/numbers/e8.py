"""E8 the expert FFN end to end (experiments/e8_moe_layer.py): the numbers and the table, when measured."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text
from experiments.report import runs_dir
from moegemm.grouped.ffn import FUSE_ABOVE_ROWS_PER_EXPERT

from .common import CLOCKS, Numbers, ci_text, gm, is_parity, phase_headline, table

OURS, UNFUSED = "ours:moe_ffn", "ours:unfused-swiglu"
HF_COMPILED, TORCH, VLLM = "hf:grouped_mm:compiled", "torch._grouped_mm pipeline", "vllm:fused_experts"
TK = "tk:matmul_ogs"  # OpenAI's triton_kernels as vLLM runs it for gpt-oss (triton_kernels_moe.py)
PEERS = (HF_COMPILED, TORCH, VLLM, TK)  # the best peer of a cell: the fastest of these there
BEST = "best peer"
KEYS = ["model", "tokens", "load"]
OURS_HF, OURS_HF_COMPILED = "ours:hf-backend", "ours:hf-backend:compiled"
PREFILL = 1024
MARGIN = 1.1  # the per-cell margin over the faster peer that the section counts the cells short of


def e8_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, split, tokens, load): each contender's GPU time as a column (rows that failed: absent),
    ``best_peer``, the fastest of transformers' compiled grouped_mm backend (where measured), the
    torch._grouped_mm pipeline, vLLM's fused_experts and triton_kernels (where at hand), and ``fused``:
    whether moe_ffn fuses SwiGLU into gate/up there (more than
    FUSE_ABOVE_ROWS_PER_EXPERT rows per expert on average)."""
    ok = df[df.status == "ok"]
    index = ["model", "split", "tokens", "load"] + [c for c in ("experts", "top_k") if c in df]
    p = ok.pivot_table(index=index, columns="contender", values="graph_us")
    peers = [c for c in PEERS if c in p]
    p["best_peer"] = p[peers].min(axis=1) if peers else float("nan")
    p = p.reset_index()
    if "experts" in p and "top_k" in p:
        p["fused"] = p.tokens * p.top_k > FUSE_ABOVE_ROWS_PER_EXPERT * p.experts
    else:
        p["fused"] = True
    return p


def fusion_at_decode(n: Numbers, results: Path) -> None:
    """What the fused gate/up measured where moe_ffn no longer fuses: E8 of runs/S16-1 (commit 6e88b3d), in
    which moe_ffn fused at every token count; the unfused contender's time over the fused one."""
    path = runs_dir(results) / "S16-1" / "moe_layer.csv"
    if not path.exists():
        return
    o = e8_frame(pd.read_csv(path))
    if UNFUSED not in o or OURS not in o:
        return
    for tag, c in (("Decode", o[~o.fused]), ("Prefill", o[o.fused])):
        for split, cs in (("Tune", c[c.split == "tune"]), ("Held", c[c.split == "heldout"])):
            f = (cs[UNFUSED] / cs[OURS]).dropna()
            if len(f):
                n.add(f"EEightEarlier{tag}{split}FusionGain", gm(f))


def compiled_small_probe(n: Numbers, results: Path) -> None:
    """probes/probe_compiled_small.py (when its CSVs are committed): the eager backend's GPU time over
    the compiled one's at T=1 and over all its cells (graph replays), and from its profiles (eager calls) how
    many (model, T) launch the same kernels the same number of times both ways, with the eager kernels' summed
    time over the compiled ones'."""
    got = probe_ratios(results / "probe_compiled_small.csv", OURS_HF, OURS_HF_COMPILED)
    k = results / "probe_compiled_small.kernels.csv"
    if got is None or not k.exists():
        return
    r, commit = got
    tokens = r.index.get_level_values("tokens")
    n.add("CompSmallCommit", commit, "{}")
    n.add("CompSmallCells", len(r), "{}")
    n.add("CompSmallGraphOne", gm(r[tokens == 1]))
    n.add("CompSmallGraphOneLo", float(r[tokens == 1].min()))
    n.add("CompSmallGraph", gm(r))
    kr = pd.read_csv(k)
    same, sums = 0, []
    for _, cell in kr.groupby(["model", "tokens"]):
        eager, comp = (cell[cell.contender == c] for c in (OURS_HF, OURS_HF_COMPILED))
        same += sorted(zip(eager.kernel, eager["count"])) == sorted(zip(comp.kernel, comp["count"]))
        sums.append(eager.us_per_call.sum() / comp.us_per_call.sum())
    n.add("CompSmallProfiled", len(sums), "{}")
    n.add("CompSmallSameKernels", same, "{}")
    n.add("CompSmallKernelTime", gm(pd.Series(sums)))


def graph_clock_probe(n: Numbers, results: Path) -> None:
    """probes/probe_graph_clock.py (when its CSV is committed): the GPU clock taken the harness's earlier
    way (``before``: the calls per graph from one host-timed call, replays timed from the host's launch),
    with the new count only (``count``) and as now (``now``: the count from a graph's GPU time, replays held),
    side by side. E8 rows: at T=1 the eager backend's time over the compiled one's before and now, the
    calls per graph the two got before (range) and now, and every contender's time now over before (and
    count over before, now over count); at the probe's largest T, now over before. E6 rows (the router
    GEMM, every graph the same count): now over before for eager and ours, and eager over ours both ways."""
    path = results / "probe_graph_clock.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    df = df[df.status == "ok"]
    e8, e6 = df[df.experiment == "E8"], df[df.experiment == "E6"]
    one = e8[e8.tokens == 1]
    if not len(one) or not {OURS_HF, OURS_HF_COMPILED} <= set(one.contender):
        return
    n.add("GClkCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("GClkModels", e8.model.nunique(), "{}")
    n.add("GClkTokens", ", ".join(str(int(t)) for t in sorted(e8.tokens.unique())), "{}")
    by = one.set_index(["model", "contender"])
    for clock, tag in (("before", "Before"), ("now", "Now")):
        r = (
            by[f"graph_us_{clock}"].xs(OURS_HF, level="contender")
            / by[f"graph_us_{clock}"].xs(OURS_HF_COMPILED, level="contender")
        ).dropna()
        n.add(f"GClkCompiled{tag}", gm(r))
        n.add(f"GClkCompiled{tag}Lo", float(r.min()))
    for name, tag in ((OURS_HF, "Eager"), (OURS_HF_COMPILED, "Compiled")):
        calls = one[one.contender == name].calls_before
        n.add(f"GClkCalls{tag}BeforeLo", int(calls.min()), "{}")
        n.add(f"GClkCalls{tag}BeforeHi", int(calls.max()), "{}")
    n.add("GClkCallsNowLo", int(one.calls_now.min()), "{}")
    shift = one.graph_us_now / one.graph_us_before
    n.add("GClkShiftOne", gm(shift), "{:.3f}")
    n.add("GClkShiftOneLo", float(shift.min()), "{:.3f}")
    n.add("GClkShiftOneHi", float(shift.max()), "{:.3f}")
    n.add("GClkCountOne", gm(one.graph_us_count / one.graph_us_before), "{:.3f}")
    n.add("GClkHoldOne", gm(one.graph_us_now / one.graph_us_count), "{:.3f}")
    top = e8[e8.tokens == e8.tokens.max()]
    n.add("GClkTopTokens", int(e8.tokens.max()), "{}")
    n.add("GClkShiftTop", gm(top.graph_us_now / top.graph_us_before), "{:.3f}")
    if len(e6) and {"eager", "ours:auto"} <= set(e6.contender):
        r6 = e6.set_index(["tokens", "contender"])
        for name, tag in (("eager", "Eager"), ("ours:auto", "Ours")):
            c = r6.xs(name, level="contender")
            n.add(f"GClkRouter{tag}", gm(c.graph_us_now / c.graph_us_before), "{:.3f}")
        for clock, tag in (("before", "Before"), ("now", "Now")):
            col = r6[f"graph_us_{clock}"]
            n.add(
                f"GClkRouterLead{tag}",
                gm(col.xs("eager", level="contender") / col.xs("ours:auto", level="contender")),
            )
        n.add("GClkRouterTokens", ", ".join(str(int(t)) for t in sorted(e6.tokens.unique())), "{}")


def large_cells_probe(n: Numbers, results: Path) -> None:
    """probes/probe_large_cells.py (when its CSV is committed): on E8's largest cells of two models in
    more rounds, the compiled backend's speed over the eager one's and moe_ffn's (fused) over the unfused
    composition's, each as a range over the probe's cells, and how far apart moe_ffn and the eager backend
    (the same kernels) are at most, in percent; and the same three in E8's cells (the lowest ratios, the
    largest distance), where E8 is committed."""
    got = probe_times(results / "probe_large_cells.csv", (OURS, UNFUSED, OURS_HF, OURS_HF_COMPILED))
    if got is None:
        return
    p, df = got
    n.add("LgCellsCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("LgCellsCells", len(p), "{}")
    n.add("LgCellsRounds", int(df.rounds.iloc[0]), "{}")
    n.add("LgCellsModels", " and ".join(sorted(set(p.index.get_level_values("model")))), "{}")
    n.add(
        "LgCellsTokens", ", ".join(str(int(t)) for t in sorted(set(p.index.get_level_values("tokens")))), "{}"
    )
    for tag, r in (("Comp", p[OURS_HF] / p[OURS_HF_COMPILED]), ("Fusion", p[UNFUSED] / p[OURS])):
        n.add(f"LgCells{tag}Lo", float(r.min()))
        n.add(f"LgCells{tag}Hi", float(r.max()))
    n.add("LgCellsSamePct", float(100 * (p[OURS_HF] / p[OURS] - 1).abs().max()), "{:.0f}")
    e8 = results / "moe_layer.csv"
    if e8.exists():
        o = e8_frame(pd.read_csv(e8))
        o = o[o.load == "uniform"].set_index(["model", "tokens"])
        same = o.loc[o.index.intersection(p.index)]
        if len(same):
            n.add("LgCellsEEightCompLo", float((same[OURS_HF] / same[OURS_HF_COMPILED]).min()))
            n.add("LgCellsEEightFusionLo", float((same[UNFUSED] / same[OURS]).min()))
            n.add("LgCellsEEightSamePct", float(100 * (same[OURS_HF] / same[OURS] - 1).abs().max()), "{:.0f}")


ROUTE_FAST, ROUTE_THREE, ROUTE_OLD = "ours:moe_ffn", "three-launch", "three-launch, 128-slot plan"


def decode_routing_probe(n: Numbers, results: Path) -> None:
    """probes/probe_decode_routing.py (when its CSV is committed): per cell (model, T), moe_ffn against
    the same layer with its routing as three launches, with the plan's blocks sized to the step and at 128
    slots (GPU time of the slower over the faster's): at T=1 over all models (lowest, highest) and per split,
    what the block sizing and the one launch give apart, at the probe's other T with at most
    GATHER_SLOTS slots, and past it, where moe_ffn takes the three launches; from the probe's first run (under
    runs/, where the one launch went to 128 slots) the lowest one-launch ratio at 128 slots."""
    from moegemm.grouped.routing_kernels import GATHER_SLOTS

    got = []
    for path in (
        results / "probe_decode_routing.csv",
        *sorted(runs_dir(results).glob("*/probe_decode_routing.csv")),
    ):
        if path.exists():
            df = pd.read_csv(path)
            ok = df[df.status == "ok"]
            p = ok.pivot_table(
                index=["model", "split", "tokens", "top_k", "experts"], columns="contender", values="graph_us"
            ).reset_index()
            if all(c in p for c in (ROUTE_FAST, ROUTE_THREE, ROUTE_OLD)):
                got.append((p, str(df.git_commit.iloc[0])[:7], path))
    if not got or got[0][2].parent != results:
        return
    p, commit, _ = got[0]
    p["slots"] = p.tokens * p.top_k
    total, gather, sizing = (
        p[ROUTE_OLD] / p[ROUTE_FAST],
        p[ROUTE_THREE] / p[ROUTE_FAST],
        p[ROUTE_OLD] / p[ROUTE_THREE],
    )
    one = p.tokens == 1
    n.add("DecRouteCommit", commit, "{}")
    n.add("DecRouteCells", len(p), "{}")
    n.add("DecRouteSlots", GATHER_SLOTS, "{}")
    n.add("DecRouteOne", gm(total[one]))
    n.add("DecRouteOneLo", float(total[one].min()))
    n.add("DecRouteOneHi", float(total[one].max()))
    n.add("DecRouteOneHiModel", str(p.loc[total[one].idxmax(), "model"]))
    for split, tag in (("tune", "Tune"), ("heldout", "Held")):
        m = one & (p.split == split)
        if m.any():
            n.add(f"DecRouteOne{tag}", gm(total[m]))
    n.add("DecRouteOneGather", gm(gather[one]))
    n.add("DecRouteOneSizing", gm(sizing[one]))
    few = ~one & (p.slots <= GATHER_SLOTS)
    if few.any():
        n.add("DecRouteFew", gm(total[few]))
        n.add("DecRouteFewLo", float(total[few].min()))
    past = p.slots > GATHER_SLOTS
    if past.any():
        n.add("DecRoutePast", gm(gather[past]))
    if len(got) < 2:
        return
    early, early_commit, path = got[1]  # the first of the runs under runs/, by name
    full = early[(early.tokens * early.top_k > GATHER_SLOTS) & (early.experts >= 64)]
    if len(full):
        r = full[ROUTE_THREE] / full[ROUTE_FAST]
        n.add("DecRouteEarlyRun", path.parent.name, "{}")
        n.add("DecRouteEarlyCommit", early_commit, "{}")
        n.add("DecRouteEarlyLo", float(r.min()))
        n.add("DecRouteEarlyLoModel", str(full.loc[r.idxmin(), "model"]))
        n.add("DecRouteEarlyCells", len(r), "{}")


def probe_times(path: Path, names: tuple[str, ...]) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(the GPU time of each contender that passed its check, a column per contender and a row per (model,
    tokens); the probe's rows as read) from a probe's CSV, or None where it or any of ``names`` is missing."""
    if not path.exists():
        return None
    df = pd.read_csv(path)
    p = df[df.status == "ok"].pivot_table(index=["model", "tokens"], columns="contender", values="graph_us")
    if not set(names) <= set(p.columns):
        return None
    return p, df


def probe_ratios(path: Path, slow: str, fast: str) -> tuple[pd.Series, str] | None:
    """(``slow``'s GPU time over ``fast``'s per (model, tokens), the probe's commit) from a probe's CSV, or
    None where it or either contender is missing."""
    got = probe_times(path, (slow, fast))
    if got is None:
        return None
    p, df = got
    return (p[slow] / p[fast]).dropna(), str(df.git_commit.iloc[0])[:7]


def fused_probe(n: Numbers, results: Path) -> None:
    """probes/probe_fused_tuned.py: on the tune models at prefill, after the fused kernel began timing a
    tuned shape's tiles against its regime's shortlist; our unfused time over moe_ffn's (fused), per cell."""
    got = probe_ratios(results / "probe_fused_tuned.csv", UNFUSED, OURS)
    if got is None:
        return
    r, commit = got
    n.add("EEightProbeFusedGain", gm(r))
    n.add("EEightProbeFusedSlower", int((r < 1).sum()), "{}")
    n.add("EEightProbeFusedCells", len(r), "{}")
    n.add("EEightProbeFusedCommit", commit, "{}")
    for t, tag in ((4096, "Mid"), (16384, "Long")):
        if ("deepseek-v3", t) in r.index:
            n.add(f"EEightProbeFusedDeepSeek{tag}", float(r[("deepseek-v3", t)]))


def compiled_probe(n: Numbers, results: Path) -> None:
    """probes/probe_compiled_layer.py: our compiled transformers backend against the eager one, side by
    side, after the traced layer's row gathers became a custom op (eager time over compiled time)."""
    got = probe_ratios(results / "probe_compiled_layer.csv", OURS_HF, OURS_HF_COMPILED)
    if got is None:
        return
    r, commit = got
    n.add("EEightProbeCompiledVsEager", gm(r))
    n.add("EEightProbeCompiledVsEagerMin", float(r.min()))
    n.add("EEightProbeCompiledVsEagerMax", float(r.max()))
    n.add("EEightProbeCompiledCells", len(r), "{}")
    n.add("EEightProbeCompiledModels", r.reset_index().model.nunique(), "{}")
    n.add("EEightProbeCompiledCommit", commit, "{}")


def compiled_kernels_probe(n: Numbers, results: Path) -> None:
    """probes/probe_compiled_kernels.py: E8's sequence of token counts replayed on one model, compiled
    backend against eager at each T (eager time over compiled), and at the largest T the profiler's GPU time
    per kernel name for each."""
    got = probe_ratios(results / "probe_compiled_kernels.csv", OURS_HF, OURS_HF_COMPILED)
    if got is None:
        return
    r, commit = got
    top = max(t for _, t in r.index)
    model = r.index[0][0]
    n.add("EEightKernProbeModel", model, "{}")
    n.add("EEightKernProbeCommit", commit, "{}")
    n.add("EEightKernProbeMin", float(r.min()))
    n.add("EEightKernProbeMax", float(r.max()))
    n.add("EEightKernProbeTop", float(r[(model, top)]))
    n.add("EEightKernProbeTopTokens", int(top), "{}")
    e8 = results / "moe_layer.csv"
    if e8.exists():
        o = e8_frame(pd.read_csv(e8))
        cell = o[(o.model == model) & (o.tokens == top) & (o.load == "zipf1.2")]
        if len(cell) and OURS_HF_COMPILED in cell:
            n.add("EEightKernProbeTopInEEight", float((cell[OURS_HF] / cell[OURS_HF_COMPILED]).iloc[0]))
    k = results / "probe_compiled_kernels.kernels.csv"
    if k.exists():
        kd = pd.read_csv(k)
        names = {c: set(g.kernel) for c, g in kd.groupby("contender")}
        tot = kd.groupby("contender").us_per_call.sum()
        if OURS_HF in names and OURS_HF_COMPILED in names:
            n.add("EEightKernProbeNames", len(names[OURS_HF]), "{}")
            n.add("EEightKernProbeSameNames", int(names[OURS_HF] == names[OURS_HF_COMPILED]), "{}")
            n.add("EEightKernProbeGpuRatio", float(tot[OURS_HF] / tot[OURS_HF_COMPILED]), "{:.3f}")


def compiled_samples_probe(n: Numbers, results: Path) -> None:
    """probes/probe_compiled_samples.py (results/<gpu>/probe_compiled_samples.csv and earlier runs of it
    under runs/): E8 run for one model with every graph replay logged; per run and cell (its largest T), the
    median replay of the eager backend over the compiled one's; from the runs that logged them, the host's
    longest replay() call, the most child processes and whether Dynamo compiled a graph while they ran."""
    paths = sorted(runs_dir(results).glob("*/probe_compiled_samples.csv"))
    if (results / "probe_compiled_samples.csv").exists():
        paths.append(results / "probe_compiled_samples.csv")
    ratios, models, tokens, host = [], set(), set(), []
    for path in paths:
        df = pd.read_csv(path)
        med = df.groupby(["cell", "contender"]).us.median().unstack()
        if OURS_HF not in med or OURS_HF_COMPILED not in med:
            continue
        ratios += list(med[OURS_HF] / med[OURS_HF_COMPILED])
        models |= set(df.model)
        tokens |= {int(c.split()[0].removeprefix("T=")) for c in df.cell}
        if "host_ms" in df:
            host.append(df)
    if not ratios:
        return
    n.add("EEightSampleRuns", len(paths), "{}")
    n.add("EEightSampleModels", " and ".join(sorted(models)), "{}")
    n.add("EEightSampleTokens", ", ".join(str(t) for t in sorted(tokens)), "{}")
    n.add("EEightSampleLo", min(ratios))
    n.add("EEightSampleHi", max(ratios))
    if host:
        h = pd.concat(host)
        n.add("EEightSampleHostMs", float(h.host_ms.max()), "{:.1f}")
        n.add("EEightSampleChildren", int(h.children.max()), "{}")
        n.add(
            "EEightSampleNewGraphs",
            int(sum(g.dynamo_graphs.max() - g.dynamo_graphs.min() for g in host)),
            "{}",
        )


def compiled_order_probe(n: Numbers, results: Path) -> None:
    """probes/probe_compiled_order.py (when its CSV is committed): E8's largest cells of one model
    measured again and again with the contenders in different orders; per order (the probe's variant), the
    eager backend's time over the compiled one's, lowest and highest over the loads. The order E8 used before
    (rotation) was measured first and last (variants "rotate" and "rotate-again"), both read here."""
    path = results / "probe_compiled_order.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    df = df[df.status == "ok"]
    p = df.pivot_table(index=["variant", "load"], columns="contender", values="graph_us")
    if OURS_HF not in p or OURS_HF_COMPILED not in p:
        return
    r = (p[OURS_HF] / p[OURS_HF_COMPILED]).dropna()
    variants = set(r.index.get_level_values("variant"))
    if not {"rotate", "balanced"} <= variants:
        return
    n.add("EEightOrderModel", str(df.model.iloc[0]), "{}")
    n.add("EEightOrderTokens", int(df.tokens.iloc[0]), "{}")
    n.add("EEightOrderCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("EEightOrderRounds", int(df[df.variant == "rotate"]["rounds"].iloc[0]), "{}")
    for macro, names in (
        ("Rotate", ["rotate", "rotate-again"]),
        ("Balanced", ["balanced"]),
        ("AfterEager", ["after-eager"]),
        ("BalancedFour", ["balanced-4"]),
    ):
        v = r[r.index.get_level_values("variant").isin(names)]
        if len(v):
            n.add(f"EEightOrder{macro}Lo", float(v.min()))
            n.add(f"EEightOrder{macro}Hi", float(v.max()))


def ffn_ceiling_probe(n: Numbers, results: Path) -> None:
    """probes/probe_ffn_ceiling.py (when its CSV is committed): on the held-out models' largest cells,
    the torch._grouped_mm pipeline's time and ours over dense:ffn's (the FFN's two GEMMs as dense cuBLAS
    GEMMs with one expert's weights, nothing else): the least of the first (with its model), the range of
    the second, and the cells measured."""
    path = results / "probe_ffn_ceiling.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df[df.status == "ok"].pivot_table(
        index=["model", "tokens", "load"], columns="contender", values="graph_us"
    )
    dense = "dense:ffn"
    if not all(c in p for c in (OURS, TORCH, dense)):
        return
    p = p.dropna(subset=[OURS, TORCH, dense])
    pipe, ours = p[TORCH] / p[dense], p[OURS] / p[dense]
    n.add("EEightCeilCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("EEightCeilCells", len(p), "{}")
    n.add("EEightCeilModels", p.index.get_level_values("model").nunique(), "{}")
    n.add(
        "EEightCeilTokens",
        ", ".join(str(int(t)) for t in sorted(set(p.index.get_level_values("tokens")))),
        "{}",
    )
    n.add("EEightCeilPipeVsDenseMin", float(pipe.min()))
    n.add("EEightCeilPipeVsDenseMinModel", str(pipe.idxmin()[0]))
    n.add("EEightCeilOursVsDenseLo", float(ours.min()))
    n.add("EEightCeilOursVsDenseHi", float(ours.max()))


def host_probe(n: Numbers, results: Path) -> None:
    """probes/probe_host_cost.py: the host's time per moe_ffn call, with the library's cached launches
    and with every kernel through Triton's own launch (measured in alternating rounds), vLLM's call as E8
    times it, one grouped GEMM call and one empty Triton kernel."""
    path = results / "probe_host_cost.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df.pivot_table(index=["model", "tokens"], columns="contender", values="cpu_us")
    ours, plain, vllm = "moe_ffn", "moe_ffn:triton-launch", "vllm:fused_experts"
    if ours not in p or plain not in p:
        return
    r = p[plain] / p[ours]
    n.add("EEightHostCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("EEightHostCells", len(r), "{}")
    n.add("EEightHostModels", p.index.get_level_values(0).nunique(), "{}")
    n.add("EEightHostTokens", ", ".join(str(int(t)) for t in sorted(set(p.index.get_level_values(1)))), "{}")
    n.add("EEightHostUsMin", float(p[ours].min()), "{:.0f}")
    n.add("EEightHostUsMax", float(p[ours].max()), "{:.0f}")
    n.add("EEightHostTritonUsMin", float(p[plain].min()), "{:.0f}")
    n.add("EEightHostTritonUsMax", float(p[plain].max()), "{:.0f}")
    n.add("EEightHostGain", gm(r))
    n.add("EEightHostGainMin", float(r.min()))
    n.add("EEightHostGainMax", float(r.max()))
    if vllm in p:
        n.add("EEightHostVllmUsMin", float(p[vllm].min()), "{:.0f}")
        n.add("EEightHostVllmUsMax", float(p[vllm].max()), "{:.0f}")
        n.add("EEightHostOverVllm", gm(p[ours] / p[vllm]))
    if "step:down" in p and "triton:empty-kernel" in p:
        n.add("EEightHostGemmUsMin", float(p["step:down"].min()), "{:.0f}")
        n.add("EEightHostGemmUsMax", float(p["step:down"].max()), "{:.0f}")
        n.add("EEightHostEmptyUs", float(p["triton:empty-kernel"].median()), "{:.0f}")


def fusion_ratios(o: pd.DataFrame) -> pd.Series:
    """Our unfused time over moe_ffn's, per cell where moe_ffn may fuse (above FUSE_ABOVE_ROWS_PER_EXPERT rows
    per expert; at decode it runs the unfused product itself)."""
    fo = o[o.fused]
    return (fo[UNFUSED] / fo[OURS]).dropna()


def fixed_fusion(n: Numbers, results: Path) -> None:
    """The E8 run before moe_ffn chose between the fused and unfused gate/up (runs/S17-2): where it always
    fused above FUSE_ABOVE_ROWS_PER_EXPERT rows per expert, our unfused time over its fused one."""
    path = runs_dir(results) / "S17-2" / "moe_layer.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    o = e8_frame(df)
    if UNFUSED not in o or OURS not in o:
        return
    f = fusion_ratios(o)
    if len(f):
        n.add("EEightFixedFusionCommit", str(df.git_commit.iloc[0])[:7], "{}")
        n.add("EEightFixedFusionGain", gm(f))
        n.add("EEightFixedFusionMin", float(f.min()))
        n.add("EEightFixedFusionSlower", int((f < 1).sum()), "{}")


def with_best_peer(df: pd.DataFrame) -> pd.DataFrame:
    """E8's rows plus, per cell and clock, a ``best peer`` row: the row of the peer (PEERS) fastest there on
    that clock (its per-round times travel with it, for the interval)."""
    ok = df[(df.status == "ok") & df.contender.isin(PEERS)]
    extra = []
    for clock in CLOCKS:
        col = f"{clock}_us"
        if col not in ok:
            continue
        live = ok[ok[col].notna()]
        if live.empty:
            continue
        best = live.loc[live.groupby(KEYS)[col].idxmin()].copy()
        best["contender"] = f"{BEST}:{clock}"
        extra.append(best)
    return pd.concat([df, *extra], ignore_index=True) if extra else df


def phase_rows(df: pd.DataFrame) -> list[dict]:
    """Per peer (the best peer, then each peer measured) and phase: their time over moe_ffn's with its 95%
    interval on both clocks, and the host cost; the best peer taken per clock."""
    d = with_best_peer(df)
    out = []
    for peer in (BEST, *PEERS):
        if peer == BEST:
            rows = {}
            for clock in CLOCKS:
                for r in phase_headline(
                    d[d.contender.isin([OURS, f"{BEST}:{clock}"])].replace({f"{BEST}:{clock}": BEST}),
                    KEYS,
                    BEST,
                    OURS,
                ):
                    rows.setdefault(r["phase"], {"phase": r["phase"], "theirs": BEST}).update(
                        {clock: r[clock], f"{clock}_cells": r[f"{clock}_cells"]}
                    )
            out += list(rows.values())
        elif peer in set(d.contender):
            out += phase_headline(d, KEYS, peer, OURS)
    return [r for r in out if any(r.get(f"{c}_cells") for c in CLOCKS)]


PEER_TAGS = {BEST: "Peer", HF_COMPILED: "HfCompiled", TORCH: "Torch", VLLM: "Vllm", TK: "Tk"}


def phase_numbers(n: Numbers, held: pd.DataFrame) -> None:
    """The E8 headline, held-out models: per phase and peer, both clocks with intervals (generated text reads
    "parity" where the interval holds 1.0); macros EEightHeld<Phase>Vs<Peer><Gpu|Launch>."""
    for r in phase_rows(held):
        tag = f"EEightHeld{r['phase'].capitalize()}Vs{PEER_TAGS[r['theirs']]}"
        for clock, ct in (("graph", "Gpu"), ("launch", "Launch")):
            if r.get(f"{clock}_cells"):
                n.add(f"{tag}{ct}", ci_text(*r[clock]))


def gemm_vs_layer(n: Numbers, results: Path, held: pd.DataFrame) -> None:
    """vLLM's GEMMs alone (E7, held-out: its kernel's gate/up plus down time over ours, ours with the gather
    timed where E7 has it, ``ours:auto+gather``, else ``ours:auto``) against its whole layer (E8) on the same
    cells (model, T, load), per phase: how much of the layer ratio is the GEMMs'. Macros
    EEightVllmGemmOnly<Phase>, EEightVllmLayer<Phase>, EEightVllmGemmCells<Phase>."""
    path = results / "grouped_skew.csv"
    if not path.exists() or VLLM not in held:
        return
    e7 = pd.read_csv(path)
    e7 = e7[(e7.status == "ok") & (e7.split == "heldout")] if "split" in e7 else e7.iloc[:0]
    ours = "ours:auto+gather" if (e7.contender == "ours:auto+gather").any() else "ours:auto"
    g = e7[e7.contender.isin([ours, "vllm:fused_moe"]) & e7.proj.isin(["up", "down"])]
    if g.empty:
        return
    per = g.pivot_table(index=KEYS, columns=["contender", "proj"], values="graph_us")
    need = [(c, pr) for c in (ours, "vllm:fused_moe") for pr in ("up", "down")]
    if not all(k in per.columns for k in need):
        return
    gemm = (
        (per[("vllm:fused_moe", "up")] + per[("vllm:fused_moe", "down")])
        / (per[(ours, "up")] + per[(ours, "down")])
    ).dropna()
    layer = (held.set_index(KEYS)[VLLM] / held.set_index(KEYS)[OURS]).dropna()
    both = gemm.index.intersection(layer.index)
    for phase, sel in (("Decode", lambda t: t <= 256), ("Prefill", lambda t: t >= PREFILL)):
        idx = [k for k in both if sel(k[1])]
        if idx:
            n.add(f"EEightVllmGemmOnly{phase}", gm(gemm.loc[idx]))
            n.add(f"EEightVllmLayer{phase}", gm(layer.loc[idx]))
            n.add(f"EEightVllmGemmCells{phase}", len(idx), "{}")


def e8(n: Numbers, results: Path, gen: Path) -> None:
    path = results / "moe_layer.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    o = e8_frame(df)
    if o.empty or OURS not in o:
        return
    held = o[o.split == "heldout"]
    n.add("EEightModels", o.model.nunique(), "{}")
    n.add("EEightFuseAbove", FUSE_ABOVE_ROWS_PER_EXPERT, "{}")
    n.add("EEightCells", len(o), "{}")
    for tag, c in (("Held", held), ("All", o)):
        r = (c.best_peer / c[OURS]).dropna()
        if len(r):
            n.add(f"EEight{tag}VsPeer", gm(r))
            n.add(f"EEight{tag}VsPeerMin", float(r.min()))
            n.add(f"EEight{tag}SlowerPeer", int((r < 1).sum()), "{}")
            n.add(f"EEight{tag}PeerCells", len(r), "{}")
    phase_numbers(n, df[df.split == "heldout"] if "split" in df else df.iloc[:0])
    gemm_vs_layer(n, results, held)
    pre = held[held.tokens >= PREFILL]
    if VLLM in o and len(pre):
        v = (pre[VLLM] / pre[OURS]).dropna()
        n.add("EEightHeldPrefillVsVllm", gm(v))
        n.add("EEightHeldPrefillVsVllmMin", float(v.min()))
    under = held[(held.best_peer / held[OURS]) < MARGIN]
    n.add("EEightMargin", MARGIN, "{:.1f}")
    n.add("EEightHeldUnderTarget", len(under), "{}")
    if len(under):
        n.add("EEightUnderTargetTokens", ", ".join(str(int(t)) for t in sorted(under.tokens.unique())))
    if HF_COMPILED in o:
        ts = sorted(o[o[HF_COMPILED].notna()].tokens.unique())
        n.add("EEightCompiledTokens", ", ".join(str(int(t)) for t in ts))
    if UNFUSED in o:
        f = fusion_ratios(o)
        if len(f):
            n.add("EEightFusionGain", gm(f))
            n.add("EEightFusionGainMin", float(f.min()))
            n.add("EEightFusionSlower", int((f < 1).sum()), "{}")
            n.add("EEightFusionCells", len(f), "{}")
    fusion_at_decode(n, results)
    one = o[o.tokens == 1]
    if OURS_HF in o and len(one):  # the backend calls moe_ffn with validate=False: the device checks' cost
        n.add("EEightChecksAtOne", gm(one[OURS] / one[OURS_HF]))
    if OURS_HF_COMPILED in o and OURS_HF in o:
        cmp = (o[OURS_HF] / o[OURS_HF_COMPILED]).dropna()
        if len(cmp):
            n.add("EEightCompiledVsEager", gm(cmp))
            n.add("EEightCompiledVsEagerMin", float(cmp.min()))
            n.add("EEightCompiledSlower", int((cmp < 1).sum()), "{}")
            n.add("EEightCompiledUnder", int((cmp < 0.97).sum()), "{}")
            n.add("EEightCompiledCells", len(cmp), "{}")
            low = o.loc[cmp.idxmin()]
            n.add("EEightCompiledMinModel", str(low.model), "{}")
            n.add("EEightCompiledMinTokens", int(low.tokens), "{}")
            row = df[
                (df.model == low.model)
                & (df.tokens == low.tokens)
                & (df.load == low.load)
                & (df.contender == OURS_HF_COMPILED)
            ]
            if len(row) and {"graph_p20_us", "graph_p80_us"} <= set(row.columns):
                n.add("EEightCompiledMinSpread", float((row.graph_p80_us / row.graph_p20_us).iloc[0]))
            top = o.tokens.max()
            big = (o[o.tokens == top][OURS_HF] / o[o.tokens == top][OURS_HF_COMPILED]).dropna()
            if len(big):
                n.add("EEightCompiledTopTokens", int(top), "{}")
                n.add("EEightCompiledVsEagerTop", gm(big))
                n.add("EEightCompiledVsEagerTopMin", float(big.min()))
                n.add("EEightCompiledVsEagerTopMinModel", str(o.loc[big.idxmin(), "model"]))
                n.add("EEightCompiledTopUnder", int((big < 0.97).sum()), "{}")
                rest = (o[o.tokens < top][OURS_HF] / o[o.tokens < top][OURS_HF_COMPILED]).dropna()
                if len(rest):
                    n.add("EEightCompiledVsEagerBelowTop", gm(rest))
    if UNFUSED in o:
        for t, tag in ((4096, "Mid"), (16384, "Long")):
            c = o[(o.model == "deepseek-v3") & (o.tokens == t) & (o.load == "uniform")]
            if len(c):
                n.add(f"EEightFusedDeepSeek{tag}", float((c[UNFUSED] / c[OURS]).iloc[0]))
    compiled_probe(n, results)
    compiled_kernels_probe(n, results)
    compiled_samples_probe(n, results)
    compiled_order_probe(n, results)
    decode_routing_probe(n, results)
    compiled_small_probe(n, results)
    graph_clock_probe(n, results)
    large_cells_probe(n, results)
    ffn_ceiling_probe(n, results)
    host_probe(n, results)
    fused_probe(n, results)
    fixed_fusion(n, results)
    rows = []
    for model, m in held.groupby("model", sort=False):
        r = m.best_peer / m[OURS]
        row = {"model": model, "vs best peer": f"{gm(r):.2f} ({r.min():.2f})"}
        if VLLM in m:
            pm = m[m.tokens >= PREFILL]
            row["prefill vs vLLM"] = f"{gm(pm[VLLM] / pm[OURS]):.2f}"
        if UNFUSED in m and m.fused.any():
            mf = m[m.fused]
            row["fused SwiGLU gain"] = f"{gm(mf[UNFUSED] / mf[OURS]):.2f}"
        rows.append(row)
    if rows:
        write_text(
            gen / "table_e8.tex",
            table(
                pd.DataFrame(rows),
                "E8, held-out models: the whole expert FFN (\\texttt{moe\\_ffn}) against the faster of "
                "transformers' compiled \\texttt{grouped\\_mm} backend and the "
                "\\texttt{torch.\\_grouped\\_mm} pipeline, and against vLLM's kernel at prefill; their time "
                "over ours, geomean (lowest) over token counts and loads; GPU time. Last column: our time "
                f"with SwiGLU as a separate op over the fused one, where \\texttt{{moe\\_ffn}} fuses (above "
                f"{FUSE_ABOVE_ROWS_PER_EXPERT} rows per expert).",
                "tab:e8",
                "l" + "r" * (len(rows[0]) - 1),
            ),
        )
