"""The backward of the grouped GEMMs and of the MoE layer: the weight-gradient GEMM (varlen K), the SwiGLU
backward (in a grouped GEMM's epilogue, or a pointwise pass over the forward GEMM's product), and the forward
and backward steps that the autograd functions and custom ops of :mod:`moegemm.grouped.autograd` run. See
that module for what is computed and what is kept between forward and backward."""

from __future__ import annotations

import torch
import triton

from .._runtime import INTERPRET
from .._triton_common import dot_meta
from .backward_kernels import (
    _grouped_dw_kernel,
    _grouped_dw_tma_kernel,
    _swiglu_bwd_kernel,
)
from .config import config_of
from .contiguous import grouped_mm_forward, grouped_mm_swiglu_forward
from .ffn import gate_up_act
from .pointwise import combine, silu_mul
from .tma import TensorDescriptor, tma_rows_ok

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
# The TMA weight-gradient kernel's tiles (16-bit operands; BLOCK_K x BLOCK_N output tiles, BLOCK_M rows a
# step): the config of least geometric-mean time over the tune split's cells of probes/probe_backward.py
# (DW_CONFIGS; results/nvidia-h200/probe_backward.csv).
DW_TMA_TILES = dict(BLOCK_M=32, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=4, num_stages=5)
_INTERPRET_DW = dict(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16, GROUP_K=2, num_warps=4, num_stages=1)
_INTERPRET_SWIGLU = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


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
    tiles: dict | None = None,
) -> torch.Tensor:
    """dW, shaped and laid out as ``w_like`` ([E, K, N] for "kn", [E, N, K] for "nk"), with
    dW_e[k, n] = sum over rows r of expert e of A[r, k] * B[r, n] * scale[r], r in order; rows of A read
    through ``a_idx`` (A[a_idx[r]]) and of B through ``b_idx`` where given. A, B: [*, K] and [*, N] in w's
    dtype; group_offsets: int32 [E + 1]. Deterministic; exact zeros for an expert with no rows.

    With no gather, 16-bit operands whose rows TMA can read go through the TMA kernel (s B made first where
    scaled), the operands ordered so that its output tiles' columns run along dW's unit stride; the rest
    through the pointer kernel. ``tiles``: the TMA kernel's tiles (default :data:`DW_TMA_TILES`)."""
    dw = torch.empty(w_like.shape, dtype=w_like.dtype, device=w_like.device)
    e, k, n, s_e, s_k, s_n = _w_dims(dw, w_layout)
    if e == 0 or k == 0 or n == 0:
        return dw
    if a.shape[0] == 0:  # no rows at all (a rank that received no tokens): every expert's dW is zero
        return dw.zero_()
    offsets = group_offsets.to(torch.int32).contiguous()
    if a_idx is None and b_idx is None and _dw_tma_ok(a, b, dw):
        if scale is not None:  # s B made first, rounded to B's dtype as the pointer kernel rounds it
            b = (b.float() * scale.float()[:, None]).to(b.dtype)
        _dw_tma(a, b, dw, offsets, e, k, n, s_e, s_k, s_n, tiles)
        return dw
    meta = dict(_INTERPRET_DW if INTERPRET else DW_TILES[dw.dtype])
    grid = e * triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n, meta["BLOCK_N"])
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
        _rows_of(a, a_idx, b, b_idx, scale),
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


def _rows_of(a, a_idx, b, b_idx, scale) -> int:
    """The rows the group offsets may name: as many as every array read per row holds (the kernels bound the
    offsets into them)."""
    n = min((a_idx if a_idx is not None else a).shape[0], (b_idx if b_idx is not None else b).shape[0])
    return min(n, scale.shape[0]) if scale is not None else n


def _dw_tma_ok(a, b, dw) -> bool:
    """Whether the TMA weight-gradient kernel can read A and B into dW: one 16-bit dtype, rows TMA reads."""
    return a.dtype == b.dtype == dw.dtype and tma_rows_ok(a) and tma_rows_ok(b)


