"""Measure the contenders of one shape side by side: correctness first, then both clocks, interleaved."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from typing import Callable

import torch

from . import timing
from .correctness import check, status_of
from .timing import Clock, GraphTimer, launch_samples


@dataclasses.dataclass
class Contender:
    """``bind(inputs)`` returns a zero-argument call computing the contender's output on that input set."""

    name: str
    bind: Callable[[tuple], Callable[[], torch.Tensor]]
    config: dict | str | None = None
    graph: bool = True  # False for contenders that replay CUDA graphs of their own (reduce-overhead)
    tf32: bool = False
    fields: dict = dataclasses.field(default_factory=dict)  # extra columns (variant, split, ...)
    # Optional own correctness check, out -> (ok, rel_err, why), for contenders whose contract differs
    # from the shared reference (e.g. capacity padding, which drops rows by design).
    check: Callable[[torch.Tensor], tuple[bool, float, str]] | None = None
    # Our Triton kernels: their first calls (compiles) may run from a thread pool, see prewarm().
    parallel_compile: bool = False


@dataclasses.dataclass
class Settings:
    rounds: int = 3
    launch_rep_ms: float = 10.0
    launch_warmup_ms: float = 2.0
    graph_replays: int = 5
    calls_per_graph: int = 20
    # None: every graph holds calls_per_graph calls. A number: a contender whose one call takes longer than
    # min_graph_us / calls_per_graph gets fewer calls per graph, enough for min_graph_us per replay (never
    # fewer than the input sets, so every replay still rotates through all of them): milliseconds-long
    # kernels gain nothing from averaging over more calls, and cost seconds per cell.
    min_graph_us: float | None = None
    # > 0: also measure Python's cost of one call (``cpu_us``): the host time of this many calls made back
    # to back with no sync, divided by their number (see cpu_cost_us). 0: not measured.
    cpu_calls: int = 0
    # The contenders' order in each round: "rotate" (round r starts r places further down the list) or
    # "balanced" (rounds in pairs: a rotation, then the same rotation reversed, so that over each pair every
    # contender's mean position is the same and it follows each neighbour once; see round_order).
    order: str = "rotate"
    # True: each contender's graph is captured afresh in every round and freed after its samples (the
    # allocator's cache emptied before each capture), so that only one graph's memory pool is held at a
    # time. For calls whose graph pools are large (a training step holds its gradients and activations):
    # with every contender's graph alive over all rounds, and what the contenders' first calls cached, a
    # capture runs out of memory, or its allocator frees cached blocks, which a capture may not do.
    one_graph: bool = False

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"settings.order: expected one of {ORDERS}, got {self.order!r}")


ORDERS = ("rotate", "balanced")


