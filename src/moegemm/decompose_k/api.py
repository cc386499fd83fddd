"""``moegemm.decompose_k.matmul``: validation and dispatch to the three kernels."""

from __future__ import annotations

import torch

from .._runtime import check_device
from .._triton_common import check_dtype
from ..epilogue import Epilogue
from . import flat, single_launch, two_stage
from .configs import KERNELS, DecomposeKConfig, Prepared, choose

_LAUNCHERS = {"two_stage": two_stage.launch, "flat": flat.launch, "single_launch": single_launch.launch}


def _validate(a, b, bias, out, split_k):
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
        bias = bias.contiguous()
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: expected shape ({m}, {n}), got {tuple(out.shape)}")
        if out.dtype != a.dtype:
            raise TypeError(f"out: dtype {out.dtype} differs from a's {a.dtype}")
        if out.device != a.device:
            raise ValueError(f"out: on {out.device}, but a is on {a.device}")
    return bias


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    kernel: str = "auto",
    split_k: int | None = None,
    epilogue: str | Epilogue = "none",
    bias: torch.Tensor | None = None,
    config: DecomposeKConfig | dict | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """``epilogue(a @ b + bias)`` by Decompose-K: S partial GEMMs over K chunks into fp32, then a reduction
    that applies the epilogue where the value first becomes final.

    a: [M, K], b: [K, N], any strides; bf16, fp16 or fp32 (both the same). Output: [M, N] in the input
    dtype (fp32 accumulation). K need not be divisible by S: the last split is shorter.

    kernel: "two_stage" | "flat" | "single_launch" | "auto" (tuned table for this GPU and shape, else the
        documented heuristic in :func:`moegemm.decompose_k.configs.heuristic_config`).
    split_k: S; overrides the config's (or the tuned/heuristic) split count.
    epilogue: "none" | "relu" | "sigmoid"; bias: optional [N] tensor added before the activation.
    config: explicit tiling (wins over the tuned table). out: optional [M, N] output of any strides.
    allow_tf32: fp32 inputs use IEEE-accurate products unless this is True.
    """
    if not isinstance(kernel, str) or (kernel != "auto" and kernel not in KERNELS):
        raise ValueError(f"kernel: unknown kernel {kernel!r}; expected 'auto' or one of {KERNELS}")
    epi = Epilogue.parse(epilogue)
    bias = _validate(a, b, bias, out, split_k)
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: C = epilogue(0 + bias)
        acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        if bias is not None:
            acc = acc + bias.float()
        return out.copy_(epi.torch_apply(acc))

    chosen, cfg, _ = choose(a, n, epi, kernel)
    if config is not None:
        cfg = DecomposeKConfig.coerce(config)
    if split_k is not None and split_k != cfg.split_k:
        cfg = DecomposeKConfig(**{**cfg.as_dict(), "split_k": split_k})
    if cfg.split_k > k:
        raise ValueError(f"config.split_k: expected 1 <= split_k <= K={k}, got {cfg.split_k}")
    prepared = Prepared(a=a, b=b, out=out, bias=bias, epilogue=epi, allow_tf32=allow_tf32)
    return _LAUNCHERS[chosen](prepared, cfg)
