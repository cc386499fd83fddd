"""TMA descriptors of the grouped kernels' operands, where the inputs allow them (16-bit, rows 16-byte
aligned, experts stacked densely), and Triton's allocator for descriptors the kernels make themselves."""

from __future__ import annotations

import torch
import triton

from .config import GroupedConfig

try:  # host-side tensor descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel serves every config
    TensorDescriptor = None

try:  # Triton's allocator for descriptors made in-kernel
    from triton.runtime._allocation import NullAllocator, _allocator
except ImportError:  # pragma: no cover - a Triton without the allocator API has no in-kernel descriptors
    NullAllocator = _allocator = None


def tma_descriptors(
    x: torch.Tensor, w: torch.Tensor, w_layout: str, e: int, n: int, k: int, cfg: GroupedConfig
):
    """(x descriptor, w descriptor, x descriptor of tail_m-row boxes) for the TMA kernel, or None where the
    inputs do not allow it: 16-bit dtypes; x and w contiguous along their last dimension with 16-byte
    aligned rows and base; w's experts stacked densely (so that it is one 2-D [E*N, K] or [E*K, N]
    matrix); for "kn", K a multiple of BLOCK_K (a K tail would read the next expert's rows). The pointer
    kernel, same tiles, serves the rest. Without tail_m the third descriptor is the first (the kernel does
    not use it)."""
    if not tma_rows_ok(x):
        return None
    b = w_descriptor(w, w_layout, e, n, k, cfg)
    if b is None:
        return None
    a = TensorDescriptor(x, [x.shape[0], k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    at = (
        TensorDescriptor(x, [x.shape[0], k], [x.stride(0), 1], [cfg.tail_m, cfg.block_k]) if cfg.tail_m else a
    )
    return a, b, at


def tma_rows_ok(x: torch.Tensor) -> bool:
    """x can be read by TMA boxes along its last dimension: 16-bit, that dimension contiguous, base and
    every other stride 16-byte aligned (x of the contiguous layout [M_total, K], or of the masked one)."""
    if TensorDescriptor is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return (
        x.stride(-1) == 1
        and x.data_ptr() % 16 == 0
        and all((s * x.element_size()) % 16 == 0 for s in x.stride()[:-1])
    )


def w_descriptor(w: torch.Tensor, w_layout: str, e: int, n: int, k: int, cfg: GroupedConfig):
    """w as one 2-D TMA descriptor, [E*N, K] ("nk") or [E*K, N] ("kn"), or None where it cannot be: not
    16-bit, last dimension not contiguous, rows or base not 16-byte aligned, experts not stacked densely,
    or "kn" with K not a multiple of BLOCK_K (a K tail would read the next expert's rows)."""
    if TensorDescriptor is None or w.dtype not in (torch.bfloat16, torch.float16):
        return None
    if w.stride(2) != 1 or w.data_ptr() % 16 or (w.stride(1) * 2) % 16:
        return None
    if e > 1 and w.stride(0) != w.shape[1] * w.stride(1):
        return None
    if w_layout == "kn" and k % cfg.block_k:
        return None
    rows_w, cols_w = (e * n, k) if w_layout == "nk" else (e * k, n)
    box = [cfg.block_n, cfg.block_k] if w_layout == "nk" else [cfg.block_k, cfg.block_n]
    return TensorDescriptor(w, [rows_w, cols_w], [w.stride(1), 1], box)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for descriptors made in-kernel (Triton calls this at launch; inside a CUDA-graph
    capture the tensor comes from the graph's pool and stays with the graph)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Triton's allocator for in-kernel descriptors, unless the caller set one. It lives in a context
    variable, which a new thread does not inherit, so this runs before every such launch."""
    if _allocator is not None and isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_scratch)