def round_order(items: list, r: int, order: str = "rotate") -> list:
    """The order of ``items`` in round ``r``. "rotate": the list rotated by r places. "balanced": rounds
    2j and 2j + 1 take the list rotated by j places, forwards and then backwards. With only rotation and
    few rounds (two, say), every contender keeps nearly the same place and the same predecessor in every
    round; the balanced pairs average both out."""
    n = max(len(items), 1)
    if order == "rotate":
        s = r % n
        return items[s:] + items[:s]
    if order == "balanced":
        s = (r // 2) % n
        o = items[s:] + items[:s]
        return o[::-1] if r % 2 else o
    raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")


def graph_timer(calls: list[Callable[[], object]], settings: Settings) -> GraphTimer:
    """A GraphTimer over these calls (one per input set) with settings.calls_per_graph calls per graph, or
    fewer where settings.min_graph_us allows (see Settings). The number comes from the GPU time of one call,
    a replay of a first graph of one call per input set (at least two), which is kept where it already holds
    that many: a host-timed call would count Python's launches, and give a contender that launches slowly
    fewer calls per graph than a fast one of the same GPU time."""
    make = timing.GraphTimer  # looked up at each call, so that a probe or a test may stand in its own
    if not settings.min_graph_us:
        return make(calls, settings.calls_per_graph)
    first = make(calls, max(len(calls), 2))
    n = fewest_calls(first.sample(1)[0], len(calls), settings)
    if n == first.n:
        return first
    del first  # its graph's memory, before the next capture
    return make(calls, n)


def fewest_calls(one_us: float, input_sets: int, settings: Settings) -> int:
    need = math.ceil(settings.min_graph_us / one_us)
    return int(min(settings.calls_per_graph, max(need, input_sets, 2)))


def prewarm(calls: list[Callable[[], object]], workers: int | None = None) -> int:
    """Make each call once, from a pool of threads (moegemm._runtime.launch_side_by_side), so that the
    Triton kernels they need compile in parallel: a tuner's or an experiment's candidates are otherwise
    compiled one after another. Launches from the threads go to the caller's stream and run in order.
    Errors are swallowed here: the caller's own first call, made afterwards one at a time, meets them again
    and records them. MOEGEMM_COMPILE_THREADS=1 turns this off. Returns the number of threads used (0: not
    used)."""
    from moegemm._runtime import launch_side_by_side

    if not torch.cuda.is_available():
        return 0
    used = launch_side_by_side(calls, workers)
    if used:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
    return used


def cpu_cost_us(calls: list[Callable[[], object]], n: int, repeats: int = 3) -> float:
    """Python's cost of one call in us: the host's wall time of ``n`` calls back to back (rotating over the
    input sets) with no sync, per call; the median of ``repeats`` such runs, each after a sync. The GPU's
    queue absorbs the launches, so this is the CPU's time to issue them, not the GPU's to run them."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            calls[i % len(calls)]()
        samples.append((time.perf_counter() - t0) * 1e6 / n)
    torch.cuda.synchronize()
    return statistics.median(samples)


def check_contenders(
    contenders: list[Contender], input_sets: list[tuple], ref64: torch.Tensor, k: int
) -> tuple[dict[str, dict], list[Contender]]:
    """({name: row with status, rel_err, note}, the contenders that passed): each contender's first call
    (compiles from a thread pool first where allowed) checked against float64 or by its own check; one that
    cannot run is recorded as an error, not raised."""
    rows, live = {}, []
    t0 = time.perf_counter()
    prewarm([c.bind(input_sets[0]) for c in contenders if c.parallel_compile])
    prewarm_s = time.perf_counter() - t0  # the cell's parallel compiles, before any contender's setup_s
    for c in contenders:
        t0 = time.perf_counter()
        try:
            out = c.bind(input_sets[0])()  # the first call: compiles/autotunes where the contender does
            torch.cuda.synchronize()
            ok, rel, why = c.check(out) if c.check is not None else check(out, ref64, k, tf32=c.tf32)
        except Exception as e:  # a contender that cannot run is recorded, not fatal
            ok, rel, why = False, math.nan, f"error: {type(e).__name__}: {str(e)[:200]}"
        out = None  # (its memory, before the next contender's first call)
        row = {
            "contender": c.name,
            **c.fields,  # fields may have been filled in by the first call
            "config": c.config if isinstance(c.config, str) else json.dumps(c.config or {}, sort_keys=True),
        }
        row.update(
            status=status_of(ok, why),
            rel_err=rel,
            note=why,
            setup_s=time.perf_counter() - t0,
            prewarm_s=prewarm_s,
        )
        rows[c.name] = row
        if ok:
            live.append(c)
    return rows, live


def measure(
    contenders: list[Contender], input_sets: list[tuple], ref64: torch.Tensor, k: int, settings: Settings
) -> list[dict]:
    """One row per contender: status, error, and both clocks (median, p20, p80 in us); the wall time of
    its first call and check (``setup_s``: compiles and autotuning included), of its graph's capture
    (``capture_s``) and of its timed rounds (``timed_s``), the run's own cost; ``prewarm_s``: the cell's
    compiles from a thread pool before the first calls (the same on each of its rows)."""
    rows, live = check_contenders(contenders, input_sets, ref64, k)
    timers, launch, graph = {}, {c.name: [] for c in live}, {c.name: [] for c in live}
    calls = {c.name: [c.bind(inp) for inp in input_sets] for c in live}  # one call per rotated input set

    def capture(c) -> None:
        t0 = time.perf_counter()
        if settings.one_graph:
            torch.cuda.empty_cache()
        try:
            timers[c.name] = graph_timer(calls[c.name], settings)
            rows[c.name]["graph_calls"] = timers[c.name].n
        except Exception as e:
            rows[c.name]["note"] = f"graph capture failed: {type(e).__name__}: {str(e)[:160]}"
            graphed.discard(c.name)
        rows[c.name]["capture_s"] = rows[c.name].get("capture_s", 0.0) + time.perf_counter() - t0

    graphed = {c.name for c in live if c.graph}
    for c in live:
        rows[c.name]["timed_s"] = 0.0
        if c.name in graphed and not settings.one_graph:
            capture(c)
    per_round = {c.name: {"launch": [], "graph": []} for c in live}  # each round's median, for the intervals
    for r in range(settings.rounds):
        for c in round_order(live, r, settings.order):
            t0 = time.perf_counter()
            rotation = iter(range(1 << 30))
            cs = calls[c.name]
            got = launch_samples(
                lambda cs=cs, it=rotation: cs[next(it) % len(cs)](),
                settings.launch_rep_ms,
                settings.launch_warmup_ms,
            )
            launch[c.name] += got
            per_round[c.name]["launch"].append(statistics.median(got) if got else math.nan)
            if settings.one_graph and c.name in graphed:
                capture(c)
            if c.name in timers:
                got = timers[c.name].sample(settings.graph_replays)
                graph[c.name] += got
                per_round[c.name]["graph"].append(statistics.median(got) if got else math.nan)
                if settings.one_graph:
                    del timers[c.name]  # (its pool, before the next contender's launches and capture)
            rows[c.name]["timed_s"] += time.perf_counter() - t0
    if settings.cpu_calls:
        for c in live:
            rows[c.name]["cpu_us"] = cpu_cost_us(calls[c.name], settings.cpu_calls)
    for c in live:
        for clock, samples in (("launch", launch[c.name]), ("graph", graph[c.name])):
            cl = Clock.of(samples)
            rows[c.name].update(
                {
                    f"{clock}_us": cl.median_us,
                    f"{clock}_p20_us": cl.p20_us,
                    f"{clock}_p80_us": cl.p80_us,
                    f"{clock}_n": cl.samples,
                }
            )
            rows[c.name][f"{clock}_round_us"] = ";".join(f"{v:.4f}" for v in per_round[c.name][clock])
    timers.clear()
    return [rows[c.name] for c in contenders]
