"""Grouped GEMM for MoE expert layers: routing (permute / unpermute), one-launch grouped kernels in the
contiguous and masked layouts, the expert FFN in one call, and the baselines they are measured against.

Modules, top to bottom: ``config`` (configs and their choice; moegemm.autotune times a shortlist on a
shape's first call), ``tiles`` (the kernels' shared device code), ``kernels`` and ``masked_kernels`` (the
Triton kernels of each layout), ``checks`` (argument checks), ``tma`` (TMA descriptors), ``call`` (the call
spec of a grouped GEMM, and the custom ops' schemas generated from it), ``launch`` (one launch's arguments,
the grid, plans), ``contiguous`` (the contiguous layout's launcher: plan cache, first calls, its custom
op), ``masked`` (the masked layout's call, launch and custom op), ``routing`` with ``routing_kernels``,
``token_order`` (the un-permute) and ``pointwise``, ``gather`` (gate/up reading x's rows by token id),
``ffn`` (the expert FFN's forward),
``backward_kernels``, ``weight_grad`` (dW) and ``swiglu_bwd`` (the SwiGLU backward), ``backward`` (the
training steps), ``autograd`` (autograd functions and the training ops), ``api`` (``grouped_mm``,
``grouped_mm_swiglu``, ``moe_ffn``: each builds its call spec and hands it to the launcher or to
autograd)."""

from .api import grouped_mm, grouped_mm_swiglu, moe_ffn
from .config import GroupedConfig, choose_config, heuristic_config
from .masked import grouped_mm_masked
from .routing import RoutingPlan, permute, route, route_and_permute, sorted_weights
from .token_order import unpermute

__all__ = [
    "route",
    "permute",
    "route_and_permute",
    "unpermute",
    "sorted_weights",
    "RoutingPlan",
    "grouped_mm",
    "grouped_mm_masked",
    "GroupedConfig",
    "heuristic_config",
    "choose_config",
    "moe_ffn",
    "grouped_mm_swiglu",
]
