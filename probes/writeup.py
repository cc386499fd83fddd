"""The probes' numbers and tables (probes/probe_*.py, from their CSVs in results/<gpu>/, each where
committed): the grouped kernel's prefill tiles, counters, power and clocks, mixed expert order, middle tiles,
Stream-K, the held-out ceilings, robust tuning and the Gluon kernel; the Decompose-K kernel's design, latency
and the seed's kernel after its own search. paper/make_numbers.py runs them with the experiments' numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments._io import write_text
from experiments.report import Numbers, gm, runs_dir, table

VLLM = "vllm:fused_moe"  # E7's contender names: vLLM's fused-MoE Triton kernel, the memory ceiling
STREAM = "ceiling:stream"


def probe_rows(results: Path, probe: str) -> pd.DataFrame | None:
    """A probe's correct rows (results/<gpu>/<probe>.csv), None where it is not committed."""
    path = results / f"{probe}.csv"
    if not path.exists():
        return None
    df = pd.read_csv(path)
    return df[df.status == "ok"]


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


def robust_probe(n: Numbers, results: Path) -> None:
    """probes/probe_robust_tuning.py (when its CSV is committed): on E7's inputs, the uniform-only
    choice's time over the both-loads choice's, side by side, per load (geomeans, lowest and highest)."""
    t = probe_cells(results, "probe_robust_tuning")
    if t is None:
        return
    t = t.dropna()
    r = t["tuned:uniform-only"] / t["tuned:both-loads"]
    loads = r.index.get_level_values("load")
    n.add("RobustProbeCells", len(r.xs("uniform", level="load")), "{}")
    best = r.idxmax()
    n.add("RobustProbeBestCell", f"{best[0]} {best[1]}, $T={best[2]}$, {best[3]}")
    for load, tag in (("uniform", "Uniform"), ("zipf1.2", "Zipf"), ("hot0.5", "Hot")):
        x = r[loads == load]
        if len(x):
            n.add(f"RobustProbe{tag}", gm(x))
            n.add(f"RobustProbe{tag}Lo", float(x.min()))
            n.add(f"RobustProbe{tag}Hi", float(x.max()))


def mixed_order_probe(n: Numbers, results: Path) -> None:
    """probes/probe_mixed_order.py (when its CSV is committed): per cell, expert order (the tuned
    config, which did not mix in the probe's run) against the mixed order at 2 row tiles, measured and as the
    wave model has it; the skewed (Zipf) DeepSeek-V3 cells at T=4096 apart from the rest; the even deal
    against the mixed order there; and the counters of DeepSeek-V3 down under Zipf 1.2 (L2 against the
    even deal) where probes/probe_prefill_counters.py measured them."""
    df = probe_rows(results, "probe_mixed_order")
    if df is None:
        return
    key = ["model", "proj", "tokens", "load"]
    t = df.pivot_table(index=key, columns="contender", values="graph_us")
    m = df.pivot_table(index=key, columns="contender", values="model_us")
    expert = df[(df.contender == "tuned") & ~df.config.str.contains("'mix': [1-9]", regex=True)]
    cells = pd.MultiIndex.from_frame(expert[key])
    gain, model = (
        (t.loc[cells, "tuned"] / t.loc[cells, "order:mix2"]),
        (m.loc[cells, "tuned"] / m.loc[cells, "order:mix2"]),
    )
    zipf = [(c[0] == "deepseek-v3" and c[2] == 4096 and str(c[3]).startswith("zipf")) for c in cells]
    skew = [z and float(str(c[3])[4:]) >= 1.2 for z, c in zip(zipf, cells)]
    rest = [not z for z in zipf]
    n.add("MixCells", len(cells), "{}")
    n.add("MixSkewCells", sum(skew), "{}")
    alphas = sorted({str(c[3])[4:] for c, k in zip(cells, skew) if k}, key=float)
    n.add(
        "MixSkewLoads",
        "Zipf " + " and ".join([", ".join(alphas[:-1]), alphas[-1]] if len(alphas) > 1 else alphas),
    )
    n.add("MixSkewGainLo", float(gain[skew].min()))
    n.add("MixSkewGainHi", float(gain[skew].max()))
    n.add("MixSkewModelLo", float(model[skew].min()))
    n.add("MixSkewModelHi", float(model[skew].max()))
    n.add("MixRestGainLo", float(gain[rest].min()))
    n.add("MixRestGainHi", float(gain[rest].max()))
    z = cells[zipf]
    n.add("MixEvenVsMixed", gm(t.loc[z, "order:mix2"] / t.loc[z, "even:ours"]))
    c = counter_frame(results)
    down = ("deepseek-v3", "down", 4096, "zipf1.2")
    if c is not None and down + ("tuned",) in c.index and down + ("even",) in c.index:
        a, e = c.loc[down + ("tuned",)], c.loc[down + ("even",)]
        n.add("MixCtrLoad", "Zipf " + down[3][4:])
        n.add("MixCtrLtwoPct", a.l2, "{:.0f}")
        n.add("MixCtrLtwoGB", a.l2_bytes / 1e9, "{:.0f}")
        n.add("MixCtrEvenLtwoGB", e.l2_bytes / 1e9, "{:.0f}")
        n.add("MixCtrTensorPct", a.tensor, "{:.0f}")
        n.add("MixCtrEvenTensorPct", e.tensor, "{:.0f}")


