"""Gradients of :func:`grouped_mm`, :func:`grouped_mm_swiglu` and :func:`moe_ffn`.

A call whose tensors require grad (with grad mode on) runs here: eagerly through a
``torch.autograd.Function``, under ``torch.compile`` through functional custom ops (``moegemm::*_train``, each
returning its outputs) whose autograd is registered with ``torch.library.register_autograd`` and whose
backward is a custom op too, so a compiled training step traces with no graph break and runs the same
kernels. Both paths share the forward and backward implementations below. A call that needs no gradient
takes the inference path unchanged.

The backward GEMMs:

- dX = dY W_e^T, the forward's grouped GEMM through the other weight layout: an [E, N, K] weight is the
  [E, K', N'] = [E, N, K] operand of dY @ W^T (and the other way round), so no weight is copied, and the
  forward's tuned configs and TMA path serve it.
- dW_e = X_e^T dY_e (:func:`grouped_dw`), a grouped GEMM whose reduction length is each expert's own row
  count: one program per (expert, output tile), rows walked in order, fp32 accumulation. Bitwise
  deterministic (no atomics, no split), exact zeros for an expert with no rows, written in the weight's
  own layout.
- The SwiGLU backward runs in the epilogue of one grouped GEMM (:func:`swiglu_backward`,
  moegemm.grouped.backward_kernels._swiglu_bwd_kernel): for moe_ffn, a tile computes P = dY D_e^T (the down
  projection's dX, its rows gathered from the layer's output gradient through the permutation) and, in the
  same K loop, recomputes G, U = X W_g, X W_u (the tokens' rows gathered likewise), then dA = s P,
  dG, dU, A and the gating weights' gradient rowdot(P, A) as per-tile partials summed in a fixed order.

What moe_ffn keeps from the forward for the backward (beyond x, the weights and topk_weights, which the
caller holds anyway), per token, for top_k routed copies:

- ``SAVE_GATE_UP = False`` (default, recompute): the routing's three int32 arrays, ``12 * top_k`` bytes
  (plus 4 (E + 1) bytes per layer for the group offsets). The backward recomputes the gate/up product,
  2 * top_k * H * 2I flops per token, inside the kernel above.
- ``SAVE_GATE_UP = True`` (save): also the [rows, 2I] gate/up pre-activations,
  ``12 * top_k + 2 * I * top_k * b`` bytes (b: bytes per element of x's dtype, 2 for bf16/fp16, 4 for
  fp32); the forward then writes them (the unfused gate/up GEMM and SiLU * up) instead of running the
  fused SwiGLU kernel, and the backward loads them.

The backward's transient buffers (freed by the step's end): dGU [rows, 2I] and A [rows, I] in x's dtype,
dX's rows [rows, H], fp32 partials [rows, ceil(I / 64)]. The torch._grouped_mm pipeline keeps the permuted
rows, gate/up, the activation and the down output for its backward: top_k * (2H + 3I) * b bytes per token
and more.

No host sync with the default arguments: every grid is a bound known from the shapes, each tile finds its
expert from the group offsets in-kernel, and the reductions are torch ops on the device.
"""

from __future__ import annotations

import torch
import triton

from .._runtime import INTERPRET
from .._triton_common import dot_meta
from ..epilogue import Epilogue
from .api import grouped_mm, grouped_mm_swiglu
from .backward_kernels import _grouped_dw_kernel, _swiglu_bwd_kernel
from .ffn import gate_up_act
from .pointwise import combine, silu_mul
from .routing import route

# moe_ffn's choice of what the backward reads: False recomputes the gate/up product in the backward's fused
# kernel (nothing of size [rows, 2I] kept between forward and backward); True keeps it from the forward.
SAVE_GATE_UP = False

