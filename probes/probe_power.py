"""Probe (not a pipeline step): the SM clock and power draw each E7 contender runs at, on E7's inputs.

Why: the floor and the practical ceiling count the datasheet's peaks, and the ceiling takes the slower of two
easier problems (streaming the cell's bytes alone, its FLOPs as one dense GEMM alone). Our H200 runs under a
700 W power cap. A grouped GEMM whose tiles keep both the HBM and the tensor cores busy (the cells where
bytes and FLOPs take about as long) may draw more power than either easier problem, and so run at a lower
SM clock than they do. This probe measures it: each contender's CUDA graph replayed back to back for
HOLD_S seconds, ROUNDS times in rotating order (the row keeps the medians), while experiments.harness.power's
sampler reads the SM clock, power and clock-limit reasons from NVML every 5 ms; the clock summarised over the
samples after SETTLE_S, the power after POWER_SINCE_S (NVML averages power over up to a second). The time per
call is the hold's own (CUDA events around it).

Contenders per cell, in an order rotating from cell to cell: ours (the tuned config, as the library picks
it), torch._grouped_mm, vLLM's fused-MoE kernel where its source is at hand (as in E7: MOEGEMM_VLLM_SOURCE
or an installed vllm; E7's light config search), the dense yardstick (one expert's weights per call, the
FLOPs alone) and the memory ceiling (experiments.harness.stream with E7's launch-shape search, the bytes
alone). Each is checked first: ours, torch._grouped_mm and vLLM's kernel against float64, the stream
against its own check; the yardstick computes another product, by design.

E7 times each contender in short bursts (a CUDA graph of a few ms, replayed a few times per round, the
launch clock's calls between), after which the GPU may idle for a moment; the hold here is what a
sustained run of the same kernel gets.

    python -m probes.probe_power --out results/<slug>/probe_power.csv
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from experiments.e7_grouped_skew import (
    Vllm,
    dense_contender,
    ours,
    run_probe,
    stream_contender,
    stream_search,
    torch_contender,
)
from experiments.harness.power import Nvml, Sampler, summary
from experiments.harness.runner import Contender, check_contenders, graph_timer
from experiments.harness.timing import GraphTimer
from moegemm.grouped import choose_config

HOLD_S, SETTLE_S, POWER_SINCE_S = 1.2, 0.3, 0.7
ROUNDS = 3  # holds per contender and cell, who goes first rotating; the rows keep the medians
CHUNK_S = 0.05  # replays queued between host synchronisations (the sampler's clock follows the GPU's)
# E7's cells at the uniform load: every prefill (model, projection, T), decode at T=64 (gate/up), and one
# skewed cell
CELLS = [
    (model, proj, t, "uniform")
    for model in ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
    for proj in ("up", "down")
    for t in (64, 1024, 4096, 16384)
    if t > 64 or proj == "up"
] + [("deepseek-v3", "down", 4096, "zipf1.2")]


def contenders(xs, plan, ws, e: int, settings, vllm: Contender | None = None) -> list[Contender]:
    """ours (tuned), torch._grouped_mm, vLLM's kernel (where given), the dense yardstick and the memory
    ceiling on this cell's rows."""
    off = plan.group_offsets
    cfg, source = choose_config(xs, e, ws[0].shape[1], "nk")
    return [
        Contender(
            "ours",
            ours(off, cfg),
            config=dataclasses.asdict(cfg),
            fields={"config_source": source},
            parallel_compile=True,
        ),
        torch_contender(off),
        *([vllm] if vllm is not None else []),
        dense_contender(e),
        stream_contender(stream_search(ws, xs, plan, settings), ws[0], xs, plan),
    ]


def hold(timer: GraphTimer, seconds: float, nvml: Nvml) -> dict:
    """Replays ``timer``'s graph back to back for about ``seconds`` (queued CHUNK_S of GPU time at a time)
    under the sampler: the time per call over the whole hold and the sampler's summary."""
    one = statistics.median(timer.sample(3))  # us per call, to size the chunks
    per_chunk = max(1, round(CHUNK_S * 1e6 / (one * timer.n)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 0
    with Sampler(nvml=nvml) as s:
        t0 = time.perf_counter()
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(per_chunk):
                timer.graph.replay()
            replays += per_chunk
            torch.cuda.synchronize()
        end.record()
        end.synchronize()
    us = start.elapsed_time(end) * 1000.0 / (replays * timer.n)
    return {
        "graph_us": us,
        "hold_s": time.perf_counter() - t0,
        "hold_calls": replays * timer.n,
        **summary(s.samples, SETTLE_S, POWER_SINCE_S),
    }


def measure_cell(
    cs: list[Contender], sets: list[tuple], ref, k: int, settings, nvml: Nvml, turn: int
) -> list[dict]:
    """Each contender checked, its graph captured, then held (hold) ROUNDS times, who goes first rotating
    from round to round (starting at ``turn``); one row each with the medians of its holds (merge_holds)."""
    rows, live = check_contenders(cs, sets, ref, k)
    timers = {}
    for c in live:
        calls = [c.bind(inp) for inp in sets]
        timers[c.name] = graph_timer(calls, settings)
    held: dict = {c.name: [] for c in live}
    for r in range(ROUNDS):
        at = (turn + r) % max(len(live), 1)
        for c in live[at:] + live[:at]:
            held[c.name].append(hold(timers[c.name], HOLD_S, nvml))
    for c in live:
        rows[c.name].update(merge_holds(held[c.name]), graph_calls=timers[c.name].n)
    del timers
    return [rows[c.name] for c in cs]


def merge_holds(holds: list[dict]) -> dict:
    """One row's fields from a contender's holds: the median of each, the fastest and slowest hold's time
    per call, and how many holds there were."""
    out = {k: statistics.median(h[k] for h in holds) for k in holds[0]}
    us = [h["graph_us"] for h in holds]
    return {**out, "graph_us_min": min(us), "graph_us_max": max(us), "holds": len(holds)}


class PowerCells:
    """run_probe's measure_cell: NVML opened at the first cell (on the GPU machine), each row with the GPU's
    maximum SM clock and enforced power limit."""

    def __init__(self):
        self.nvml = None

    def __call__(self, cs, sets, ref, k, settings, turn):
        if self.nvml is None:
            self.nvml = Nvml()
            self.gpu = {"max_sm_mhz": self.nvml.max_clock_mhz(), "power_limit_w": self.nvml.power_limit_w()}
        return [{**r, **self.gpu} for r in measure_cell(cs, sets, ref, k, settings, self.nvml, turn)]


def summary_line(out: list[dict]) -> str:
    return ", ".join(
        f"{r['contender']}={r.get('graph_us', math.nan):.0f}us@{r.get('sm_mhz', math.nan):.0f}MHz/"
        f"{r.get('power_w', math.nan):.0f}W"
        for r in out
    )


def main():
    vllm = Vllm()
    run_probe(
        __doc__,
        "probe_power",
        CELLS,
        lambda xs, plan, ref, w, t, e, k, n, g, cell, ws, settings, x, ids: contenders(
            xs, plan, ws, e, settings, vllm.contender(g, cell, w, settings, x, xs, plan, ids, ref, k, n)
        ),
        summary_line,
        measure_cell=PowerCells(),
        with_sets=True,
    )


if __name__ == "__main__":
    main()
