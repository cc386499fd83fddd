"""Probe (not a pipeline step): where the grouped kernel's prefill time goes, measured side by side in one
process, in E7's prefill cells that stay furthest below 70% of the floor.

Per cell, for the same rows (E7's seeds), interleaved (harness.runner.measure, E7's timing settings):
- ``tuned``: what the library picks (the tuned table's tiles and grid);
- (while the kernel had TMA stores: ``tuned:store0/1/2``, the same tiles with the tiles whose rows all
  belong to their expert stored by TMA, whole or in two slices; the committed CSV holds those rows);
- ``dense:cublas``: one GEMM over all the cell's rows with one expert's weights (torch.mm, cuBLAS): what
  the same FLOPs cost without the expert structure;
- ``dense:ours``: our kernel on that dense problem (E = 1, the tuned tiles): the Triton tile loop's own rate
  for this shape, so that the grouped kernel's gap to cuBLAS splits into the tile loop's share and the
  share of the expert structure;
- ``tuned:separate-tails`` / ``tuned:merged-tails``: the same tiles with an expert's last few rows (at most
  tail_m, 32 where the tuned config has none) computed as a transposed tile of their own, or by the program
  of the row tile before them from its weight tiles (stages reduced where they would not fit);
- ``tuned:kn``: the tuned tiles on the weights laid out [E, K, N] (a copy): each weight box row is then
  BLOCK_N contiguous elements instead of BLOCK_K, longer runs of HBM reads;
- ``tile:128x128x128``: 128 x 128 tiles with 128-deep K steps in three stages (the tuned grid, loop and
  tails): 256-byte weight box rows in the [E, N, K] layout;
- ``even:ours``: our kernel (tuned tiles) on the same rows dealt out evenly, M_total / E rows to each expert
  (a whole number of row tiles in every cell here): E weight matrices streamed as in the cell, but no
  ragged row tiles, which splits the expert structure's share into that of streaming E weight matrices
  and that of the ragged (routed) row counts.

    python -m probes.probe_prefill_tiles --out results/<slug>/probe_prefill_tiles.csv
"""

from __future__ import annotations

import dataclasses
import math

import torch

from experiments.e7_grouped_skew import ours, ref_rows, run_probe
from experiments.harness.correctness import check
from experiments.harness.runner import Contender
from moegemm.grouped import choose_config, grouped_mm
from probes.common import even_offsets, variant

# (model, projection, tokens, load): E7's prefill cells furthest below 70% of the floor, and two others
CELLS = [
    ("mixtral-8x7b", "up", 1024, "uniform"),
    ("mixtral-8x7b", "down", 1024, "uniform"),
    ("qwen3-30b-a3b", "up", 4096, "uniform"),
    ("qwen3-30b-a3b", "down", 4096, "uniform"),
    ("qwen3-30b-a3b", "up", 4096, "zipf1.2"),
    ("deepseek-v3", "up", 4096, "uniform"),
    ("deepseek-v3", "down", 4096, "zipf1.2"),
    ("mixtral-8x7b", "up", 16384, "uniform"),
]


def contenders(xs, plan, dense_ref, k: int, e: int, n: int, w=None) -> list[Contender]:
    """dense_ref: xs @ w[0]^T in float64 (every input set's w is a copy of the same weights); with ``w``
    also the even deal of the rows (checked against its own float64 reference)."""
    off = plan.group_offsets
    m = xs.shape[0]
    tuned, source = choose_config(xs, e, n, "nk")
    one = torch.tensor([0, m], dtype=torch.int32, device=xs.device)
    even = even_offsets(m, e, xs.device)

    cs = [
        Contender(
            "tuned",
            ours(off, tuned),
            config=dataclasses.asdict(tuned),
            fields={"config_source": source},
            parallel_compile=True,
        )
    ]
    if tuned.block_m >= 64:  # tails as tiles of their own, and merged into the row tile before them
        for merge in (False, True):
            c = variant(tuned, tail_m=tuned.tail_m or 32, merge_tail=merge)
            if c is not None and c != tuned:
                cs.append(
                    Contender(
                        f"tuned:{'merged' if merge else 'separate'}-tails",
                        ours(off, c),
                        config=dataclasses.asdict(c),
                        fields={"config_source": "tuned, tails changed"},
                        parallel_compile=True,
                    )
                )
    kn: dict = {}

    def as_kn(wi):  # the [E, K, N] copy of an input set's weights, made once
        if wi.data_ptr() not in kn:
            kn[wi.data_ptr()] = wi.transpose(1, 2).contiguous()
        return kn[wi.data_ptr()]

    cs.append(
        Contender(
            "tuned:kn",
            lambda inp: (
                lambda wk=as_kn(inp[1]): grouped_mm(
                    inp[0], wk, off, w_layout="kn", config=tuned, validate=False
                )
            ),
            config=dataclasses.asdict(tuned),
            fields={"config_source": "tuned (nk), w as [E, K, N]"},
            parallel_compile=True,
        )
    )
    deep = dataclasses.replace(
        tuned,
        block_m=128,
        block_n=128,
        block_k=128,
        num_warps=8,
        num_stages=3,
        tma=True,
        tail_m=min(tuned.tail_m, 64),
    )
    if deep != tuned:
        cs.append(
            Contender(
                "tile:128x128x128",
                ours(off, deep),
                config=dataclasses.asdict(deep),
                fields={"config_source": "tuned grid, loop and tails"},
                parallel_compile=True,
            )
        )
    cs.append(
        Contender(
            "dense:cublas",
            lambda inp: lambda: torch.mm(inp[0], inp[1][0].T),
            config={"torch.mm": "cuBLAS"},
            fields={"config_source": ""},
            check=lambda out: check(out, dense_ref, k),
        )
    )
    cs.append(
        Contender(
            "dense:ours",
            lambda inp: (
                lambda: grouped_mm(inp[0], inp[1][:1], one, w_layout="nk", config=tuned, validate=False)
            ),
            config=dataclasses.asdict(tuned),
            fields={"config_source": "tuned (of the grouped cell)"},
            check=lambda out: check(out, dense_ref, k),
            parallel_compile=True,
        )
    )
    if w is not None:
        even_ref = ref_rows(xs, w, even)
        cs.append(
            Contender(
                "even:ours",
                ours(even, tuned),
                config=dataclasses.asdict(tuned),
                fields={"config_source": "tuned (of the grouped cell)"},
                check=lambda out: check(out, even_ref, k),
                parallel_compile=True,
            )
        )
    return cs


def tflops(out: list[dict]) -> str:
    return "TFLOP/s " + ", ".join(f"{r['contender']}={r.get('tflops_graph', math.nan):.0f}" for r in out)


def main():
    run_probe(
        __doc__,
        "probe_prefill_tiles",
        CELLS,
        lambda xs, plan, ref, w, t, e, k, n, g, cell: contenders(
            xs, plan, xs.double() @ w[0].double().T, k, e, n, w
        ),
        tflops,
    )


if __name__ == "__main__":
    main()
