"""The masked layout's grouped GEMM kernels (static [E, m_max, K] rows per expert, the valid count per
expert on the device: decode, CUDA-graph capturable), pointer and TMA."""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import _masked_plan, _store_tile, _tile_coords, _tile_mm, _tma_k_loop, _zero_tail


@triton.jit
def _grouped_mm_masked_kernel(
    a_ptr,
    w_ptr,
    y_ptr,
    masked_m_ptr,
    E,
    M_MAX,
    N,
    K,
    stride_ae,
    stride_am,
    stride_ak,
    stride_we,
    stride_wk,
    stride_wn,
    stride_ye,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EPILOGUE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
):
    """Masked layout, x: [E, m_max, K]. The tiles are those of rows below masked_m[e] only, numbered as in
    the contiguous layout (expert by expert, GROUP_M bands column by column) from masked_m read in-kernel,
    so a fixed grid -- a persistent one of a few programs per SM, or one covering E * ceil(m_max / BLOCK_M)
    row tiles -- serves any masked_m: capturable in a CUDA graph, right on replay with new values, and the
    persistent grid launches no programs for the rows past masked_m. Those rows are not read; ZERO_TAIL:
    they are written with zeros, by the same programs after their GEMM tiles (_zero_tail), else left
    unwritten."""
    e_offs, lo, hi, cum, total_tiles = _masked_plan(masked_m_ptr, E, M_MAX, N, BLOCK_M, BLOCK_N, E_BLOCK)
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        e64 = expert.to(tl.int64)
        rows_c = tl.minimum(row0 + tl.arange(0, BLOCK_M), row_end - 1).to(tl.int64)  # only rows < masked_m[e]
        n_c = (col0 + tl.arange(0, BLOCK_N)) % N
        acc = _tile_mm(
            a_ptr + e64 * stride_ae,
            w_ptr + e64 * stride_we,
            rows_c,
            n_c,
            0,
            K,
            stride_am,
            stride_ak,
            stride_wk,
            stride_wn,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            PRECISION,
            UPCAST,
        )
        _store_tile(
            acc,
            y_ptr + e64 * stride_ye,
            y_ptr,
            row0,
            row_end,
            col0,
            N,
            stride_ym,
            stride_yn,
            BLOCK_M,
            BLOCK_N,
            False,
            EPILOGUE,
        )
    if ZERO_TAIL:
        _zero_tail(y_ptr, e_offs, hi, E, M_MAX, N, stride_ye, stride_ym, stride_yn, BLOCK_M, BLOCK_N)


@triton.jit
def _grouped_mm_masked_tma_kernel(
    a_ptr,
    w_desc,
    y_ptr,
    masked_m_ptr,
    E,
    M_MAX,
    N,
    K,
    stride_ae,
    stride_am,
    stride_ye,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    W_KN: tl.constexpr,
    EPILOGUE: tl.constexpr,
    UPCAST: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
):
    """The masked layout with TMA loads (16-bit). Same tiles and order as _grouped_mm_masked_kernel; each
    tile's rows come through a descriptor made in-kernel for its expert's first masked_m[e] rows only, so
    the box reads zeros past them instead of memory: rows past masked_m are still not read (ZERO_TAIL:
    written with zeros, as there). w is the contiguous TMA kernel's 2-D descriptor."""
    e_offs, lo, hi, cum, total_tiles = _masked_plan(masked_m_ptr, E, M_MAX, N, BLOCK_M, BLOCK_N, E_BLOCK)
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        e64 = expert.to(tl.int64)
        a_desc = tl.make_tensor_descriptor(
            a_ptr + e64 * stride_ae,
            shape=[row_end, K],
            strides=[stride_am, 1],
            block_shape=[BLOCK_M, BLOCK_K],
        )
        acc = _tma_k_loop(
            a_desc, w_desc, row0, col0, expert, N, K, BLOCK_M, BLOCK_N, BLOCK_K, W_KN, False, UPCAST
        )
        _store_tile(
            acc,
            y_ptr + e64 * stride_ye,
            y_ptr,
            row0,
            row_end,
            col0,
            N,
            stride_ym,
            stride_yn,
            BLOCK_M,
            BLOCK_N,
            False,
            EPILOGUE,
        )
    if ZERO_TAIL:
        _zero_tail(y_ptr, e_offs, hi, E, M_MAX, N, stride_ye, stride_ym, stride_yn, BLOCK_M, BLOCK_N)
