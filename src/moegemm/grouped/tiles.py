"""The grouped kernels' shared device code: the tile-to-expert map from the group offsets (plain and
mixed orders, the masked layout's), the K loops (pointer and TMA), and the tile's epilogue and store."""

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
def _bounded_rows(lo, hi, M):
    """An expert's rows [lo, hi) from the group offsets, bounded into x's M rows: 0 <= lo <= hi <= M,
    whatever the offsets hold (the device check that they are consistent is optional, ``validate=False``),
    so that no kernel reads or writes a row outside its tensors; consistent offsets pass unchanged."""
    lo = tl.minimum(tl.maximum(lo, 0), M)
    hi = tl.minimum(tl.maximum(hi, lo), M)
    return lo, hi


@triton.jit
def _tile_plan(
    offsets_ptr,
    E,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    E_BLOCK: tl.constexpr,
    ABSORB: tl.constexpr,
):
    """Per-expert row ranges from the group offsets (bounded into x's M rows, _bounded_rows) and the
    inclusive prefix of tiles per expert."""
    e_offs = tl.arange(0, E_BLOCK)
    lo = tl.load(offsets_ptr + e_offs, mask=e_offs < E, other=0)
    hi = tl.load(offsets_ptr + e_offs + 1, mask=e_offs < E, other=0)
    lo, hi = _bounded_rows(lo, hi, M)
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
def _zero_tail(
    y_ptr,
    e_offs,
    hi,
    E,
    M_MAX,
    N,
    stride_ye,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The masked layout's rows past masked_m: zeros into y[e, hi[e]:M_MAX, :] for every expert, tiles of
    those rows numbered as the GEMM's (_plan_of_ranges over [hi, M_MAX)) and walked by the same programs
    after their GEMM tiles, so that no launch is added and every row of y holds a defined value."""
    top = tl.where(e_offs < E, M_MAX, 0).to(hi.dtype)
    z_offs, z_lo, z_hi, z_cum, z_total = _plan_of_ranges(e_offs, hi, top, N, BLOCK_M, BLOCK_N, 0)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
    for tile in range(tl.program_id(0), z_total, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, z_offs, z_lo, z_hi, z_cum, N, BLOCK_M, BLOCK_N, 1, 0
        )
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        ptrs = (
            y_ptr
            + expert.to(tl.int64) * stride_ye
            + rows.to(tl.int64)[:, None] * stride_ym
            + cols[None, :] * stride_yn
        )
        tl.store(ptrs, zeros, mask=(rows < row_end)[:, None] & (cols < N)[None, :])
