"""The probes' numbers (probes/probe_*.py, from their CSVs in results/<gpu>/, each where committed), those the
write-up's probe table quotes: the grouped kernel's prefill tiles, counters, power, mixed expert order,
Stream-K, the held-out ceilings and the Gluon kernel; the Decompose-K kernel's design and latency.
paper/make_numbers.py runs them with the experiments' numbers. They read the probes' CSVs only, never the
probes' code: a config is named as the probes' rows name it (config_label)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from .latex import Numbers, gm


def probe_rows_any(results: Path, probe: str) -> pd.DataFrame | None:
    """A probe's rows (results/<gpu>/<probe>.csv) whatever their status, None where it is not committed."""
    path = results / f"{probe}.csv"
    return pd.read_csv(path) if path.exists() else None


def probe_rows(results: Path, probe: str) -> pd.DataFrame | None:
    """A probe's correct rows (results/<gpu>/<probe>.csv), None where it is not committed."""
    df = probe_rows_any(results, probe)
    return None if df is None else df[df.status == "ok"]


def probe_cells(results: Path, probe: str, values: str | list[str] = "graph_us") -> pd.DataFrame | None:
    """A probe's correct rows (results/<gpu>/<probe>.csv, when committed) side by side: one row per cell
    (model, projection, T, load), one column per contender (per value and contender for a list of
    ``values``), the values in the cells; None without it."""
    path = results / f"{probe}.csv"
    if not path.exists():
        return None
    df = pd.read_csv(path)
    return df[df.status == "ok"].pivot_table(
        index=["model", "proj", "tokens", "load"], columns="contender", values=values
    )


def mixed_order_probe(n: Numbers, results: Path) -> None:
    """probes/probe_mixed_order.py (when its CSV is committed): per cell, expert order (the tuned config,
    which did not mix in the probe's run) against the mixed order at 2 row tiles, in the skewed (Zipf 1.2 and
    above) DeepSeek-V3 cells at T=4096 (lowest, highest); and the even deal against the mixed order in its
    Zipf cells."""
    df = probe_rows(results, "probe_mixed_order")
    if df is None:
        return
    key = ["model", "proj", "tokens", "load"]
    t = df.pivot_table(index=key, columns="contender", values="graph_us")
    expert = df[(df.contender == "tuned") & ~df.config.str.contains("'mix': [1-9]", regex=True)]
    cells = pd.MultiIndex.from_frame(expert[key])
    gain = t.loc[cells, "tuned"] / t.loc[cells, "order:mix2"]
    zipf = [(c[0] == "deepseek-v3" and c[2] == 4096 and str(c[3]).startswith("zipf")) for c in cells]
    skew = [z and float(str(c[3])[4:]) >= 1.2 for z, c in zip(zipf, cells)]
    n.add("MixSkewGainLo", float(gain[skew].min()))
    n.add("MixSkewGainHi", float(gain[skew].max()))
    z = cells[zipf]
    n.add("MixEvenVsMixed", gm(t.loc[z, "order:mix2"] / t.loc[z, "even:ours"]))


def power_probe(n: Numbers, results: Path, e7f: pd.DataFrame | None = None) -> None:
    """probes/probe_power.py (when its CSV is committed), prefill cells (T > 256): the power cap and how long
    each contender was held, the median SM clock of ours and of torch._grouped_mm while held, ours against
    torch._grouped_mm held (geomean over the cells) and in E7's short bursts of the same cells (``e7f``:
    paper.numbers.e7.e7_frame, where given)."""
    df = probe_rows(results, "probe_power")
    if df is None:
        return
    key = ["model", "proj", "tokens", "load"]
    n.add("PowLimitW", float(df.power_limit_w.max()), "{:.0f}")
    n.add("PowHoldS", float(df.hold_s.median()), "{:.1f}")
    sub = df[df.tokens > 256]
    if sub.empty or not {"ours", "torch._grouped_mm"} <= set(sub.contender):
        return
    us = df.pivot_table(index=key, columns="contender", values="graph_us")
    cells = us.loc[pd.MultiIndex.from_frame(sub[key].drop_duplicates())]
    n.add("PowPrefillCells", len(cells), "{}")
    for c, short in (("ours", "Ours"), ("torch._grouped_mm", "Torch")):
        n.add(f"PowPrefill{short}MHz", float(sub[sub.contender == c].sm_mhz.median()), "{:.0f}")
    r = (cells["torch._grouped_mm"] / cells["ours"]).dropna()
    n.add("PowPrefillVsTorch", gm(r))
    if e7f is not None and "tg_us" in e7f:
        b = e7f.set_index(key).reindex(r.index)
        n.add("PowPrefillBurstTorch", gm(b.tg_us / b.us))