POWER_NAMES = {
    "ours": "ours (tuned)",
    "torch._grouped_mm": "torch._grouped_mm",
    VLLM: "vLLM fused_moe",
    "dense-reference": "dense cuBLAS (one expert)",
    STREAM: "memory ceiling (stream)",
}


def power_probe(n: Numbers, results: Path, gen: Path, e7f: pd.DataFrame | None = None) -> None:
    """probes/probe_power.py (when its CSV is committed): per regime (decode T <= 256, prefill), each
    contender's median SM clock and power while held, its sustained time over ours (geomean over the cells),
    the share of samples the power cap held the clock down; ours against torch._grouped_mm and vLLM's kernel
    held (geomean, lowest, cells where they were faster), in SM cycles (time x clock), and E7's short bursts
    in the same cells (``e7f``: paper.numbers.e7.e7_frame, the better of our two grids, where given)."""
    df = probe_rows(results, "probe_power")
    if df is None:
        return
    key = ["model", "proj", "tokens", "load"]
    us = df.pivot_table(index=key, columns="contender", values="graph_us")
    cyc = (df.assign(c=df.graph_us * df.sm_mhz)).pivot_table(index=key, columns="contender", values="c")
    burst = e7f.set_index(key) if e7f is not None else None
    n.add("PowMaxMHz", float(df.max_sm_mhz.max()), "{:.0f}")
    n.add("PowLimitW", float(df.power_limit_w.max()), "{:.0f}")
    n.add("PowHoldS", float(df.hold_s.median()), "{:.1f}")
    n.add("PowHolds", int(df.holds.max()) if "holds" in df else 1, "{}")  # holds per contender and cell
    from moegemm.bench.floors import HOPPER_BF16_FLOP_PER_CLOCK_PER_SM  # imports torch: only when needed

    peak = json.loads((results / "floors.json").read_text())["datasheet"]["bf16_tflops"] * 1e12
    n.add("PowPeakMHz", peak / (int(df.sm_count.iloc[0]) * HOPPER_BF16_FLOP_PER_CLOCK_PER_SM) / 1e6, "{:.0f}")
    rows = []
    for regime, sel in (("Decode", df.tokens <= 256), ("Prefill", df.tokens > 256)):
        sub = df[sel]
        if sub.empty or "ours" not in set(sub.contender):
            continue
        cells = us.loc[pd.MultiIndex.from_frame(sub[key].drop_duplicates())]
        n.add(f"Pow{regime}Cells", len(cells), "{}")
        for c, short in (
            ("ours", "Ours"),
            ("torch._grouped_mm", "Torch"),
            (VLLM, "Vllm"),
            ("dense-reference", "Dense"),
            (STREAM, "Stream"),
        ):
            one = sub[sub.contender == c]
            if one.empty:
                continue
            n.add(f"Pow{regime}{short}MHz", float(one.sm_mhz.median()), "{:.0f}")
            n.add(f"Pow{regime}{short}W", float(one.power_w.median()), "{:.0f}")
            rows.append(
                {
                    "regime": regime.lower(),
                    "kernel": POWER_NAMES[c],
                    "SM clock (MHz, median)": f"{one.sm_mhz.median():.0f}",
                    "power (W, median)": f"{one.power_w.median():.0f}",
                    "samples power-capped": f"{100 * one.power_capped.mean():.0f}%",
                    "held time / ours (geomean)": gm(cells[c] / cells["ours"]),
                }
            )
        gemm = sub[sub.contender.isin(["ours", "torch._grouped_mm", VLLM])]
        n.add(f"Pow{regime}GemmCappedPct", 100 * float(gemm.power_capped.mean()), "{:.0f}")
        for c, short in (("torch._grouped_mm", "Torch"), (VLLM, "Vllm")):
            if c not in cells:
                continue
            r = (cells[c] / cells["ours"]).dropna()
            n.add(f"Pow{regime}Vs{short}", gm(r))
            n.add(f"Pow{regime}Vs{short}Min", float(r.min()))
            n.add(f"Pow{regime}Vs{short}Slower", int((r < 1).sum()), "{}")
            cy = cyc.loc[r.index]
            n.add(f"Pow{regime}Vs{short}Cycles", gm(cy[c] / cy["ours"]))
            col = {"Torch": "tg_us", "Vllm": "vl_us"}[short]
            if burst is not None and col in burst:
                b = burst.reindex(r.index)
                n.add(f"Pow{regime}Burst{short}", gm(b[col] / b.us))
    if rows:
        write_text(
            gen / "table_power.tex",
            table(
                pd.DataFrame(rows),
                "Held back to back for about \\PowHoldS\\,s, \\PowHolds{} times each (medians) "
                "(probes/probe\\_power.py, E7's inputs, the uniform load and one skewed cell): the SM clock "
                "and power NVML reported, the share of samples in which the power cap held the clock down, and "
                "each kernel's held time over ours (geomean over the regime's cells; the yardstick and the "
                "ceiling solve easier problems).",
                "tab:power",
                "llrrrr",
            ),
        )


