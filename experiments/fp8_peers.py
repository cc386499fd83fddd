"""The peers of E10's projection cells (experiments/e10_fp8.py; ours: experiments/fp8_cells.py), each on its
own FP8 operands, quantised before the call (the GEMM alone is timed), each checked against float64 on those
operands dequantised (experiments/fp8_refs.py), its output poisoned with NaN first:

- ``vllm:fused_moe-fp8``: vLLM's fused_moe_kernel with use_fp8_w8a8 and block [128, 128], its rows read by
  id (gate/up: the tokens, down: the slots) and quantised by vLLM's own kernel (experiments/vllm_fp8.py), at
  the faster of vLLM's own config and a light search (``vllm_search``);
- ``torch._scaled_grouped_mm``: torch's grouped FP8 GEMM, which takes row-wise scales only (one per token,
  one per expert and output channel): the nearest format it takes;
- ``tk:matmul_ogs-fp8``: triton_kernels' matmul_ogs with e4m3 operands and its flexpoint scales (one for
  the activations, one per expert): the nearest its API takes to block scales (its other scaled path is
  MX weights); its own routing, gate/up gathering the tokens;
- ``deepgemm:contiguous`` and, at decode, ``deepgemm:masked``: DeepGEMM's grouped FP8 GEMMs
  (experiments/deepgemm_peer.py) on the block format.

A peer that cannot run here (no source, no such op, a build that failed) is an ``Unrunnable``: one row per
cell naming it and why, never timed.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import torch

from experiments import deepgemm_peer, fp8_refs, triton_kernels_moe, vllm_fp8, vllm_moe
from experiments.fp8_cells import (
    BLOCK_NOTE,
    GemmCell,
    Unrunnable,
    Weights,
    block_rows,
    masked_rows,
    ours_bf16,
    ours_fp8,
    ours_fp8_masked,
    poison_pool,
)
from experiments.harness.runner import Contender
from moegemm.grouped.fp8.quant import FP8

VLLM, TORCH, TK = "vllm:fused_moe-fp8", "torch._scaled_grouped_mm", "tk:matmul_ogs-fp8"
DG_CONTIGUOUS, DG_MASKED = "deepgemm:contiguous", "deepgemm:masked"
ROWWISE_NOTE = (
    "e4m3 with row-wise scales (x: one per token over K; w: one per expert and output channel): "
    "torch._scaled_grouped_mm takes no block scales; use_fast_accum=False (its default)"
)
TENSOR_NOTE = (
    "e4m3 with triton_kernels' flexpoint scales (x: one for the tensor; w: one per expert): the nearest "
    "its matmul_ogs takes to block scales"
)


@dataclasses.dataclass
class Peers:
    """Each peer, loaded once per run, or why it cannot run here."""

    vllm: tuple | None = None  # (vLLM's kernel, its activation quant kernel)
    vllm_why: str = ""
    tk: object | None = None
    tk_why: str = ""
    dg: deepgemm_peer.DeepGemm | None = None
    dg_why: str = ""
    torch_why: str = ""

    @classmethod
    def load(cls, device) -> Peers:
        p = cls()
        try:
            vk = vllm_moe.load()
            p.vllm = (vk, vllm_fp8.load_quant(vk)) if vk else None
            p.vllm_why = "" if vk else "no vllm installed and no MOEGEMM_VLLM_SOURCE"
        except Exception as ex:  # noqa: BLE001 (a peer that cannot load is recorded, not fatal)
            p.vllm_why = f"{type(ex).__name__}: {str(ex)[:300]}"
        try:
            p.tk = triton_kernels_moe.load()
            p.tk_why = "" if p.tk else f"no {triton_kernels_moe.ENV}"
        except Exception as ex:  # noqa: BLE001
            p.tk_why = f"{type(ex).__name__}: {str(ex)[:300]}"
        p.dg, p.dg_why = deepgemm_peer.load()
        p.torch_why = torch_scaled_unfit(device) or ""
        return p


def torch_scaled_unfit(device) -> str | None:
    """Why torch._scaled_grouped_mm cannot serve here (None: a tiny call of it ran): this torch lacks it, or
    it refuses this device."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        a = torch.ones(32, 32, device=device).to(FP8)
        b = torch.ones(2, 32, 32, device=device).to(FP8).transpose(1, 2)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        sa, sb = torch.ones(32, device=device), torch.ones(2, 32, device=device)
        torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    except Exception as ex:  # noqa: BLE001
        first = (str(ex).strip().splitlines() or [""])[0][:200]
        return f"torch._scaled_grouped_mm on {torch.device(device).type} failed: {type(ex).__name__}: {first}"
    return None


