"""The one epilogue vocabulary shared by every kernel in moegemm.

An epilogue is applied where a value first becomes final (in a split-K kernel: in the reduction's store,
never to a partial sum). Order: ``acc (fp32) -> + bias[n] -> activation -> * row_scale[m] -> cast``.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl


class Epilogue(enum.IntEnum):
    NONE = 0
    RELU = 1
    SIGMOID = 2

    @classmethod
    def parse(cls, value: "str | Epilogue", arg: str = "epilogue") -> "Epilogue":
        if isinstance(value, Epilogue):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        names = ", ".join(repr(e.name.lower()) for e in cls)
        raise ValueError(f"{arg}: unknown epilogue {value!r}; expected one of {names}")

    def torch_apply(self, x: torch.Tensor) -> torch.Tensor:
        """The same function in PyTorch (used by references and unfused baselines)."""
        if self is Epilogue.RELU:
            return torch.relu(x)
        if self is Epilogue.SIGMOID:
            return torch.sigmoid(x)
        return x


@triton.jit
def apply_epilogue(acc, bias_ptr, bias_offs, bias_mask, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr):
    """acc (fp32) -> acc + bias -> activation. ``bias_offs`` must broadcast against ``acc``."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + bias_offs, mask=bias_mask, other=0.0).to(tl.float32)
        acc = acc + bias
    if EPILOGUE == 1:
        # NaN propagates as in torch.relu (a plain max.f32 would drop it). A select (where(acc < 0, 0, acc))
        # is equivalent but crashes Triton 3.6's TritonGPUOptimizeThreadLocality pass after a tl.sum.
        acc = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif EPILOGUE == 2:
        acc = tl.sigmoid(acc)
    return acc
