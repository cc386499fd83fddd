"""The forward and backward steps that the autograd functions and custom ops of
:mod:`moegemm.grouped.autograd` run, for the grouped GEMMs and the MoE layer: the grouped GEMM through the
other weight layout for dX, :func:`grouped_dw` for dW, :func:`swiglu_grad` and :func:`swiglu_backward` for
the SwiGLU backward. See :mod:`moegemm.grouped.autograd` for what is computed and what is kept between
forward and backward."""

from __future__ import annotations

import torch

from .._runtime import INTERPRET  # noqa: F401
from .config import config_of
from .contiguous import grouped_mm_forward, grouped_mm_swiglu_forward
from .ffn import gate_up_act
from .pointwise import combine, silu_mul
from .swiglu_bwd import _INTERPRET_SWIGLU, SWIGLU_TILES, swiglu_backward, swiglu_grad, swiglu_pass  # noqa: F401
from .weight_grad import DW_TILES, DW_TMA_TILES, grouped_dw, other_layout  # noqa: F401
from .weight_grad import w_dims as _w_dims  # noqa: F401

# (The tiles, launchers and INTERPRET imported beside the steps are read here too, by the probes that
# measure them; swiglu_grad is looked up here at each call, so that a probe can swap it.)


# ---- grouped_mm / grouped_mm_swiglu ----


def mm_forward(x, w, group_offsets, row_scale, w_layout, swiglu, config, allow_tf32, validate):
    fn = grouped_mm_swiglu_forward if swiglu else grouped_mm_forward
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
                dx = grouped_mm_forward(
                    dgu, w, group_offsets, w_layout=other_layout(w_layout), validate=False
                )
            if need_w:
                dw = grouped_dw(x, dgu, group_offsets, w, w_layout)
        else:
            if need_s:  # the unscaled dX rows serve both dx and rowdot(dY, X W) = rowdot(dY W^T, X)
                p = grouped_mm_forward(dy, w, group_offsets, w_layout=other_layout(w_layout), validate=False)
                ds = (p.float() * x.float()).sum(1)
                if need_x:
                    dx = (p.float() * row_scale.float()[:, None]).to(x.dtype)
            elif need_x:
                dx = grouped_mm_forward(
                    dy, w, group_offsets, w_layout=other_layout(w_layout), row_scale=row_scale, validate=False
                )
            if need_w:
                dw = grouped_dw(x, dy, group_offsets, w, w_layout, scale=row_scale)
    if ds is not None:
        ds = ds.to(row_scale.dtype)
    return dx, dw, ds


# ---- moe_ffn ----


def ffn_forward(
    x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, w_layout, top_k, save
):
    """(y [T, H], the gate/up pre-activations [rows, 2I] where ``save``, else None)."""
    with torch.no_grad():
        xs = x.index_select(0, tok)
        ws = topk_weights.reshape(-1).index_select(0, sorted_slot)
        if save:
            gu = grouped_mm_forward(xs, w_gate_up, offsets, w_layout=w_layout, validate=False)
            act = silu_mul(gu)
        else:
            gu = None
            act = gate_up_act(xs, w_gate_up, offsets, w_layout)
        del xs
        ys = grouped_mm_forward(act, w_down, offsets, w_layout=w_layout, row_scale=ws, validate=False)
        return combine(ys, slot_rows, top_k, None), gu


def ffn_backward(
    dy, x, topk_weights, w_gate_up, w_down, tok, sorted_slot, slot_rows, offsets, gu, w_layout, top_k, needs
):
    """(dx, d topk_weights, d w_gate_up, d w_down), each None where ``needs`` says it is not wanted.

    The gate/up pre-activations: ``gu`` (kept by the forward; overwritten here by their gradient), else
    recomputed by the forward's grouped GEMM into a buffer of the backward's own. Then, with the rows of x
    and of dY in sorted order: the down projection's dX GEMM with the SwiGLU backward in its epilogue (dGU
    written over the gate/up buffer, s A, the gating weights' gradient), the two weight gradients, and dX
    through the gate/up weights, summed over each token's top-k rows. Each transient buffer is freed once
    its last reader has run."""
    need_x, need_tw, need_gu, need_d = needs
    dx = dtw = dwgu = dwd = None
    dy = dy.contiguous()
    with torch.no_grad():
        ws = topk_weights.reshape(-1).index_select(0, sorted_slot)
        xs = x.index_select(0, tok) if gu is None or need_gu else None
        if gu is None:
            gu = grouped_mm_forward(xs, w_gate_up, offsets, w_layout=w_layout, validate=False)
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
            dxs = grouped_mm_forward(dgu, w_gate_up, offsets, w_layout=other_layout(w_layout), validate=False)
            del dgu
            dx = combine(dxs, slot_rows, top_k, None)
        if need_tw:
            dtw = ds.index_select(0, slot_rows).view(topk_weights.shape).to(topk_weights.dtype)
    return dx, dtw, dwgu, dwd
