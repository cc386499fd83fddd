"""Triton kernels of the grouped GEMMs' backward pass (contiguous layout, rows grouped by expert).

- :func:`_grouped_dw_kernel`: dW_e = A_e^T @ B_e, the weight gradient, a grouped GEMM whose reduction runs
  over each expert's own rows (varlen K). One program per (expert, output tile): it walks its expert's rows
  in order and accumulates in fp32, so the result is bitwise deterministic (no atomics, no split), and an
  expert with no rows stores exact zeros. The output is written through three strides, so either weight
  layout ([E, K, N] or [E, N, K]) takes the gradient in place. Rows of A and B may be gathered through an
  index (the permutation fused into the load), and B's rows scaled (the gating weights).
- :func:`_swiglu_bwd_kernel`: the SwiGLU backward in the epilogue of a grouped GEMM. Per tile of rows of one
  expert and of I columns: the gate and up pre-activations, recomputed (G = X W_g, U = X W_u, three
  accumulators in one K loop with the next one) or loaded from a saved [rows, 2I] buffer; the upstream
  gradient of the activation, computed (P = dY D^T, the down projection's dX) or loaded; then, in
  registers, A = silu(G) U, the row-scale gradient's per-tile partials rowdot(P, A), dA = s P, and
  dG = dA U silu'(G), dU = dA silu(G), stored as [rows, 2I] (gate first), and A where asked (for the down
  projection's weight gradient).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton_common import mma
from .tiles import _bounded_rows, _tile_coords, _tile_plan


@triton.jit
def _grouped_dw_kernel(
    a_ptr,
    a_idx_ptr,
    b_ptr,
    b_idx_ptr,
    scale_ptr,
    offsets_ptr,
    dw_ptr,
    K,
    N,
    E,
    M,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_de,
    stride_dk,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    A_IDX: tl.constexpr,
    B_IDX: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dW[e, k-tile, n-tile] = sum over rows r of expert e, in order, of A[r, k-tile]^T B[r, n-tile] * s[r].

    Program p: expert p // (k tiles * n tiles); inside an expert, bands of GROUP_K k-tiles walked n-tile by
    n-tile (so the programs running together share the expert's B rows and A rows in L2). A row r reads
    A[a_idx[r]] with A_IDX, B[b_idx[r]] with B_IDX."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_e = k_tiles * n_tiles
    e = pid // per_e
    local = pid % per_e
    band = local // (GROUP_K * n_tiles)
    in_band = local % (GROUP_K * n_tiles)
    band_rows = tl.minimum(k_tiles - band * GROUP_K, GROUP_K)
    tk = band * GROUP_K + in_band % band_rows
    tn = in_band // band_rows
    lo, hi = _bounded_rows(tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1), M)
    offs_k = tk * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    n_ok = offs_n < N
    k_c = (offs_k % K).to(tl.int64)
    n_c = (offs_n % N).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        ok = rows < hi
        rows_c = tl.minimum(rows, hi - 1)
        if A_IDX:
            ra = tl.load(a_idx_ptr + rows_c).to(tl.int64)
        else:
            ra = rows_c.to(tl.int64)
        if B_IDX:
            rb = tl.load(b_idx_ptr + rows_c).to(tl.int64)
        else:
            rb = rows_c.to(tl.int64)
        a = tl.load(a_ptr + ra[:, None] * stride_am + k_c[None, :] * stride_ak, mask=ok[:, None], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * stride_bm + n_c[None, :] * stride_bn, mask=ok[:, None], other=0.0)
        if HAS_SCALE:
            s = tl.load(scale_ptr + rows_c, mask=ok, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * s[:, None]).to(b_ptr.dtype.element_ty)
        acc = mma(tl.trans(a), b, acc, PRECISION, UPCAST)
    ptrs = (
        dw_ptr
        + e.to(tl.int64) * stride_de
        + offs_k[:, None].to(tl.int64) * stride_dk
        + offs_n[None, :].to(tl.int64) * stride_dn
    )
    tl.store(ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


@triton.jit
def _swiglu_bwd_kernel(
    x_ptr,
    x_idx_ptr,
    wgu_ptr,
    gu_ptr,
    dy_ptr,
    dy_idx_ptr,
    wd_ptr,
    scale_ptr,
    offsets_ptr,
    dgu_ptr,
    act_ptr,
    part_ptr,
    N_I,
    H,
    E,
    M,
    stride_xm,
    stride_xk,
    stride_gue,
    stride_guk,
    stride_gun,
    stride_gm,
    stride_gn,
    stride_dym,
    stride_dyk,
    stride_de,
    stride_dk,
    stride_dn,
    stride_om,
    stride_on,
    stride_am,
    stride_an,
    stride_pm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    RECOMPUTE: tl.constexpr,
    P_GEMM: tl.constexpr,
    X_IDX: tl.constexpr,
    DY_IDX: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROWDOT: tl.constexpr,
    STORE_ACT: tl.constexpr,
    IN_PLACE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One tile of [rows of an expert] x [BLOCK_N of the N_I activation columns], tiles numbered as in the
    forward kernels (from the group offsets, in-kernel: no host sync).

    RECOMPUTE: G, U = X[rows] @ Wgu_e[:, cols], Wgu_e[:, cols + I] (X's rows through x_idx with X_IDX; Wgu
    by its (expert, K, N) strides), else loaded from gu [rows, 2I]. P_GEMM: P = dY[rows] @ Dt_e[:, cols],
    Dt_e the down projection's weight read transposed through its strides (dY's rows through dy_idx with
    DY_IDX), else P = dY[rows, cols] (dY: [rows, I]). Stores dGU [rows, 2I]; with STORE_ACT A [rows, I];
    with ROWDOT the partial sum over this tile's columns of P * A at part[row, column tile]."""
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, M, N_I, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N_I, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows_c = tl.minimum(rows, row_end - 1).to(tl.int64)
        cols = col0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N_I
        n_c = cols % N_I
        e64 = expert.to(tl.int64)
        if X_IDX:
            xr = tl.load(x_idx_ptr + rows_c).to(tl.int64)
        else:
            xr = rows_c
        if DY_IDX:
            yr = tl.load(dy_idx_ptr + rows_c).to(tl.int64)
        else:
            yr = rows_c
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        p = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if RECOMPUTE or P_GEMM:  # one K loop over H for all the products of the tile
            offs_k = tl.arange(0, BLOCK_K)
            wg_e = wgu_ptr + e64 * stride_gue
            wd_e = wd_ptr + e64 * stride_de
            for k in range(0, H, BLOCK_K):
                kk = k + offs_k
                k_ok = kk < H
                if RECOMPUTE:
                    x_ptrs = x_ptr + xr[:, None] * stride_xm + kk[None, :] * stride_xk
                    wg_ptrs = wg_e + kk[:, None] * stride_guk + n_c[None, :] * stride_gun
                    if EVEN_K:
                        a = tl.load(x_ptrs)
                        wg = tl.load(wg_ptrs)
                        wu = tl.load(wg_ptrs + N_I * stride_gun)
                    else:
                        a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                        wg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
                        wu = tl.load(wg_ptrs + N_I * stride_gun, mask=k_ok[:, None], other=0.0)
                    gate = mma(a, wg, gate, PRECISION, UPCAST)
                    up = mma(a, wu, up, PRECISION, UPCAST)
                if P_GEMM:
                    dy_ptrs = dy_ptr + yr[:, None] * stride_dym + kk[None, :] * stride_dyk
                    d_ptrs = wd_e + kk[:, None] * stride_dk + n_c[None, :] * stride_dn
                    if EVEN_K:
                        g = tl.load(dy_ptrs)
                        d = tl.load(d_ptrs)
                    else:
                        g = tl.load(dy_ptrs, mask=k_ok[None, :], other=0.0)
                        d = tl.load(d_ptrs, mask=k_ok[:, None], other=0.0)
                    p = mma(g, d, p, PRECISION, UPCAST)
        if not RECOMPUTE:
            g_ptrs = gu_ptr + rows_c[:, None] * stride_gm + n_c[None, :] * stride_gn
            gate = tl.load(g_ptrs).to(tl.float32)
            up = tl.load(g_ptrs + N_I * stride_gn).to(tl.float32)
        if not P_GEMM:
            p = tl.load(dy_ptr + yr[:, None] * stride_dym + n_c[None, :] * stride_dyk).to(tl.float32)
        _dswiglu_store(
            p,
            gate,
            up,
            scale_ptr,
            dgu_ptr,
            act_ptr,
            part_ptr,
            rows_c,
            row_ok,
            cols,
            col_ok,
            col0,
            N_I,
            stride_om,
            stride_on,
            stride_am,
            stride_an,
            stride_pm,
            BLOCK_N,
            HAS_SCALE,
            ROWDOT,
            STORE_ACT,
            IN_PLACE,
        )