def vllm_operands(cell: GemmCell, qk):
    """(a_q, a_s, top_k, sorted-row index): the rows vLLM's kernel reads (gate/up: the tokens, down: the
    slots, in slot order), quantised by vLLM's kernel, and where each expert-sorted row sits among them."""
    if cell.proj == "up":
        a, top_k, idx = cell.x, cell.ids.shape[1], cell.plan.sorted_token_ids.long()
    else:
        a = torch.empty_like(cell.xs)
        a[cell.slots] = cell.xs
        top_k, idx = 1, cell.slots
    aq, as_ = vllm_fp8.group_quant(qk, a.contiguous())
    return aq, as_, top_k, idx


def vllm_contender(cell: GemmCell, w: Weights, peers: Peers, choice) -> Contender | Unrunnable:
    """vLLM's kernel on block-FP8 operands at the config ``choice`` (vllm_search's, or why it failed)."""
    name = VLLM
    if peers.vllm is None:
        return Unrunnable(name, f"not runnable: {peers.vllm_why}")
    vk, qk = peers.vllm
    if not isinstance(choice, dict):
        return Unrunnable(name, f"not runnable: {choice}", {"origin": vk.origin})
    aq, as_, top_k, idx = vllm_operands(cell, qk)
    t, e = cell.x.shape[0], len(cell.sizes)
    naive = vllm_moe.naive_assignment(t, cell.ids.shape[1], e)
    bind = vllm_fp8.launcher(vk, aq, as_, top_k, cell.plan, cell.ids, cell.n, choice["config"], naive)
    bm, bn = choice["config"]["BLOCK_SIZE_M"], choice["config"]["BLOCK_SIZE_N"]
    flags = vllm_moe.vllm_flags(
        set(vk.kernel.arg_names), torch.bfloat16, vllm_moe.capability_of(aq), (bm, bn)
    )
    own = choice["own"]
    return Contender(
        name,
        lambda inp: bind(*w.q("block", inp[0])),
        config=choice["config"],
        fields={
            "quant": BLOCK_NOTE,
            "origin": vk.origin,
            "config_source": f"{choice['source']}; best of {choice['tried']}",
            "vllm_own_config": own[0] if own else "",
            "vllm_own_search_us": own[1] if own else math.nan,
            "vllm_search_us": choice.get("graph_us", math.nan),
            "vllm_flags": flags[1],
            "glue": "per_token_group_quant_fp8 as its Triton kernel, before the call",
            "naive_block_assignment": naive,
        },
        parallel_compile=True,
        check=cell.checker("vllm", "block", aq[idx], as_[idx], w, lambda out: out[cell.slots]),
    )


