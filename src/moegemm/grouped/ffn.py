"""The whole expert FFN of an MoE layer behind one call: routing in, combined [T, H] out."""

from __future__ import annotations

import torch

from .._runtime import gpu_slug
from .api import autotune_key, grouped_mm, grouped_mm_swiglu
from .ops import gate_up_act_op
from .pointwise import silu_mul
from .routing import route_and_permute, triton_here, unpermute

# At most this many rows per expert on average (decode), gate/up is one grouped GEMM into [rows, 2I] and
# SiLU(gate) * up a separate op: there, on the tune split of E8 (results/nvidia-h200/runs/S16-1/moe_layer.csv),
# the fused kernel (half-width N tiles, no tail tiles) ran 1-6% slower; above it, it was faster in most cells
# but not all (results/nvidia-h200/probe_fused_tuned.csv), so there the first call of a shape times both.
FUSE_ABOVE_ROWS_PER_EXPERT = 16


def gate_up_act(xs: torch.Tensor, w_gate_up: torch.Tensor, group_offsets: torch.Tensor, w_layout: str
                ) -> torch.Tensor:
    """silu(xs G_e) * (xs U_e) for every expert's rows of the sorted tokens ``xs``: [rows, I].

    At most FUSE_ABOVE_ROWS_PER_EXPERT rows per expert: the [rows, 2I] product, then SiLU * up as a separate
    kernel. Above it, whichever of that and the fused kernel (:func:`grouped_mm_swiglu`) the first call of
    the shape (dtype, E, H, 2I, layout, rows bucket) measured faster on its own inputs, kept like a grouped
    config (:mod:`moegemm.grouped.autotune`: in memory and on disk; no timing inside a capture, a trace or
    the interpreter, where a shape not yet timed takes the fused kernel)."""
    e = w_gate_up.shape[0]
    if xs.shape[0] > FUSE_ABOVE_ROWS_PER_EXPERT * e and _fused_faster(xs, w_gate_up, group_offsets, w_layout):
        return grouped_mm_swiglu(xs, w_gate_up, group_offsets, w_layout=w_layout, validate=False)
    return _unfused(xs, w_gate_up, group_offsets, w_layout)


def _unfused(xs, w_gate_up, group_offsets, w_layout):
    gu = grouped_mm(xs, w_gate_up, group_offsets, w_layout=w_layout, validate=False)
    if not triton_here(gu):
        i = gu.shape[1] // 2
        return (torch.nn.functional.silu(gu[:, :i].float()) * gu[:, i:].float()).to(gu.dtype)
    return silu_mul(gu)


def _fused_faster(xs, w_gate_up, group_offsets, w_layout) -> bool:
    from . import autotune

    if not triton_here(xs):
        return True
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    slug = gpu_slug(xs)
    key = autotune_key(xs.shape[0], xs.shape[1], xs.dtype, w_gate_up.shape[0], two_i, w_layout + "+ffn-gate-up")
    hit = autotune.lookup(slug, key)
    if hit is not None:
        return bool(hit["fused"])
    if not autotune.can_time(xs):
        return True
    runs = {"fused": lambda: grouped_mm_swiglu(xs, w_gate_up, group_offsets, w_layout=w_layout, validate=False),
            "unfused": lambda: _unfused(xs, w_gate_up, group_offsets, w_layout)}
    best, times = autotune.fastest(lambda c: runs[c](), list(runs))
    autotune.remember(slug, key, {"fused": best == "fused"}, times)
    return best == "fused"


def moe_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor, *, w_layout: str = "nk", validate: bool = True) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t, j] * FFN_e(x[t]), e = topk_ids[t, j], FFN_e(v) = (silu(v G_e) * (v U_e)) D_e.

    x: [T, H]. topk_ids, topk_weights: [T, top_k] (the router's choice and gating weights). w_gate_up: the gate
    and up projections fused, gate first: [E, 2I, H] (w_layout="nk", the nn.Linear layout Hugging Face and
    vLLM store) or [E, H, 2I] ("kn"); w_down: [E, H, I] ("nk") or [E, I, H] ("kn"). Returns [T, H] in x's
    dtype.

    Routing and the permutation first (:func:`moegemm.grouped.route_and_permute`: one launch at decode), then
    two grouped GEMM launches: gate and up for every expert at once with SwiGLU in the epilogue
    (:func:`grouped_mm_swiglu`: the [rows, 2I] product is never written), or the product and a separate
    SiLU * up where that is faster (see :func:`gate_up_act`), then down with the gating weights fused into its
    store; the un-permute last. No host sync with the default arguments (``validate`` checks the expert ids, on a GPU on the device, see
    :func:`moegemm.grouped.route`; the group offsets come from that routing, so the GEMMs do not check them
    again), so the layer can be captured in a CUDA graph; under torch.compile it traces with no graph break
    and runs the same kernels (custom ops).
    """
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_gate_up", w_gate_up),
                    ("w_down", w_down)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, H] tensor, got shape {tuple(x.shape)}")
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"w_layout: expected 'kn' or 'nk', got {w_layout!r}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"w_gate_up, w_down: expected 3-D tensors, got shapes {tuple(w_gate_up.shape)} and "
                         f"{tuple(w_down.shape)}")
    e, h = w_gate_up.shape[0], x.shape[1]
    two_i, hk = (w_gate_up.shape[1], w_gate_up.shape[2]) if w_layout == "nk" else (w_gate_up.shape[2],
                                                                                 w_gate_up.shape[1])
    if hk != h:
        raise ValueError(f"w_gate_up: hidden size {hk} differs from x's {h} (layout {w_layout!r})")
    if two_i % 2:
        raise ValueError(f"w_gate_up: expected an even gate/up width 2I, got {two_i}")
    i = two_i // 2
    want = (e, h, i) if w_layout == "nk" else (e, i, h)
    if tuple(w_down.shape) != want:
        raise ValueError(f"w_down: expected shape {want} (E={e}, I={i}, H={h}, layout {w_layout!r}), got "
                         f"{tuple(w_down.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)} (topk_ids'), got "
                         f"{tuple(topk_weights.shape)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w_gate_up, w_down)):
        from .autograd import moe_ffn_train  # training: gradients (moegemm.grouped.autograd)

        return moe_ffn_train(x, topk_ids, topk_weights, w_gate_up, w_down, w_layout=w_layout,
                             validate=validate)
    plan, xs, ws = route_and_permute(x, topk_ids, topk_weights, e, validate=validate)
    if torch.compiler.is_compiling() and triton_here(xs):  # the same choice and kernels, as a custom op
        act = gate_up_act_op(xs, w_gate_up, plan.group_offsets, w_layout)
    else:
        act = gate_up_act(xs, w_gate_up, plan.group_offsets, w_layout)
    ys = grouped_mm(act, w_down, plan.group_offsets, w_layout=w_layout, row_scale=ws, validate=False)
    return unpermute(ys, plan, None)