@triton.jit
def _dswiglu_store(
    p,
    gate,
    up,
    scale_ptr,
    dgu_ptr,
    act_ptr,
    part_ptr,
    rows_c,
    row_ok,
    cols,
    col_ok,
    col0,
    N_I,
    stride_om,
    stride_on,
    stride_am,
    stride_an,
    stride_pm,
    BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROWDOT: tl.constexpr,
    STORE_ACT: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """The SwiGLU backward of one tile, in fp32 registers, from the upstream gradient of the activation
    ``p`` (before the row scale s) and the gate/up pre-activations: A = silu(G) U; with ROWDOT the row
    scale's gradient's partial sum over this tile's columns, rowdot(P, A), at part[row, column tile];
    dA = s P, dG = dA U silu'(G), dU = dA silu(G) stored as dGU [rows, 2I] (gate first); with STORE_ACT
    s A (the down projection's input as its weight gradient sees it, s being applied to its output).
    IN_PLACE: dGU overwrites the gate/up buffer the tile was loaded from (a barrier first, so that every
    element of the tile is read before any is written)."""
    sig = tl.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    mask = row_ok[:, None] & col_ok[None, :]
    if ROWDOT:
        part = tl.sum(tl.where(mask, p * act, 0.0), axis=1)
        tl.store(part_ptr + rows_c * stride_pm + col0 // BLOCK_N, part, mask=row_ok)
    if HAS_SCALE:
        s = tl.load(scale_ptr + rows_c, mask=row_ok, other=0.0).to(tl.float32)
        p = p * s[:, None]
        act = act * s[:, None]
    d_up = p * silu
    d_gate = p * up * sig * (1.0 + gate * (1.0 - sig))
    if IN_PLACE:
        tl.debug_barrier()
    o_ptrs = dgu_ptr + rows_c[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(o_ptrs, d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptrs + N_I * stride_on, d_up.to(dgu_ptr.dtype.element_ty), mask=mask)
    if STORE_ACT:
        tl.store(
            act_ptr + rows_c[:, None] * stride_am + cols[None, :] * stride_an,
            act.to(act_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _grouped_dw_tma_kernel(
    a_desc,
    b_desc,
    a_ptr,
    b_ptr,
    offsets_ptr,
    dw_ptr,
    K,
    N,
    E,
    M,
    stride_am,
    stride_bm,
    stride_de,
    stride_dk,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """_grouped_dw_kernel with the tiles brought in by the tensor-memory accelerator (16-bit A [rows, K] and
    B [rows, N], unit stride along their columns, no gather, no scale). Each program walks its expert's
    whole BLOCK_M row steps through TMA boxes; the last, partial step (rows up to the expert's end, the
    box's other rows being the next expert's) through masked loads. Columns past K or N read zeros."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_e = k_tiles * n_tiles
    e = pid // per_e
    local = pid % per_e
    band = local // (GROUP_K * n_tiles)
    in_band = local % (GROUP_K * n_tiles)
    band_rows = tl.minimum(k_tiles - band * GROUP_K, GROUP_K)
    k0 = (band * GROUP_K + in_band % band_rows) * BLOCK_K
    n0 = (in_band // band_rows) * BLOCK_N
    lo, hi = _bounded_rows(tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1), M)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    whole = (hi - lo) // BLOCK_M
    for step in range(0, whole):
        m0 = lo + step * BLOCK_M
        a = a_desc.load([m0, k0])
        b = b_desc.load([m0, n0])
        acc = mma(a.T, b, acc, "tf32", UPCAST)  # 16-bit operands: the precision argument is unused
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    n_ok = offs_n < N
    m0 = lo + whole * BLOCK_M
    if m0 < hi:
        rows = m0 + tl.arange(0, BLOCK_M)
        ok = rows < hi
        r64 = tl.minimum(rows, hi - 1).to(tl.int64)
        a_ptrs = a_ptr + r64[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + r64[:, None] * stride_bm + offs_n[None, :]
        a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=ok[:, None] & n_ok[None, :], other=0.0)
        acc = mma(a.T, b, acc, "tf32", UPCAST)
    ptrs = (
        dw_ptr
        + e.to(tl.int64) * stride_de
        + offs_k[:, None].to(tl.int64) * stride_dk
        + offs_n[None, :].to(tl.int64) * stride_dn
    )
    tl.store(ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])
