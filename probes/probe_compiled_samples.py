"""Probe (not a pipeline step): every graph replay of E8's contenders in order, with the SM clock, on one
model's whole E8 sequence.

Why: in E8, at T=16384 on gpt-oss-120b, our compiled transformers backend took 0.87-0.88x the eager
backend's speed in two runs on two machines, its replays split in two (the p20 at the eager time, the p80
about 30% slower), while probes that time only the two backends side by side find them equal. This runs
E8 itself for one model (its cells in E8's order, E8's inputs, contenders and timing settings, Dynamo
reset as E8 resets it) and records, for the cells at the largest T, each graph replay as it happens:
contender, replay, microseconds per call, the SM clock and power read from NVML right after it, the host's
time in the graph's replay() call, its load average, this process's threads and child processes, and the
graphs Dynamo has compiled so far.

    python -m probes.probe_compiled_samples --out probe_compiled_samples.csv [--model gpt-oss-120b]
"""

from __future__ import annotations

import csv
import os
import sys
import time

from experiments import e8_moe_layer as e8
from experiments.common import provenance_fields
from experiments.e7_grouped_skew import Vllm
from experiments.harness import runner, timing
from experiments.harness.power import Nvml
from probes.common import one_model_setup


class _TimedReplay:
    """A CUDA graph whose replay() also keeps the host's time in that call (ms)."""

    def __init__(self, graph):
        self.graph, self.host_ms = graph, 0.0

    def replay(self) -> None:
        t0 = time.perf_counter()
        self.graph.replay()
        self.host_ms = (time.perf_counter() - t0) * 1e3


def _children() -> int:
    """Live child processes of this one (Inductor's compile workers among them)."""
    me = str(os.getpid())
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    n += f.read().rsplit(")", 1)[1].split()[1] == me
            except OSError:
                pass
    return n


def _dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (its unique_graphs counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main():
    out, model, g, e8cfg, settings, top = one_model_setup(sys.argv[1:])
    nvml = Nvml()
    log: list[dict] = []
    state = {"cell": None, "name": None}

    class LoggedTimer(timing.GraphTimer):
        def __init__(self, calls, calls_per_graph: int = 20):
            super().__init__(calls, calls_per_graph)
            self.graph = _TimedReplay(self.graph)

        def sample(self, replays: int = 5) -> list[float]:
            out = []
            for i in range(replays):
                us = super().sample(1)[0]
                out.append(us)
                if state["cell"] is not None:
                    log.append(
                        {
                            "cell": state["cell"],
                            "contender": state["name"],
                            "replay": i,
                            "us": round(us, 1),
                            "sm_mhz": nvml.clock_mhz(),
                            "power_w": round(nvml.power_w(), 1),
                            "host_ms": round(self.graph.host_ms, 2),
                            "load1": os.getloadavg()[0],
                            "threads": len(os.listdir("/proc/self/task")),
                            "children": _children(),
                            "dynamo_graphs": _dynamo_graphs(),
                        }
                    )
            return out

    timing.GraphTimer = LoggedTimer  # what runner.graph_timer makes
    vllm = Vllm()
    vllm.load()
    weights: dict = {}
    for t in e8cfg["tokens"]:
        for load in e8cfg["loads"]:
            m, e, top_k, h, i, ids, x, wts, ref, active, sets = e8.cell_inputs(g, model, t, load, weights)
            cs = e8.contenders(x, ids, wts, e, h, i, t, t in e8cfg["compiled_tokens"], vllm.kernel)
            state["cell"] = f"T={t} {load}" if t == top else None
            for c in cs:  # name each timer's samples: wrap the binder so the graph timer knows its contender
                inner = c.bind

                def bind(inp, inner=inner, name=c.name):
                    call = inner(inp)

                    def named():
                        state["name"] = name
                        return call()

                    return named

                c.bind = bind
            rows = runner.measure(cs, sets, ref, h + i, settings)
            med = {r["contender"]: r.get("graph_us") for r in rows}
            print(
                f"{model} T={t} {load}: eager {med.get('ours:hf-backend')} compiled "
                f"{med.get('ours:hf-backend:compiled')}",
                file=sys.stderr,
                flush=True,
            )
            del sets, cs
    prov = provenance_fields()
    with open(out + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(
            f,
            fieldnames=[
                "model",
                "cell",
                "seq",
                "contender",
                "replay",
                "us",
                "sm_mhz",
                "power_w",
                "host_ms",
                "load1",
                "threads",
                "children",
                "dynamo_graphs",
                *prov,
            ],
        )
        w.writeheader()
        for seq, r in enumerate(log):
            w.writerow({"model": model, "seq": seq, **r, **prov})
    os.replace(out + ".tmp", out)
    for r in log:
        print(
            f"{r['cell']:16s} {r['contender']:28s} {r['replay']} {r['us']:9.1f} us {r['sm_mhz']} MHz "
            f"{r['power_w']} W host {r['host_ms']} ms load {r['load1']:.1f} thr {r['threads']} "
            f"ch {r['children']} dg {r['dynamo_graphs']}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