# Tiles of the backward kernels on a GPU, per kernel and operand dtype (module-level so that they can be
# measured and changed); the interpreter takes 16-wide tiles.
DW_TILES = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=8, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=8, num_stages=3),
    torch.float32: dict(BLOCK_M=32, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=8, num_stages=2),
}
SWIGLU_TILES = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
}
_INTERPRET_DW = dict(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16, GROUP_K=2, num_warps=4, num_stages=1)
_INTERPRET_SWIGLU = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


def needs_grad(*tensors) -> bool:
    """Whether a call on these operands must record a gradient (grad mode on, one of them requiring it)."""
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def other_layout(w_layout: str) -> str:
    """The layout under which a weight of ``w_layout`` is the operand of dY @ W^T."""
    return "nk" if w_layout == "kn" else "kn"


def _w_dims(w: torch.Tensor, w_layout: str) -> tuple[int, int, int, int, int, int]:
    """(E, K, N, stride over E, over K, over N) of a weight of the forward product X[., K] @ W_e[K, N]."""
    if w_layout == "kn":
        e, k, n = w.shape
        s_e, s_k, s_n = w.stride()
    else:
        e, n, k = w.shape
        s_e, s_n, s_k = w.stride()
    return e, k, n, s_e, s_k, s_n


def grouped_dw(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    w_like: torch.Tensor,
    w_layout: str,
    *,
    a_idx: torch.Tensor | None = None,
    b_idx: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """dW, shaped and laid out as ``w_like`` ([E, K, N] for "kn", [E, N, K] for "nk"), with
    dW_e[k, n] = sum over rows r of expert e of A[r, k] * B[r, n] * scale[r], r in order; rows of A read
    through ``a_idx`` (A[a_idx[r]]) and of B through ``b_idx`` where given. A, B: [*, K] and [*, N] in w's
    dtype; group_offsets: int32 [E + 1]. Deterministic; exact zeros for an expert with no rows."""
    dw = torch.empty(w_like.shape, dtype=w_like.dtype, device=w_like.device)
    e, k, n, s_e, s_k, s_n = _w_dims(dw, w_layout)
    if e == 0 or k == 0 or n == 0:
        return dw
    meta = dict(_INTERPRET_DW if INTERPRET else DW_TILES[dw.dtype])
    grid = e * triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n, meta["BLOCK_N"])
    offsets = group_offsets.to(torch.int32).contiguous()
    _grouped_dw_kernel[(grid,)](
        a,
        a_idx if a_idx is not None else offsets,
        b,
        b_idx if b_idx is not None else offsets,
        scale.contiguous() if scale is not None else offsets,
        offsets,
        dw,
        k,
        n,
        e,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        s_e,
        s_k,
        s_n,
        A_IDX=a_idx is not None,
        B_IDX=b_idx is not None,
        HAS_SCALE=scale is not None,
        **dot_meta(dw.dtype, False),
        **meta,
    )
    return dw


