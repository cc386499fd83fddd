"""Decompose-K's argument checks: operands, bias, output and split count, each error naming its argument."""

from __future__ import annotations

import torch

from .._runtime import check_device
from .._triton_common import check_dtype


def check_operands(a, b, bias, out, split_k) -> None:
    """The operands' checks, each error naming its argument."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
        check_dtype(name, t)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"b: dtype {b.dtype} differs from a's {a.dtype}")
    if b.device != a.device:
        raise ValueError(f"b: on {b.device}, but a is on {a.device}")
    check_device("a", a)
    m, k = a.shape
    n = b.shape[1]
    if split_k is not None:
        if isinstance(split_k, bool) or not isinstance(split_k, int):
            raise TypeError(f"split_k: expected an int, got {type(split_k).__name__}")
        if split_k < 1 or split_k > max(k, 1):
            raise ValueError(f"split_k: expected 1 <= split_k <= K={k}, got {split_k}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.dtype != a.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} differs from a's {a.dtype}")
        if bias.device != a.device:
            raise ValueError(f"bias: on {bias.device}, but a is on {a.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: expected shape ({m}, {n}), got {tuple(out.shape)}")
        if out.dtype != a.dtype:
            raise TypeError(f"out: dtype {out.dtype} differs from a's {a.dtype}")
        if out.device != a.device:
            raise ValueError(f"out: on {out.device}, but a is on {a.device}")
