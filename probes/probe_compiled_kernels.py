"""Probe (not a pipeline step): where our compiled transformers backend spends its time against the eager
one, kernel by kernel.

Why: in E8 the compiled backend ran as fast as the eager one in most cells, but up to 15% slower in a few
at T=16384 (gpt-oss-120b, Zipf 1.2 the worst). This replays E8's sequence for the models given (every E8
token count, one load, E8's inputs and seeds, so that Dynamo sees the same shapes in the same order and
recompiles as it did), timing ``ours:hf-backend`` and ``ours:hf-backend:compiled`` side by side at each T;
at the largest T it then profiles a few calls of each (torch.profiler, GPU time per kernel name) and
writes those rows, with provenance, to ``<out>.kernels.csv``.

    python -m probes.probe_compiled_kernels --out probe_compiled_kernels.csv
"""

from __future__ import annotations

import sys

from experiments.common import load_config
from experiments.e8_moe_layer import hf_contender
from probes.common import profile_once, run_cells, write_kernels

MODELS = ("gpt-oss-120b",)
LOAD = "zipf1.2"


def main():
    out = sys.argv[sys.argv.index("--out") + 1]
    tokens = load_config()["moe_layer"]["tokens"]
    cells = [(model, t) for model in MODELS for t in tokens]
    top = max(tokens)
    kernels: list[dict] = []

    def contenders(x, ids, wts, e):
        cs = [
            hf_contender("ours:hf-backend", "moegemm", x, ids, wts, False),
            hf_contender("ours:hf-backend:compiled", "moegemm", x, ids, wts, True),
        ]
        if x.shape[0] == top:
            for c in cs:
                profile_once(c, kernels)
        return cs

    run_cells(__doc__, "probe_compiled_kernels", cells, contenders, load=LOAD)
    write_kernels(out, kernels)
    for name in ("ours:hf-backend", "ours:hf-backend:compiled"):
        mine = [r for r in kernels if r["contender"] == name]
        print(
            f"{name}: {sum(r['us_per_call'] for r in mine):.0f} us in {len(mine)} kernel names",
            file=sys.stderr,
        )
        for r in mine[:12]:
            print(f"  {r['us_per_call']:9.1f} us x{r['count']}  {r['kernel'][:110]}", file=sys.stderr)


if __name__ == "__main__":
    main()
