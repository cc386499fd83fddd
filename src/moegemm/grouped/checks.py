"""Input checks on the device, with no host sync: one small Triton kernel reduces the check to one flag,
and ``torch._assert_async`` turns a failed flag into a device-side assertion (two launches in all, so that
a default call stays cheap and can be captured in a CUDA graph)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _offsets_ok_kernel(off_ptr, ok_ptr, E, M_TOTAL, BLOCK: tl.constexpr):
    """ok = off[0] == 0 and off[E] == M_TOTAL and off non-decreasing (off: E + 1 values)."""
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, E, BLOCK):
        i = start + tl.arange(0, BLOCK)
        lo = tl.load(off_ptr + i, mask=i < E, other=0)
        hi = tl.load(off_ptr + i + 1, mask=i < E, other=0)
        bad += ((i < E) & (hi < lo)).to(tl.int32)
    first = tl.load(off_ptr)
    last = tl.load(off_ptr + E)
    ok = (tl.sum(bad, axis=0) == 0) & (first == 0) & (last == M_TOTAL)
    tl.store(ok_ptr, ok.to(tl.int8))


@triton.jit
def _ids_ok_kernel(ids_ptr, ok_ptr, N, E, BLOCK: tl.constexpr):
    """ok = every one of the N ids lies in [0, E)."""
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, N, BLOCK):
        i = start + tl.arange(0, BLOCK)
        v = tl.load(ids_ptr + i, mask=i < N, other=0)
        bad += ((i < N) & ((v < 0) | (v >= E))).to(tl.int32)
    tl.store(ok_ptr, (tl.sum(bad, axis=0) == 0).to(tl.int8))


def assert_offsets(group_offsets: torch.Tensor, m_total: int) -> None:
    """Device-side assertion that group_offsets runs from 0 to m_total and never decreases."""
    ok = torch.empty(1, dtype=torch.int8, device=group_offsets.device)
    off = group_offsets.contiguous()
    _offsets_ok_kernel[(1,)](off, ok, off.numel() - 1, m_total, BLOCK=1024)
    torch._assert_async(ok.bool().squeeze(0), f"group_offsets: must run from 0 to M_total={m_total}, non-decreasing")


def assert_ids(flat_ids: torch.Tensor, num_experts: int) -> None:
    """Device-side assertion that every expert id lies in [0, num_experts)."""
    ok = torch.empty(1, dtype=torch.int8, device=flat_ids.device)
    ids = flat_ids.contiguous()
    _ids_ok_kernel[(1,)](ids, ok, ids.numel(), num_experts, BLOCK=1024)
    torch._assert_async(ok.bool().squeeze(0), f"topk_ids: expert ids must be in [0, {num_experts})")