def stream_k_probe(n: Numbers, results: Path) -> None:
    """probes/probe_stream_k.py (when its CSV is committed): per cell, the same tiles on the same
    persistent grid whole against dealt out by K steps (time whole / time dealt: > 1 where dealing won),
    and the library's tuned config against the fastest Stream-K tiles (time tuned / time Stream-K)."""
    t = probe_cells(results, "probe_stream_k")
    if t is None:
        return
    sk = [c for c in t.columns if c.startswith("stream-k:")]
    if not sk or "tuned" not in t:
        return
    whole = pd.concat([t[c.replace("stream-k:", "whole:")] / t[c] for c in sk]).dropna()
    vs_tuned = (t["tuned"] / t[sk].min(axis=1)).dropna()
    n.add("StreamKCells", len(vs_tuned), "{}")
    n.add("StreamKShapes", len(sk), "{}")
    n.add("StreamKWins", int((whole > 1).sum()), "{}")
    n.add("StreamKPairs", len(whole), "{}")
    n.add("StreamKVsWhole", gm(whole))
    n.add("StreamKVsWholeLo", float(whole.min()))
    n.add("StreamKVsWholeHi", float(whole.max()))
    n.add("StreamKVsTunedLo", float(vs_tuned.min()))
    n.add("StreamKVsTunedHi", float(vs_tuned.max()))


PROBE_COLUMNS = [
    ("tuned", "grouped"),
    ("tuned:merged-tails", "tails merged"),
    ("tuned:kn", "w as [E,K,N]"),
    ("even:ours", "rows even"),
    ("dense:ours", "dense, ours"),
    ("dense:cublas", "dense, cuBLAS"),
]


