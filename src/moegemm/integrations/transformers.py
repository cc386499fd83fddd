"""An experts implementation for Hugging Face transformers (5.x): importing this module registers "moegemm"
in ``transformers.integrations.moe.ExpertsInterface``, so that an MoE model whose experts class uses that
interface (Qwen3-MoE, Mixtral, DeepSeek-V3, OLMoE, ...) runs its experts on :func:`moegemm.grouped.moe_ffn`::

    import moegemm.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moegemm")

The experts this serves: gate and up concatenated (``gate_up_proj``, gate first), SiLU on the gate with the
default gating, no biases, no post-expert norm, no expert parallelism; weights [E, 2I, H] and [E, H, I] or,
with ``is_transposed``, [E, H, 2I] and [E, I, H]. An experts module with anything else (gpt-oss's clamped,
interleaved gating, biases, ...) runs transformers' own ``grouped_mm`` implementation instead, with a
warning naming the reason, once per reason. The forward has no host sync and traces under torch.compile.
Under autocast (mixed-precision training) the expert GEMMs run in autocast's dtype, the weights cast to it
as autocast casts a linear layer's.
"""

from __future__ import annotations

import warnings

import torch
import transformers

try:  # imported here, not in the forward: an import inside it breaks torch.compile's trace on torch 2.11
    from transformers.integrations import moe as hf_moe
except ImportError:  # transformers 4.x: register() says so
    hf_moe = None

from ..grouped import moe_ffn

NAME = "moegemm"
_WARNED: set = set()


def unsupported(experts: torch.nn.Module) -> str | None:
    """Why ``experts`` cannot run on moe_ffn, or None where it can."""
    if not getattr(experts, "has_gate", False) or not hasattr(experts, "gate_up_proj"):
        return "experts without a gate (no gate_up_proj)"
    if not getattr(experts, "is_concatenated", True):
        return "gate and up interleaved, not concatenated"
    if getattr(experts, "has_bias", False):
        return "expert biases"
    if getattr(experts, "has_post_expert_norm", False):
        return "a post-expert norm"
    if getattr(experts, "_is_expert_parallel", False):
        return "expert parallelism"
    if getattr(type(experts), "_apply_gate", hf_moe._default_apply_gate) is not hf_moe._default_apply_gate:
        return f"its own gating ({type(experts).__name__}._apply_gate)"
    act = getattr(experts, "act_fn", None)
    if not isinstance(act, torch.nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        return f"activation {type(act).__name__}, not SiLU"
    return None


def moegemm_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward (hidden_states [T, H], the router's top-k ids and weights [T, k]) on
    :func:`moegemm.grouped.moe_ffn`; see the module's docstring for what it serves."""
    why = unsupported(self)
    if why is not None:
        if why not in _WARNED:
            _WARNED.add(why)
            warnings.warn(
                f"moegemm experts: {why} is not supported; running transformers' grouped_mm instead",
                stacklevel=2,
            )
        return hf_moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    w_layout = "kn" if getattr(self, "is_transposed", False) else "nk"
    x, w_gate_up, w_down = hidden_states, self.gate_up_proj, self.down_proj
    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):  # mixed precision: the GEMMs in autocast's dtype, as matmuls run
        dtype = torch.get_autocast_dtype(device)
        x, w_gate_up, w_down = (t.to(dtype) for t in (x, w_gate_up, w_down))
    y = moe_ffn(
        x,
        top_k_index,
        top_k_weights.to(torch.float32),
        w_gate_up,
        w_down,
        w_layout=w_layout,
        validate=False,
    )
    return y


def register(name: str = NAME) -> None:
    """Register :func:`moegemm_experts_forward` in transformers' ExpertsInterface under ``name`` (done once at
    import under "moegemm")."""
    if not hasattr(hf_moe, "ExpertsInterface"):
        raise ImportError(
            f"moegemm.integrations.transformers needs transformers 5.x (its ExpertsInterface); "
            f"found transformers {transformers.__version__}"
        )
    hf_moe.ExpertsInterface.register(name, moegemm_experts_forward)


register()