def stream_k_probe(n: Numbers, results: Path) -> None:
    """The Stream-K probe's CSV (when committed): per cell, the same tiles on the same persistent grid whole
    against dealt out by K steps (time whole / time dealt: > 1 where dealing won)."""
    t = probe_cells(results, "probe_stream_k")
    if t is None:
        return
    sk = [c for c in t.columns if c.startswith("stream-k:")]
    if not sk:
        return
    whole = pd.concat([t[c.replace("stream-k:", "whole:")] / t[c] for c in sk]).dropna()
    n.add("StreamKWins", int((whole > 1).sum()), "{}")
    n.add("StreamKPairs", len(whole), "{}")
    n.add("StreamKVsWhole", gm(whole))


def prefill_probe(n: Numbers, results: Path) -> None:
    """Where the prefill time goes (probes/probe_prefill_tiles.py, when its CSV is committed): over its
    uniform cells, our grouped kernel's TFLOP/s over the same rows dealt out evenly over the experts, and our
    tile loop on one dense GEMM over cuBLAS's (geomeans); the cells measured."""
    t = probe_cells(results, "probe_prefill_tiles", "tflops_graph")
    if t is None:
        return
    uni = t.xs("uniform", level="load")
    n.add("ProbeCells", len(t), "{}")
    n.add("ProbeDenseOursVsCublas", gm(uni["dense:ours"] / uni["dense:cublas"]))
    n.add("ProbeGroupedVsEven", gm(uni["tuned"] / uni["even:ours"]))
    rows = pd.read_csv(results / "probe_prefill_tiles.csv", usecols=lambda c: c == "triton", dtype=str)
    if "triton" in rows:  # the Triton it ran on (the write-up's E7 explanation rests on it)
        n.add("ProbePrefillTriton", ", ".join(sorted(set(rows.triton.dropna()))))


COUNTERS = {
    "us": "gpu__time_duration.sum",
    "tensor": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "ops": "sm__ops_path_tensor_src_bf16_dst_fp32.sum",
    "l2": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_bytes": "lts__t_bytes.sum",
    "dram": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_bytes": "dram__bytes_read.sum",
}


def counter_frame(results: Path) -> pd.DataFrame | None:
    """probes/probe_prefill_counters.py's counters (when committed), one row per (cell, contender): the
    longest kernel of the profiled call (torch._grouped_mm's setup kernel left out), the counters of
    COUNTERS, and executed tensor math over the cell's useful FLOPs (from the probe's timing CSV)."""
    path, timing = results / "probe_prefill_counters.csv", results / "probe_prefill_timing.csv"
    if not path.exists() or not timing.exists():
        return None
    df = pd.read_csv(path)
    key = ["model", "proj", "tokens", "load", "contender"]
    dur = df[df.metric == COUNTERS["us"]]
    main = dur.loc[dur.groupby(key).value.idxmax(), key + ["kernel_id"]]
    df = df.merge(main, on=key + ["kernel_id"])
    t = df[df.metric.isin(COUNTERS.values())].pivot_table(index=key, columns="metric", values="value")
    out = pd.DataFrame({name: t[m] for name, m in COUNTERS.items() if m in t.columns})
    flops = pd.read_csv(timing).groupby(["model", "proj", "tokens", "load"]).flops.first()
    out["us"] /= 1e3
    out["ops_ratio"] = [r.ops / flops[i[:4]] for i, r in out.iterrows()]
    return out