def prefill_probe(n: Numbers, results: Path, gen: Path) -> None:
    """Where the prefill time goes (probes/probe_prefill_tiles.py, when its CSV is committed): per cell
    the TFLOP/s of our grouped kernel, its variants and the dense yardsticks, side by side; geomean ratios."""
    t = probe_cells(results, "probe_prefill_tiles", ["tflops_graph", "pct_floor_graph"])
    if t is None:
        return
    tf, pct = t["tflops_graph"], t["pct_floor_graph"]
    rows = []
    for cell, r in tf.iterrows():
        row = {"cell": f"{cell[0]} {cell[1]} T={cell[2]} {cell[3]}"}
        for c, label in PROBE_COLUMNS:
            row[label] = f"{r[c]:.0f}" if c in r and r[c] == r[c] else "--"
        row["grouped / even, % floor"] = f"{pct.loc[cell, 'tuned']:.0f} / {pct.loc[cell, 'even:ours']:.0f}"
        rows.append(row)
    write_text(
        gen / "table_probe.tex",
        table(
            pd.DataFrame(rows),
            "Where the prefill time goes (probe, TFLOP/s on the GPU clock, side by side in one "
            "process at E7's seeds): our grouped kernel with the tuned tiles; the same tiles with the tails merged "
            "into the row tile before them; on weights laid out [E, K, N]; on the same rows dealt out evenly over "
            "the experts (no ragged row tiles); one GEMM over all rows with one expert's weights, by our kernel "
            "and by cuBLAS. Last column: \\% of the cell's floor, grouped and even (the even deal activates every "
            "expert, so under Zipf it streams more weights than the cell).",
            "tab:probe",
            "lrrrrrrr",
        ),
    )
    uni = tf.xs("uniform", level="load")
    n.add("ProbeCells", len(tf), "{}")
    n.add("ProbeUniformCells", len(uni), "{}")
    n.add("ProbeDenseOursVsCublas", gm(uni["dense:ours"] / uni["dense:cublas"]))
    n.add("ProbeEvenVsDense", gm(uni["even:ours"] / uni["dense:ours"]))
    n.add("ProbeGroupedVsEven", gm(uni["tuned"] / uni["even:ours"]))
    n.add("ProbeGroupedVsEvenLo", float((uni["tuned"] / uni["even:ours"]).min()))
    n.add("ProbeEvenPct", gm(pct.xs("uniform", level="load")["even:ours"]), "{:.0f}")
    n.add("ProbeGroupedPct", gm(pct.xs("uniform", level="load")["tuned"]), "{:.0f}")
    n.add("ProbeKnVsNk", gm(tf["tuned:kn"] / tf["tuned"]))
    stores = tf[[c for c in ("tuned:store1", "tuned:store2") if c in tf]].max(axis=1)
    n.add("ProbeStoreVsPointer", gm((stores / tf["tuned"]).dropna()))
    merged = (tf["tuned:merged-tails"] / tf["tuned"]).dropna()
    n.add("ProbeMergedLo", float(merged.min()))
    n.add("ProbeMergedHi", float(merged.max()))


# NVML's clock-event reason bits (nvidia-smi clocks_event_reasons.active)
CLOCK_REASONS = {
    0x1: "GPU idle",
    0x2: "application clocks",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock",
}


COUNTER_CASES = [
    ("tuned", "tuned"),
    ("tails:merged", "tails merged"),
    ("even", "rows even"),
    ("dense:cublas", "dense, cuBLAS"),
    ("torch._grouped_mm", "torch._grouped_mm"),
]


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


