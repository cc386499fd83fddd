"""The forward of the whole expert FFN of an MoE layer (routing in, combined [T, H] out), and the choice of
its gate/up step: fused SwiGLU or the product and a separate SiLU * up."""

from __future__ import annotations

import torch

from .. import autotune
from .._runtime import check_device, gpu_slug, triton_here
from .._triton_common import check_dtype
from . import contiguous
from .call import UNCHECKED
from .config import autotune_key
from .pointwise import silu_mul
from .routing import route_and_permute
from .token_order import unpermute

# At most this many rows per expert on average (decode), gate/up is one grouped GEMM into [rows, 2I] and
# SiLU(gate) * up a separate op: there, on the tune-split models' layers, the fused kernel (half-width N
# tiles, no tail tiles) is the slower; above it, it is the faster in most cells but not all, so there the
# first call of a shape times both.
FUSE_ABOVE_ROWS_PER_EXPERT = 16


def gate_up_act(
    xs: torch.Tensor, w_gate_up: torch.Tensor, group_offsets: torch.Tensor, w_layout: str
) -> torch.Tensor:
    """silu(xs G_e) * (xs U_e) for every expert's rows of the sorted tokens ``xs``: [rows, I].

    At most FUSE_ABOVE_ROWS_PER_EXPERT rows per expert: the [rows, 2I] product, then SiLU * up as a separate
    kernel. Above it, whichever of that and the fused kernel (:func:`grouped_mm_swiglu`) the first call of
    the shape (dtype, E, H, 2I, layout, rows bucket) measured faster on its own inputs, kept like a grouped
    config (:mod:`moegemm.autotune`: in memory and on disk; no timing inside a capture, a trace or
    the interpreter, where a shape not yet timed takes the fused kernel)."""
    e = w_gate_up.shape[0]
    if xs.shape[0] > FUSE_ABOVE_ROWS_PER_EXPERT * e and _fused_faster(xs, w_gate_up, group_offsets, w_layout):
        return contiguous.run(UNCHECKED[w_layout, True], xs, w_gate_up, group_offsets)
    return _unfused(xs, w_gate_up, group_offsets, w_layout)


@torch.library.custom_op("moegemm::gate_up_act", mutates_args=())
def gate_up_act_op(
    xs: torch.Tensor, w_gate_up: torch.Tensor, group_offsets: torch.Tensor, w_layout: str
) -> torch.Tensor:
    """:func:`gate_up_act` as the custom op ``moe_ffn`` traces as under torch.compile (the same choice and
    kernels)."""
    return gate_up_act(xs, w_gate_up, group_offsets, w_layout)


@gate_up_act_op.register_fake
def _(xs, w_gate_up, group_offsets, w_layout):
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    return xs.new_empty((xs.shape[0], two_i // 2))


def _unfused(xs, w_gate_up, group_offsets, w_layout):
    gu = contiguous.run(UNCHECKED[w_layout, False], xs, w_gate_up, group_offsets)
    if not triton_here(gu):
        i = gu.shape[1] // 2
        return (torch.nn.functional.silu(gu[:, :i].float()) * gu[:, i:].float()).to(gu.dtype)
    return silu_mul(gu)


def _fused_faster(xs, w_gate_up, group_offsets, w_layout) -> bool:
    if not triton_here(xs):
        return True
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    slug = gpu_slug(xs)
    key = autotune_key(
        xs.shape[0], xs.shape[1], xs.dtype, w_gate_up.shape[0], two_i, w_layout + "+ffn-gate-up", slug
    )
    hit = autotune.lookup(slug, key)
    if hit is not None:
        return bool(hit["fused"])
    if not autotune.can_time(xs):
        return True
    runs = {
        "fused": lambda: contiguous.run(UNCHECKED[w_layout, True], xs, w_gate_up, group_offsets),
        "unfused": lambda: _unfused(xs, w_gate_up, group_offsets, w_layout),
    }
    best, times = autotune.fastest(lambda c: runs[c](), list(runs))
    autotune.remember(slug, key, {"fused": best == "fused"}, times)
    return best == "fused"


def check_moe_ffn(x, topk_ids, topk_weights, w_gate_up, w_down, w_layout: str) -> int:
    """The argument checks of :func:`moegemm.grouped.moe_ffn`, each error naming its argument; returns the
    number of experts E."""
    for name, t in (
        ("x", x),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
        ("w_gate_up", w_gate_up),
        ("w_down", w_down),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, H] tensor, got shape {tuple(x.shape)}")
    check_dtype("x", x)
    check_device("x", x)
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"w_layout: expected 'nk' or 'kn', got {w_layout!r}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from x's {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"w_gate_up, w_down: expected 3-D tensors, got shapes {tuple(w_gate_up.shape)} and "
            f"{tuple(w_down.shape)}"
        )
    e, h = w_gate_up.shape[0], x.shape[1]
    two_i, hk = (
        (w_gate_up.shape[1], w_gate_up.shape[2])
        if w_layout == "nk"
        else (w_gate_up.shape[2], w_gate_up.shape[1])
    )
    if hk != h:
        raise ValueError(f"w_gate_up: hidden size {hk} differs from x's {h} (layout {w_layout!r})")
    if two_i % 2:
        raise ValueError(f"w_gate_up: expected an even gate/up width 2I, got {two_i}")
    i = two_i // 2
    want = (e, h, i) if w_layout == "nk" else (e, i, h)
    if tuple(w_down.shape) != want:
        raise ValueError(
            f"w_down: expected shape {want} (E={e}, I={i}, H={h}, layout {w_layout!r}), got "
            f"{tuple(w_down.shape)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights: expected shape {tuple(topk_ids.shape)} (topk_ids'), got "
            f"{tuple(topk_weights.shape)}"
        )
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected a 2-D [T, top_k] tensor, got shape {tuple(topk_ids.shape)}")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids: routes {topk_ids.shape[0]} tokens, but x has {x.shape[0]} rows")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights: expected a floating-point tensor, got {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
    return e


def moe_ffn_forward(call, x, topk_ids, topk_weights, w_gate_up, w_down) -> torch.Tensor:
    """:func:`moegemm.grouped.moe_ffn` recording no gradient (arguments checked by :func:`check_moe_ffn`):
    routing and the permutation, gate/up with SwiGLU, down with the gating weights fused into its store,
    the un-permute."""
    e, w_layout = w_gate_up.shape[0], call.w_layout
    plan, xs, ws = route_and_permute(x, topk_ids, topk_weights, e, validate=call.validate)
    if torch.compiler.is_compiling() and triton_here(xs):  # the same choice and kernels, as a custom op
        act = gate_up_act_op(xs, w_gate_up, plan.group_offsets, w_layout)
    else:
        act = gate_up_act(xs, w_gate_up, plan.group_offsets, w_layout)
    ys = contiguous.run(UNCHECKED[w_layout, False], act, w_down, plan.group_offsets, row_scale=ws)
    return unpermute(ys, plan, None)
