"""Probe (not a pipeline step): what the one-launch routing saves moe_ffn at decode, side by side.

Why: at T=1 a layer of a small MoE model takes tens of microseconds of GPU time, and before the GEMMs its
routing took three launches: the plan (one program whose blocks were sized for 128 slots and 128 experts,
whatever the step held), then the token rows and the gating weights gathered in the plan's order. Now
``route_and_permute`` does all three in one launch up to 64 slots (routing_kernels.GATHER_SLOTS), and the
plan's blocks are sized to the slots and experts. Here, per cell (E8's inputs and seeds, uniform load, every
zoo model at the token counts whose slots fit 128), each checked against E8's float64 reference and timed
interleaved:
- ``ours:moe_ffn``: the library's layer (one launch up to 64 slots, else three);
- ``three-launch``: the same layer with route, permute and sorted_weights in turn (the plan's blocks sized
  to the step);
- ``three-launch, 128-slot plan``: the same with the plan's one program at 128 slots and 128 experts per
  step, as before (the kernel launched here with those blocks).

    python -m probes.probe_decode_routing --out results/<slug>/probe_decode_routing.csv
"""

from __future__ import annotations

import torch

from experiments.common import load_config
from experiments.harness.runner import Contender
from moegemm._triton_common import launch
from moegemm.grouped import RoutingPlan, grouped_mm, moe_ffn, permute, route, sorted_weights, unpermute
from moegemm.grouped import routing_kernels as rk
from moegemm.grouped.ffn import gate_up_act
from probes.common import run_cells


def _cells() -> list[tuple[str, int]]:
    cfg = load_config()
    models = cfg["grouped"]["models"]
    return [
        (model, t)
        for model, m in models.items()
        for t in cfg["moe_layer"]["tokens"]
        if t * m["top_k"] <= rk.CHUNK
    ]


def route_128(ids: torch.Tensor, e: int) -> RoutingPlan:
    """route's plan from the one-program kernel at 128 slots and 128 experts per step (its earlier blocks)."""
    flat = ids.reshape(-1).contiguous()
    n, k = flat.numel(), ids.shape[1]
    tok, slot, rows, sizes, offsets, ok = rk.plan_buffers(flat, e)
    launch(
        rk._small_kernel,
        (1,),
        (flat, tok, slot, rows, sizes, offsets, ok, n, e, k),
        dict(CHUNK=rk.CHUNK, EB=rk.EB, num_warps=4),
    )
    torch._assert_async(ok.squeeze(0), f"topk_ids: expert ids must be in [0, {e})")
    return RoutingPlan(
        sorted_token_ids=tok,
        sorted_slot=slot,
        slot_rows=rows,
        group_sizes=sizes,
        group_offsets=offsets,
        num_tokens=ids.shape[0],
        top_k=k,
    )


def three_launch(x, ids, wts, w_gu, w_dn, plan_of):
    """moe_ffn's steps with the routing as three launches: ``plan_of(ids, E)``, the row gather, the
    weights'."""
    plan = plan_of(ids, w_gu.shape[0])
    xs, ws = permute(x, plan), sorted_weights(wts, plan)
    act = gate_up_act(xs, w_gu, plan.group_offsets, "nk")
    ys = grouped_mm(act, w_dn, plan.group_offsets, w_layout="nk", row_scale=ws, validate=False)
    return unpermute(ys, plan, None)


def contenders(x, ids, wts, e: int) -> list[Contender]:
    return [
        Contender("ours:moe_ffn", lambda inp: lambda: moe_ffn(x, ids, wts, inp[0], inp[1])),
        Contender("three-launch", lambda inp: lambda: three_launch(x, ids, wts, inp[0], inp[1], route)),
        Contender(
            "three-launch, 128-slot plan",
            lambda inp: lambda: three_launch(x, ids, wts, inp[0], inp[1], route_128),
        ),
    ]


if __name__ == "__main__":
    run_cells(__doc__, "probe_decode_routing", _cells(), contenders)