def prefill_counters(n: Numbers, results: Path, gen: Path) -> None:
    """What limits the prefill kernels, from the GPU's counters (probes/probe_prefill_counters.py,
    when committed): a table per cell and contender, and the clock the timing saw (nvidia-smi)."""
    c = counter_frame(results)
    if c is None:
        return
    rows = []
    for cell in dict.fromkeys(i[:4] for i in c.index):
        for case, label in COUNTER_CASES:
            if cell + (case,) not in c.index:
                continue
            r = c.loc[cell + (case,)]
            rows.append(
                {
                    "cell": f"{cell[0]} {cell[1]} T={cell[2]} {cell[3]}",
                    "kernel": label,
                    "us": f"{r.us:.0f}",
                    "tensor pipe %": f"{r.tensor:.0f}",
                    "tensor math / FLOPs": f"{r.ops_ratio:.2f}",
                    "L2 %": f"{r.l2:.0f}",
                    "L2 GB": f"{r.l2_bytes / 1e9:.1f}",
                    "DRAM %": f"{r.dram:.0f}",
                    "DRAM GB read": f"{r.dram_bytes / 1e9:.1f}",
                }
            )
    write_text(
        gen / "table_counters.tex",
        table(
            pd.DataFrame(rows),
            "What limits the prefill kernels: Nsight Compute's counters of one call each "
            "(probes/probe\\_prefill\\_counters.py; kernel replay, caches flushed, clocks left alone), E7's "
            "seeds. tuned: the library's choice in the probe's run, from a table that did not yet offer merged tails "
            "on 128 x 256 tiles; tails merged: the same tiles with the last <= 32 rows of an expert merged into the "
            "row tile before them. us: the kernel's time under the profiler; tensor pipe: share of cycles the "
            "tensor cores were busy; tensor math / FLOPs: the bf16 tensor operations executed over the cell's useful FLOPs (above 1: "
            "padded rows of ragged row tiles); L2 \\%: L2 throughput against its peak; L2 GB: bytes through L2; "
            "DRAM: HBM throughput against its peak and bytes read.",
            "tab:counters",
            "llrrrrrrr",
        ),
    )
    tuned = c.xs("tuned", level="contender")
    n.add("CtrCells", len(tuned), "{}")
    n.add("CtrTunedOpsLo", float(tuned.ops_ratio.min()))
    n.add("CtrTunedOpsHi", float(tuned.ops_ratio.max()))
    ds = ("deepseek-v3", "up", 4096, "uniform")
    qw = ("qwen3-30b-a3b", "up", 4096, "uniform")
    if ds + ("tuned",) in c.index and ds + ("tails:merged",) in c.index and ds + ("even",) in c.index:
        a, m, e = c.loc[ds + ("tuned",)], c.loc[ds + ("tails:merged",)], c.loc[ds + ("even",)]
        n.add("CtrDsLtwoPct", a.l2, "{:.0f}")
        n.add("CtrDsEvenLtwoPct", e.l2, "{:.0f}")
        n.add("CtrDsDramPct", a.dram, "{:.0f}")
        n.add("CtrDsEvenDramPct", e.dram, "{:.0f}")
        n.add("CtrDsLtwoGB", a.l2_bytes / 1e9, "{:.0f}")
        n.add("CtrDsMergedLtwoGB", m.l2_bytes / 1e9, "{:.0f}")
        n.add("CtrDsEvenLtwoGB", e.l2_bytes / 1e9, "{:.0f}")
        n.add("CtrDsDramGB", a.dram_bytes / 1e9, "{:.1f}")
        n.add("CtrDsOps", a.ops_ratio)
        n.add("CtrDsMergedOps", m.ops_ratio)
        n.add("CtrDsTensorPct", a.tensor, "{:.0f}")
    if qw + ("tuned",) in c.index and qw + ("even",) in c.index:
        a, e = c.loc[qw + ("tuned",)], c.loc[qw + ("even",)]
        n.add("CtrQwTensorPct", a.tensor, "{:.0f}")
        n.add("CtrQwLtwoPct", a.l2, "{:.0f}")
        n.add("CtrQwOps", a.ops_ratio)
        n.add("CtrQwEvenVsTuned", a.us / e.us)
    if "dense:cublas" in c.index.get_level_values("contender"):
        n.add("CtrCublasTensorLo", float(c.xs("dense:cublas", level="contender").tensor.min()), "{:.0f}")
    t = pd.read_csv(results / "probe_prefill_timing.csv")
    t = t[t.status == "ok"]
    g = t.set_index(["model", "proj", "tokens", "load", "contender"]).graph_us
    if ds + ("tuned",) in g.index and ds + ("tails:merged",) in g.index:
        n.add("CtrDsMergedGain", g[ds + ("tuned",)] / g[ds + ("tails:merged",)])
    if "sm_mhz_min" in t.columns and t.clock_samples.fillna(0).gt(0).any():
        cells = t.drop_duplicates(["model", "proj", "tokens", "load"])
        n.add("ClockSmMin", float(cells.sm_mhz_min.min()), "{:.0f}")
        n.add("ClockSmMax", float(cells.sm_mhz_max.max()), "{:.0f}")
        n.add("ClockPowerMax", float(cells.power_w_max.max()), "{:.0f}")
        bits = 0
        for v in cells.clock_event_reasons.dropna():
            bits |= int(str(v), 16)
        n.add("ClockReasons", ", ".join(name for bit, name in CLOCK_REASONS.items() if bits & bit) or "none")
        low = cells.sm_mhz_min.idxmin()
        n.add("ClockSmMinCell", f"{cells.model[low]} {cells.proj[low]}, $T={cells.tokens[low]}$")


