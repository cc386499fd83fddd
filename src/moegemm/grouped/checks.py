"""The group offsets' check on the device, with no host sync: one small Triton kernel reduces the check to one
flag, and ``torch._assert_async`` turns a failed flag into a device-side assertion (two launches in all, so
that a default call stays cheap and can be captured in a CUDA graph). The expert ids' check is a flag of the
routing kernels (moegemm.grouped.routing_kernels)."""

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
    tl.store(ok_ptr, ok)


def assert_offsets(group_offsets: torch.Tensor, m_total: int) -> None:
    """Device-side assertion that group_offsets runs from 0 to m_total and never decreases."""
    ok = torch.empty(1, dtype=torch.bool, device=group_offsets.device)
    off = group_offsets.contiguous()
    _offsets_ok_kernel[(1,)](off, ok, off.numel() - 1, m_total, BLOCK=1024)
    torch._assert_async(ok.squeeze(0), f"group_offsets: must run from 0 to M_total={m_total}, non-decreasing")

