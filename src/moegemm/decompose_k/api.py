"""``moegemm.decompose_k.matmul``: an eager call runs its cached plan (:mod:`moegemm.decompose_k.plans`).

Under ``torch.compile`` the call goes through the custom op ``moegemm::dk_matmul`` (registered below,
beside the call it serves), so that ``torch.compile(fullgraph=True)`` traces a caller with no graph
break: its real implementation runs the same plans, its fake one gives the compiler the output's shape,
dtype and (contiguous) strides. Eager calls do not pass through the op: a plan costs less CPU time per
call than the dispatcher would, except where a gradient is recorded (``a``, ``b`` or ``bias`` requires
grad, grad mode on): then the op runs, whose registered autograd gives the router's gradients, eagerly and
compiled alike. Its backward: the epilogue's derivative from the saved output (ReLU: where it is positive;
sigmoid: ``c (1 - c)``), then ``dA = dZ B^T`` and ``dB = A^T dZ`` as cuBLAS GEMMs (neither is skinny in
K: their reduction runs over the router's N or the token count) and ``dbias`` the column sums.
"""

from __future__ import annotations

import dataclasses

import torch

from .._runtime import records_grad
from ..epilogue import Epilogue
from .configs import BACKENDS, KERNELS, LEGACY, DecomposeKConfig
from .plans import cached_plan


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

    kernel: "auto" (the tuned table for this GPU and shape, else the heuristic of
        :func:`moegemm.decompose_k.configs.heuristic_choice`; either may pick cuBLAS where it is faster, the
        epilogue then applied after it), "single_launch", "two_stage", "flat" or "cublas".
    split_k: S; overrides the config's (or the tuned/heuristic) split count.
    epilogue: "none" | "relu" | "sigmoid"; bias: optional [N] tensor added before the activation.
    config: explicit tiling (wins over the tuned table). out: optional [M, N] output of any strides.
    allow_tf32: fp32 inputs use IEEE-accurate products unless this is True.

    The default kernel is bitwise deterministic and safe in CUDA graphs (warm it up once outside capture).
    Under ``torch.compile`` this traces as the custom op ``moegemm::dk_matmul``.
    """
    if torch.compiler.is_compiling():
        return _traced_matmul(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32)
    if records_grad(a, b, bias):  # a gradient is recorded: the custom op, whose autograd is registered
        if out is not None:
            raise ValueError("out: not supported where a gradient is recorded (a, b or bias requires grad)")
        return _traced_matmul(a, b, kernel, split_k, epilogue, bias, config, None, allow_tf32)
    return cached_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32).run(a, b, bias, out)


@torch.library.custom_op("moegemm::dk_matmul", mutates_args=())
def dk_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: str,
    split_k: int | None,
    epilogue: str,
    config: list[int] | None,
    allow_tf32: bool,
) -> torch.Tensor:
    cfg = DecomposeKConfig(*config) if config else None
    return cached_plan(a, b, kernel, split_k, epilogue, bias, cfg, None, allow_tf32).run(a, b, bias, None)


@dk_matmul.register_fake
def _(a, b, bias, kernel, split_k, epilogue, config, allow_tf32):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "a, b: expected 2-D tensors")
    torch._check(a.shape[1] == b.shape[0], lambda: "b: inner dimensions differ")
    return a.new_empty((a.shape[0], b.shape[1]))


def _dk_setup_context(ctx, inputs, output):
    a, b, bias, _kernel, _split_k, epilogue, _config, allow_tf32 = inputs
    ctx.epilogue = Epilogue.parse(epilogue)
    ctx.has_bias = bias is not None
    ctx.allow_tf32 = allow_tf32
    keep = output if ctx.epilogue is not Epilogue.NONE else None  # the epilogue's derivative reads it
    ctx.save_for_backward(a, b, keep)


def _dk_backward(ctx, grad):
    """dZ = grad times the epilogue's derivative at the output; dA = dZ B^T, dB = A^T dZ, dbias = sum dZ."""
    a, b, c = ctx.saved_tensors
    if ctx.epilogue is Epilogue.RELU:
        dz = torch.where(c > 0, grad, torch.zeros_like(grad))
    elif ctx.epilogue is Epilogue.SIGMOID:
        cf = c.float()
        dz = (grad.float() * cf * (1.0 - cf)).to(grad.dtype)
    else:
        dz = grad
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    if dz.dtype is torch.float32:  # cuBLAS through the op: its precision holds eagerly and compiled alike
        da = dk_matmul(dz, b.t(), None, "cublas", None, "none", None, ctx.allow_tf32) if need_a else None
        db = dk_matmul(a.t(), dz, None, "cublas", None, "none", None, ctx.allow_tf32) if need_b else None
    else:
        da = dz @ b.t() if need_a else None
        db = a.t() @ dz if need_b else None
    dbias = dz.float().sum(0).to(dz.dtype) if ctx.has_bias and need_bias else None
    return da, db, dbias, None, None, None, None, None


dk_matmul.register_autograd(_dk_backward, setup_context=_dk_setup_context)


# Read here, not while tracing (Dynamo does not trace dataclasses.fields on a class).
_FIELDS = tuple(f.name for f in dataclasses.fields(DecomposeKConfig))
_DEFAULTS = tuple(
    None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(DecomposeKConfig)
)


def _traced_matmul(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32):
    """What :func:`matmul` does while being traced: the custom op, then a copy into ``out`` if one is
    given."""
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in LEGACY or v != LEGACY[k]}
        unknown = [key for key in config if key not in _FIELDS]
        if unknown or "split_k" not in config:
            raise ValueError(
                f"config: unknown keys {sorted(unknown)}" if unknown else "config: missing key 'split_k'"
            )
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


__all__ = ["matmul", "KERNELS", "BACKENDS"]
