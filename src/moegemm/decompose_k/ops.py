"""``moegemm::dk_matmul``: Decompose-K as a torch custom op, so that ``torch.compile(fullgraph=True)`` traces
a function that calls :func:`moegemm.decompose_k.matmul` with no graph break.

The op's real implementation is the eager :func:`matmul` (its cached plans included); its fake
implementation gives the compiler the output's shape, dtype and (contiguous) strides. Eager calls do not
pass through the op: :func:`matmul` goes straight to its plan, which costs less CPU time per call than the
dispatcher would.
"""

from __future__ import annotations

import dataclasses

import torch

from ..epilogue import Epilogue
from .configs import DecomposeKConfig


@torch.library.custom_op("moegemm::dk_matmul", mutates_args=())
def dk_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, kernel: str, split_k: int | None,
              epilogue: str, config: list[int] | None, allow_tf32: bool) -> torch.Tensor:
    from .api import matmul

    cfg = DecomposeKConfig(*config) if config else None
    return matmul(a, b, kernel=kernel, split_k=split_k, epilogue=epilogue, bias=bias, config=cfg,
                  allow_tf32=allow_tf32)


@dk_matmul.register_fake
def _(a, b, bias, kernel, split_k, epilogue, config, allow_tf32):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "a, b: expected 2-D tensors")
    torch._check(a.shape[1] == b.shape[0], lambda: "b: inner dimensions differ")
    return a.new_empty((a.shape[0], b.shape[1]))


# Read here, not while tracing (Dynamo does not trace dataclasses.fields on a class).
_FIELDS = tuple(f.name for f in dataclasses.fields(DecomposeKConfig))
_DEFAULTS = tuple(None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(DecomposeKConfig))


def traced_matmul(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32):
    """What :func:`matmul` does while being traced: the custom op, then a copy into ``out`` if one is given."""
    if isinstance(config, dict):
        unknown = [key for key in config if key not in _FIELDS]
        if unknown or "split_k" not in config:
            raise ValueError(f"config: unknown keys {sorted(unknown)}" if unknown else "config: missing key 'split_k'")
        fields = [config.get(name, default) for name, default in zip(_FIELDS, _DEFAULTS)]
    elif config is not None:
        fields = [getattr(config, name) for name in _FIELDS]
    else:
        fields = None
    epi = epilogue.name.lower() if isinstance(epilogue, Epilogue) else epilogue
    res = dk_matmul(a, b, bias, kernel, split_k, epi, fields, allow_tf32)
    if out is not None:
        out.copy_(res)
        return out
    return res
