"""The contiguous layout's grouped GEMM kernels (rows grouped by expert, one launch for all experts, the
tile-to-expert map found in-kernel from the group offsets, no host sync, no padding): the pointer kernel, the
TMA kernel and the TMA kernel with SwiGLU fused in its epilogue."""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton_common import mma
from .tiles import (
    _mixed_plan,
    _mixed_tile,
    _store_tile,
    _swiglu,
    _tile_coords,
    _tile_mm,
    _tile_plan,
    _tma_k_loop,
    _tma_k_loop_merged,
    _w_tile,
)


@triton.jit
def _grouped_mm_kernel(
    a_ptr,
    w_ptr,
    y_ptr,
    offsets_ptr,
    scale_ptr,
    N,
    K,
    E,
    M,
    stride_am,
    stride_ak,
    stride_we,
    stride_wk,
    stride_wn,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EPILOGUE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """Contiguous layout, pointer loads (any strides, any dtype). Each program walks tiles pid, pid + nprog,
    ... up to the tile count it computes from the offsets (one tile when the grid covers an upper bound of
    them, a persistent loop when the grid is the SM count) and finds each tile's expert in-kernel: no host
    sync, no padding. SWIGLU: gate and up fused, w holding each expert's 2N columns (the gate's first); a
    tile of output columns computes both products from the same row tile and stores silu(gate) * up (N is
    the output's width; EPILOGUE unused), so the [M, 2N] product is never written."""
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        rows_c = tl.minimum(row0 + tl.arange(0, BLOCK_M), row_end - 1).to(tl.int64)  # the store masks them
        n_c = (col0 + tl.arange(0, BLOCK_N)) % N
        w_e = w_ptr + expert.to(tl.int64) * stride_we
        acc = _tile_mm(
            a_ptr,
            w_e,
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
        if SWIGLU:
            up = _tile_mm(
                a_ptr,
                w_e,
                rows_c,
                n_c + N,
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
            acc = _swiglu(acc, up)
        _store_tile(
            acc,
            y_ptr,
            scale_ptr,
            row0,
            row_end,
            col0,
            N,
            stride_ym,
            stride_yn,
            BLOCK_M,
            BLOCK_N,
            HAS_SCALE,
            EPILOGUE,
        )


@triton.jit
def _grouped_mm_tma_kernel(
    a_desc,
    w_desc,
    at_desc,
    y_ptr,
    offsets_ptr,
    scale_ptr,
    N,
    K,
    E,
    M,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    TAIL_M: tl.constexpr,
    W_KN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    FLATTEN: tl.constexpr,
    MERGE_TAIL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EPILOGUE: tl.constexpr,
    UPCAST: tl.constexpr,
    MIX: tl.constexpr,
):
    """The contiguous layout with the tiles brought in by the tensor-memory accelerator (16-bit operands).
    An expert's rows are contiguous in x_sorted, so its row tile is a plain 2-D box of the [M_total, K]
    descriptor (rows past the expert's end are computed and not stored; past M_total the box reads zeros).
    w is a 2-D [E*N, K] descriptor ("nk": rows past N belong to the next expert and are not stored; past
    K the box reads zeros) or [E*K, N] ("kn": only with K a multiple of BLOCK_K, checked by the caller).
    TAIL_M > 0: a tile holding at most TAIL_M of its expert's rows (the last row tile of an expert, or all
    of a small expert) is computed as a TAIL_M-row tile, transposed (see _tma_k_loop), through ``at_desc``
    (x with [TAIL_M, BLOCK_K] boxes): with about as many rows per expert as BLOCK_M, half of the experts
    end in a row tile of a few rows, which would otherwise cost a whole tile of tensor-core work.
    MERGE_TAIL (with TAIL_M): such a remainder after a whole row tile gets no tile of its own; the program of
    that row tile computes it beside, from the same weight tiles (_tma_k_loop_merged), where a tile of its
    own would stream the expert's weight columns once more for a few rows. Only experts of at most TAIL_M
    rows still take a tail tile.
    MIX > 0: the tiles of experts of at least MIX row tiles dealt out in proportion among the others'
    (_mixed_tile), not in expert order: under a skewed load the programs running together then mix
    tensor-bound and memory-bound tiles."""
    ABSORB: tl.constexpr = TAIL_M if MERGE_TAIL else 0
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK, ABSORB)
    if MIX > 0:
        cum_heavy, cum_light, heavy_total = _mixed_plan(e_offs, lo, hi, N, BLOCK_M, BLOCK_N, ABSORB, MIX)
    for tile in tl.range(
        tl.program_id(0), total_tiles, tl.num_programs(0), flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
    ):
        if MIX > 0:
            number, cum_of = _mixed_tile(tile, total_tiles, cum_heavy, cum_light, heavy_total)
        else:
            number, cum_of = tile, cum
        expert, row_start, row_end, row0, col0 = _tile_coords(
            number, e_offs, lo, hi, cum_of, N, BLOCK_M, BLOCK_N, GROUP_M, ABSORB
        )
        if TAIL_M > 0 and row_end - row0 <= TAIL_M:
            tail = _tma_k_loop(
                at_desc, w_desc, row0, col0, expert, N, K, TAIL_M, BLOCK_N, BLOCK_K, W_KN, True, UPCAST
            )  # (its own name: a variable of both branches needs one shape)
            _store_tile(
                tail,
                y_ptr,
                scale_ptr,
                row0,
                row_end,
                col0,
                N,
                stride_ym,
                stride_yn,
                TAIL_M,
                BLOCK_N,
                HAS_SCALE,
                EPILOGUE,
            )
        else:
            # the expert's last tile, holding a whole row tile and the <= TAIL_M rows after it (a tile before
            # it holds more than BLOCK_M + TAIL_M rows of the expert: see _row_tiles)
            if ABSORB > 0 and row_end - row0 > BLOCK_M and row_end - row0 <= BLOCK_M + TAIL_M:
                acc, extra = _tma_k_loop_merged(
                    a_desc,
                    at_desc,
                    w_desc,
                    row0,
                    col0,
                    expert,
                    N,
                    K,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    TAIL_M,
                    W_KN,
                    UPCAST,
                )
                _store_tile(
                    extra,
                    y_ptr,
                    scale_ptr,
                    row0 + BLOCK_M,
                    row_end,
                    col0,
                    N,
                    stride_ym,
                    stride_yn,
                    TAIL_M,
                    BLOCK_N,
                    HAS_SCALE,
                    EPILOGUE,
                )
            else:
                acc = _tma_k_loop(
                    a_desc, w_desc, row0, col0, expert, N, K, BLOCK_M, BLOCK_N, BLOCK_K, W_KN, False, UPCAST
                )
            _store_tile(
                acc,
                y_ptr,
                scale_ptr,
                row0,
                row_end,
                col0,
                N,
                stride_ym,
                stride_yn,
                BLOCK_M,
                BLOCK_N,
                HAS_SCALE,
                EPILOGUE,
            )


@triton.jit
def _grouped_mm_swiglu_tma_kernel(
    a_desc,
    w_desc,
    y_ptr,
    offsets_ptr,
    scale_ptr,
    N,
    K,
    E,
    M,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    W_KN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    FLATTEN: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    MIX: tl.constexpr,
):
    """_grouped_mm_kernel's SWIGLU with the tiles brought in by TMA (16-bit): per K step one row tile of x and
    two weight tiles, the gate's columns col0.. and the up projection's col0 + N.., into two accumulators.
    w is the 2-D descriptor of _grouped_mm_tma_kernel over each expert's 2N columns. Tile order as there
    (bands of GROUP_M row tiles; MIX > 0: the mixed order); no tail tiles."""
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    if MIX > 0:
        cum_heavy, cum_light, heavy_total = _mixed_plan(e_offs, lo, hi, N, BLOCK_M, BLOCK_N, 0, MIX)
    for tile in tl.range(
        tl.program_id(0), total_tiles, tl.num_programs(0), flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
    ):
        if MIX > 0:
            number, cum_of = _mixed_tile(tile, total_tiles, cum_heavy, cum_light, heavy_total)
        else:
            number, cum_of = tile, cum
        expert, row_start, row_end, row0, col0 = _tile_coords(
            number, e_offs, lo, hi, cum_of, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k])
            g = _w_tile(w_desc, expert, k, col0, 2 * N, K, W_KN)
            u = _w_tile(w_desc, expert, k, col0 + N, 2 * N, K, W_KN)
            gate = mma(a, g, gate, "tf32", UPCAST)  # 16-bit operands: the precision argument is unused
            up = mma(a, u, up, "tf32", UPCAST)
        _store_tile(
            _swiglu(gate, up),
            y_ptr,
            scale_ptr,
            row0,
            row_end,
            col0,
            N,
            stride_ym,
            stride_yn,
            BLOCK_M,
            BLOCK_N,
            HAS_SCALE,
            0,
        )
