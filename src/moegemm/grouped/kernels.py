"""Grouped GEMM Triton kernels: contiguous layout (rows grouped by expert, run-time tile -> expert mapping
from the group offsets, no host sync, no padding) and masked layout (static [E, m_max, K], decode)."""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton_common import k_loop, mma
from ..epilogue import apply_epilogue


@triton.jit
def _tile_mm(
    a_ptr,
    w_ptr,
    rows,
    offs_n,
    k0,
    k1,
    stride_am,
    stride_ak,
    stride_wk,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = A[rows, k0:k1] @ W[k0:k1, offs_n] (rows/offs_n already clamped into
    range)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    return k_loop(
        a_ptrs, w_ptrs, k0, k1, stride_ak, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST
    )


@triton.jit
def _row_tiles(m, BLOCK_M: tl.constexpr, ABSORB: tl.constexpr):
    """Row tiles of an expert of m rows. ABSORB > 0: a remainder of at most ABSORB rows after a whole row
    tile has no tile of its own (it rides with that tile, see _grouped_mm_tma_kernel's MERGE_TAIL)."""
    if ABSORB > 0:
        t = tl.where(m > 0, tl.maximum((m - ABSORB + BLOCK_M - 1) // BLOCK_M, 1), 0)
    else:
        t = (m + BLOCK_M - 1) // BLOCK_M
    return t


@triton.jit
def _plan_of_ranges(e_offs, lo, hi, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ABSORB: tl.constexpr):
    """(e_offs, lo, hi, inclusive prefix of tiles per expert, total tiles) for experts whose rows are
    [lo, hi): row tiles x N tiles each. Both layouts number their tiles from this."""
    m_tiles = _row_tiles(hi - lo, BLOCK_M, ABSORB)
    n_tiles = tl.cdiv(N, BLOCK_N)
    cum = tl.cumsum(m_tiles, axis=0) * n_tiles
    return e_offs, lo, hi, cum, tl.sum(m_tiles, axis=0) * n_tiles


@triton.jit
def _tile_plan(
    offsets_ptr,
    E,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    E_BLOCK: tl.constexpr,
    ABSORB: tl.constexpr,
):
    """Per-expert row ranges from the group offsets and the inclusive prefix of tiles per expert."""
    e_offs = tl.arange(0, E_BLOCK)
    lo = tl.load(offsets_ptr + e_offs, mask=e_offs < E, other=0)
    hi = tl.load(offsets_ptr + e_offs + 1, mask=e_offs < E, other=0)
    return _plan_of_ranges(e_offs, lo, hi, N, BLOCK_M, BLOCK_N, ABSORB)


@triton.jit
def _mixed_plan(
    e_offs, lo, hi, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ABSORB: tl.constexpr, MIX: tl.constexpr
):
    """(inclusive prefix of tiles per expert over the heavy experts only, the same over the light ones, the
    heavy experts' tiles in all) for the mixed tile order (_mixed_tile): an expert of at least MIX row tiles
    is heavy (its programs reuse each weight tile from L2 and are bound by the tensor cores), the others
    light (each weight tile streamed from memory for one row tile)."""
    m_tiles = _row_tiles(hi - lo, BLOCK_M, ABSORB)
    n_tiles = tl.cdiv(N, BLOCK_N)
    heavy = tl.where(m_tiles >= MIX, m_tiles, 0)
    light = m_tiles - heavy
    return (
        tl.cumsum(heavy, axis=0) * n_tiles,
        tl.cumsum(light, axis=0) * n_tiles,
        tl.sum(heavy, axis=0) * n_tiles,
    )


@triton.jit
def _mixed_tile(tile, total, cum_heavy, cum_light, heavy_total):
    """(number of tile ``tile`` in its own sequence, that sequence's prefix of tiles per expert) in the mixed
    order: the heavy experts' tiles (expert by expert) dealt out among the light experts' tiles (expert
    by expert) in proportion, tile t being heavy where floor((t + 1) H / total) > floor(t H / total), H
    heavy tiles in all. The programs running together then hold heavy and light tiles in the whole
    launch's proportion, so the tensor cores and memory are busy together, where expert order runs a hot
    expert's tiles together (tensor-bound, memory idle) and then the cold ones' (the other way round)."""
    h = heavy_total.to(tl.int64)  # (64-bit products: tiles x heavy tiles passes 2**31 at about 46k tiles)
    heavy_before = (tile * h) // total
    is_heavy = ((tile + 1) * h) // total > heavy_before
    number = tl.where(is_heavy, heavy_before, tile - heavy_before).to(tl.int32)
    return number, tl.where(is_heavy, cum_heavy, cum_light)


@triton.jit
def _tile_coords(
    tile,
    e_offs,
    lo,
    hi,
    cum,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    ABSORB: tl.constexpr,
):
    """(expert, first row, end row, first row of the tile, first column of the tile) of tile number
    ``tile``. Tiles are numbered expert by expert; inside an expert, bands of GROUP_M row tiles are walked
    column by column (row tile fastest), so the programs running together share the expert's weight
    columns in L2 (GROUP_M = 1: row by row, sharing the activation rows instead)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    expert = tl.sum((cum <= tile).to(tl.int32), axis=0)
    sel = e_offs == expert
    row_start = tl.sum(tl.where(sel, lo, 0), axis=0)
    row_end = tl.sum(tl.where(sel, hi, 0), axis=0)
    mt = _row_tiles(row_end - row_start, BLOCK_M, ABSORB)
    local = tile - (tl.sum(tl.where(sel, cum, 0), axis=0) - mt * n_tiles)
    band = local // (GROUP_M * n_tiles)
    in_band = local % (GROUP_M * n_tiles)
    band_rows = tl.minimum(mt - band * GROUP_M, GROUP_M)
    tm = band * GROUP_M + in_band % band_rows
    tn = in_band // band_rows
    return expert, row_start, row_end, row_start + tm * BLOCK_M, tn * BLOCK_N


@triton.jit
def _finish_tile(
    acc,
    scale_ptr,
    row0,
    row_end,
    col0,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """epilogue(acc) * row_scale[rows] (rows past row_end, which are not stored, are scaled by 0)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    rows_c = tl.minimum(rows, row_end - 1).to(tl.int64)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    acc = apply_epilogue(acc, scale_ptr, offs_n[None, :], offs_n[None, :] < N, False, EPILOGUE)
    if HAS_SCALE:
        s = tl.load(scale_ptr + rows_c, mask=rows < row_end, other=0.0).to(tl.float32)
        acc = acc * s[:, None]
    return acc


@triton.jit
def _store_tile(
    acc,
    y_ptr,
    scale_ptr,
    row0,
    row_end,
    col0,
    N,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """epilogue(acc) * row_scale into the rows [row0, min(row0 + BLOCK_M, row_end)) and columns < N."""
    acc = _finish_tile(acc, scale_ptr, row0, row_end, col0, N, BLOCK_M, BLOCK_N, HAS_SCALE, EPILOGUE)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_c = tl.minimum(rows, row_end - 1).to(tl.int64)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows_c[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _swiglu(gate, up):
    """silu(gate) * up in fp32."""
    return gate * tl.sigmoid(gate) * up


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
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
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
def _w_tile(w_desc, expert, k, col0, N, K, W_KN: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile of ``expert`` at (k, col0) from the 2-D TMA descriptor of w."""
    if W_KN:
        b = w_desc.load([expert * K + k, col0])
    else:
        b = w_desc.load([expert * N + col0, k]).T
    return b


@triton.jit
def _tma_k_loop_merged(
    a_desc,
    at_desc,
    w_desc,
    row0,
    col0,
    expert,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TAIL_M: tl.constexpr,
    W_KN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(fp32 [BLOCK_M, BLOCK_N] of the rows row0.., fp32 [TAIL_M, BLOCK_N] of the TAIL_M rows after them)
    over all of K, both from one weight tile per K step: the second product transposed (see _tma_k_loop)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    extra = tl.zeros((BLOCK_N, TAIL_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k])
        a2 = at_desc.load([row0 + BLOCK_M, k])
        b = _w_tile(w_desc, expert, k, col0, N, K, W_KN)
        acc = mma(a, b, acc, "tf32", UPCAST)  # 16-bit operands: the precision argument is unused
        extra = mma(b.T, a2.T, extra, "tf32", UPCAST)
    return acc, extra.T


@triton.jit
def _tma_k_loop(
    a_desc,
    w_desc,
    row0,
    col0,
    expert,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_KN: tl.constexpr,
    SWAP_AB: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = A[row0:+BLOCK_M, :] @ W_expert[:, col0:+BLOCK_N], the tiles brought in by
    TMA. SWAP_AB computes the transpose,
    W-tile^T @ A-tile^T, so that the weight columns fill the tensor cores' M side (at least 64 rows per
    warp group) and the few rows of the tile are their N side (any multiple of 8): the cheap way to compute
    a tile of only a few rows."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k])
        b = _w_tile(w_desc, expert, k, col0, N, K, W_KN)
        if SWAP_AB:
            acc = mma(b.T, a.T, acc, "tf32", UPCAST)  # 16-bit operands: the precision argument is unused
        else:
            acc = mma(a, b, acc, "tf32", UPCAST)
    if SWAP_AB:  # (one return: the compiler sees both returns of a constexpr if)
        res = acc.T
    else:
        res = acc
    return res


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
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, N, BLOCK_M, BLOCK_N, E_BLOCK, ABSORB)
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
def _masked_plan(
    masked_m_ptr, E, M_MAX, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_BLOCK: tl.constexpr
):
    """_tile_plan for the masked layout: each expert's rows are [0, masked_m[e]) of its own block, the
    counts clamped to [0, m_max]."""
    e_offs = tl.arange(0, E_BLOCK)
    hi = tl.load(masked_m_ptr + e_offs, mask=e_offs < E, other=0)
    hi = tl.minimum(tl.maximum(hi, 0), M_MAX).to(tl.int32)
    return _plan_of_ranges(e_offs, tl.zeros_like(hi), hi, N, BLOCK_M, BLOCK_N, 0)


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
):
    """Masked layout, x: [E, m_max, K]. The tiles are those of rows below masked_m[e] only, numbered as in
    the contiguous layout (expert by expert, GROUP_M bands column by column) from masked_m read in-kernel,
    so a fixed grid -- a persistent one of a few programs per SM, or one covering E * ceil(m_max / BLOCK_M)
    row tiles -- serves any masked_m: capturable in a CUDA graph, right on replay with new values, and the
    persistent grid launches no programs for the rows past masked_m. Those rows are neither read nor
    written."""
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
):
    """The masked layout with TMA loads (16-bit). Same tiles and order as _grouped_mm_masked_kernel; each
    tile's rows come through a descriptor made in-kernel for its expert's first masked_m[e] rows only, so
    the box reads zeros past them instead of memory: rows past masked_m are still neither read nor
    written. w is the contiguous TMA kernel's 2-D descriptor."""
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
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
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