def vllm_search(cell: GemmCell, w: Weights, peers: Peers, settings, gpu: str, m: dict) -> dict | str:
    """vLLM's config for this (model, projection, T), on ``cell`` (the tuner's seeds at the uniform load, as
    E7 searches): its own choice for block FP8 and our light search, each checked and timed
    (e7_grouped_skew.fastest_config); the fastest right one, or why none is."""
    from experiments.common import check_and_time
    from experiments.e7_grouped_skew import fastest_config

    vk, qk = peers.vllm
    try:
        aq, as_, top_k, idx = vllm_operands(cell, qk)
        t, e = cell.x.shape[0], len(cell.sizes)
        naive = vllm_moe.naive_assignment(t, cell.ids.shape[1], e)
        own = vllm_moe.own_choice(
            vk,
            gpu,
            e,
            m["down"][0],
            m["up"][0],
            cell.n,
            cell.ids.shape[1],
            t,
            vllm_fp8.DTYPE,
            vllm_fp8.BLOCK_SHAPE,
        )
        chk = cell.checker("vllm", "block", aq[idx], as_[idx], w, lambda out: out[cell.slots])
        return fastest_config(
            own,
            vllm_moe.candidates(t * cell.ids.shape[1] / e, block_k=vllm_fp8.GROUP),
            lambda config: vllm_fp8.launcher(vk, aq, as_, top_k, cell.plan, cell.ids, cell.n, config, naive),
            [w.q("block", 0)],
            None,
            0,
            settings,
            check_and_time_fn=lambda calls, ref, k, s: check_and_time(calls, None, 0, s, check_fn=chk),
        )
    except Exception as ex:  # noqa: BLE001 (recorded in the cells it serves, not fatal)
        return f"config search failed: {type(ex).__name__}: {str(ex)[:200]}"


def torch_scaled(cell: GemmCell, w: Weights, peers: Peers) -> Contender | Unrunnable:
    name = TORCH
    origin = f"torch {torch.__version__}"
    if peers.torch_why:
        return Unrunnable(name, f"not runnable: {peers.torch_why}", {"origin": origin})
    xq, xscale = fp8_refs.quantize_rowwise(cell.xs)
    offs = cell.plan.group_offsets[1:].to(torch.int32)

    def bind(inp):
        wq, ws = w.q("rowwise", inp[0])
        poison_pool(xq.shape[0] * cell.n, torch.bfloat16, xq.device)
        return lambda: torch._scaled_grouped_mm(
            xq, wq.transpose(1, 2), xscale, ws, offs=offs, out_dtype=torch.bfloat16
        )

    return Contender(
        name,
        bind,
        fields={"quant": ROWWISE_NOTE, "origin": origin},
        check=cell.checker("rowwise", "rowwise", xq, xscale, w),
    )


def tk_fp8(cell: GemmCell, w: Weights, peers: Peers) -> Contender | Unrunnable:
    name = TK
    tk = peers.tk
    if tk is None:
        return Unrunnable(name, f"not runnable: {peers.tk_why}")
    ids, e = cell.ids, len(cell.sizes)
    gather = cell.proj == "up"
    wts = torch.full(ids.shape, 1.0 / ids.shape[1], device=ids.device)
    rd, gidx, _ = triton_kernels_moe.route(tk, ids, triton_kernels_moe.routing_logits(ids, wts, e))
    order = triton_kernels_moe.slot_order(gidx)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    perm = inv[cell.slots]  # the row of its output (and of its down operand) for each expert-sorted row
    if gather:
        a = cell.x
        sorted_rows = cell.plan.sorted_token_ids.long()
    else:
        slot_rows = torch.empty_like(cell.xs)
        slot_rows[cell.slots] = cell.xs
        a, sorted_rows = slot_rows[order].contiguous(), perm
    aq, as_ = fp8_refs.quantize_tensor(a)
    numerics = importlib.import_module("triton_kernels.numerics")
    mo = tk.matmul_ogs
    slots = order.numel()

    def bind(inp):
        wq, ws = w.q("tensor", inp[0])
        flex = mo.FlexCtx(
            lhs_data=numerics.InFlexData(dtype=FP8, scale=as_),
            rhs_data=numerics.InFlexData(dtype=FP8, scale=ws),
        )
        pc = mo.PrecisionConfig(flex_ctx=flex, out_dtype=torch.bfloat16)
        y = torch.full((1, slots, cell.n), float("nan"), dtype=torch.bfloat16, device=aq.device)

        def call():
            mo.matmul_ogs(
                aq,
                wq.transpose(1, 2),
                None,
                rd,
                gather_indx=gidx if gather else None,
                precision_config=pc,
                y=y,
            )
            return y.view(slots, cell.n)

        return call

    return Contender(
        name,
        bind,
        fields={"quant": TENSOR_NOTE, "origin": tk.origin, "config_source": "its own opt_flags"},
        check=cell.checker("tensor", "tensor", aq[sorted_rows], as_, w, lambda out: out[perm]),
    )


