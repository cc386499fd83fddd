"""Probe (not a pipeline step): E8's largest cells where our own contenders disagreed, timed in more rounds.

Why: in E8 (two rounds a cell) the compiled transformers backend ran more than 3% slower than the eager one,
and moe_ffn's fused gate/up slower than the unfused one, in a few cells at T=16384, where every replay runs
milliseconds under the power cap; there moe_ffn and the eager backend, the same kernels behind two calls,
differed too. This times those four contenders (``ours:moe_ffn``, ``ours:unfused-swiglu``,
``ours:hf-backend`` and ``ours:hf-backend:compiled``) side by side in ROUNDS (probes.common's)
balanced rounds on E8's inputs, uniform load, at T=4096 and then 16384 for each of MODELS (so that Dynamo
compiles as in E8: T dynamic at the second), each checked against float64 first.

    python -m probes.probe_large_cells --out results/<slug>/probe_large_cells.csv
"""

from __future__ import annotations

from experiments.e8_moe_layer import hf_contender, unfused_ours
from experiments.harness.runner import Contender
from moegemm.grouped import moe_ffn
from probes.common import run_cells

MODELS = ("gpt-oss-120b", "llama-4-scout")
CELLS = [(model, t) for model in MODELS for t in (4096, 16384)]


def contenders(x, ids, wts, e: int) -> list[Contender]:
    return [
        Contender("ours:moe_ffn", lambda inp: lambda: moe_ffn(x, ids, wts, inp[0], inp[1])),
        Contender("ours:unfused-swiglu", lambda inp: lambda: unfused_ours(x, ids, wts, inp[0], inp[1], e)),
        hf_contender("ours:hf-backend", "moegemm", x, ids, wts, False),
        hf_contender("ours:hf-backend:compiled", "moegemm", x, ids, wts, True),
    ]


if __name__ == "__main__":
    run_cells(__doc__, "probe_large_cells", CELLS, contenders)