def prefill_counters(n: Numbers, results: Path) -> None:
    """What limits the prefill kernels, from the GPU's counters (probes/probe_prefill_counters.py, when
    committed): the tuned kernel's executed tensor math over the useful FLOPs (lowest, highest over the
    cells); for DeepSeek-V3's gate/up at T=4096, its L2 throughput against the peak and, side by side in the
    probe's timing, the tuned kernel's time over the one with merged tails."""
    c = counter_frame(results)
    if c is None:
        return
    tuned = c.xs("tuned", level="contender")
    n.add("CtrCells", len(tuned), "{}")
    n.add("CtrTunedOpsLo", float(tuned.ops_ratio.min()))
    n.add("CtrTunedOpsHi", float(tuned.ops_ratio.max()))
    ds = ("deepseek-v3", "up", 4096, "uniform")
    if ds + ("tuned",) in c.index:
        n.add("CtrDsLtwoPct", c.loc[ds + ("tuned",)].l2, "{:.0f}")
    t = pd.read_csv(results / "probe_prefill_timing.csv")
    g = t[t.status == "ok"].set_index(["model", "proj", "tokens", "load", "contender"]).graph_us
    if ds + ("tuned",) in g.index and ds + ("tails:merged",) in g.index:
        n.add("CtrDsMergedGain", g[ds + ("tuned",)] / g[ds + ("tails:merged",)])


def heldout_ceilings_probe(n: Numbers, results: Path) -> None:
    """probes/probe_heldout_ceilings.py (when its CSV is committed): on the held-out models at the probe's
    decode T (its smallest), ours (grouped_mm, no config) and torch._grouped_mm as % of the memory ceiling's
    speed (geomeans)."""
    t = probe_cells(results, "probe_heldout_ceilings")
    need = ("ours:auto", "torch._grouped_mm", "ceiling:stream")
    if t is None or not all(c in t for c in need):
        return
    t = t.dropna(subset=list(need))
    tokens = t.index.get_level_values("tokens")
    dec = t[tokens == tokens.min()]
    n.add("CeilHeldDecodeTokens", int(tokens.min()), "{}")
    n.add("CeilHeldDecodeOursPct", gm(100 * dec["ceiling:stream"] / dec["ours:auto"]), "{:.0f}")
    n.add("CeilHeldDecodeTorchPct", gm(100 * dec["ceiling:stream"] / dec["torch._grouped_mm"]), "{:.0f}")


def gluon_probe(n: Numbers, results: Path) -> None:
    """probes/probe_gluon_prefill.py (when its CSV is committed): per prefill cell of the tune models, the
    faster of ours on its two grids (``ours:*``) against the fastest config of the hand warp-specialized
    Gluon kernel (``gluon-ws:*``): the Gluon kernel's speed as a multiple of ours (geomean, lowest,
    highest) and the cells."""
    t = probe_cells(results, "probe_gluon_prefill")
    if t is None:
        return
    mine = [c for c in t.columns if c.startswith("ours:")]
    glu = [c for c in t.columns if c.startswith("gluon-ws:")]
    if not mine or not glu:
        return
    t = t.dropna(subset=mine + glu)
    if not len(t):
        return
    vs = t[mine].min(axis=1) / t[glu].min(axis=1)
    n.add("GluCells", len(t), "{}")
    n.add("GluVsOurs", gm(vs))
    n.add("GluVsOursLo", float(vs.min()))
    n.add("GluVsOursHi", float(vs.max()))


