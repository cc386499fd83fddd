"""Decompose-K: skinny, long-K GEMMs split over K into an fp32 [S, M, N] buffer, reduced with a fused
epilogue. See :func:`matmul`; the seed's PyTorch formulation is :func:`reference.decompose_k`."""

from .api import matmul
from .configs import BACKENDS, KERNELS, DecomposeKConfig, heuristic_config
from .plans import Plan, plan
from .reference import decompose_k

__all__ = [
    "matmul",
    "plan",
    "Plan",
    "decompose_k",
    "DecomposeKConfig",
    "KERNELS",
    "BACKENDS",
    "heuristic_config",
]