def swiglu_backward(
    group_offsets: torch.Tensor,
    rows: int,
    dy: torch.Tensor,
    *,
    x: torch.Tensor | None,
    w_gate_up: torch.Tensor,
    w_layout: str,
    gu: torch.Tensor | None = None,
    x_idx: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    dy_idx: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    rowdot: bool = False,
    store_act: bool = False,
):
    """(dGU [rows, 2I], A [rows, I] or None, row-scale gradient [rows] fp32 or None) of
    y = s * silu(G) * U (per permuted row), in one launch.

    G, U: from ``gu`` [rows, 2I] where given, else recomputed as X @ W_gate_up (X's rows: x[x_idx[r]]).
    The activation's upstream gradient: ``dy`` [rows, I] itself, or with ``w_down`` dY @ D_e^T (the down
    projection y = s * A @ D_e; dY's rows: dy[dy_idx[r]]). ``rowdot``: also the gradient of s (rowdot of the
    upstream gradient and A). ``store_act``: also A."""
    e, h, two_i, s_ge, s_gk, s_gn = _w_dims(w_gate_up, w_layout)
    i = two_i // 2
    dtype = w_gate_up.dtype
    dgu = torch.empty((rows, two_i), dtype=dtype, device=w_gate_up.device)
    act = torch.empty((rows, i), dtype=dtype, device=w_gate_up.device) if store_act else None
    meta = dict(_INTERPRET_SWIGLU if INTERPRET else SWIGLU_TILES[dtype])
    n_tiles = triton.cdiv(i, meta["BLOCK_N"]) if i else 0
    part = torch.empty((rows, max(n_tiles, 1)), dtype=torch.float32, device=dgu.device) if rowdot else None
    if rows == 0 or i == 0:
        return dgu, act, (part.sum(1) if rowdot else None)
    if w_down is not None:
        _, di, dh, s_de, s_dk, s_dn = _w_dims(w_down, w_layout)  # down: A[., I] @ D_e[I, H]
        d_strides = (s_de, s_dn, s_dk)  # read as D_e^T [H, I]: (expert, over H, over I)
    else:
        d_strides = (0, 0, 0)
    if gu is None and (x is None or h == 0):
        raise ValueError("x: the gate/up recompute needs the forward's input")
    offsets = group_offsets.to(torch.int32).contiguous()
    bm = meta["BLOCK_M"]
    tiles = (triton.cdiv(rows, bm) + min(e, rows)) * n_tiles
    dummy = offsets
    xt = x if x is not None else dgu
    gut = gu if gu is not None else dgu
    _swiglu_bwd_kernel[(tiles,)](
        xt,
        x_idx if x_idx is not None else dummy,
        w_gate_up,
        gut,
        dy,
        dy_idx if dy_idx is not None else dummy,
        w_down if w_down is not None else dgu,
        scale.contiguous() if scale is not None else dummy,
        offsets,
        dgu,
        act if act is not None else dgu,
        part if part is not None else dummy,
        i,
        h,
        e,
        xt.stride(0),
        xt.stride(1),
        s_ge,
        s_gk,
        s_gn,
        gut.stride(0),
        gut.stride(1),
        dy.stride(0),
        dy.stride(1),
        *d_strides,
        dgu.stride(0),
        dgu.stride(1),
        act.stride(0) if act is not None else 0,
        act.stride(1) if act is not None else 0,
        part.stride(0) if part is not None else 0,
        E_BLOCK=max(16, triton.next_power_of_2(e)),
        EVEN_K=h % meta["BLOCK_K"] == 0,
        RECOMPUTE=gu is None,
        P_GEMM=w_down is not None,
        X_IDX=x_idx is not None,
        DY_IDX=dy_idx is not None,
        HAS_SCALE=scale is not None,
        ROWDOT=rowdot,
        STORE_ACT=store_act,
        **dot_meta(dtype, False),
        **meta,
    )
    return dgu, act, (part.sum(1) if rowdot else None)


# ---- grouped_mm / grouped_mm_swiglu ----


def mm_forward(x, w, group_offsets, row_scale, w_layout, swiglu, config, allow_tf32, validate):
    from .ops import config_of

    fn = grouped_mm_swiglu if swiglu else grouped_mm
    with torch.no_grad():
        return fn(
            x,
            w,
            group_offsets,
            w_layout=w_layout,
            row_scale=row_scale,
            config=config_of(config),
            allow_tf32=allow_tf32,
            validate=validate,
        )


