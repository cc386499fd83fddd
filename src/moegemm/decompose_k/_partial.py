"""Stage 1 of Decompose-K, shared by all three kernels: one (output tile, K split) -> an fp32 partial."""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton_common import k_loop


@triton.jit
def tile_coords(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Group-major swizzle of a linear tile id -> (pid_m, pid_n), so neighbouring programs share A rows."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = tile_id // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % width) % group_size
    pid_n = (tile_id % width) // group_size
    return pid_m, pid_n


@triton.jit
def partial_tile(
    a_ptr,
    b_ptr,
    M,
    N,
    K,
    k_per_split,
    split,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    pid_m,
    pid_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """fp32 sum over k in [split*k_per_split, min((split+1)*k_per_split, K)) of A[m,k]*B[k,n]."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/columns past the edge re-read valid ones (wrapped), so A/B loads need no M/N mask;
    # the store masks them out.
    # No contiguity hints here: with M or N smaller than the block the wrapped indices are not contiguous.
    rm = offs_m % M
    rn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = k_loop(
        a_ptrs,
        b_ptrs,
        k_start,
        k_end,
        stride_ak,
        stride_bk,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        PRECISION,
        UPCAST,
    )
    return acc, offs_m, offs_n


@triton.jit
def _partial_mm_kernel(
    a_ptr,
    b_ptr,
    p_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (tiles, S): partials[split, m, n] (contiguous fp32 [S, M, N]); no atomics."""
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    acc, offs_m, offs_n = partial_tile(
        a_ptr,
        b_ptr,
        M,
        N,
        K,
        k_per_split,
        split,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        pid_m,
        pid_n,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        PRECISION,
        UPCAST,
    )
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    p_ptrs = p_ptr + split.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(p_ptrs, acc, mask=mask)
