"""Grouped GEMM for MoE expert layers: routing (permute / unpermute), one-launch grouped kernels in the
contiguous and masked layouts, and the baselines they are measured against."""

from . import ops as _ops  # noqa: F401 - registers the custom ops moegemm::grouped_mm(_masked)
from .api import GroupedConfig, choose_config, grouped_mm, grouped_mm_masked, grouped_mm_swiglu, heuristic_config
from .ffn import moe_ffn
from . import autograd as _autograd  # noqa: F401,E402 - registers the training ops moegemm::*_train
from .routing import RoutingPlan, permute, route, route_and_permute, sorted_weights, unpermute

__all__ = ["route", "permute", "route_and_permute", "unpermute", "sorted_weights", "RoutingPlan", "grouped_mm",
           "grouped_mm_masked", "GroupedConfig", "heuristic_config", "choose_config", "moe_ffn", "grouped_mm_swiglu"]
