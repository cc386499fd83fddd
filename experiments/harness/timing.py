"""The two clocks.

- ``launch``: launch-inclusive latency per call, ``triton.testing.do_bench`` (CUDA events around each
  call, L2 flushed before each, the seed's method). Includes the CPU launch path.
- ``graph``: GPU time per call, from replaying a CUDA graph that captured ``calls_per_graph`` calls
  (rotating over several input sets so that repeated calls do not all hit a warm L2). Removes the CPU
  launch overhead, which on our H200 host is ~3.8 us per kernel from Python vs ~1.0 us in a graph. Each
  replay is queued behind a spin kernel (HOLD_CYCLES), so that its start event fires once the host has
  launched the whole graph: the time between the events is the GPU's, not the host's cudaGraphLaunch,
  whatever the number of calls and kernels in the graph.

Contenders are measured interleaved in rounds (A B C, B C A, ...; or in balanced pairs, A B C then C B A:
see runner.round_order) and the per-round samples pooled.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

import torch


@dataclasses.dataclass
class Clock:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int

    @staticmethod
    def of(samples_us: list[float]) -> "Clock":
        if not samples_us:
            nan = float("nan")
            return Clock(nan, nan, nan, 0)
        s = sorted(samples_us)
        q = statistics.quantiles(s, n=5, method="inclusive") if len(s) > 1 else [s[0]] * 4
        return Clock(statistics.median(s), q[0], q[3], len(s))


def launch_samples(fn: Callable[[], object], rep_ms: float = 20.0, warmup_ms: float = 5.0) -> list[float]:
    """Launch-inclusive per-call latencies in us (do_bench, L2 flushed before each call)."""
    import triton.testing

    times = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return [t * 1000.0 for t in times]


HOLD_CYCLES = 500_000  # the spin before each timed replay: ~250 us at the H200's 1.98 GHz clock


class GraphTimer:
    """Captures ``calls`` (a list of zero-argument callables, one per rotated input set) into one CUDA graph
    of ``calls_per_graph`` calls; ``sample()`` replays it and returns us per call."""

    def __init__(self, calls: list[Callable[[], object]], calls_per_graph: int = 20):
        self.n = calls_per_graph
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:  # warm-up on the capture stream (compiles; allocates per-stream state)
                c()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                for i in range(self.n):
                    calls[i % len(calls)]()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.graph.replay()  # first replay uploads the graph
        torch.cuda.synchronize()

    def sample(self, replays: int = 5, hold_cycles: int = HOLD_CYCLES) -> list[float]:
        """``replays`` replays, us per call each. ``hold_cycles``: the spin before each (0: none, so that the
        start event fires at once and the host's launch of the replay is timed with it)."""
        out = []
        for _ in range(replays):
            if hold_cycles:
                torch.cuda._sleep(hold_cycles)  # the GPU waits here while the host launches the replay
            self.start.record()
            self.graph.replay()
            self.end.record()
            self.end.synchronize()
            out.append(self.start.elapsed_time(self.end) * 1000.0 / self.n)
        return out


def input_sets_for(bytes_per_set: int, l2_bytes: int | None = None, max_sets: int = 8) -> int:
    """How many input sets to rotate through so that one pass exceeds 2x the L2 (at most max_sets)."""
    if l2_bytes is None:
        l2_bytes = (
            torch.cuda.get_device_properties(0).L2_cache_size if torch.cuda.is_available() else 50 << 20
        )
    need = -(-2 * l2_bytes // max(bytes_per_set, 1))
    return int(max(1, min(max_sets, need)))
