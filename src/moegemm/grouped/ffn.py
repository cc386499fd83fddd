"""The forward of the whole expert FFN of an MoE layer (routing in, combined [T, H] out), and the choice of
its gate/up step: fused SwiGLU or the product and a separate SiLU * up on the permuted copy of x, or the
fused kernel reading x's rows by token id."""

from __future__ import annotations

import torch

from .. import autotune
from .._runtime import check_device, gpu_slug, triton_here
from .._triton_common import check_dtype
from . import contiguous
from .call import UNCHECKED
from .config import autotune_key
from .gather import can_gather, fused_config, gather_swiglu
from .pointwise import silu_mul
from .routing import gather_rows, route_and_permute, route_with_weights
from .token_order import unpermute

# At most this many rows per expert on average (decode), gate/up is one grouped GEMM into [rows, 2I] and
# SiLU(gate) * up a separate op: there, on the tune-split models' layers, the fused kernel (half-width N
# tiles, no tail tiles) is the slower; above it, it is the faster in most cells but not all, so there the
# first call of a shape times the forms (FORMS).
FUSE_ABOVE_ROWS_PER_EXPERT = 16
# gate/up's forms above FUSE_ABOVE_ROWS_PER_EXPERT: the fused SwiGLU kernel and the product with a separate
# SiLU * up, both on the permuted copy of x the routing writes, and the fused kernel reading x's rows by
# token id (moegemm.grouped.gather: no permuted copy). GATHER = False leaves the last out (the layer's
# ablation of it; its choices are kept apart from the default's).
FORMS = ("fused", "unfused", "gather")
GATHER = True


