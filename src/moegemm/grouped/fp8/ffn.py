"""The MoE expert FFN with FP8 block-scaled experts, as DeepSeek-V3 is served: the routing, the activations'
quantisation fused into the permutation (one pass over x writes e4m3 rows and their scales in expert
order), gate/up with SwiGLU and the down projection's quantisation in its epilogue, down with the gating
weights fused into its store, the un-permute. Inference only (no gradient)."""

from __future__ import annotations

import torch

from ..._runtime import records_grad
from ..routing import route, sorted_weights
from ..token_order import unpermute
from .api import grouped_mm_fp8, grouped_mm_fp8_swiglu
from .quant import FP8, quantize_fp8_rows


def moe_ffn_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up_q: torch.Tensor,
    w_gate_up_scale: torch.Tensor,
    w_down_q: torch.Tensor,
    w_down_scale: torch.Tensor,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t, j] * FFN_e(x[t]), e = topk_ids[t, j], FFN_e(v) = (silu(v G_e) * (v U_e))
    D_e, with e4m3 weights and activations.

    x: [T, H] (bf16, fp16 or fp32; the output's dtype). topk_ids, topk_weights: [T, top_k]. w_gate_up_q:
    e4m3 [E, 2I, H], gate rows first, with w_gate_up_scale fp32 [E, ceil(2I/128), ceil(H/128)]; w_down_q:
    e4m3 [E, H, I] with w_down_scale [E, ceil(H/128), ceil(I/128)]
    (:func:`moegemm.grouped.fp8.quantize_fp8_weights` makes both). Activations are quantised with one scale
    per token and 128 channels, x as it is gathered into expert order and the SwiGLU output in the gate/up
    kernel. ``validate`` checks the expert ids (on a GPU on the device, no sync)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, H] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x: expected bfloat16, float16 or float32, got {x.dtype}")
    if records_grad(x, topk_weights):
        raise ValueError("x: the FP8 expert FFN records no gradient (call it under torch.no_grad())")
    for name, w in (("w_gate_up_q", w_gate_up_q), ("w_down_q", w_down_q)):
        if not isinstance(w, torch.Tensor) or w.dtype != FP8 or w.dim() != 3:
            raise TypeError(
                f"{name}: expected a 3-D float8_e4m3fn tensor (moegemm.grouped.fp8.quantize_fp8_weights)"
            )
    e, two_i, h = w_gate_up_q.shape
    if h != x.shape[1]:
        raise ValueError(f"w_gate_up_q: H={h} differs from x's {x.shape[1]}")
    if tuple(w_down_q.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"w_down_q: expected shape {(e, h, two_i // 2)} ([E, H, I]), got {tuple(w_down_q.shape)}"
        )
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids: expected [T={x.shape[0]}, top_k], got {getattr(topk_ids, 'shape', None)}"
        )
    plan = route(topk_ids, e, validate=validate)
    x_q, x_s = quantize_fp8_rows(x, plan.sorted_token_ids)
    h_q, h_s = grouped_mm_fp8_swiglu(
        x_q, x_s, w_gate_up_q, w_gate_up_scale, plan.group_offsets, validate=False
    )
    ws = sorted_weights(topk_weights, plan)
    ys = grouped_mm_fp8(
        h_q, h_s, w_down_q, w_down_scale, plan.group_offsets, row_scale=ws, out_dtype=x.dtype, validate=False
    )
    return unpermute(ys, plan, None)
