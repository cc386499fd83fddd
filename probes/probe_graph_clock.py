"""Probe (not a pipeline step): the GPU clock as the harness took it before and as it takes it now, side by
side on the same contenders.

Why: in E8 the compiled transformers backend ran a few percent slower than the eager one at T=1, with the
same kernels, launched as often, taking the same GPU time (probe_compiled_small). Both differences between
the two ways below grow with the host's cost of a call, which the compiled backend has more of:
- before, the calls per graph (with min_graph_us) came from one call timed with CUDA events around the
  Python call, so the host's launches counted: E8 gave the compiled backend 2 or 3 calls per graph at T=1 and
  the other contenders 2 to 8. Each replay was timed from the host's cudaGraphLaunch on, whose cost was then
  spread over those few calls;
- now (runner.graph_timer, timing.GraphTimer) the count comes from a first graph's replayed GPU time, and
  each replay waits behind a spin kernel (timing.HOLD_CYCLES) until the host has launched it.
Per contender three graph clocks, in interleaved rounds: ``before`` (the host-timed count, replays not
held), ``count`` (the new count, not held) and ``now`` (the new count, held). Cells: E8's (its inputs and
seeds, its graph-timed contenders, uniform load) for MODELS at TOKENS, in E8's order of T, so that Dynamo
compiles as in E8; and E6's router GEMM at ROUTER_TOKENS (eager cuBLAS and our default), on E1-E6's timing
settings (calls_per_graph calls in every graph, so only the hold differs).

    python -m probes.probe_graph_clock --out results/<slug>/probe_graph_clock.csv
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from experiments import dk
from experiments.common import timing_settings
from experiments.e7_grouped_skew import Vllm, start
from experiments.e8_moe_layer import cell_inputs, contenders
from experiments.harness.runner import check_contenders, fewest_calls, graph_timer, round_order
from experiments.harness.timing import GraphTimer

MODELS = ("olmoe-1b-7b", "qwen3-235b-a22b", "deepseek-v2-lite", "qwen3-30b-a3b")
TOKENS = (1, 16, 256)
ROUTER_TOKENS = (1, 16, 256)
ROUNDS = 4
CLOCKS = ("before", "count", "now")


def host_timed_calls(calls: list, settings) -> int:
    """The count as the harness took it before: one call timed with CUDA events around the Python call."""
    if not settings.min_graph_us:
        return settings.calls_per_graph
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    calls[0]()
    end_ev.record()
    end_ev.synchronize()
    return fewest_calls(max(start_ev.elapsed_time(end_ev) * 1000.0, 1e-3), len(calls), settings)


def three_clocks(cs, sets, ref, k: int, settings) -> list[dict]:
    """Each graph-timed contender checked against float64, then its three clocks over ROUNDS balanced rounds
    (settings.graph_replays replays each per round); one row each."""
    rows, live = check_contenders([c for c in cs if c.graph], sets, ref, k)
    timers = {}
    for c in live:
        calls = [c.bind(s) for s in sets]
        before = GraphTimer(calls, host_timed_calls(calls, settings))
        timers[c.name] = (before, graph_timer(calls, settings))
    got = {c.name: {clock: [] for clock in CLOCKS} for c in live}
    for r in range(ROUNDS):
        for c in round_order(live, r, "balanced"):
            before, now = timers[c.name]
            got[c.name]["before"] += before.sample(settings.graph_replays, hold_cycles=0)  # as before
            got[c.name]["count"] += now.sample(settings.graph_replays, hold_cycles=0)
            got[c.name]["now"] += now.sample(settings.graph_replays)
    for c in live:
        before, now = timers[c.name]
        rows[c.name].update(
            calls_before=before.n,
            calls_now=now.n,
            rounds=ROUNDS,
            **{f"graph_us_{clock}": statistics.median(s) for clock, s in got[c.name].items()},
        )
    del timers
    return list(rows.values())


def main():
    args, cfg, g, settings, prov, slug, writer = start(__doc__, ("experiment", "model", "tokens"))
    weights: dict = {}
    vllm = Vllm()
    vllm.load()
    e8cfg = cfg["moe_layer"]
    for model in MODELS:
        for t in TOKENS:
            if writer.done(experiment="E8", model=model, tokens=t):
                continue
            t0 = time.perf_counter()
            m, e, top_k, h, i, ids, x, wts, ref, active, sets = cell_inputs(g, model, t, "uniform", weights)
            cs = contenders(x, ids, wts, e, h, i, t, t in e8cfg["compiled_tokens"], vllm.kernel)
            rows = three_clocks(cs, sets, ref, h + i, settings)
            for row in rows:
                row.update(experiment="E8", model=model, split=m["split"], tokens=t, load="uniform", **prov)
            writer.add(rows)
            report(f"E8 {model} T={t}", rows, t0)
    weights.clear()
    torch._dynamo.reset()
    r = cfg["decompose_k"]["router"]
    dk_settings = timing_settings(cfg)
    for t in ROUTER_TOKENS:
        if writer.done(experiment="E6", model="router", tokens=t):
            continue
        t0 = time.perf_counter()
        sets, ref = dk.shape_inputs(t, r["n"], r["k"], torch.bfloat16, seed=t)
        cs = [dk.eager("none"), dk.ours("auto", "none", None, name="ours:auto")]
        rows = three_clocks(cs, sets, ref, r["k"], dk_settings)
        for row in rows:
            row.update(experiment="E6", model="router", split="", tokens=t, load="", **prov)
        writer.add(rows)
        report(f"E6 router T={t}", rows, t0)
    writer.finish()


def report(cell: str, rows: list[dict], t0: float) -> None:
    parts = [
        f"{r['contender']} {r.get('calls_before', '-')}->{r.get('calls_now', '-')} calls "
        f"{r.get('graph_us_before', math.nan):.1f}/{r.get('graph_us_count', math.nan):.1f}/"
        f"{r.get('graph_us_now', math.nan):.1f}"
        for r in rows
    ]
    print(f"{cell} ({time.perf_counter() - t0:.0f} s): " + "; ".join(parts), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
