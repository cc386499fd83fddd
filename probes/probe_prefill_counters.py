"""Probe (not a pipeline step): what limits the grouped kernel at prefill, read from the GPU's own
counters. E7 places our prefill kernel furthest below its cell's practical ceiling at T = 4096; timings
alone cannot say whether a tile loop there waits on the tensor cores, on L2 or on HBM. This probe runs a
few such cells, each with E7's weights, routing and activations (E7's seeds), and in each the same
contenders as probe_prefill_tiles where they split the gap:

- ``tuned``: what the library picks; ``tails:separate`` / ``tails:merged``: the same tiles with an
  expert's last <= 32 rows as a transposed tile of their own, or computed by the row tile before them from
  its weight tiles;
- ``even``: the tuned kernel on the same rows dealt out evenly (M_total / E rows per expert): the same
  weights streamed, no ragged row tiles;
- ``dense:ours`` / ``dense:cublas``: the cell's FLOPs as one GEMM with one expert's weights (our tiles,
  cuBLAS): the tile loop without the expert structure;
- ``torch._grouped_mm``: the CUTLASS grouped GEMM;
- with ``--cases``, also ``mcast:async`` / ``mcast:ws`` (and their slot hand-over at CTA scope,
  ``...-cta``, and ``mcast:async-cta-lag2``, CLUSTER_SETTINGS): the multicast grouped kernel on 2-CTA
  clusters (probes/cluster_grouped.py) at its fastest tiles, its two forms (asynchronous wgmma in every
  warp; a producer warp group and consumer warp groups), whose loss against the library's kernel the
  counters' warp-stall breakdown places.

Two phases, one command:

1. Timing, side by side (experiments.harness.runner.measure, interleaved rounds, more samples than E7 takes)
   while ``nvidia-smi`` samples the SM clock, power and clock-event reasons every 100 ms: each row says
   what the clock did while its cell was timed. Each contender is first checked against float64 on 512
   random rows (all of them finite) -- E7 and the verify step check these kernels in full on these shapes.
2. Counters: each checked contender once more, in a process of its own under Nsight Compute (``ncu``;
   kernel replay, caches flushed before each pass, clocks left alone), profiling only the one call made
   between cudaProfilerStart/Stop, with the SpeedOfLight, memory, compute, occupancy, launch and warp-state
   sections and the tensor-pipe, L2 and DRAM counters this ncu knows. One row per (cell, contender,
   kernel, metric).

    python -m probes.probe_prefill_counters --out results/<slug>/probe_prefill_timing.csv \\
        --counters-out results/<slug>/probe_prefill_counters.csv [--raw-dir DIR]
    python -m probes.probe_prefill_counters --cells mixtral-8x7b:up:4096:uniform \\
        --cases tuned,torch._grouped_mm,mcast:async,mcast:ws --out results/<slug>/probe_cluster_timing.csv \\
        --counters-out results/<slug>/probe_cluster_counters.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

CELLS = [  # E7's prefill cells where our kernel trails the practical ceiling most, and one where it is close
    ("deepseek-v3", "up", 4096, "uniform"),
    ("deepseek-v3", "down", 4096, "zipf1.2"),
    ("qwen3-30b-a3b", "up", 4096, "uniform"),
    ("mixtral-8x7b", "down", 1024, "uniform"),
]
CASES = ("tuned", "tails:separate", "tails:merged", "even", "dense:ours", "dense:cublas", "torch._grouped_mm")
# the multicast grouped kernel on 2-CTA clusters (probes/cluster_grouped.py) at its fastest tiles of
# probe_cluster_grouped.csv (E = 8, K = 4096, N = 14336; 128 x 256 a CTA, four slots), asked for by --cases
# where the GPU's Triton can run it: asynchronous wgmma in every warp, the pair's slot hand-over at cluster
# scope (async), at CTA scope (async-cta), at CTA scope with the lead's refill a step later
# (async-cta-lag2); warp-specialized, at cluster and at CTA scope
CLUSTER_CASES = ("mcast:async", "mcast:async-cta", "mcast:async-cta-lag2", "mcast:ws", "mcast:ws-cta")
CLUSTER_SETTINGS = {
    "mcast:async": {},
    "mcast:async-cta": {"scope": "cta"},
    "mcast:async-cta-lag2": {"scope": "cta", "lag": 2},
    "mcast:ws": {"ws": True},
    "mcast:ws-cta": {"ws": True, "scope": "cta"},
}
SECTIONS = (
    "SpeedOfLight",
    "MemoryWorkloadAnalysis",
    "ComputeWorkloadAnalysis",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
)
# (base name, suffix): counters asked for by name where this ncu lists them (ncu --query-metrics); executed
# tensor-core math (which counts the padded rows of a ragged tile), tensor pipe activity, L2 and DRAM bytes
WANTED = (
    ("sm__ops_path_tensor_src_bf16_dst_fp32", ".sum"),
    ("sm__pipe_tensor_op_gmma_cycles_active", ".avg.pct_of_peak_sustained_elapsed"),
    ("sm__pipe_tensor_op_hmma_cycles_active", ".avg.pct_of_peak_sustained_elapsed"),
    ("sm__inst_executed_pipe_tensor_op_gmma", ".sum"),
    ("lts__t_bytes", ".sum"),
    ("lts__t_bytes", ".sum.per_second"),
    ("lts__t_sectors", ".avg.pct_of_peak_sustained_elapsed"),
    ("lts__t_sectors_srcunit_tex", ".sum"),
    ("dram__bytes_read", ".sum"),
    ("dram__bytes_write", ".sum"),
    ("dram__throughput", ".avg.pct_of_peak_sustained_elapsed"),
    ("sm__cycles_active", ".avg"),
    ("gpc__cycles_elapsed", ".max"),
)
SAMPLE_ROWS = 512
T_START = time.time()
CLOCK_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,{}.active"
CLOCK_REASONS = ("clocks_event_reasons", "clocks_throttle_reasons")  # the newer name, then the older one
# the counters kept (ncu's raw page has hundreds): time and clock, tensor pipe and executed tensor math, L2,
# DRAM and L1 throughput and bytes, warps, launch shape, and the warp-stall breakdown (every
# smsp__average_warps_issue_stalled_* ratio)
KEPT = frozenset(
    {
        "gpu__time_duration.sum",
        "gpc__cycles_elapsed.avg.per_second",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
        "sm__ops_path_tensor_src_bf16_dst_fp32.sum",
        "sm__inst_executed_pipe_tensor_op_gmma.sum",
        "lts__throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
        "lts__t_bytes.sum",
        "lts__t_bytes.sum.per_second",
        "lts__t_sector_hit_rate.pct",
        "lts__d_sectors_fill_device.avg.pct_of_peak_sustained_elapsed",
        "lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__bytes_read.sum",
        "dram__bytes_write.sum",
        "l1tex__throughput.avg.pct_of_peak_sustained_active",
        "sm__warps_active.avg.pct_of_peak_sustained_active",
        "launch__registers_per_thread",
        "launch__grid_size",
        "launch__block_size",
        "launch__shared_mem_per_block_dynamic",
        "launch__waves_per_multiprocessor",
    }
)
STALLS = "smsp__average_warps_issue_stalled_"


def cell_fields(model: str, proj: str, t: int, load: str) -> dict:
    """The columns that name a row's cell, in the timing CSV and in the counters'."""
    return dict(experiment="probe_prefill_counters", model=model, proj=proj, tokens=t, load=load)


def kept(metric: str) -> bool:
    return metric in KEPT or (metric.startswith(STALLS) and metric.endswith("_per_issue_active.ratio"))


# profiled in this order while the counters budget lasts: the splits of the gap first
PRIORITY = (
    "tuned",
    "even",
    "dense:cublas",
    "tails:merged",
    "dense:ours",
    "torch._grouped_mm",
    "tails:separate",
)


# ---------------------------------------------------------------- the cells and their contenders


def cell_inputs(g: dict, model: str, proj: str, t: int, load: str):
    """E7's inputs of a cell: (w [E, N, K], x_sorted, plan, experts, K, N)."""
    from experiments.e7_grouped_skew import cell_tokens, expert_weights
    from moegemm.grouped import permute, route

    m = g["models"][model]
    e, top_k = m["experts"], m["top_k"]
    k, n = m[proj]
    w = expert_weights(g["seed"], e, n, k)
    ids, x, _ = cell_tokens(g, t, e, top_k, k, load)
    plan = route(ids, e)
    return w, permute(x, plan), plan, e, k, n