def middle_tiles_probe(n: Numbers, results: Path) -> None:
    """probes/probe_middle_tiles.py (when its CSV is committed): per cell, the tuned table's config
    against each tile config the tuner does not try, on both grids (time tuned / time new: > 1 where the new
    one won); per family of the probe's names (K steps of 256, four stages of 128, 64 x 256 tiles, 8 warps)
    the geomean over its variants and cells, and how often the best of all of them beat the tuned config by
    more than the clock's 3%."""
    t = probe_cells(results, "probe_middle_tiles")
    if t is None or "tuned" not in t:
        return
    new = [c for c in t.columns if c != "tuned"]
    vs = pd.DataFrame({c: t["tuned"] / t[c] for c in new})
    best = vs.max(axis=1)
    n.add("MidCells", len(t), "{}")
    n.add("MidConfigs", len(new), "{}")
    n.add("MidBeat", int((best > 1.03).sum()), "{}")
    n.add("MidBestLo", float(best.min()))
    n.add("MidBestHi", float(best.max()))
    for macro, prefix in (
        ("MidKLong", "k256-"),
        ("MidKLongNarrow", "n64-k256-"),
        ("MidFourStage", "k128-s4"),
        ("MidWide", "n256-"),
        ("MidEightWarps", "w8-"),
    ):
        cols = [c for c in new if c.startswith(prefix)]
        if cols:
            n.add(macro, gm(pd.concat([vs[c] for c in cols]).dropna()))