def dk_latency_probe(n: Numbers, results: Path) -> None:
    """probes/probe_dk_latency.py: where the single-launch kernel's time goes. The exchange of partials:
    ours launched directly (no cooperative attribute) less its K loop alone with no exchange (median over the
    shapes); and how fast an exchange-free kernel of this grid at the fastest config of the tuner's space
    would be against the seed's optimized kernel (geomean)."""
    path = results / "probe_dk_latency.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df[df.status == "ok"].pivot_table(index=["m", "n", "k"], columns="contender", values="graph_us")
    need = (
        "seed: optimized",
        "direct:no-attribute",
        "ceiling:load:no-attribute",
        "ceiling:load:fastest-config",
    )
    if any(c not in p for c in need):
        return
    n.add("DkLatExchangeUs", float((p["direct:no-attribute"] - p["ceiling:load:no-attribute"]).median()))
    n.add("DkLatBoundGm", gm(p["seed: optimized"] / p["ceiling:load:fastest-config"]))


def dk_design_probe(n: Numbers, results: Path) -> None:
    """probe_dk_design.csv: the single-launch kernel's best config launched cooperatively, the same kernel
    without the cooperative attribute, and its last-arriver form, side by side; the configs it screened."""
    path = results / "probe_dk_design.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df[(df.status == "ok") & ~df.contender.str.startswith("screen:")].pivot_table(
        index=["m", "n", "k"], columns="contender", values="graph_us"
    )
    n.add("DkProbeShapes", len(p), "{}")
    n.add("DkCoopAttrCost", gm(p["coop"] / p["coop-no-attribute"]))
    n.add("DkLastArriverMin", (p["last-arriver"] / p["coop"]).min(), "{:.1f}")
    n.add("DkLastArriverMax", (p["last-arriver"] / p["coop"]).max(), "{:.1f}")
    n.add("DkScreened", int(df.contender.str.startswith("screen:").sum()), "{}")


def config_label(cfg: dict) -> str:
    """A kernel config as probes/probe_backward.py's rows name it, e.g. 128x256x64/w8s3e4: tiles, warps,
    stages, epilogue split (probes/tests/test_probe_numbers.py checks that it is the probe's own label)."""
    split = f"e{cfg['EPI_SPLIT']}" if cfg.get("EPI_SPLIT", 1) > 1 else ""
    tiles = "x".join(str(cfg[k]) for k in cfg if k.startswith("BLOCK"))
    return f"{tiles}/w{cfg['num_warps']}s{cfg['num_stages']}{split}"


# The fused SwiGLU backward's tiles (probes/dswiglu_fused.py's FUSED_TILES), as its rows name them
DSWIGLU_FUSED = "128x256x64/w8s3e4"
# A config of the SwiGLU backward's sweep whose epilogue is whole (no EPI_SPLIT: no e<N> after its stages)
WHOLE_EPILOGUE = re.compile(r"^\d+x\d+x\d+/w\d+s\d+$")


