"""Probe (not a pipeline step): where our compiled transformers backend spends its time against the eager
one, kernel by kernel.

Why: in E8 the compiled backend ran as fast as the eager one in most cells, but up to 15% slower in a few
at T=16384 (gpt-oss-120b, Zipf 1.2 the worst). This replays E8's sequence for the models given (every E8
token count, one load, E8's inputs and seeds, so that Dynamo sees the same shapes in the same order and
recompiles as it did), timing ``ours:hf-backend`` and ``ours:hf-backend:compiled`` side by side at each T;
at the largest T it then profiles a few calls of each (torch.profiler, GPU time per kernel name) and
writes those rows, with provenance, to ``<out>.kernels.csv``.

    python -m experiments.probe_compiled_kernels --out probe_compiled_kernels.csv
"""

from __future__ import annotations

import csv
import sys

import torch

from experiments._io import atomic_path
from experiments.common import load_config, provenance_fields
from experiments.e8_moe_layer import hf_contender
from experiments.probe_compiled_layer import run_cells

MODELS = ("gpt-oss-120b",)
LOAD = "zipf1.2"
CALLS = 3


def _profile(name: str, fn) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if us:
            rows.append({"contender": name, "kernel": ev.key[:160], "count": ev.count // CALLS,
                         "us_per_call": round(us / CALLS, 2)})
    return sorted(rows, key=lambda r: -r["us_per_call"])


def profile_once(c, kernels: list[dict], **tags) -> None:
    """Make contender ``c`` profile its first input set's call once per ``tags`` (after the warm-up call, its
    compile): the rows, tagged, added to ``kernels``."""
    inner = c.bind

    def bind(inp):
        call = inner(inp)
        if not any(r["contender"] == c.name and all(r[k] == v for k, v in tags.items()) for r in kernels):
            kernels.extend({**tags, **r} for r in _profile(c.name, call))
        return call

    c.bind = bind


def write_kernels(out: str, kernels: list[dict], tags: tuple[str, ...] = ()) -> None:
    """The profiled rows (their ``tags`` columns first) with provenance, atomically to ``<out>.kernels.csv``."""
    prov = provenance_fields()
    with atomic_path(out + ".kernels.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*tags, "contender", "kernel", "count", "us_per_call", *prov])
        w.writeheader()
        w.writerows({**r, **prov} for r in kernels)


def main():
    out = sys.argv[sys.argv.index("--out") + 1]
    tokens = load_config()["moe_layer"]["tokens"]
    cells = [(model, t) for model in MODELS for t in tokens]
    top = max(tokens)
    kernels: list[dict] = []

    def contenders(x, ids, wts, e):
        cs = [hf_contender("ours:hf-backend", "moegemm", x, ids, wts, False),
              hf_contender("ours:hf-backend:compiled", "moegemm", x, ids, wts, True)]
        if x.shape[0] == top:
            for c in cs:
                profile_once(c, kernels)
        return cs

    run_cells(__doc__, "probe_compiled_kernels", cells, contenders, load=LOAD)
    write_kernels(out, kernels)
    for name in ("ours:hf-backend", "ours:hf-backend:compiled"):
        mine = [r for r in kernels if r["contender"] == name]
        print(f"{name}: {sum(r['us_per_call'] for r in mine):.0f} us in {len(mine)} kernel names", file=sys.stderr)
        for r in mine[:12]:
            print(f"  {r['us_per_call']:9.1f} us x{r['count']}  {r['kernel'][:110]}", file=sys.stderr)


if __name__ == "__main__":
    main()