def gate_up_act(
    xs: torch.Tensor,
    w_gate_up: torch.Tensor,
    group_offsets: torch.Tensor,
    w_layout: str,
    x: torch.Tensor | None = None,
    tok: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(xs G_e) * (xs U_e) for every expert's rows of the sorted tokens ``xs``: [rows, I]; ``x`` and
    ``tok`` (the tokens [T, H] and each row's token), where given, let it take the gathering form too.

    At most FUSE_ABOVE_ROWS_PER_EXPERT rows per expert: the [rows, 2I] product, then SiLU * up as a separate
    kernel. Above it, the form the first call of the shape (dtype, E, H, 2I, layout, rows bucket) measured
    fastest on its own inputs (:func:`time_forms`, with ``x`` and ``tok``; no timing inside a capture, a
    trace or the interpreter, where a shape not yet timed takes the fused kernel)."""
    return _act(
        planned_form(xs, xs.shape[0], w_gate_up, w_layout), xs, w_gate_up, group_offsets, w_layout, x, tok
    )


def _act(form, xs, w_gate_up, group_offsets, w_layout, x, tok) -> torch.Tensor:
    """gate_up_act in the form :func:`planned_form` gave (None: none kept yet, timed here where it can)."""
    if form is None and x is not None and triton_here(xs):
        form = time_forms(x, tok, xs, w_gate_up, group_offsets, w_layout)
    if form == "gather" and x is not None:
        cfg = _gather_config(x, xs.shape[0], w_gate_up, w_layout)
        if cfg is not None:
            return gather_swiglu(x, tok, w_gate_up, group_offsets, w_layout, cfg)
    if form == "unfused":
        return _unfused(xs, w_gate_up, group_offsets, w_layout)
    return contiguous.run(UNCHECKED[w_layout, True], xs, w_gate_up, group_offsets)


def _gather_config(x, rows: int, w_gate_up, w_layout: str):
    """The fused kernel's tiles for the gathering form, or None where its kernel cannot serve these
    operands (:func:`moegemm.grouped.gather.can_gather`)."""
    cfg = fused_config(rows, x, w_gate_up, w_layout)
    return cfg if can_gather(x, w_gate_up, w_layout, cfg) else None


@torch.library.custom_op("moegemm::gate_up_act", mutates_args=())
def gate_up_act_op(
    xs: torch.Tensor,
    w_gate_up: torch.Tensor,
    group_offsets: torch.Tensor,
    w_layout: str,
    x: torch.Tensor,
    tok: torch.Tensor,
) -> torch.Tensor:
    """:func:`gate_up_act` as the custom op ``moe_ffn`` traces as under torch.compile (the same choice and
    kernels; the routing has written the permuted copy)."""
    return gate_up_act(xs, w_gate_up, group_offsets, w_layout, x, tok)


@gate_up_act_op.register_fake
def _(xs, w_gate_up, group_offsets, w_layout, x, tok):
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    return xs.new_empty((xs.shape[0], two_i // 2))


def _unfused(xs, w_gate_up, group_offsets, w_layout):
    gu = contiguous.run(UNCHECKED[w_layout, False], xs, w_gate_up, group_offsets)
    if not triton_here(gu):
        i = gu.shape[1] // 2
        return (torch.nn.functional.silu(gu[:, :i].float()) * gu[:, i:].float()).to(gu.dtype)
    return silu_mul(gu)


def _form_key(x, rows: int, w_gate_up, w_layout: str) -> tuple[str, tuple]:
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    slug = gpu_slug(x)
    form = w_layout + ("+ffn-gate-up" if GATHER else "+ffn-gate-up-nogather")  # (each its own choice)
    return slug, autotune_key(rows, x.shape[1], x.dtype, w_gate_up.shape[0], two_i, form, slug)


def _kept_form(x, rows: int, w_gate_up, w_layout: str) -> str | None:
    """The form the shape's first call chose (a choice kept before the gathering form existed names the
    fused kernel or not), or None."""
    if not triton_here(x):
        return None
    hit = autotune.lookup(*_form_key(x, rows, w_gate_up, w_layout))
    if hit is None:
        return None
    return hit.get("form") or ("fused" if hit.get("fused") else "unfused")


def planned_form(x: torch.Tensor, rows: int, w_gate_up: torch.Tensor, w_layout: str) -> str | None:
    """The form gate/up takes for ``rows`` rows of x before anything is routed: 'unfused' at decode, else
    the shape's kept choice, or None where none is kept yet (the layer then routes with the permuted copy
    and lets :func:`time_forms` choose where the call can time)."""
    if rows <= FUSE_ABOVE_ROWS_PER_EXPERT * w_gate_up.shape[0]:
        return "unfused"
    return _kept_form(x, rows, w_gate_up, w_layout)


def time_forms(x, tok, xs, w_gate_up, group_offsets, w_layout: str) -> str:
    """The first call of a shape above decode: each form timed on the call's own inputs (the two on the
    permuted copy with a gather of x's rows in their time, which the routing makes for them, in its
    placement kernel rather than in a launch of its own as here, so that their time is counted a launch
    high; the gathering form where its kernel serves these operands and GATHER is on), the fastest kept like
    a grouped config (in memory and on disk); 'fused' where the call cannot time."""
    if not autotune.can_time(x):
        return "fused"
    runs = {
        "fused": lambda: contiguous.run(
            UNCHECKED[w_layout, True], gather_rows(x, tok), w_gate_up, group_offsets
        ),
        "unfused": lambda: _unfused(gather_rows(x, tok), w_gate_up, group_offsets, w_layout),
    }
    runs["fused"]()  # the fused kernel's own first call: its tiles, timed where untuned, which gather shares
    cfg = _gather_config(x, xs.shape[0], w_gate_up, w_layout)
    if GATHER and cfg is not None:
        runs["gather"] = lambda: gather_swiglu(x, tok, w_gate_up, group_offsets, w_layout, cfg)
    best, times = autotune.fastest(lambda c: runs[c](), list(runs))
    autotune.remember(*_form_key(x, xs.shape[0], w_gate_up, w_layout), {"form": best}, times)
    return best


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
    the un-permute. Where the shape's gate/up reads x's rows itself (:func:`planned_form`), the routing
    writes no permuted copy."""
    e, w_layout = w_gate_up.shape[0], call.w_layout
    if torch.compiler.is_compiling():  # the same choice and kernels, as a custom op, on the permuted copy
        plan, xs, ws = route_and_permute(x, topk_ids, topk_weights, e, validate=call.validate)
        op = gate_up_act_op if triton_here(xs) else gate_up_act
        act = op(xs, w_gate_up, plan.group_offsets, w_layout, x, plan.sorted_token_ids)
        return _down(call, act, w_down, plan, ws)
    form = planned_form(x, topk_ids.numel(), w_gate_up, w_layout)  # (looked up once per call)
    cfg = _gather_config(x, topk_ids.numel(), w_gate_up, w_layout) if form == "gather" else None
    if cfg is not None:
        plan, ws = route_with_weights(x, topk_ids, topk_weights, e, call.validate)
        act = gather_swiglu(x, plan.sorted_token_ids, w_gate_up, plan.group_offsets, w_layout, cfg)
    else:
        plan, xs, ws = route_and_permute(x, topk_ids, topk_weights, e, validate=call.validate)
        act = _act(form, xs, w_gate_up, plan.group_offsets, w_layout, x, plan.sorted_token_ids)
    return _down(call, act, w_down, plan, ws)


def _down(call, act, w_down, plan, ws) -> torch.Tensor:
    """down with the gating weights fused into its store, then the un-permute."""
    ys = contiguous.run(UNCHECKED[call.w_layout, False], act, w_down, plan.group_offsets, row_scale=ws)
    return unpermute(ys, plan, None)