def _dw_tma(a, b, dw, offsets, e, k, n, s_e, s_k, s_n, tiles=None) -> None:
    """Launch the TMA weight-gradient kernel (operands that _dw_tma_ok accepts; see grouped_dw)."""
    if s_n != 1 and s_k == 1:  # dW's unit stride runs along K: compute its transpose, dW^T = B^T A
        a, b, k, n, s_k, s_n = b, a, n, k, s_n, s_k
    meta = dict(_INTERPRET_DW if INTERPRET else tiles or DW_TMA_TILES)
    bm, bk, bn = meta["BLOCK_M"], meta["BLOCK_K"], meta["BLOCK_N"]
    a_desc = TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(b, [b.shape[0], n], [b.stride(0), 1], [bm, bn])
    grid = e * triton.cdiv(k, bk) * triton.cdiv(n, bn)
    _grouped_dw_tma_kernel[(grid,)](
        a_desc,
        b_desc,
        a,
        b,
        offsets,
        dw,
        k,
        n,
        e,
        min(a.shape[0], b.shape[0]),
        a.stride(0),
        b.stride(0),
        s_e,
        s_k,
        s_n,
        UPCAST=dot_meta(dw.dtype, False)["UPCAST"],
        **meta,
    )


def swiglu_grad(
    group_offsets: torch.Tensor,
    dys: torch.Tensor,
    gu: torch.Tensor,
    w_down: torch.Tensor,
    w_layout: str,
    *,
    scale: torch.Tensor | None,
    rowdot: bool,
    store_act: bool,
    in_place: bool,
):
    """(dGU [rows, 2I], s A [rows, I] or None, the row scale's gradient [rows] fp32 or None) of the down
    projection y = s * (silu(G) U) @ D_e over the permuted rows, from ``dys`` (the output gradient's rows in
    sorted order, [rows, H]) and the gate/up pre-activations ``gu`` [rows, 2I]. ``in_place``: dGU is
    written over ``gu`` (and returned as it).

    16-bit operands of one dtype (:func:`_separate_ok`): two launches. The down projection's dX GEMM
    P = dY D_e^T [rows, I] runs through the forward's grouped GEMM (its tuned TMA kernels, P in the
    operands' dtype), then the SwiGLU backward's pointwise kernel reads P, G and U (s A written over P,
    dGU over ``gu`` where in place). Measured against the same backward in the dX GEMM's epilogue (one
    launch, P never stored): 0.80x against 0.68x of torch._grouped_mm's speed on the plain GEMM, faster in
    every cell of the tune split, because on Triton for sm_90 a tile's long epilogue runs after its main
    loop, not beside it (docs/training.md). Otherwise (fp32, mixed dtypes) one launch of the pointer
    kernel, which computes P in its K loop and applies the backward in its epilogue."""
    _, i, h, *_ = _w_dims(w_down, w_layout)
    dgu = gu if in_place else torch.empty_like(gu)
    if dys.shape[0] and i and h and _separate_ok(dys, gu, w_down):
        p = grouped_mm_forward(dys, w_down, group_offsets, w_layout=other_layout(w_layout), validate=False)
        return swiglu_pass(
            group_offsets, p, gu, None, w_layout, scale, rowdot, store_act, dgu, p if store_act else None
        )
    return swiglu_pass(group_offsets, dys, gu, w_down, w_layout, scale, rowdot, store_act, dgu)


def swiglu_pass(group_offsets, upstream, gu, w_down, w_layout, scale, rowdot, store_act, dgu, act=None):
    """The SwiGLU backward of :func:`swiglu_grad` in one launch of the pointer kernel, G and U loaded from
    ``gu``: over ``upstream`` as P itself (``w_down`` None), or as dY with P = dY D_e^T computed in its K
    loop and the backward in its epilogue. dGU into ``dgu``, s A into ``act`` where given."""
    return swiglu_backward(
        group_offsets,
        upstream.shape[0],
        upstream,
        x=None,
        w_gate_up=None,
        w_layout=w_layout,
        gu=gu,
        w_down=w_down,
        scale=scale,
        rowdot=rowdot,
        store_act=store_act,
        out=dgu,
        act=act,
    )


