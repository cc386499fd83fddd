"""Decompose-K on a GPU that no tuned table serves (another architecture than any table was tuned on): the
first call of each shape times a shortlist of backends on its own inputs, instead of running the heuristic's
one guess, and keeps the fastest (moegemm.autotune: in memory and on disk), so that later calls, a CUDA
graph's capture among them, take it with no timing."""

from __future__ import annotations

import dataclasses

import torch

from .. import autotune
from .._runtime import device_sm_count, gpu_slug
from ..epilogue import Epilogue
from .configs import DecomposeKConfig, heuristic_choice, heuristic_config


def shortlist(
    m: int, n: int, k: int, dtype: torch.dtype, sms: int
) -> list[tuple[str, DecomposeKConfig | None]]:
    """(backend, config) pairs to time: the heuristic's choice first, then cuBLAS, then our single launch
    with the heuristic's tiles at half and twice its split and at half its K step (each split at least one
    K step long, no repeats)."""
    first = heuristic_choice(m, n, k)
    cfg = heuristic_config(m, n, k, dtype, sms)
    out: list[tuple[str, DecomposeKConfig | None]] = [(first, None if first == "cublas" else cfg)]
    out.append(("cublas", None))
    variants = [
        cfg,
        dataclasses.replace(cfg, split_k=max(1, cfg.split_k // 2)),
        dataclasses.replace(cfg, split_k=cfg.split_k * 2),
        dataclasses.replace(cfg, block_k=max(16, cfg.block_k // 2)),
    ]
    for v in variants:
        if v.split_k <= max(1, k // v.block_k):
            out.append(("single_launch", v))
    return list(dict.fromkeys(out))


def key(a: torch.Tensor, n: int, epilogue: Epilogue, has_bias: bool, allow_tf32: bool) -> tuple:
    m, k = a.shape
    return (
        "decompose_k",
        str(a.dtype).replace("torch.", ""),
        m,
        n,
        k,
        epilogue.name.lower(),
        has_bias,
        allow_tf32,
    )


def choice(a: torch.Tensor, n: int, epilogue: Epilogue, has_bias: bool, allow_tf32: bool, make_plan):
    """(backend, config, source) for a call whose table lookup said 'generic': the choice an earlier call
    timed ('autotuned'), else, where this call can time, the fastest of :func:`shortlist` on these inputs
    ('autotuned on this call'; ``make_plan(backend, config)`` gives a plan to run), else None (the caller
    keeps the heuristic's choice and does not keep the plan, so that a later call may still time)."""
    slug = gpu_slug(a)
    k_ = key(a, n, epilogue, has_bias, allow_tf32)
    hit = autotune.lookup(slug, k_)
    if hit is not None:
        cfg = DecomposeKConfig.coerce(hit["config"]) if hit["config"] else None
        return hit["backend"], cfg, "autotuned"
    if not autotune.can_time(a):
        return None
    m, k = a.shape
    candidates = shortlist(m, n, k, a.dtype, device_sm_count(a))
    plans = [make_plan(name, cfg) for name, cfg in candidates]
    best, times = autotune.fastest(lambda p: p(), plans)
    name, cfg = candidates[plans.index(best)]
    autotune.remember(slug, k_, {"backend": name, "config": cfg.as_dict() if cfg else None}, times)
    return name, cfg, "autotuned on this call"