def deepgemm(cell: GemmCell, w: Weights, peers: Peers, xq, xscale, masked: bool) -> Contender | Unrunnable:
    """DeepGEMM's contiguous (padded rows) or masked grouped GEMM on the block-format rows xq, xscale."""
    name = DG_MASKED if masked else DG_CONTIGUOUS
    dg = peers.dg
    if dg is None:
        return Unrunnable(name, f"not runnable: {peers.dg_why}")
    mod = dg.module
    if masked:
        m_max = -(-max(1, max(cell.sizes)) // deepgemm_peer.MASKED_M_ALIGN) * deepgemm_peer.MASKED_M_ALIGN
        a, s, masked_m, expert, pos = masked_rows(cell, xq, xscale, m_max)
        expected_m = max(1, -(-xq.shape[0] // len(cell.sizes)))
        config = {"m_max": m_max, "expected_m": expected_m}
        d = torch.full((len(cell.sizes), m_max, cell.n), float("nan"), dtype=torch.bfloat16, device=xq.device)
        to_sorted = lambda out: out[expert, pos]  # noqa: E731
    else:
        align = int(mod.get_mk_alignment_for_contiguous_layout())
        layout, dest, m_pad = deepgemm_peer.contiguous_layout(cell.sizes, align, xq.device)
        a = torch.zeros(m_pad, xq.shape[1], dtype=xq.dtype, device=xq.device)
        s = torch.ones(m_pad, xscale.shape[1], dtype=xscale.dtype, device=xq.device)
        a[dest], s[dest] = xq, xscale
        config = {"align": align, "m_pad": m_pad}
        d = torch.full((m_pad, cell.n), float("nan"), dtype=torch.bfloat16, device=xq.device)
        to_sorted = lambda out: out[dest]  # noqa: E731
    sfa = mod.get_mn_major_tma_aligned_tensor(s)

    def bind(inp):
        wq, ws = w.q("block", inp[0])
        d.fill_(float("nan"))

        def call():
            if masked:
                mod.m_grouped_fp8_gemm_nt_masked((a, sfa), (wq, ws), d, masked_m, expected_m)
            else:
                mod.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (wq, ws), d, layout)
            return d

        return call

    return Contender(
        name,
        bind,
        config=config,
        fields={"quant": BLOCK_NOTE, "origin": dg.origin},
        check=cell.checker("block", "block", xq, xscale, w, to_sorted),
    )


def gemm_contenders(cell: GemmCell, w: Weights, peers: Peers, vllm_choice, ref64) -> list:
    """The contenders of a projection's cell (Contender, or Unrunnable where a peer cannot run here), in
    measuring order; ``ref64``: the bf16 rows' float64 reference (for ours:bf16)."""
    xq, xscale = block_rows(cell)
    out = [ours_fp8(cell, w, xq, xscale)]
    if cell.decode:
        out.append(ours_fp8_masked(cell, w, xq, xscale))
    out.append(ours_bf16(cell, w, ref64))
    made = [
        (VLLM, lambda: vllm_contender(cell, w, peers, vllm_choice)),
        (TORCH, lambda: torch_scaled(cell, w, peers)),
        (TK, lambda: tk_fp8(cell, w, peers)),
        (DG_CONTIGUOUS, lambda: deepgemm(cell, w, peers, xq, xscale, False)),
    ]
    if cell.decode:
        made.append((DG_MASKED, lambda: deepgemm(cell, w, peers, xq, xscale, True)))
    for name, make in made:
        try:
            out.append(make())
        except Exception as ex:  # noqa: BLE001 (a peer whose operands cannot be made here is recorded)
            out.append(Unrunnable(name, f"not runnable: {type(ex).__name__}: {str(ex)[:300]}"))
    return out