def case_calls(name: str, xs, w, plan, e: int, n: int):
    """(bind(input set) -> call, config dict, the group offsets its rows follow, or None for one dense GEMM
    with expert 0's weights); None where the case does not apply (a tails variant equal to the tuned
    config, or one whose shared memory never fits)."""
    from experiments.e7_grouped_skew import ours
    from moegemm.grouped import choose_config, grouped_mm
    from probes.common import even_offsets, variant

    off = plan.group_offsets
    m = xs.shape[0]
    tuned, _ = choose_config(xs, e, n, "nk")

    if name == "tuned":
        return ours(off, tuned), dataclasses.asdict(tuned), off
    if name.startswith("tails:"):
        c = variant(tuned, tail_m=32, merge_tail=name == "tails:merged") if tuned.block_m >= 64 else None
        if c is None or c == tuned:
            return None
        return ours(off, c), dataclasses.asdict(c), off
    if name == "even":
        even = even_offsets(m, e, xs.device)
        return ours(even, tuned), dataclasses.asdict(tuned), even
    if name == "dense:ours":
        one = torch.tensor([0, m], dtype=torch.int32, device=xs.device)
        return (
            (
                lambda inp: (
                    lambda: grouped_mm(inp[0], inp[1][:1], one, w_layout="nk", config=tuned, validate=False)
                )
            ),
            dataclasses.asdict(tuned),
            None,
        )
    if name == "dense:cublas":
        return (lambda inp: lambda: torch.mm(inp[0], inp[1][0].T)), {"torch.mm": "cuBLAS"}, None
    if name == "torch._grouped_mm":
        from moegemm.grouped.baselines import torch_grouped_mm

        return (lambda inp: lambda: torch_grouped_mm(inp[0], inp[1], off, w_layout="nk")), {}, off
    if name in CLUSTER_CASES:
        from probes import cluster_grouped as cg

        if xs.dtype not in (torch.bfloat16, torch.float16) or not cg.cluster_supported(xs.device):
            return None  # the probe's grouped_mm would run the library's kernel in its place
        c = cg.ClusterGroupedConfig(
            block_m=128, block_n=256, block_k=64, num_warps=8, stages=4, **CLUSTER_SETTINGS[name]
        )
        return (
            (
                lambda inp: (
                    lambda: cg.grouped_mm(
                        inp[0], inp[1], off, w_layout="nk", config=c, validate=False, strict=True
                    )
                )
            ),
            dataclasses.asdict(c),
            off,
        )
    raise ValueError(f"case: expected one of {CASES + CLUSTER_CASES}, got {name!r}")


