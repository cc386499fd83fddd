"""Probe (not a pipeline step): our transformers backend compiled against eager, at prefill, side by side.

Why: in E8 at T=16384 the compiled backend ran up to 12% slower than the eager one, on cells where the
GEMMs take almost all of the time. Since that run the traced layer also gathers rows through a custom op
(moegemm::gather_rows), so that compiled and eager run the same kernels from routing to the un-permute;
this measures whether the gap remains. Cells: the E8 models where compiled lost most at T=16384, at
T=4096 and 16384, uniform load, with E8's inputs (same seeds), timed interleaved in ROUNDS rounds:
``ours:hf-backend``, ``ours:hf-backend:compiled`` and ``ours:moe_ffn``, each checked against float64.

    python -m probes.probe_compiled_layer --out results/<slug>/probe_compiled_layer.csv
"""

from __future__ import annotations

from experiments.e8_moe_layer import hf_contender
from experiments.harness.runner import Contender
from moegemm.grouped import moe_ffn
from probes.common import run_cells

MODELS = ("gpt-oss-120b", "llama-4-scout", "mixtral-8x22b", "olmoe-1b-7b")
CELLS = [(model, t) for model in MODELS for t in (4096, 16384)]


def contenders(x, ids, wts, e: int) -> list[Contender]:
    return [
        hf_contender("ours:hf-backend", "moegemm", x, ids, wts, False),
        hf_contender("ours:hf-backend:compiled", "moegemm", x, ids, wts, True),
        Contender("ours:moe_ffn", lambda inp: lambda: moe_ffn(x, ids, wts, inp[0], inp[1])),
    ]


if __name__ == "__main__":
    run_cells(__doc__, "probe_compiled_layer", CELLS, contenders)
