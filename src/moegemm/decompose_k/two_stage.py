"""The seed's two-stage Decompose-K kernel: partial GEMMs, then one program per output tile reduces the
S partials in split order, applies the epilogue and stores C once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..epilogue import apply_epilogue
from ._partial import tile_coords
from .configs import GROUP_M, DecomposeKConfig, Prepared, cdiv


@triton.jit
def _reduce_tile_kernel(
    p_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    S,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    p_ptrs = p_ptr + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, S):  # split order: deterministic
        acc += tl.load(p_ptrs, mask=mask, other=0.0)
        p_ptrs += M * N
    acc = apply_epilogue(acc, bias_ptr, offs_n[None, :], mask_n[None, :], HAS_BIAS, EPILOGUE)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def launch(p: Prepared, cfg: DecomposeKConfig) -> torch.Tensor:
    """Run stage 1 (into a fresh fp32 [S, M, N] buffer) and the per-tile reducer; returns ``p.out``."""
    partials = p.stage1(cfg)
    tiles = cdiv(p.m, cfg.block_m) * cdiv(p.n, cfg.block_n)
    _reduce_tile_kernel[(tiles,)](
        partials,
        p.out,
        p.bias_arg,
        p.m,
        p.n,
        cfg.split_k,
        p.out.stride(0),
        p.out.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        GROUP_M=GROUP_M,
        HAS_BIAS=p.bias is not None,
        EPILOGUE=int(p.epilogue),
        num_warps=cfg.num_warps,
    )
    return p.out
