"""The grouped GEMMs' argument checks. The group offsets' values are checked on the device with no host
sync: one small Triton kernel reduces the check to one flag, and ``torch._assert_async`` turns a failed flag
into a device-side assertion (two launches in all, so that a default call stays cheap and can be captured
in a CUDA graph). The expert ids' check is a flag of the routing kernels (moegemm.grouped.routing_kernels)."""

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


def check_offsets(group_offsets: torch.Tensor, m_total: int) -> None:
    """group_offsets starts at 0, ends at m_total and never decreases. On the CPU a ValueError naming what is
    wrong; on a GPU a device-side assertion (:func:`assert_offsets`: two small launches), so that the check
    costs no host sync and a call can be captured in a CUDA graph (a failed check then stops the process at
    the next sync, as a CUDA device assertion does)."""
    if group_offsets.device.type == "cpu":
        off = group_offsets.tolist()
        if off[0] != 0 or off[-1] != m_total:
            raise ValueError(
                f"group_offsets: must start at 0 and end at M_total={m_total}, got {off[0]}..{off[-1]}"
            )
        if any(b < a for a, b in zip(off, off[1:])):
            raise ValueError("group_offsets: must be non-decreasing (offsets not monotone)")
        return
    assert_offsets(group_offsets, m_total)


def check_w(
    w, x: torch.Tensor, w_layout: str, k: int, x_name: str = "x", w_name: str = "w"
) -> tuple[int, int, int, int, int]:
    """(E, N, stride_we, stride_wk, stride_wn) for w in either layout; errors name the caller's arguments
    (``x_name``, ``w_name``)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{w_name}: expected a torch.Tensor, got {type(w).__name__}")
    if w_layout not in ("kn", "nk"):
        raise ValueError(
            f"w_layout: expected 'nk' ([E, N, K], nn.Linear's) or 'kn' ([E, K, N]), got {w_layout!r}"
        )
    if w.dim() != 3:
        raise ValueError(
            f"{w_name}: expected a 3-D [E, N, K] (w_layout='nk') or [E, K, N] ('kn') tensor, "
            f"got shape {tuple(w.shape)}"
        )
    if w.dtype != x.dtype:
        raise TypeError(f"{w_name}: dtype {w.dtype} differs from {x_name}'s {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"{w_name}: on {w.device}, but {x_name} is on {x.device}")
    if w_layout == "kn":
        e, wk, n = w.shape
        s_e, s_k, s_n = w.stride()
    else:
        e, n, wk = w.shape
        s_e, s_n, s_k = w.stride()
    if wk != k:
        raise ValueError(f"{w_name}: K={wk} (w_layout={w_layout!r}) differs from {x_name}'s K={k}")
    return e, n, s_e, s_k, s_n


def check_counts(name: str, t, shape: tuple, x: torch.Tensor, x_name: str) -> None:
    """Per-expert row counts or offsets: an int32 or int64 tensor of ``shape`` on ``x``'s device, or an error
    naming ``name``."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ValueError(
            f"{name}: expected an int tensor of shape {shape}, got {getattr(t, 'shape', type(t).__name__)}"
        )
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected int32 or int64, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name}: on {t.device}, but {x_name} is on {x.device}")


def check_masked_m_values(masked_m: torch.Tensor, m_max: int) -> None:
    """Every masked_m value lies in [0, m_max], or a ValueError naming masked_m. Reads the values to the host
    (a sync on a GPU), so it is opt-in (grouped_mm_masked's ``check_masked_m``)."""
    lo, hi = int(masked_m.min()), int(masked_m.max())
    if lo < 0 or hi > m_max:
        raise ValueError(f"masked_m: values must lie in [0, m_max={m_max}], got range [{lo}, {hi}]")