def parse_cells(spec: str) -> list[tuple[str, str, int, str]]:
    """--cells MODEL:PROJ:T:LOAD[,...] -> [(model, proj, T, load)]; a malformed cell raises naming it."""
    cells = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) != 4 or parts[1] not in ("up", "down") or not parts[2].isdigit():
            raise ValueError(f"--cells: expected MODEL:PROJ:T:LOAD (PROJ up or down), got {item!r}")
        cells.append((parts[0], parts[1], int(parts[2]), parts[3]))
    return cells


def parse_cases(spec: str) -> tuple[str, ...]:
    """--cases NAME[,...]: the cases of CASES and CLUSTER_CASES to run, in the order given, each once."""
    names = tuple(dict.fromkeys(spec.split(",")))
    bad = [c for c in names if c not in CASES + CLUSTER_CASES]
    if bad:
        raise ValueError(f"--cases: not cases of this probe: {bad}; expected among {CASES + CLUSTER_CASES}")
    return names


def sampled_check(xs, w, offsets, k: int, seed: int = 0):
    """out -> (ok, rel_err, why): every element finite, and SAMPLE_ROWS random rows against float64 (each
    row against its expert's weights under ``offsets``; offsets None: expert 0's)."""
    from experiments.harness.correctness import check

    m = xs.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = torch.randperm(m, generator=gen)[:SAMPLE_ROWS].sort().values.to(xs.device)
    if offsets is None:
        experts = torch.zeros_like(rows)
    else:
        experts = torch.searchsorted(offsets[1:].long(), rows, right=True)
    ref = torch.empty(rows.numel(), w.shape[1], dtype=torch.float64, device=xs.device)
    for ex in experts.unique().tolist():
        sel = experts == ex
        ref[sel] = xs[rows[sel]].double() @ w[ex].double().T

    def check_fn(out):
        if not torch.isfinite(out).all():
            return False, math.nan, "a non-finite element in the output"
        return check(out[rows], ref, k)

    return check_fn


# ---------------------------------------------------------------- phase 1: timing, with the clocks sampled