def mm_backward(dy, x, w, group_offsets, row_scale, w_layout, swiglu, needs):
    """(dx, dw, d_row_scale), each None where ``needs`` (three bools) says it is not wanted."""
    need_x, need_w, need_s = needs
    need_s = need_s and row_scale is not None
    dx = dw = ds = None
    dy = dy.contiguous()
    with torch.no_grad():
        if swiglu:
            dgu, _, ds = swiglu_backward(
                group_offsets,
                x.shape[0],
                dy,
                x=x,
                w_gate_up=w,
                w_layout=w_layout,
                scale=row_scale,
                rowdot=need_s,
            )
            if need_x:
                dx = grouped_mm(dgu, w, group_offsets, w_layout=other_layout(w_layout), validate=False)
            if need_w:
                dw = grouped_dw(x, dgu, group_offsets, w, w_layout)
        else:
            if need_s:  # the unscaled dX rows serve both dx and rowdot(dY, X W) = rowdot(dY W^T, X)
                p = grouped_mm(dy, w, group_offsets, w_layout=other_layout(w_layout), validate=False)
                ds = (p.float() * x.float()).sum(1)
                if need_x:
                    dx = (p.float() * row_scale.float()[:, None]).to(x.dtype)
            elif need_x:
                dx = grouped_mm(
                    dy, w, group_offsets, w_layout=other_layout(w_layout), row_scale=row_scale, validate=False
                )
            if need_w:
                dw = grouped_dw(x, dy, group_offsets, w, w_layout, scale=row_scale)
    if ds is not None:
        ds = ds.to(row_scale.dtype)
    return dx, dw, ds


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_offsets, row_scale, w_layout, swiglu, config, allow_tf32, validate):
        ctx.save_for_backward(x, w, group_offsets, row_scale)
        ctx.meta = (w_layout, swiglu)
        return mm_forward(x, w, group_offsets, row_scale, w_layout, swiglu, config, allow_tf32, validate)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets, row_scale = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dw, ds = mm_backward(dy, x, w, offsets, row_scale, *ctx.meta, (n[0], n[1], n[3]))
        return dx, dw, None, ds, None, None, None, None, None


@torch.library.custom_op("moegemm::grouped_mm_train", mutates_args=())
def grouped_mm_train_op(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    row_scale: torch.Tensor | None,
    w_layout: str,
    swiglu: bool,
    config: list[int] | None,
    allow_tf32: bool,
    validate: bool,
) -> torch.Tensor:
    return mm_forward(x, w, group_offsets, row_scale, w_layout, swiglu, config, allow_tf32, validate)


