"""Probe (not a pipeline step): gate/up reading each row of x by token id inside the GEMM
(moegemm.grouped.gather: pointer-loaded row tiles, TMA weight tiles) against the permuted copy of x written
first and read by the fused TMA kernel, on E7's gate/up cells of the tune-split models.

Why: ``moe_ffn`` chooses among its gate/up forms by timing them on a shape's first call; this shows, per
cell, what each costs beside the others, for the write-up's account of what the gathering form buys.

Per cell, side by side (experiments.harness.runner.measure, E7's timing settings), all on the tiles the
fused kernel takes for the shape (its first call's timed choice where it times):
- ``permute+fused``: the permuted copy (``permute``) then ``grouped_mm_swiglu``;
- ``gather+fused``: ``gather_swiglu`` on x and the routing's token order (no copy);
- ``rows+fused``: ``grouped_mm_swiglu`` on rows already permuted (the GEMM alone).
Each is checked against SiLU(gate) * up of the float64 product.

    python -m probes.probe_gather_gate_up --out results/<slug>/probe_gather_gate_up.csv
"""

from __future__ import annotations

import dataclasses
import math

import torch

from experiments.e7_grouped_skew import run_probe
from experiments.harness.correctness import check
from experiments.harness.runner import Contender
from moegemm.grouped import grouped_mm_swiglu, permute
from moegemm.grouped.gather import can_gather, fused_config, gather_swiglu

MODELS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
CELLS = [(m, "up", t, "uniform") for m in MODELS for t in (256, 4096, 16384)] + [
    (m, "up", 4096, "zipf1.2") for m in MODELS
]


def contenders_of(xs, plan, ref, w, t, e, k, n, g, cell, ws, settings, x, ids) -> list[Contender]:
    off, tok = plan.group_offsets, plan.sorted_token_ids
    i = n // 2
    act_ref = torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]
    grouped_mm_swiglu(xs, w, off, validate=False)  # its first call times its shortlist where it may
    cfg = fused_config(xs.shape[0], x, w, "nk")

    def make(name, call):
        return Contender(
            name,
            lambda inp: lambda: call(inp[1]),
            config=dataclasses.asdict(cfg),
            parallel_compile=True,
            check=lambda out: check(out, act_ref, k),
        )

    cs = [
        make("rows+fused", lambda wi: grouped_mm_swiglu(xs, wi, off, validate=False)),
        make("permute+fused", lambda wi: grouped_mm_swiglu(permute(x, plan), wi, off, validate=False)),
    ]
    if can_gather(x, w, "nk", cfg):
        cs.append(make("gather+fused", lambda wi: gather_swiglu(x, tok, wi, off, "nk", cfg)))
    return cs


def summary(out: list[dict]) -> str:
    us = {r["contender"]: r.get("graph_us", math.nan) for r in out}
    parts = [f"{name}={v:.1f}" for name, v in us.items()]
    p, gth = us.get("permute+fused"), us.get("gather+fused")
    if p and gth:
        parts.append(f"permute/gather {p / gth:.3f}")
    return " ".join(parts)


def main():
    run_probe(__doc__, "probe_gather_gate_up", CELLS, contenders_of, summary, with_sets=True)


if __name__ == "__main__":
    main()
