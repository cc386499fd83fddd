"""Probe (not a pipeline step): the fused SwiGLU gate/up on the tuned models, where E8 measured it slower than
our unfused kernels at prefill (DeepSeek-V3 at T=4096 and 16384).

Why: the tuned table holds tiles for the unfused product; until 7bc9537 the fused kernel took that entry's
tiles with half the columns per half, untimed. Now its first call on a shape times those against the
distilled shortlist of the regime and keeps the fastest. Cells: the tune models at E8's prefill token counts,
uniform load, E8's inputs (same seeds); ``ours:moe_ffn`` (fused above 16 rows per expert) against
``ours:unfused-swiglu``, interleaved in ROUNDS rounds, each checked against float64.

    python -m probes.probe_fused_tuned --out results/<slug>/probe_fused_tuned.csv
"""

from __future__ import annotations

from experiments.e8_moe_layer import unfused_ours
from experiments.harness.runner import Contender
from moegemm.grouped import moe_ffn
from probes.common import run_cells

CELLS = [
    ("deepseek-v3", 1024),
    ("deepseek-v3", 4096),
    ("deepseek-v3", 16384),
    ("qwen3-30b-a3b", 4096),
    ("qwen3-30b-a3b", 16384),
    ("mixtral-8x7b", 4096),
    ("mixtral-8x7b", 16384),
]


def contenders(x, ids, wts, e: int) -> list[Contender]:
    return [
        Contender("ours:moe_ffn", lambda inp: lambda: moe_ffn(x, ids, wts, inp[0], inp[1])),
        Contender("ours:unfused-swiglu", lambda inp: lambda: unfused_ours(x, ids, wts, inp[0], inp[1], e)),
    ]


if __name__ == "__main__":
    run_cells(__doc__, "probe_fused_tuned", CELLS, contenders)
