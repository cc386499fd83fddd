"""vLLM's Triton fused MoE with block-FP8 weights (E10's contender), as vLLM runs it for DeepSeek-V3's
checkpoints: ``fused_moe_kernel`` (experiments/vllm_moe.py loads it) with ``use_fp8_w8a8=True`` and
``block_shape=[128, 128]``, and its activations quantised per token and 128 channels as vLLM's
``per_token_group_quant_fp8`` does.

That function calls a CUDA op of vLLM's on a GPU (``per_token_group_fp8_quant``), which does not load beside
our torch; its Triton fallback is vLLM's own kernel ``_per_token_group_quant_fp8`` (in
``vllm/model_executor/layers/quantization/utils/fp8_utils.py``), read out of the same source as the MoE
kernel (``ast``, as vllm_moe.py reads ``fused_moe_kernel``) and launched as that fallback launches it:
row-major scales, eps 1e-10, e4m3's range +-448, no power-of-two rounding of the scales (vLLM rounds them
only for DeepGEMM on Blackwell), one program per group of 128. ``GLUE`` names it with vllm_moe's stand-ins.

- ``launcher``: one projection, its rows quantised before the call (E10 times the GEMM alone);
- ``layer``: the whole FFN as vLLM's ``fused_experts`` runs it for block FP8: the expert assignment, x
  quantised, gate/up gathering its rows, silu_and_mul, the result quantised, down with the routing weights
  inside the kernel, moe_sum.
"""

from __future__ import annotations

import torch
import triton

from experiments import vllm_moe
from moegemm.grouped.fp8.quant import FP8

QUANT_KERNEL = "_per_token_group_quant_fp8"
GROUP = 128  # channels per activation scale, and the weights' scale block (block_shape [128, 128])
DTYPE, BLOCK_SHAPE = "fp8_w8a8", [GROUP, GROUP]  # vLLM's names for the format (its config tables' keys)
# the kernel arguments the block-FP8 path passes beyond vllm_moe.ARGS
FP8_ARGS = ("stride_asm", "stride_ask", "stride_bse", "stride_bsk", "stride_bsn", "group_n", "group_k")
FP8_ARGS += ("use_fp8_w8a8",)
GLUE = vllm_moe.GLUE + (
    "; per_token_group_quant_fp8: its Triton kernel _per_token_group_quant_fp8 (the fallback of its CUDA op)"
)


def load_quant(vk: vllm_moe.VllmKernel):
    """vLLM's ``_per_token_group_quant_fp8`` (a Triton JITFunction) from the fp8_utils.py of ``vk``'s source.
    A ValueError, naming what is missing, where that source has no fp8_utils.py or the kernel lacks the
    block-FP8 arguments."""
    if vk.fp8_utils is None:
        raise ValueError(
            f"{vk.origin}: no {vllm_moe.FP8_UTILS} beside its fused_moe.py (experiments/fetch_peers.sh "
            "unpacks it)"
        )
    missing = [a for a in FP8_ARGS if a not in set(vk.kernel.arg_names)]
    if missing:
        raise ValueError(
            f"{vk.origin}: its fused_moe_kernel has no block-FP8 argument(s) {', '.join(missing)}"
        )
    mod = vllm_moe.kernel_module(vk.fp8_utils, vk.origin, (QUANT_KERNEL,), stem="vllm_fp8_utils")
    return getattr(mod, QUANT_KERNEL)


