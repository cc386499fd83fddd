"""moegemm as transformers' experts implementation at real MoE sizes, natively on a CUDA GPU (``pytest -m
gpu``; skipped without one or without transformers)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close_to_ref

transformers = pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("transformers.integrations.moe"), "ExpertsInterface"):
    pytest.skip(
        f"transformers {transformers.__version__} has no ExpertsInterface (5.x has)", allow_module_level=True
    )

from transformers import MixtralConfig, Qwen3MoeConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

import moegemm.integrations.transformers  # noqa: E402,F401  (registers "moegemm")

pytestmark = pytest.mark.gpu

CASES = {  # real sizes: Qwen3-30B-A3B, and Mixtral 8x7B's experts at a quarter of its intermediate size
    "qwen3-30b-a3b": (
        Qwen3MoeSparseMoeBlock,
        Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    ),
    "mixtral-8x7b/4": (
        MixtralSparseMoeBlock,
        MixtralConfig(hidden_size=4096, intermediate_size=3584, num_local_experts=8, num_experts_per_tok=2),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("t", [16, 1024])
def test_block_at_real_sizes_eager_and_compiled(name, t):
    """The block on our experts, eager and under torch.compile(fullgraph=True), against transformers' eager
    experts in float64 on the same routing."""
    block_cls, config = CASES[name]
    torch.manual_seed(t)
    block = block_cls(copy.deepcopy(config))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    ref_block = copy.deepcopy(block).double().cuda()
    ref_block.experts.config._experts_implementation = "eager"
    block = block.to(torch.bfloat16).cuda()
    block.experts.config._experts_implementation = "moegemm"
    x = torch.randn(t, config.hidden_size, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        ref = ref_block.experts(x.double(), ids, weights.double())
        assert_close_to_ref(block.experts(x, ids, weights), ref, config.hidden_size, f"{name} T={t}")
        torch._dynamo.reset()
        compiled = torch.compile(block.experts, fullgraph=True)
        assert_close_to_ref(compiled(x, ids, weights), ref, config.hidden_size, f"{name} T={t} compiled")
