"""The SwiGLU backward of the expert layers: over the permuted rows, from the output gradient and the gate/up
pre-activations (kept or recomputed), dGU, s A and the row scale's gradient, in the epilogue of a grouped
GEMM (the pointer kernel of :mod:`moegemm.grouped.backward_kernels`) or as a pointwise pass over the
forward GEMM's product."""

from __future__ import annotations

import torch
import triton

from .._runtime import INTERPRET
from .._triton_common import dot_meta
from . import contiguous
from .backward_kernels import _swiglu_bwd_kernel
from .call import UNCHECKED
from .weight_grad import other_layout, w_dims

# Tiles of the SwiGLU backward kernel on a GPU, per operand dtype (module-level so that they can be
# measured and changed); the interpreter takes 16-wide tiles.
SWIGLU_TILES = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
}
_INTERPRET_SWIGLU = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


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
    dGU over ``gu`` where in place). Against the same backward in the dX GEMM's epilogue (one launch, P
    never stored) the two launches run at 0.80x against 0.68x of torch._grouped_mm's speed on the plain
    GEMM, faster in every cell of the tune split, because on Triton for sm_90 a tile's long epilogue runs
    after its main loop, not beside it (docs/training.md). Otherwise (fp32, mixed dtypes) one launch of the
    pointer kernel, which computes P in its K loop and applies the backward in its epilogue."""
    _, i, h, *_ = w_dims(w_down, w_layout)
    dgu = gu if in_place else torch.empty_like(gu)
    if dys.shape[0] and i and h and _separate_ok(dys, gu, w_down):
        p = contiguous.run(UNCHECKED[other_layout(w_layout), False], dys, w_down, group_offsets)
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
    down = w_dims(w_down, w_layout) if w_down is not None else None  # down: A[., I] @ D_e[I, H]
    if w_gate_up is not None:
        e, h, two_i, s_ge, s_gk, s_gn = w_dims(w_gate_up, w_layout)
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
