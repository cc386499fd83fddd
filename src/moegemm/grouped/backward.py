"""The forward and backward steps that the autograd functions and custom ops of
:mod:`moegemm.grouped.autograd` run, for the grouped GEMMs and the MoE layer: the grouped GEMM through the
other weight layout for dX, :func:`grouped_dw` for dW, :func:`swiglu_grad` and :func:`swiglu_backward` for
the SwiGLU backward. See :mod:`moegemm.grouped.autograd` for what is computed and what is kept between
forward and backward."""

from __future__ import annotations

import torch

from .._runtime import INTERPRET  # noqa: F401
from . import contiguous
from .call import UNCHECKED
from .ffn import gate_up_act
from .pointwise import combine, silu_mul
from .swiglu_bwd import _INTERPRET_SWIGLU, SWIGLU_TILES, swiglu_backward, swiglu_grad, swiglu_pass  # noqa: F401
from .weight_grad import DW_TILES, DW_TMA_TILES, grouped_dw, other_layout  # noqa: F401
from .weight_grad import w_dims as _w_dims  # noqa: F401

# (The tiles, launchers and INTERPRET imported beside the steps are read here too, by the probes that
# measure them; swiglu_grad is looked up here at each call, so that a probe can swap it.)


# ---- grouped_mm / grouped_mm_swiglu ----


def mm_forward(call, x, w, group_offsets, row_scale):
    """grouped_mm (``call.swiglu``: grouped_mm_swiglu) recording nothing: the autograd function's forward."""
    with torch.no_grad():
        return contiguous.run(call, x, w, group_offsets, None, row_scale)


def mm_backward(call, dy, x, w, group_offsets, row_scale, needs):
    """(dx, dw, d_row_scale) of ``call``, each None where ``needs`` (three bools) says it is not wanted."""
    w_layout = call.w_layout
    need_x, need_w, need_s = needs
    need_s = need_s and row_scale is not None
    dx = dw = ds = None
    dy = dy.contiguous()
    with torch.no_grad():
        if call.swiglu:
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
                dx = contiguous.run(UNCHECKED[other_layout(w_layout), False], dgu, w, group_offsets)
            if need_w:
                dw = grouped_dw(x, dgu, group_offsets, w, w_layout)
        else:
            if need_s:  # the unscaled dX rows serve both dx and rowdot(dY, X W) = rowdot(dY W^T, X)
                p = contiguous.run(UNCHECKED[other_layout(w_layout), False], dy, w, group_offsets)
                ds = (p.float() * x.float()).sum(1)
                if need_x:
                    dx = (p.float() * row_scale.float()[:, None]).to(x.dtype)
            elif need_x:
                call = UNCHECKED[other_layout(w_layout), False]
                dx = contiguous.run(call, dy, w, group_offsets, row_scale=row_scale)
            if need_w:
                dw = grouped_dw(x, dy, group_offsets, w, w_layout, scale=row_scale)
    if ds is not None:
        ds = ds.to(row_scale.dtype)
    return dx, dw, ds


# ---- moe_ffn ----


def ffn_forward(call, x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets):
    """(y [T, H], the gate/up pre-activations [rows, 2I] where ``call.save``, else None)."""
    w_layout = call.w_layout
    with torch.no_grad():
        xs = x.index_select(0, tok)
        ws = topk_weights.reshape(-1).index_select(0, sorted_slot)
        if call.save:
            gu = contiguous.run(UNCHECKED[w_layout, False], xs, w_gate_up, offsets)
            act = silu_mul(gu)
        else:
            gu = None
            act = gate_up_act(xs, w_gate_up, offsets, w_layout)
        del xs
        ys = contiguous.run(UNCHECKED[w_layout, False], act, w_down, offsets, row_scale=ws)
        return combine(ys, slot_rows, call.top_k, None), gu


def ffn_backward(
    call, dy, x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, gu, needs
):
    """(dx, d topk_weights, d w_gate_up, d w_down), each None where ``needs`` says it is not wanted.

    The gate/up pre-activations: ``gu`` (kept by the forward; overwritten here by their gradient), else
    recomputed by the forward's grouped GEMM into a buffer of the backward's own. Then, with the rows of x
    and of dY in sorted order: the down projection's dX GEMM with the SwiGLU backward in its epilogue (dGU
    written over the gate/up buffer, s A, the gating weights' gradient), the two weight gradients, and dX
    through the gate/up weights, summed over each token's top-k rows. Each transient buffer is freed once
    its last reader has run."""
    need_x, need_tw, need_gu, need_d = needs
    w_layout = call.w_layout
    dx = dtw = dwgu = dwd = None
    dy = dy.contiguous()
    with torch.no_grad():
        ws = topk_weights.reshape(-1).index_select(0, sorted_slot)
        xs = x.index_select(0, tok) if gu is None or need_gu else None
        if gu is None:
            gu = contiguous.run(UNCHECKED[w_layout, False], xs, w_gate_up, offsets)
        if not need_gu:
            xs = None
        dys = dy.index_select(0, tok)
        dgu, sact, ds = swiglu_grad(
            offsets,
            dys,
            gu,
            w_down,
            w_layout,
            scale=ws,
            rowdot=need_tw,
            store_act=need_d,
            in_place=True,
        )
        if need_d:
            dwd = grouped_dw(sact, dys, offsets, w_down, w_layout)
        del sact, dys
        if need_gu:
            dwgu = grouped_dw(xs, dgu, offsets, w_gate_up, w_layout)
        del xs
        if need_x:
            dxs = contiguous.run(UNCHECKED[other_layout(w_layout), False], dgu, w_gate_up, offsets)
            del dgu
            dx = combine(dxs, slot_rows, call.top_k, None)
        if need_tw:
            dtw = ds.index_select(0, slot_rows).view(topk_weights.shape).to(topk_weights.dtype)
    return dx, dtw, dwgu, dwd
