"""Probe (not a pipeline step): our compiled transformers backend against the eager one at small token
counts, kernel by kernel.

Why: in E8 the compiled backend ran a few percent slower than the eager one in some cells at T=1 (a few
microseconds of GPU time on layers of tens of microseconds), where the kernels of routing, permutation and
combine weigh as much as the GEMMs. This replays E8's sequence of token counts for the models given (E8's
inputs and seeds, one load, so that Dynamo sees the shapes in E8's order), times ``ours:hf-backend`` and
``ours:hf-backend:compiled`` side by side at each T (checked against float64 first), and at each T of
PROFILE_TOKENS profiles a few eager calls of each (torch.profiler: GPU time and launches per kernel name),
written with the model and T to ``<out>.kernels.csv``.

    python -m probes.probe_compiled_small --out probe_compiled_small.csv
"""

from __future__ import annotations

import sys

from experiments.common import load_config
from experiments.e8_moe_layer import hf_contender
from probes.common import profile_once, run_cells, write_kernels

MODELS = ("qwen1.5-moe-a2.7b", "phi-3.5-moe")
LOAD = "uniform"
PROFILE_TOKENS = (1, 16)


def main():
    out = sys.argv[sys.argv.index("--out") + 1]
    cells = [(model, t) for model in MODELS for t in load_config()["moe_layer"]["tokens"]]
    turn = iter(cells)
    kernels: list[dict] = []

    def contenders(x, ids, wts, e):
        model, t = next(turn)
        cs = [
            hf_contender("ours:hf-backend", "moegemm", x, ids, wts, False),
            hf_contender("ours:hf-backend:compiled", "moegemm", x, ids, wts, True),
        ]
        if t in PROFILE_TOKENS:
            for c in cs:
                profile_once(c, kernels, model=model, tokens=t)
        return cs

    run_cells(__doc__, "probe_compiled_small", cells, contenders, load=LOAD)
    write_kernels(out, kernels, ("model", "tokens"))
    for model in MODELS:
        for t in PROFILE_TOKENS:
            for name in ("ours:hf-backend", "ours:hf-backend:compiled"):
                mine = [
                    r for r in kernels if r["contender"] == name and r["model"] == model and r["tokens"] == t
                ]
                print(
                    f"{model} T={t} {name}: {sum(r['us_per_call'] for r in mine):.1f} us in "
                    f"{sum(r['count'] for r in mine)} launches",
                    file=sys.stderr,
                )
                for r in mine:
                    print(f"  {r['us_per_call']:8.2f} us x{r['count']}  {r['kernel'][:100]}", file=sys.stderr)


if __name__ == "__main__":
    main()
