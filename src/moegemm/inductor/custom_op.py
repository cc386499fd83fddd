"""Custom-op autotuning of Decompose-K with Inductor (``register_custom_op_autotuning``).

Two custom ops, ``moegemm::mm`` and ``moegemm::mm_relu``, whose candidates are the plain mm and the seed's
decomposeK (bmm to fp32, sum, cast) at every valid split. Under ``torch.compile(mode="max-autotune...")``
Inductor benchmarks the candidates and inlines the winner, so the ReLU can fuse into the winner's code.
``register(dispatch_splits=[...])`` adds range dispatch on the token dimension (the router case).

The registration arguments that exist only in newer PyTorch (``benchmark_with_cudagraphs``,
``min_speedup_threshold``, 2.12+) are feature-detected.
"""

from __future__ import annotations

import inspect

import torch

from ..decompose_k.reference import decompose_k

SPLITS = (8, 16, 32, 64, 128, 256)
MIN_CHUNK = 64  # a split must hold at least this many K elements


def decompose_k_impl(a: torch.Tensor, b: torch.Tensor, k_splits: int = 64) -> torch.Tensor:
    """The seed's decomposeK (bmm to fp32 over [S, M, K/S] x [S, K/S, N], sum, cast)."""
    return decompose_k(a, b, k_splits)


def decompose_k_relu_impl(a: torch.Tensor, b: torch.Tensor, k_splits: int = 64) -> torch.Tensor:
    return torch.relu(decompose_k_impl(a, b, k_splits))


def mm_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def mm_relu_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(a @ b)


@torch.library.custom_op("moegemm::mm", mutates_args=())
def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@mm.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("moegemm::mm_relu", mutates_args=())
def mm_relu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(a @ b)


@mm_relu.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def valid_splits(k: int) -> list[int]:
    """Splits that divide K into chunks of at least MIN_CHUNK; for a short K, chunks of at least 16, so
    that there is always a choice (torch 2.11's custom-op autotuning fails on a single candidate)."""
    return [s for s in SPLITS if k % s == 0 and k // s >= MIN_CHUNK] or [
        s for s in SPLITS if k % s == 0 and k // s >= 16
    ]


def _configs(plain, decomposed, fake_tensors: dict) -> list:
    from torch._inductor.kernel.custom_op import CustomOpConfig

    k = fake_tensors["a"].shape[1]
    try:
        k = int(k)
    except TypeError:  # symbolic K: offer only the plain mm
        return [CustomOpConfig(plain)]
    return [CustomOpConfig(plain)] + [CustomOpConfig(decomposed, k_splits=s) for s in valid_splits(k)]


def _optional_kwargs(fn) -> dict:
    params = inspect.signature(fn).parameters
    extra = {}
    if "benchmark_with_cudagraphs" in params:  # torch >= 2.12: time candidates as graph replays
        extra["benchmark_with_cudagraphs"] = True
    return extra


_REGISTERED: dict[str, object] = {}


def register(dispatch_splits: list[int] | None = None) -> dict:
    """Register both ops for autotuning (idempotent per dispatch setting). Returns what was registered."""
    from torch._inductor.kernel.custom_op import register_custom_op_autotuning

    key = repr(dispatch_splits)
    if key in _REGISTERED:
        return _REGISTERED[key]
    extra = _optional_kwargs(register_custom_op_autotuning)
    gen = {"a": lambda t: torch.randn_like(t), "b": lambda t: torch.randn_like(t)}
    dispatch = {}
    if dispatch_splits:
        dispatch = dict(dispatch_on={"tensor_name": "a", "dim": 0}, split_points=list(dispatch_splits))
    register_custom_op_autotuning(
        mm,
        config_generator=lambda f: _configs(mm_impl, decompose_k_impl, f),
        name="moegemm_mm_autotuned",
        input_gen_fns=gen,
        **dispatch,
        **extra,
    )
    register_custom_op_autotuning(
        mm_relu,
        config_generator=lambda f: _configs(mm_relu_impl, decompose_k_relu_impl, f),
        name="moegemm_mm_relu_autotuned",
        input_gen_fns=gen,
        **dispatch,
        **extra,
    )
    info = {"dispatch_splits": dispatch_splits, "extra_kwargs": sorted(extra)}
    _REGISTERED[key] = info
    return info