def _separate_ok(dys: torch.Tensor, gu: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether :func:`swiglu_grad` runs the dX GEMM and the SwiGLU backward as two launches: dY, the gate/up
    product and the down weight of one 16-bit dtype (the forward's grouped GEMM then serves P with its tuned
    kernels, in the dtype the backward reads it in)."""
    return dys.dtype == gu.dtype == w_down.dtype and dys.dtype in (torch.bfloat16, torch.float16)


def swiglu_backward(
    group_offsets: torch.Tensor,
    rows: int,
    dy: torch.Tensor,
    *,
    x: torch.Tensor | None,
    w_gate_up: torch.Tensor | None,
    w_layout: str,
    gu: torch.Tensor | None = None,
    x_idx: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    dy_idx: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    rowdot: bool = False,
    store_act: bool = False,
    out: torch.Tensor | None = None,
    act: torch.Tensor | None = None,
):
    """(dGU [rows, 2I], s A [rows, I] or None, row-scale gradient [rows] fp32 or None) of
    y = s * silu(G) * U (per permuted row), in one launch of the pointer kernel.

    G, U: from ``gu`` [rows, 2I] where given, else recomputed as X @ W_gate_up (X's rows: x[x_idx[r]]).
    The activation's upstream gradient: ``dy`` [rows, I] itself, or with ``w_down`` dY @ D_e^T (the down
    projection y = s * A @ D_e; dY's rows: dy[dy_idx[r]]). ``rowdot``: also the gradient of s (rowdot of the
    upstream gradient and A). ``store_act``: also s A (into ``act`` where given; ``dy`` itself: written
    over it). ``out``: dGU's buffer (``gu`` itself: written in place)."""
    down = _w_dims(w_down, w_layout) if w_down is not None else None  # down: A[., I] @ D_e[I, H]
    if w_gate_up is not None:
        e, h, two_i, s_ge, s_gk, s_gn = _w_dims(w_gate_up, w_layout)
        dtype = w_gate_up.dtype
    else:  # G and U loaded: the sizes from gu and the offsets
        if gu is None:
            raise ValueError("gu: without w_gate_up the gate/up product is needed")
        e = group_offsets.numel() - 1
        h = down[2] if down is not None else 0
        two_i, s_ge, s_gk, s_gn, dtype = gu.shape[1], 0, 0, 0, gu.dtype
    i = two_i // 2
    device = dy.device
    dgu = out if out is not None else torch.empty((rows, two_i), dtype=dtype, device=device)
    if store_act and act is None:
        act = torch.empty((rows, i), dtype=dtype, device=device)
    meta = dict(_INTERPRET_SWIGLU if INTERPRET else SWIGLU_TILES[dtype])
    n_tiles = triton.cdiv(i, meta["BLOCK_N"]) if i else 0
    part = torch.empty((rows, max(n_tiles, 1)), dtype=torch.float32, device=device) if rowdot else None
    if rows == 0 or i == 0:
        return dgu, act, (part.sum(1) if rowdot else None)
    if down is not None:
        _, di, dh, s_de, s_dk, s_dn = down
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
        w_gate_up if w_gate_up is not None else dgu,
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
        rows,
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
        # (dGU over gu, or s A over the upstream gradient it is computed from: every load of a tile first)
        IN_PLACE=(gu is not None and dgu.data_ptr() == gu.data_ptr())
        or (act is not None and act.data_ptr() == dy.data_ptr()),
        **dot_meta(dtype, False),
        **meta,
    )
    return dgu, act, (part.sum(1) if rowdot else None)


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