def group_quant(qk, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 [M, K/128]): x [M, K] quantised per row and 128 channels by vLLM's kernel ``qk``,
    launched as per_token_group_quant_fp8's Triton fallback launches it. vLLM asserts what it asserts: K a
    multiple of 128, the rows contiguous (a ValueError here)."""
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"x: K={k} is not a multiple of {GROUP} (vLLM's per_token_group_quant_fp8 needs it)")
    if not x.is_contiguous():
        raise ValueError("x: vLLM's per_token_group_quant_fp8 takes contiguous groups")
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, k // GROUP, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(GROUP)
        qk[(m * k // GROUP,)](
            x,
            q,
            s,
            GROUP,
            k,
            x.stride(0),
            1e-10,
            fp8_min=-448.0,
            fp8_max=448.0,
            use_ue8m0=False,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
            num_stages=1,
        )
    return q, s


def _assign(plan, topk_ids, bm: int, naive: bool, device):
    slots = plan.sorted_slot.numel()
    if naive:  # vLLM's naive path: slot s is row tile s, of expert topk_ids.flat[s]
        post = torch.full((1,), slots * bm, dtype=torch.int32, device=device)
        return None, topk_ids.reshape(-1).to(torch.int32), post
    return vllm_moe.align(plan, bm)


def launcher(vk, a_q, a_s, top_k: int, plan, topk_ids, n: int, config: dict, naive: bool):
    """bind(w_q [E, N, K] e4m3, w_s [E, N/128, K/128]) -> a call of vLLM's kernel with block-FP8 operands
    writing y [slots, N] bf16 (row s: slot s); a_q, a_s: the rows it reads (at row id // top_k), quantised by
    group_quant beforehand. The row-id lists are made here, before timing."""
    bm = vllm_moe._split_config(config)[0]
    slots = plan.sorted_slot.numel()
    assign = _assign(plan, topk_ids, bm, naive, a_q.device)
    cap = vllm_moe.capability_of(a_q)

    def bind(w_q: torch.Tensor, w_s: torch.Tensor):
        y = torch.full((slots, n), float("nan"), dtype=torch.bfloat16, device=a_q.device)

        def call():
            vllm_moe.kernel_call(
                vk, a_q, w_q, y, None, assign, n, slots, top_k, config, naive, cap, scales=(a_s, w_s)
            )
            return y

        return call

    return bind


def layer(vk, qk, x: torch.Tensor, topk_ids, topk_weights, e: int, config: dict):
    """bind(w_gu_q, w_gu_s, w_dn_q, w_dn_s) -> a call of the whole expert FFN as vLLM's fused_experts runs it
    for block-FP8 weights (w_gu: [E, 2I, H] e4m3 with [E, 2I/128, H/128] scales; w_dn: [E, H, I]): the
    expert assignment in the call, x quantised, gate/up gathering its rows, silu_and_mul (vllm_moe's
    stand-in), its output quantised, down with the routing weights applied inside, moe_sum; [T, H] bf16 out
    (x's dtype). One config for both GEMMs, as vLLM takes it."""
    from moegemm.grouped.pointwise import silu_mul

    t, top_k = topk_ids.shape
    slots = t * top_k
    naive = vllm_moe.naive_assignment(t, top_k, e)
    bm = vllm_moe._split_config(config)[0]
    ids32 = topk_ids.to(torch.int32)  # as vLLM's routers give them
    w_flat = topk_weights.reshape(-1).float().contiguous()
    aligner = None if naive else vllm_moe.AlignTriton(slots, e, bm, x.device)
    cap = vllm_moe.capability_of(x)

    def bind(w_gu_q, w_gu_s, w_dn_q, w_dn_s):
        two_i, h = w_gu_q.shape[1], w_dn_q.shape[1]
        y1 = torch.empty(slots, two_i, dtype=x.dtype, device=x.device)
        y2 = torch.full((t, top_k, h), float("nan"), dtype=x.dtype, device=x.device)
        out = torch.full((t, h), float("nan"), dtype=x.dtype, device=x.device)

        def call():
            assign = vllm_moe.layer_assignment(naive, aligner, ids32, slots, bm)
            xq, xs = group_quant(qk, x)
            vllm_moe.kernel_call(
                vk, xq, w_gu_q, y1, None, assign, two_i, slots, top_k, config, naive, cap, (xs, w_gu_s)
            )
            hq, hs = group_quant(qk, silu_mul(y1))
            vllm_moe.kernel_call(
                vk,
                hq,
                w_dn_q,
                y2.view(slots, h),
                w_flat,
                assign,
                h,
                slots,
                1,
                config,
                naive,
                cap,
                (hs, w_dn_s),
            )
            return vllm_moe.moe_sum(y2, out)

        return call

    return bind
