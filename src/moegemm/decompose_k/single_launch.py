"""Single-launch Decompose-K: each (tile, split) program stores its fp32 partial and takes a ticket from a
per-tile counter; the program that arrives last sums all S partials in split order (bitwise
deterministic), applies the epilogue, stores C and resets the counter for the next launch/graph replay."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..epilogue import apply_epilogue
from ._partial import partial_tile, tile_coords
from . import configs
from .configs import DecomposeKConfig, Prepared, cdiv


@triton.jit
def _single_launch_kernel(
    a_ptr, b_ptr, p_ptr, c_ptr, bias_ptr, counter_ptr,
    M, N, K, k_per_split, S,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
):
    tile_id = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, offs_m, offs_n = partial_tile(
        a_ptr, b_ptr, M, N, K, k_per_split, split, stride_am, stride_ak, stride_bk, stride_bn,
        pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST,
    )
    mask_n = offs_n < N
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    p_tile = p_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(p_tile + split.to(tl.int64) * M * N, acc, mask=mask)
    # Every thread's partial store is ordered before the ticket (CTA barrier, then a gpu-scope release);
    # the acquire side of the same atomic orders the last program's loads after all other releases.
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    if ticket == S - 1:
        tl.debug_barrier()
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, S):  # split order, whoever arrives last: bitwise deterministic
            # .cg: read at L2, never a stale L1 line.
            total += tl.load(p_tile, mask=mask, other=0.0, cache_modifier=".cg")
            p_tile += M * N
        total = apply_epilogue(total, bias_ptr, offs_n[None, :], mask_n[None, :], HAS_BIAS, EPILOGUE)
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr + tile_id, 0, sem="relaxed", scope="gpu")


# One zero-initialised counter buffer per (device, stream), grown on demand. The kernel leaves every
# counter it used at zero, so the buffer is reusable by the next launch on the same stream without a
# memset launch, and a CUDA graph that captured the kernel stays correct on replay. Launch once
# outside capture first (the usual warm-up) so that the buffer is not allocated inside a capture.
_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def launch(p: Prepared, cfg: DecomposeKConfig) -> torch.Tensor:
    tiles = cdiv(p.m, cfg.block_m) * cdiv(p.n, cfg.block_n)
    partials = configs.alloc_partials(cfg.split_k, p.m, p.n, p.a.device)
    counters = _counters(p.a.device, tiles)
    k_per_split = p.k_per_split(cfg)
    _single_launch_kernel[(tiles, cfg.split_k)](
        p.a, p.b, partials, p.out, p.bias_arg, counters,
        p.m, p.n, p.k, k_per_split, cfg.split_k,
        p.a.stride(0), p.a.stride(1), p.b.stride(0), p.b.stride(1), p.out.stride(0), p.out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=p.even_k(cfg), HAS_BIAS=p.bias is not None, EPILOGUE=int(p.epilogue),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **p.dot_meta,
    )
    return p.out
