"""Decompose-K with a flat vector reducer: stage 1 as in the two-stage kernel, then C is flattened to
x = m*N + n and each program reduces an [XBLOCK, RBLOCK] block of partials over the split axis."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..epilogue import apply_epilogue
from .configs import REDUCE_WARPS, DecomposeKConfig, Prepared, cdiv


@triton.jit
def _reduce_flat_kernel(
    p_ptr,
    c_ptr,
    bias_ptr,
    MN,
    N,
    S,
    stride_cm,
    stride_cn,
    XBLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
    C_CONTIGUOUS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    offs_x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask_x = offs_x < MN
    offs_r = tl.arange(0, RBLOCK)
    acc = tl.zeros((XBLOCK,), dtype=tl.float32)
    for r0 in range(0, S, RBLOCK):
        rows = r0 + offs_r
        ptrs = p_ptr + rows[None, :].to(tl.int64) * MN + offs_x[:, None]
        vals = tl.load(ptrs, mask=mask_x[:, None] & (rows[None, :] < S), other=0.0)
        acc += tl.sum(vals, axis=1)
    n = offs_x % N
    acc = apply_epilogue(acc, bias_ptr, n, mask_x, HAS_BIAS, EPILOGUE)
    acc = acc.to(c_ptr.dtype.element_ty)
    if C_CONTIGUOUS:
        tl.store(c_ptr + offs_x, acc, mask=mask_x)
    else:
        m = offs_x // N
        tl.store(c_ptr + m * stride_cm + n * stride_cn, acc, mask=mask_x)


def launch(p: Prepared, cfg: DecomposeKConfig) -> torch.Tensor:
    partials = p.stage1(cfg)
    mn = p.m * p.n
    contiguous = p.out.stride(1) == 1 and (p.out.stride(0) == p.n or p.m == 1)
    _reduce_flat_kernel[(cdiv(mn, cfg.xblock),)](
        partials,
        p.out,
        p.bias_arg,
        mn,
        p.n,
        cfg.split_k,
        p.out.stride(0),
        p.out.stride(1),
        XBLOCK=cfg.xblock,
        RBLOCK=cfg.rblock,
        C_CONTIGUOUS=contiguous,
        HAS_BIAS=p.bias is not None,
        EPILOGUE=int(p.epilogue),
        num_warps=REDUCE_WARPS,
    )
    return p.out