class ClockLog:
    """``nvidia-smi`` sampling the SM clock, power and clock-event reasons every 100 ms, in a thread."""

    def __init__(self):
        self.samples: list[tuple[float, dict]] = []
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        for reasons in CLOCK_REASONS:  # an nvidia-smi that does not know a field exits at once
            self.proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    f"--query-gpu={CLOCK_FIELDS.format(reasons)}",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "100",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            time.sleep(1.0)
            if self.proc.poll() is None:
                break
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 6:
                continue
            try:
                rec = {
                    "sm_mhz": float(parts[1]),
                    "mem_mhz": float(parts[2]),
                    "power_w": float(parts[3]),
                    "temp_c": float(parts[4]),
                    "reasons": int(parts[5], 16),
                }
            except ValueError:
                continue
            self.samples.append((time.time(), rec))

    def summary(self, t0: float, t1: float) -> dict:
        """The clock while [t0, t1] was being measured."""
        s = [r for (ts, r) in self.samples if t0 <= ts <= t1]
        if not s:
            return {"clock_samples": 0}
        sm = sorted(r["sm_mhz"] for r in s)
        reasons = 0
        for r in s:
            reasons |= r["reasons"]
        return {
            "clock_samples": len(s),
            "sm_mhz_min": sm[0],
            "sm_mhz_median": sm[len(sm) // 2],
            "sm_mhz_max": sm[-1],
            "power_w_max": max(r["power_w"] for r in s),
            "temp_c_max": max(r["temp_c"] for r in s),
            "clock_event_reasons": hex(reasons),
        }

    def close(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def timing_phase(args, cfg, g, prov, slug, cells) -> list[tuple]:
    """Phase 1: measure each cell's contenders side by side; returns the (cell, case) pairs that passed."""
    from experiments.common import ResultWriter, timing_settings, weight_sets
    from experiments.e7_grouped_skew import floor_us, graph_rates
    from experiments.harness.moe_loads import skew_stats
    from experiments.harness.runner import Contender, measure

    settings = timing_settings(cfg, "grouped")
    if not args.quick:
        settings = dataclasses.replace(settings, rounds=4, graph_replays=5)
    writer = ResultWriter(args.out, ("model", "proj", "tokens", "load"))
    clocks = ClockLog()
    passed = []
    try:
        for model, proj, t, load in cells:
            if writer.done(model=model, proj=proj, tokens=t, load=load):
                out = [
                    r
                    for r in writer.rows
                    if (r["model"], r["proj"], r["tokens"], r["load"]) == (model, proj, t, load)
                ]
                passed += [((model, proj, t, load), r["contender"]) for r in out if r["status"] == "ok"]
                continue
            w, xs, plan, e, k, n = cell_inputs(g, model, proj, t, load)
            stats = skew_stats(plan.group_sizes)
            rows = xs.shape[0]
            fl, nbytes, flops = floor_us(rows, k, n, stats["active_experts"], slug)
            ws = weight_sets(w, stats["active_experts"], rows, k, n)
            cs = []
            for name in args.cases:
                got = case_calls(name, xs, w, plan, e, n)
                if got is None:
                    continue
                bind, config, offsets = got
                cs.append(
                    Contender(
                        name,
                        bind,
                        config=config,
                        check=sampled_check(xs, w, offsets, k),
                        parallel_compile=name not in ("dense:cublas", "torch._grouped_mm"),
                    )
                )
            t0 = time.time()
            out = measure(cs, [(xs, wi) for wi in ws], None, k, settings)
            clock = clocks.summary(t0, time.time())
            for r in out:
                r.update(
                    **cell_fields(model, proj, t, load),
                    experts=e,
                    k=k,
                    n=n,
                    rows=rows,
                    **stats,
                    floor_us=fl,
                    flops=flops,
                    input_sets=len(ws),
                    **graph_rates(r.get("graph_us", math.nan), flops, fl),
                    **clock,
                    **prov,
                )
            writer.add(out)
            passed += [((model, proj, t, load), r["contender"]) for r in out if r["status"] == "ok"]
            print(
                f"{model} {proj} T={t} {load}: "
                + ", ".join(
                    f"{r['contender']}={r.get('graph_us', math.nan):.0f}us"
                    if r["status"] == "ok"
                    else f"{r['contender']}={r['status']}"
                    for r in out
                ),
                flush=True,
            )
            del w, ws, xs
            torch.cuda.empty_cache()
    finally:
        clocks.close()
    writer.finish()
    return passed


# ---------------------------------------------------------------- phase 2: counters under ncu


def find_ncu(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("ncu")
    if found:
        return found
    import glob

    for pattern in (
        "/usr/local/cuda*/bin/ncu",
        "/opt/nvidia/nsight-compute/*/ncu",
        "/usr/local/NVIDIA-Nsight-Compute*/ncu",
    ):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def metric_names(query_output: str) -> set[str]:
    """Base metric names from ``ncu --query-metrics`` output (the first word of each line naming one)."""
    names = set()
    for line in query_output.splitlines():
        word = line.strip().split(" ")[0] if line.strip() else ""
        if "__" in word and all(c.isalnum() or c in "_." for c in word):
            names.add(word)
    return names


def wanted_metrics(available: set[str]) -> list[str]:
    return [base + suffix for base, suffix in WANTED if base in available]


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` report -> one dict per (kernel, kept numeric metric: see kept()): kernel id
    and name, block and grid size, metric, unit, value. Non-numeric metrics (names, strings) are left out;
    thousands separators are removed."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # ncu's own ==PROF== lines are not CSV
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if not table or table[0][:1] != ["ID"]:
        raise ValueError('not an ncu raw CSV page: no header row starting with "ID"')
    head, body = table[0], table[1:]
    units = [""] * len(head)
    if body and body[0][:1] == [""]:
        units, body = body[0], body[1:]
    ident = {
        "ID",
        "Process ID",
        "Process Name",
        "Host Name",
        "Kernel Name",
        "Context",
        "Stream",
        "Block Size",
        "Grid Size",
        "Device",
        "CC",
    }
    out = []
    for row in body:
        rec = dict(zip(head, row))
        for col, unit in zip(head, units):
            if col in ident or col not in rec or not kept(col):
                continue
            raw = rec[col].replace(",", "").strip()
            try:
                value = float(raw)
            except ValueError:
                continue
            out.append(
                {
                    "kernel_id": int(rec["ID"]),
                    "kernel": rec.get("Kernel Name", ""),
                    "block": rec.get("Block Size", ""),
                    "grid": rec.get("Grid Size", ""),
                    "metric": col,
                    "unit": unit,
                    "value": value,
                }
            )
    return out


def counters_phase(args, prov, passed: list[tuple]) -> None:
    """Phase 2: each passed (cell, case) once under ncu in a child process; rows written atomically."""
    from experiments.common import ResultWriter

    ncu = find_ncu(args.ncu)
    if ncu is None:
        sys.exit("ncu (Nsight Compute) not found: the counters phase needs it (--ncu PATH)")
    query = subprocess.run([ncu, "--query-metrics", "--chip", "gh100"], capture_output=True, text=True)
    metrics = wanted_metrics(metric_names(query.stdout))
    print(f"ncu {ncu}: {len(metrics)} of {len(WANTED)} named counters known: {metrics}", flush=True)
    raw_dir = Path(args.raw_dir) if args.raw_dir else None
    if raw_dir:
        raw_dir.mkdir(parents=True, exist_ok=True)
    writer = ResultWriter(args.counters_out, ("model", "proj", "tokens", "load", "contender"))
    order = PRIORITY + CLUSTER_CASES
    passed = sorted(passed, key=lambda p: order.index(p[1]))  # stable: cells in order within a case
    deadline = time.time() + args.counters_budget_s
    if args.deadline_s:  # no case started that might not end before the whole run's deadline
        deadline = min(deadline, T_START + args.deadline_s - args.case_timeout_s)
    with tempfile.TemporaryDirectory() as tmp:
        for (model, proj, t, load), case in passed:
            if time.time() > deadline:
                print(
                    f"counters: budget spent; {model} {proj} T={t} {load} {case} and after not profiled",
                    flush=True,
                )
                break
            if writer.done(model=model, proj=proj, tokens=t, load=load, contender=case):
                continue  # profiled by an earlier, interrupted run (its rows resumed from the .partial log)
            spec = f"{model}:{proj}:{t}:{load}:{case}"
            rep = Path(tmp) / "rep"
            base = [
                ncu,
                "--profile-from-start",
                "off",
                "--clock-control",
                "none",
                "--cache-control",
                "all",
                "--replay-mode",
                "kernel",
                "--export",
                str(rep),
                "--force-overwrite",
            ]
            for s in SECTIONS:
                base += ["--section", s]
            child = [
                sys.executable,
                "-m",
                "probes.probe_prefill_counters",
                "--one",
                spec,
                "--config",
                args.config,
                "--out",
                os.devnull,
                "--cases",
                case,
            ]
            t0 = time.time()
            run = subprocess.run(
                base + (["--metrics", ",".join(metrics)] if metrics else []) + child,
                capture_output=True,
                text=True,
                timeout=args.case_timeout_s,
            )
            if run.returncode != 0 and metrics:  # a named counter this ncu refuses: the sections alone
                run = subprocess.run(
                    base + child, capture_output=True, text=True, timeout=args.case_timeout_s
                )
            if run.returncode != 0:
                print(
                    f"counters {spec}: ncu rc={run.returncode}: {(run.stderr or run.stdout)[-400:]}",
                    flush=True,
                )
                continue
            page = subprocess.run(
                [ncu, "--import", str(rep) + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base"],
                capture_output=True,
                text=True,
            )
            if raw_dir:
                (raw_dir / (spec.replace(":", "_").replace(".", "") + ".csv")).write_text(page.stdout)
            try:
                got = parse_raw_csv(page.stdout)
            except ValueError as ex:
                print(f"counters {spec}: {ex}", flush=True)
                continue
            for r in got:
                r.update(**cell_fields(model, proj, t, load), contender=case, **prov)
            writer.add(got)
            kernels = sorted({r["kernel"][:40] for r in got})
            print(
                f"counters {spec}: {len(got)} values, kernels {kernels}, {time.time() - t0:.0f}s", flush=True
            )
    if not writer.rows:
        sys.exit("counters: nothing profiled")
    writer.finish()


def one(args, g) -> None:
    """The child under ncu: one call of one case, alone between cudaProfilerStart and cudaProfilerStop (two
    calls before it: compiled, warm)."""
    model, proj, t, load, case = args.one.split(":", 4)
    w, xs, plan, e, k, n = cell_inputs(g, model, proj, int(t), load)
    got = case_calls(case, xs, w, plan, e, n)
    if got is None:
        sys.exit(f"{case} does not apply to {model} {proj} T={t} {load}")
    call = got[0]((xs, w))
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main():
    from experiments.common import load_config, provenance_fields, require_gpu
    from moegemm._runtime import slugify

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the timing CSV (written atomically)")
    ap.add_argument("--counters-out", help="the counters CSV (written atomically); without it, no ncu phase")
    ap.add_argument("--raw-dir", help="also keep ncu's raw CSV page of each case here")
    ap.add_argument("--config", default=str(ROOT / "experiments" / "config.yaml"))
    ap.add_argument("--quick", action="store_true", help="the first cell only, at E7's timing")
    ap.add_argument("--cells", help="MODEL:PROJ:T:LOAD[,...] of the zoo, in place of the probe's own cells")
    ap.add_argument(
        "--cases", default=",".join(CASES), help=f"the cases to run (of {', '.join(CASES + CLUSTER_CASES)})"
    )
    ap.add_argument("--ncu", help="path of ncu (default: on PATH, or CUDA's and Nsight Compute's folders)")
    ap.add_argument(
        "--counters-budget-s",
        type=float,
        default=300.0,
        help="start no new ncu case after this many seconds of the counters phase",
    )
    ap.add_argument("--case-timeout-s", type=float, default=120.0)
    ap.add_argument(
        "--deadline-s",
        type=float,
        help="start no ncu case that could end past this many seconds after the start",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)  # MODEL:PROJ:T:LOAD:CASE, the child under ncu
    args = ap.parse_args()
    try:
        args.cases = parse_cases(args.cases)
        cells = parse_cells(args.cells) if args.cells else None
    except ValueError as ex:
        ap.error(str(ex))
    require_gpu()
    cfg = load_config(args.config)
    g = cfg["grouped"]
    if args.one:
        one(args, g)
        return
    prov = provenance_fields()
    slug = slugify(prov["gpu"])
    if cells is None:
        cells = CELLS[:1] if args.quick else CELLS
    unknown = sorted({m for m, *_ in cells} - set(g["models"]))
    if unknown:
        sys.exit(f"--cells: not zoo models: {unknown}")
    passed = timing_phase(args, cfg, g, prov, slug, cells)
    if args.counters_out:
        counters_phase(args, prov, passed)


if __name__ == "__main__":
    main()