def heldout_ceilings_probe(n: Numbers, results: Path) -> None:
    """probes/probe_heldout_ceilings.py (when its CSV is committed): on the held-out models, per cell,
    the memory ceiling's and the dense cuBLAS yardstick's times beside ours (grouped_mm, no config) and
    torch._grouped_mm. At decode (the probe's smaller T): ours and torch._grouped_mm as % of the ceiling's
    speed, and the ceiling's speed over torch._grouped_mm's (the most any kernel that only streams the cell's
    bytes gains over it). At prefill (its larger T): torch._grouped_mm's and ours' times over the dense
    GEMM's, the least of the first with its model."""
    t = probe_cells(results, "probe_heldout_ceilings")
    need = ("ours:auto", "torch._grouped_mm", "dense-reference", "ceiling:stream")
    if t is None or not all(c in t for c in need):
        return
    t = t.dropna(subset=list(need))
    tokens = t.index.get_level_values("tokens")
    dec, pre = t[tokens == tokens.min()], t[tokens == tokens.max()]
    df = pd.read_csv(results / "probe_heldout_ceilings.csv")
    n.add("CeilHeldCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("CeilHeldCells", len(t), "{}")
    n.add("CeilHeldDecodeTokens", int(tokens.min()), "{}")
    n.add("CeilHeldPrefillTokens", int(tokens.max()), "{}")
    ours_pct = 100 * dec["ceiling:stream"] / dec["ours:auto"]
    n.add("CeilHeldDecodeOursPct", gm(ours_pct), "{:.0f}")
    n.add("CeilHeldDecodeOursPctLo", float(ours_pct.min()), "{:.0f}")
    n.add("CeilHeldDecodeOursPctHi", float(ours_pct.max()), "{:.0f}")
    n.add("CeilHeldDecodeTorchPct", gm(100 * dec["ceiling:stream"] / dec["torch._grouped_mm"]), "{:.0f}")
    room = dec["torch._grouped_mm"] / dec["ceiling:stream"]
    n.add("CeilHeldDecodeRoomMin", float(room.min()))
    n.add("CeilHeldDecodeRoomMax", float(room.max()))
    torch_dense = pre["torch._grouped_mm"] / pre["dense-reference"]
    ours_dense = pre["ours:auto"] / pre["dense-reference"]
    n.add("CeilHeldPrefillTorchVsDenseMin", float(torch_dense.min()))
    n.add("CeilHeldPrefillTorchVsDenseMinModel", str(torch_dense.idxmin()[0]))
    n.add("CeilHeldPrefillTorchVsDenseMax", float(torch_dense.max()))
    n.add("CeilHeldPrefillOursVsDenseLo", float(ours_dense.min()))
    n.add("CeilHeldPrefillOursVsDenseHi", float(ours_dense.max()))


def gluon_probe(n: Numbers, results: Path) -> None:
    """probes/probe_gluon_prefill.py (when its CSV is committed): per prefill cell of the tune models, the
    faster of ours on its two grids (``ours:*``) against the fastest config of the hand warp-specialized
    Gluon kernel (``gluon-ws:*``) and against torch._grouped_mm: the Gluon kernel's speed as a multiple of
    ours (geomean, lowest, highest, and at the probe's largest T), how often it beat ours by more than the
    clock's 3%, how often its fastest config was the ping-pong one, and both kernels over torch._grouped_mm."""
    t = probe_cells(results, "probe_gluon_prefill")
    if t is None or "torch._grouped_mm" not in t:
        return
    mine = [c for c in t.columns if c.startswith("ours:")]
    glu = [c for c in t.columns if c.startswith("gluon-ws:")]
    if not mine or not glu:
        return
    t = t.dropna(subset=mine + glu + ["torch._grouped_mm"])
    if not len(t):
        return
    ours, best = t[mine].min(axis=1), t[glu].min(axis=1)
    vs = ours / best
    df = pd.read_csv(results / "probe_gluon_prefill.csv")
    n.add("GluCommit", str(df.git_commit.iloc[0])[:7], "{}")
    n.add("GluCells", len(t), "{}")
    n.add("GluConfigs", len(glu), "{}")
    n.add("GluVsOurs", gm(vs))
    n.add("GluVsOursLo", float(vs.min()))
    n.add("GluVsOursHi", float(vs.max()))
    n.add("GluBeat", int((vs > 1.03).sum()), "{}")
    n.add("GluPingBest", int(t[glu].idxmin(axis=1).str.contains("pingpong").sum()), "{}")
    tokens = t.index.get_level_values("tokens")
    n.add("GluBigTokens", int(tokens.max()), "{}")
    n.add("GluBigVsOurs", gm(vs[tokens == tokens.max()]))
    n.add("GluVsTorch", gm(t["torch._grouped_mm"] / best))
    n.add("GluOursVsTorch", gm(t["torch._grouped_mm"] / ours))


DK_LATENCY_RATIO = 1.3  # the speed-up over the seed's optimized kernel the latency budget is worked out for


def dk_latency_probe(n: Numbers, results: Path) -> None:
    """probes/probe_dk_latency.py: where the single-launch kernel's time goes (lower bounds of its grid:
    no work; the K loop with no exchange, at its config and at the fastest of the tuner's space), beside the
    seed's optimized kernel; and its earlier run (runs/S18-1) with two other waits and a compile-time M."""
    path = results / "probe_dk_latency.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df[df.status == "ok"].pivot_table(index=["m", "n", "k"], columns="contender", values="graph_us")
    need = (
        "ours:auto",
        "seed: optimized",
        "direct:coop",
        "direct:no-attribute",
        "ceiling:empty",
        "ceiling:empty:no-attribute",
        "ceiling:load:no-attribute",
        "ceiling:load:fastest-config",
    )
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
    n.add(
        "DkLatBoundConfigs",
        int(df.loc[df.contender == "ceiling:load:fastest-config", "configs_timed"].sum()),
        "{}",
    )
    early = runs_dir(results) / "S18-1" / "probe_dk_latency.csv"
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
            index=["m", "n", "k"], columns="contender", values="graph_us"
        )
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
