"""The block-scaled FP8 grouped GEMM kernel, both layouts (contiguous: rows grouped by expert, found from
the group offsets; masked: [E, m_max, K] with masked_m valid rows per expert), as DeepGEMM computes it:
e4m3 operands, each 128-channel K block's product taken in fp32 on the tensor cores and then scaled by the
row's activation scale and the column's weight scale before it joins the fp32 accumulator. The tile-to-expert
map is the bf16 kernels' (moegemm.grouped.tiles), read in-kernel: no host sync, one launch."""

from __future__ import annotations

import triton
import triton.language as tl

from ..tiles import _masked_plan, _store_tile, _swiglu, _tile_coords, _tile_plan, _zero_tail
from .quant import _quantize_group


@triton.jit
def _scaled_k_loop(
    a_ptr,
    sa_ptr,
    w_ptr,
    sw_ptr,
    rows,
    cols,
    K,
    stride_am,
    stride_ak,
    stride_sam,
    stride_sak,
    stride_wn,
    stride_wk,
    stride_swn,
    stride_swk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = sum over 128-channel blocks kb of (A_q[rows, kb] @ W_q[cols, kb]^T) *
    sa[rows, kb] * sw[cols // 128, kb] (rows and cols clamped into range by the caller; channels past K
    read zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    col_blocks = (cols // BLOCK).to(tl.int64)
    for kb in range(0, tl.cdiv(K, BLOCK)):
        k = kb * BLOCK + offs
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk, mask=k_ok[:, None], other=0.0)
        part = tl.dot(a, w, out_dtype=tl.float32)
        sa = tl.load(sa_ptr + rows * stride_sam + kb * stride_sak)
        sw = tl.load(sw_ptr + col_blocks * stride_swn + kb * stride_swk)
        acc += part * sa[:, None] * sw[None, :]
    return acc


@triton.jit
def _scaled_k_loop_tma(
    a_desc,
    w_desc,
    sa_ptr,
    sw_ptr,
    a_row0,
    w_row0,
    rows,
    cols,
    K,
    stride_sam,
    stride_sak,
    stride_swn,
    stride_swk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """_scaled_k_loop with the operand tiles brought in by the tensor-memory accelerator: [BLOCK_M, 128] boxes
    of A from row a_row0 and [BLOCK_N, 128] boxes of W from row w_row0 of their 2-D descriptors (boxes past
    K read zeros; rows past the tile's own belong to the next expert, computed and not stored)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    col_blocks = (cols // BLOCK).to(tl.int64)
    for kb in range(0, tl.cdiv(K, BLOCK)):
        a = a_desc.load([a_row0, kb * BLOCK])
        w = w_desc.load([w_row0, kb * BLOCK])
        part = tl.dot(a, w.T, out_dtype=tl.float32)
        sa = tl.load(sa_ptr + rows * stride_sam + kb * stride_sak)
        sw = tl.load(sw_ptr + col_blocks * stride_swn + kb * stride_swk)
        acc += part * sa[:, None] * sw[None, :]
    return acc


@triton.jit
def _fp8_grouped_kernel(
    a_ptr,
    sa_ptr,
    w_ptr,
    sw_ptr,
    a_desc,
    w_desc,
    y_ptr,
    sy_ptr,
    counts_ptr,
    scale_ptr,
    E,
    M,
    N,
    K,
    stride_ae,
    stride_am,
    stride_ak,
    stride_sae,
    stride_sam,
    stride_sak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_swe,
    stride_swn,
    stride_swk,
    stride_ye,
    stride_ym,
    stride_yn,
    stride_sye,
    stride_sym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    MASKED: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SWIGLU: tl.constexpr,
    TMA: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    E4M3_MAX: tl.constexpr,
):
    """Y = (A_q * sa) @ (W_q * sw)^T per expert, times row_scale (HAS_SCALE), into y's dtype.
    counts_ptr: the group offsets [E + 1] (contiguous layout; M = x's rows, stride_ae = 0) or masked_m [E]
    (MASKED; M = m_max, each expert's block of rows at e * stride_ae). SWIGLU: w holds each expert's 2N rows
    (the gate's first); the tile computes gate and up from the same row tile and writes silu(gate) * up
    quantised to e4m3 with one scale per row and 128 columns into sy (BLOCK_N = 128: a tile is one scale
    block), the down projection's operand, so the [M, 2N] product and the bf16 activation are never
    written. ZERO_TAIL (MASKED): rows past masked_m get zeros (scales too with SWIGLU), by the same programs.
    TMA: the operand tiles come through a_desc ([E * m_max or M, K]) and w_desc ([E * rows of w, K]), the
    scales through pointers."""
    if MASKED:
        e_offs, lo, hi, cum, total_tiles = _masked_plan(counts_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK)
    else:
        e_offs, lo, hi, cum, total_tiles = _tile_plan(counts_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        e64 = expert.to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        rows_c = tl.minimum(rows, row_end - 1).to(tl.int64)  # the store masks them
        cols = (col0 + tl.arange(0, BLOCK_N)) % N
        a_e = a_ptr + e64 * stride_ae
        sa_e = sa_ptr + e64 * stride_sae
        w_e = w_ptr + e64 * stride_we
        sw_e = sw_ptr + e64 * stride_swe
        if TMA:
            a_row0 = row0.to(tl.int32)  # (descriptor coordinates are 32-bit)
            if MASKED:
                a_row0 += expert * M
            w_row0 = (expert * (2 * N if SWIGLU else N) + col0).to(tl.int32)
            acc = _scaled_k_loop_tma(
                a_desc, w_desc, sa_e, sw_e, a_row0, w_row0, rows_c, cols, K, stride_sam, stride_sak,
                stride_swn, stride_swk, BLOCK_M, BLOCK_N, BLOCK,
            )  # fmt: skip
        else:
            acc = _scaled_k_loop(
                a_e, sa_e, w_e, sw_e, rows_c, cols, K, stride_am, stride_ak, stride_sam, stride_sak,
                stride_wn, stride_wk, stride_swn, stride_swk, BLOCK_M, BLOCK_N, BLOCK,
            )  # fmt: skip
        y_e = y_ptr + e64 * stride_ye
        if SWIGLU:
            if TMA:
                up = _scaled_k_loop_tma(
                    a_desc, w_desc, sa_e, sw_e, a_row0, w_row0 + N, rows_c, cols + N, K, stride_sam,
                    stride_sak, stride_swn, stride_swk, BLOCK_M, BLOCK_N, BLOCK,
                )  # fmt: skip
            else:
                up = _scaled_k_loop(
                    a_e, sa_e, w_e, sw_e, rows_c, cols + N, K, stride_am, stride_ak, stride_sam, stride_sak,
                    stride_wn, stride_wk, stride_swn, stride_swk, BLOCK_M, BLOCK_N, BLOCK,
                )  # fmt: skip
            h = _swiglu(acc, up)
            col_ok = (col0 + tl.arange(0, BLOCK_N)) < N
            h = tl.where(col_ok[None, :], h, 0.0)
            q, s = _quantize_group(h, AMAX_FLOOR, E4M3_MAX)
            row_ok = rows < row_end
            offs_n = col0 + tl.arange(0, BLOCK_N)
            tl.store(
                y_e + rows_c[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                q,
                mask=row_ok[:, None] & col_ok[None, :],
            )
            tl.store(sy_ptr + e64 * stride_sye + rows_c * stride_sym + col0 // BLOCK, s, mask=row_ok)
        else:
            _store_tile(
                acc, y_e, scale_ptr, row0, row_end, col0, N, stride_ym, stride_yn, BLOCK_M, BLOCK_N,
                HAS_SCALE, "none",
            )  # fmt: skip
    if MASKED and ZERO_TAIL:
        _zero_tail(y_ptr, e_offs, hi, E, M, N, stride_ye, stride_ym, stride_yn, BLOCK_M, BLOCK_N)
        if SWIGLU:
            _zero_tail(sy_ptr, e_offs, hi, E, M, tl.cdiv(N, BLOCK), stride_sye, stride_sym, 1, BLOCK_M, BLOCK)