@grouped_mm_train_op.register_fake
def _(x, w, group_offsets, row_scale, w_layout, swiglu, config, allow_tf32, validate):
    n = w.shape[2] if w_layout == "kn" else w.shape[1]
    return x.new_empty((x.shape[0], n // 2 if swiglu else n))


@torch.library.custom_op("moegemm::grouped_mm_train_backward", mutates_args=())
def grouped_mm_train_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    row_scale: torch.Tensor | None,
    w_layout: str,
    swiglu: bool,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, ds = mm_backward(dy, x, w, group_offsets, row_scale, w_layout, swiglu, needs)
    empty = x.new_empty(0)
    return (
        dx if dx is not None else empty,
        dw if dw is not None else empty.clone(),
        ds if ds is not None else empty.clone(),
    )


@grouped_mm_train_backward_op.register_fake
def _(dy, x, w, group_offsets, row_scale, w_layout, swiglu, needs):
    return (
        x.new_empty(x.shape) if needs[0] else x.new_empty(0),
        w.new_empty(w.shape) if needs[1] else x.new_empty(0),
        row_scale.new_empty(row_scale.shape) if needs[2] and row_scale is not None else x.new_empty(0),
    )


def _mm_setup(ctx, inputs, output):
    x, w, group_offsets, row_scale, w_layout, swiglu, *_ = inputs
    ctx.save_for_backward(x, w, group_offsets, row_scale)
    ctx.meta = (w_layout, swiglu)


def _mm_grad(ctx, dy):
    x, w, offsets, row_scale = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [bool(n[0]), bool(n[1]), bool(n[3]) and row_scale is not None]
    dx, dw, ds = grouped_mm_train_backward_op(dy, x, w, offsets, row_scale, *ctx.meta, needs)
    return (
        dx if needs[0] else None,
        dw if needs[1] else None,
        None,
        ds if needs[2] else None,
        None,
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd("moegemm::grouped_mm_train", _mm_grad, setup_context=_mm_setup)


def grouped_mm_train(
    x_sorted,
    w,
    group_offsets,
    *,
    w_layout,
    epilogue,
    row_scale,
    config,
    out,
    allow_tf32,
    validate,
    swiglu: bool,
) -> torch.Tensor:
    """grouped_mm (``swiglu``: grouped_mm_swiglu) recording gradients for x_sorted, w and row_scale."""
    from .ops import config_list

    if Epilogue.parse(epilogue) != Epilogue.NONE:
        raise ValueError(f"epilogue: gradients are computed for epilogue='none' only, got {epilogue!r}")
    if out is not None:
        raise ValueError("out: not supported when gradients are recorded (the output is a new tensor)")
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"w_layout: expected 'kn' ([E, K, N]) or 'nk' ([E, N, K]), got {w_layout!r}")
    for name, t in (("x_sorted", x_sorted), ("w", w), ("group_offsets", group_offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if row_scale is not None and not isinstance(row_scale, torch.Tensor):
        raise TypeError(f"row_scale: expected a torch.Tensor or None, got {type(row_scale).__name__}")
    if getattr(group_offsets, "requires_grad", False):
        raise TypeError("group_offsets: an int tensor, cannot require grad")
    if torch.compiler.is_compiling():
        return grouped_mm_train_op(
            x_sorted, w, group_offsets, row_scale, w_layout, swiglu, config_list(config), allow_tf32, validate
        )
    return _GroupedMM.apply(
        x_sorted, w, group_offsets, row_scale, w_layout, swiglu, config_list(config), allow_tf32, validate
    )


# ---- moe_ffn ----


def ffn_forward(
    x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, w_layout, top_k, save
):
    """(y [T, H], the gate/up pre-activations [rows, 2I] where ``save``, else None)."""
    with torch.no_grad():
        xs = x.index_select(0, tok)
        ws = topk_weights.reshape(-1).index_select(0, sorted_slot)
        if save:
            gu = grouped_mm(xs, w_gate_up, offsets, w_layout=w_layout, validate=False)
            act = silu_mul(gu)
        else:
            gu = None
            act = gate_up_act(xs, w_gate_up, offsets, w_layout)
        del xs
        ys = grouped_mm(act, w_down, offsets, w_layout=w_layout, row_scale=ws, validate=False)
        return combine(ys, slot_rows, top_k, None), gu


def ffn_backward(
    dy, x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, gu, w_layout, top_k, needs
):
    """(dx, d topk_weights, d w_gate_up, d w_down), each None where ``needs`` says it is not wanted."""
    need_x, need_tw, need_gu, need_d = needs
    rows = tok.numel()
    dx = dtw = dwgu = dwd = None
    dy = dy.contiguous()
    with torch.no_grad():
        ws = topk_weights.reshape(-1).index_select(0, sorted_slot)
        dgu, act, ds = swiglu_backward(
            offsets,
            rows,
            dy,
            x=x,
            x_idx=tok,
            w_gate_up=w_gate_up,
            w_layout=w_layout,
            gu=gu,
            w_down=w_down,
            dy_idx=tok,
            scale=ws,
            rowdot=need_tw,
            store_act=need_d,
        )
        if need_d:
            dwd = grouped_dw(act, dy, offsets, w_down, w_layout, b_idx=tok, scale=ws)
        del act
        if need_gu:
            dwgu = grouped_dw(x, dgu, offsets, w_gate_up, w_layout, a_idx=tok)
        if need_x:
            dxs = grouped_mm(dgu, w_gate_up, offsets, w_layout=other_layout(w_layout), validate=False)
            del dgu
            dx = combine(dxs, slot_rows, top_k, None)
        if need_tw:
            dtw = ds.index_select(0, slot_rows).view(topk_weights.shape).to(topk_weights.dtype)
    return dx, dtw, dwgu, dwd


class _MoEFFN(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, w_layout, top_k, save
    ):
        y, gu = ffn_forward(
            x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, w_layout, top_k, save
        )
        ctx.save_for_backward(x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, gu)
        ctx.meta = (w_layout, top_k)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        grads = ffn_backward(dy, *saved, *ctx.meta, ctx.needs_input_grad[:4])
        return (*grads, None, None, None, None, None, None, None)


@torch.library.custom_op("moegemm::moe_ffn_train", mutates_args=())
def moe_ffn_train_op(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    tok: torch.Tensor,
    sorted_slot: torch.Tensor,
    slot_rows: torch.Tensor,
    offsets: torch.Tensor,
    w_layout: str,
    top_k: int,
    save: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, gu = ffn_forward(
        x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, w_layout, top_k, save
    )
    return y, (gu if gu is not None else x.new_empty(0))


@moe_ffn_train_op.register_fake
def _(x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, w_layout, top_k, save):
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    return x.new_empty(x.shape), (x.new_empty((tok.shape[0], two_i)) if save else x.new_empty(0))


@torch.library.custom_op("moegemm::moe_ffn_train_backward", mutates_args=())
def moe_ffn_train_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    tok: torch.Tensor,
    sorted_slot: torch.Tensor,
    slot_rows: torch.Tensor,
    offsets: torch.Tensor,
    gu: torch.Tensor | None,
    w_layout: str,
    top_k: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = ffn_backward(
        dy,
        x,
        topk_weights,
        w_gate_up,
        w_down,
        tok,
        sorted_slot,
        slot_rows,
        offsets,
        gu,
        w_layout,
        top_k,
        needs,
    )
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@moe_ffn_train_backward_op.register_fake
def _(
    dy, x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, gu, w_layout, top_k, needs
):
    like = (x, topk_weights, w_gate_up, w_down)
    return tuple(t.new_empty(t.shape) if need else x.new_empty(0) for t, need in zip(like, needs))


def _ffn_setup(ctx, inputs, output):
    x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, w_layout, top_k, save = inputs
    ctx.save_for_backward(
        x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, output[1] if save else None
    )
    ctx.meta = (w_layout, top_k)
    ctx.set_materialize_grads(False)


def _ffn_grad(ctx, dy, _dgu):
    saved = ctx.saved_tensors
    if dy is None:  # the output took no part in the loss
        return (None,) * 11
    needs = [bool(v) for v in ctx.needs_input_grad[:4]]
    grads = moe_ffn_train_backward_op(dy, *saved, *ctx.meta, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None, None)


torch.library.register_autograd("moegemm::moe_ffn_train", _ffn_grad, setup_context=_ffn_setup)


def moe_ffn_train(
    x,
    topk_ids,
    topk_weights,
    w_gate_up,
    w_down,
    *,
    w_layout: str,
    validate: bool,
    save_gate_up: bool | None = None,
) -> torch.Tensor:
    """moe_ffn recording gradients for x, topk_weights, w_gate_up and w_down (arguments checked by moe_ffn).
    ``save_gate_up``: keep the gate/up pre-activations for the backward (None: :data:`SAVE_GATE_UP`)."""
    save = SAVE_GATE_UP if save_gate_up is None else bool(save_gate_up)
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise TypeError(
            f"w_gate_up, w_down: dtypes {w_gate_up.dtype}, {w_down.dtype} differ from x's {x.dtype}"
        )
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights: expected a float tensor, got {topk_weights.dtype}")
    plan = route(topk_ids, w_gate_up.shape[0], validate=validate)
    args = (
        x,
        topk_weights,
        w_gate_up,
        w_down,
        plan.sorted_token_ids,
        plan.sorted_slot,
        plan.slot_rows,
        plan.group_offsets,
        w_layout,
        plan.top_k,
        save,
    )
    if torch.compiler.is_compiling():
        return moe_ffn_train_op(*args)[0]
    return _MoEFFN.apply(*args)
