"""moegemm as a Hugging Face transformers experts implementation (moegemm.integrations.transformers), on
tiny random configs under the interpreter (CPU), against transformers' own eager experts in float64."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("transformers.integrations.moe"), "ExpertsInterface"):
    pytest.skip(
        f"transformers {transformers.__version__} has no ExpertsInterface (5.x has)", allow_module_level=True
    )

from transformers import MixtralConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

import moegemm.integrations.transformers as mt  # noqa: E402  (registers "moegemm")
from moegemm.grouped import GroupedConfig  # noqa: E402


@pytest.fixture
def small_tiles(monkeypatch, tmp_path):
    """Interpreter-sized tiles for every shape (no tuned entry covers these), and no cache file at home."""
    import moegemm.grouped.config as api

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)


def qwen3(experts: int = 8, top_k: int = 2, hidden: int = 64, inter: int = 32) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=97,
    )


def mixtral(experts: int = 4, top_k: int = 2, hidden: int = 64, inter: int = 48) -> MixtralConfig:
    return MixtralConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=97,
    )


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize(
    "block_cls,config",
    [
        (Qwen3MoeSparseMoeBlock, qwen3()),
        (MixtralSparseMoeBlock, mixtral()),
        (Qwen3MoeSparseMoeBlock, qwen3(experts=12, top_k=4, inter=40)),
    ],
    ids=["qwen3-moe", "mixtral", "qwen3-moe-12x4"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_block_matches_eager_experts_in_float64(block_cls, config, dtype, device, small_tiles):
    """A real transformers MoE block on our experts implementation: its router in the block's dtype, then
    moe_ffn; against transformers' eager experts in float64 on the same routing, fresh random weights and
    inputs. In float32 the whole block (routing included) agrees with the float64 block too."""
    block = block_cls(config)
    randomize(block, 1)
    x = torch.randn(3 * 7, config.hidden_size, generator=torch.Generator().manual_seed(2))
    ref_block = block_cls(copy.deepcopy(config)).double()  # (a config of its own: the backend is per config)
    ref_block.load_state_dict(block.state_dict())
    ref_block.experts.config._experts_implementation = "eager"
    ours = block.to(dtype).to(device)
    ours.experts.config._experts_implementation = "moegemm"
    calls = []
    real = mt.moe_ffn

    def spy(*a, **k):
        calls.append(a[3].shape)
        return real(*a, **k)

    mt.moe_ffn = spy
    try:
        with torch.no_grad():
            xd = x.to(dtype).to(device)
            _, weights, ids = ours.gate(xd)
            got = ours.experts(xd, ids, weights)
            whole = ours(xd.view(3, 7, -1))
    finally:
        mt.moe_ffn = real
    assert len(calls) == 2, "the block did not run on moegemm's experts"
    with torch.no_grad():
        ref = ref_block.experts(x.to(dtype).double(), ids.cpu(), weights.double().cpu())
        ref_whole = ref_block(x.double().view(3, 7, -1))
    assert got.shape == ref.shape and got.dtype == dtype
    assert not torch.isnan(got).any()
    if dtype == torch.bfloat16:
        # as accurate as transformers' own experts in bf16 on the same routing (its eager loop, which also
        # rounds the gate/up product and the activation to bf16), within a factor: the largest error against
        # float64 at most 3x its own (Triton's CPU interpreter, where this runs in CI, rounds more than the GPU)
        ours.experts.config._experts_implementation = "eager"
        with torch.no_grad():
            hf = ours.experts(xd, ids, weights).double().cpu()
        ours.experts.config._experts_implementation = "moegemm"
        err, hf_err = (got.double().cpu() - ref), (hf - ref)
        assert err.abs().max() <= 3 * hf_err.abs().max() + 1e-3, (err.abs().max(), hf_err.abs().max())
        assert err.norm() / ref.norm() < 2e-2
    else:
        torch.testing.assert_close(got.double().cpu(), ref, rtol=1e-4, atol=1e-4)
    if dtype == torch.float32:
        torch.testing.assert_close(whole.double().cpu(), ref_whole, rtol=1e-4, atol=1e-4)


def test_from_config_with_experts_implementation(device, small_tiles):
    """experts_implementation="moegemm" is accepted by a transformers model, and its logits agree with the
    eager experts' (float32)."""
    model = Qwen3MoeForCausalLM._from_config(qwen3(), experts_implementation="moegemm")
    assert model.config._experts_implementation == "moegemm"
    randomize(model, 3)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model.to(device)(ids.to(device)).logits
        model.set_experts_implementation("eager")
        eager = model(ids.to(device)).logits
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)


def test_unsupported_experts_fall_back_with_a_warning(device, small_tiles):
    """An experts module with something moe_ffn does not do (here: biases) runs transformers' grouped_mm
    instead, with one warning naming the reason."""
    block = Qwen3MoeSparseMoeBlock(qwen3())
    randomize(block, 5)
    block.experts.config._experts_implementation = "moegemm"
    assert mt.unsupported(block.experts) is None
    block.experts.has_bias = True
    block.experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(8, 64))
    block.experts.down_proj_bias = torch.nn.Parameter(torch.zeros(8, 64))
    assert mt.unsupported(block.experts) == "expert biases"
    mt._WARNED.discard("expert biases")
    x = torch.randn(1, 4, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            y = block(x)
    assert any("expert biases is not supported" in str(w.message) for w in caught)
    block.experts.config._experts_implementation = "grouped_mm"
    with torch.no_grad():
        torch.testing.assert_close(y, block(x))


def test_moe_block_traces_under_torch_compile(device, small_tiles):
    """torch.compile(fullgraph=True) of a transformers MoE block on our backend: no graph break (the
    router's ops, routing, the fused gate/up and the down GEMM as custom ops), right against eager."""
    torch._dynamo.reset()
    block = Qwen3MoeSparseMoeBlock(qwen3())
    randomize(block, 6)
    block = block.to(torch.bfloat16).to(device)
    block.experts.config._experts_implementation = "moegemm"
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(device)
    with torch.no_grad():
        want = block(x)
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
        explained = torch._dynamo.explain(block)(x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