def backward_probe(n: Numbers, results: Path) -> None:
    """probes/probe_backward.py (when its CSV is committed), the tune split's cells: the backward GEMMs that
    (the configs of backward.DW_TMA_TILES and dswiglu_fused.FUSED_TILES, the fastest of its sweep) against
    torch._grouped_mm on the same products, as torch's time over ours (geomean): the SwiGLU backward fused in
    the down projection's dX GEMM (against the plain GEMM), the two weight gradients; then the step
    (forward + backward, GPU time) of moe_ffn as it comes (the gate/up product kept) and recomputing it,
    against the torch._grouped_mm pipeline (lowest, highest over the cells). Then the fused kernel's two
    knobs against it (probe_dswiglu_flatten), and the separate form (the library's) against it and against
    the plain GEMM, piece and step (probe_dswiglu_separate)."""
    from moegemm.grouped import backward as bw

    separate_probe(n, results, DSWIGLU_FUSED)

    df = probe_rows(results, "probe_backward")
    if df is None:
        return
    cell = ["model", "tokens"]

    split = probe_rows(results, "probe_dswiglu_split")  # the SwiGLU backward's tiles with split epilogues
    if split is not None:
        s = split.pivot_table(index=cell, columns="config", values="graph_us")
        ratio = {c: gm(s["torch._grouped_mm"] / s[c]) for c in s if c != "torch._grouped_mm"}
        whole = [c for c in ratio if WHOLE_EPILOGUE.search(c)]
        if DSWIGLU_FUSED in ratio:
            n.add("BwdDswiglu", ratio[DSWIGLU_FUSED])
        if whole:
            n.add("BwdSplitWhole", max(ratio[c] for c in whole))  # the best tile with a whole epilogue
    t = df.pivot_table(index=cell, columns=["piece", "config"], values="graph_us")
    for name, piece, cfg in (
        ("BwdDswiglu", "dswiglu", DSWIGLU_FUSED),
        ("BwdDwDown", "dw_down", config_label(bw.DW_TMA_TILES)),
        ("BwdDwGateUp", "dw_gate_up", config_label(bw.DW_TMA_TILES)),
    ):
        key, torch_key = (piece, cfg), (piece, "torch._grouped_mm")
        if key in t and torch_key in t and name not in n.items:
            both = t[[key, torch_key]].dropna()
            if len(both):
                n.add(name, gm(both[torch_key] / both[key]))
    step = t.get("step:fwd+bwd")
    if step is None or "torch._grouped_mm pipeline" not in step:
        return
    n.add("BwdCells", len(step.dropna()), "{}")
    for name, ours in (("BwdStepKeep", "ours:moe_ffn:save-gate-up"), ("BwdStepRecompute", "ours:moe_ffn")):
        if ours in step:
            r = (step["torch._grouped_mm pipeline"] / step[ours]).dropna()
            n.add(name + "Lo", float(r.min()))
            n.add(name + "Hi", float(r.max()))


def separate_probe(n: Numbers, results: Path, fused: str) -> None:
    """The SwiGLU backward's form. probe_dswiglu_flatten: the fused kernel at its tiles ``fused`` with its
    persistent loop flattened (f), with G, U by TMA boxes (g), and both (fg), each as the plain fused
    kernel's time over its own (geomean over the cells). probe_dswiglu_separate: torch._grouped_mm's plain
    GEMM time over the separate form's, the fused kernel's and the forward's GEMM alone (geomean), and the
    default step's GPU time with the fused kernel over its time with the separate form (geomean, lowest,
    highest)."""
    df = probe_rows(results, "probe_dswiglu_flatten")
    if df is not None:
        t = df[df.piece == "dswiglu"].pivot_table(
            index=["model", "tokens"], columns="config", values="graph_us"
        )
        for suffix, name in (("f", "BwdFlatten"), ("g", "BwdGuTma"), ("fg", "BwdFlattenGuTma")):
            if fused + suffix in t and fused in t:
                n.add(name, gm(t[fused] / t[fused + suffix]))
    df = probe_rows(results, "probe_dswiglu_separate")
    if df is None:
        return
    t = df.pivot_table(index=["model", "tokens"], columns=["piece", "config"], values="graph_us")
    torch_ = t[("dswiglu", "torch._grouped_mm")]
    for name, key in (
        ("BwdSepPiece", ("dswiglu", "separate")),
        ("BwdSepFusedPiece", ("dswiglu", fused)),
        ("BwdSepGemmOnly", ("dswiglu:gemm-only", "auto")),
    ):
        if key in t:
            n.add(name, gm(torch_ / t[key]))
    acc = probe_rows_any(results, "probe_swiglu_accuracy")
    if acc is not None:  # dX's relative error against float64, E9's check, per form: the largest over cells
        dx = acc[acc.grad == "x"]
        for form, name in (("fused", "BwdAccFused"), ("separate", "BwdAccSeparate")):
            f = dx[dx.form == form]
            if len(f):
                n.add(name, f"{f.rel_err.max():.1e}", "{}")
                n.add(name + "Ok", f"{int(f.ok.astype(str).eq('True').sum())} of {len(f)}", "{}")
    step = t.get("step:fwd+bwd")
    # the step rows' names (fused, separate): both forms as variants of the same run (the committed run's),
    # else the fused variant against the default, the separate form (the probe's code now)
    pairs = [
        (f"ours:moe_ffn:save-gate-up:dswiglu={fused}", "ours:moe_ffn:save-gate-up:dswiglu=separate"),
        ("ours:moe_ffn:save-gate-up:fused", "ours:moe_ffn:save-gate-up"),
    ]
    pair = next((p for p in pairs if step is not None and p[0] in step and p[1] in step), None)
    if pair is not None:
        r = (step[pair[0]] / step[pair[1]]).dropna()
        n.add("BwdSepStep", gm(r))
        n.add("BwdSepStepLo", float(r.min()))
        n.add("BwdSepStepHi", float(r.max()))
        n.add("BwdSepCells", len(r), "{}")


def cluster_probe(n: Numbers, results: Path) -> None:
    """probes/cluster_dk.py and probes/cluster_grouped.py (when their CSVs are committed): thread-block
    clusters. Decompose-K with the S split programs of a tile as one cluster, the partials exchanged through
    distributed shared memory: per shape, the fastest correct clustered config's speed as a multiple of
    ``ours: auto`` and of the seed's optimized kernel (geomean over the shapes; rows whose check failed left
    out). The grouped GEMM on two-CTA clusters sharing each weight tile by TMA multicast: its best TFLOP/s
    per row count against grouped_mm's (lowest, highest over the row counts)."""
    path = results / "probe_cluster_dk.csv"
    if path.exists():
        df = pd.read_csv(path)
        shape = ["kind", "m", "n", "k", "dtype", "epilogue"]
        ok = df[df.status == "ok"]
        clustered = ok[ok.contender.str.startswith("cluster")].groupby(shape).graph_us.min()
        p = ok[~ok.contender.str.startswith("cluster")].pivot_table(
            index=shape, columns="contender", values="graph_us"
        )
        if {"ours: auto", "seed: optimized"} <= set(p.columns):
            both = p.join(clustered.rename("cluster"), how="inner").dropna()
            if len(both):
                n.add("ClusterDkShapes", len(both), "{}")
                n.add("ClusterDkVsOurs", gm(both["ours: auto"] / both["cluster"]))
                n.add("ClusterDkVsSeed", gm(both["seed: optimized"] / both["cluster"]))
    path = results / "probe_cluster_grouped.csv"
    if path.exists():
        g = pd.read_csv(path)
        g = g[(g.status == "ok") & (g.contender.isin(["cluster-multicast", "grouped_mm"]))]
        # the multicast kernel's two forms apart: asynchronous wgmma in every warp, and warp-specialized (a
        # producer warp group loading, consumer warp groups multiplying; "'ws': True" in the config)
        ws = g.config.fillna("").str.contains("'ws': True")
        g = g.assign(contender=g.contender.where(~ws, "cluster-multicast-ws"))
        best = g.pivot_table(index="rows", columns="contender", values="tflops", aggfunc="max").dropna()
        if len(best) and "cluster-multicast" in best:
            forms = (("Cl", "cluster-multicast"), ("Ws", "cluster-multicast-ws"), ("Ours", "grouped_mm"))
            for tag, c in forms:
                if c in best:
                    n.add(f"ClusterGr{tag}Lo", float(best[c].min()), "{:.0f}")
                    n.add(f"ClusterGr{tag}Hi", float(best[c].max()), "{:.0f}")


def first_call_probe(n: Numbers, results: Path) -> None:
    """probes/probe_first_call.py: how much sooner moe_ffn's first call on an unseen shape returns with the
    shortlists' compiles side by side than one after another (the probe's first cell, the medians over the
    repeats of each setting)."""
    df = probe_rows(results, "probe_first_call")
    if df is None or not len(df):
        return
    model, t = df.model.iloc[0], int(df.tokens.iloc[0])
    cell = df[(df.model == model) & (df.tokens == t)]
    med = cell.groupby("setting").first_call_s.median()
    if not {"side by side", "one after another"} <= set(med.index):
        return
    n.add("FirstCallGain", float(med["one after another"] / med["side by side"]), "{:.2f}")
