"""The grouped GEMMs' and the MoE layer's public entry points: a call whose operands require grad (with grad
mode on) records gradients (:mod:`moegemm.grouped.autograd`); any other call runs the forward alone
(:mod:`moegemm.grouped.contiguous`, :mod:`moegemm.grouped.ffn`). Each builds its call spec
(:mod:`moegemm.grouped.call`) once and hands it on."""

from __future__ import annotations

import torch

from .._runtime import records_grad
from ..epilogue import Epilogue
from . import autograd, contiguous, layer_graphs
from .call import FFNCall, GroupedCall
from .config import GroupedConfig
from .ffn import check_moe_ffn, moe_ffn_forward
from .fp8.ffn import moe_ffn_fp8
from .fp8.quant import FP8


def grouped_mm(
    x_sorted: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    w_layout: str = "nk",
    epilogue: str | Epilogue = "none",
    row_scale: torch.Tensor | None = None,
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """Y[rows of e] = epilogue(X[rows of e] @ W_e^T) * row_scale[rows], for every expert e, in ONE launch.

    x_sorted: [M_total, K], rows grouped by expert; group_offsets: int [E + 1], non-decreasing, from 0 to
    M_total (row range of each expert; m_e = 0 allowed). w: [E, N, K] (w_layout="nk", the default: the
    nn.Linear convention) or [E, K, N] ("kn"). row_scale: optional [M_total] (e.g. the gating weights in
    sorted order). ``validate`` checks the offsets' values: on a GPU on the device, with no host sync (a
    call can be captured in a CUDA graph; a failed check is a device-side assertion), on the CPU with a
    ValueError. Under ``torch.compile`` this traces as the custom op ``moegemm::grouped_mm``.
    config: tiles, grid and load path; default: :func:`moegemm.grouped.choose_config` (this GPU's tuned
    table, else a config autotuned on the first call of an unseen shape, else the distilled default). A
    config with ``tma=True`` uses the TMA kernel where the inputs allow it (16-bit, rows 16-byte aligned,
    experts stacked densely; "kn" needs K % block_k == 0) and the pointer kernel with the same tiles
    elsewhere; with ``tail_m`` it computes a tile holding at most tail_m rows of its expert as a smaller,
    transposed tile (prefill: the last row tile of most experts), or with ``merge_tail`` beside the
    expert's previous row tile, from the same weight tiles; with ``mix`` the tiles of experts of at least
    that many row tiles are dealt out in proportion among the other experts' (a skewed load: a hot
    expert's tensor-bound tiles run beside cold experts' memory-bound ones, not before or after them).
    Gradients (an operand requiring grad, grad mode on): for x_sorted, w and row_scale, with epilogue "none"
    and no ``out`` (:mod:`moegemm.grouped.autograd`).
    """
    call = GroupedCall.of(w_layout, epilogue, False, config, allow_tf32, validate)
    if records_grad(x_sorted, w, row_scale):
        return autograd.grouped_mm_train(call, x_sorted, w, group_offsets, out, row_scale)
    return contiguous.run(call, x_sorted, w, group_offsets, out, row_scale)


def grouped_mm_swiglu(
    x_sorted: torch.Tensor,
    w_gate_up: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    w_layout: str = "nk",
    row_scale: torch.Tensor | None = None,
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """Y[rows of e] = silu(X[rows of e] G_e) * (X[rows of e] U_e) * row_scale[rows], for every expert e,
    in ONE launch: the gate and up projections fused with SwiGLU in the epilogue. w_gate_up: [E, 2I, K]
    ("nk", the default: the nn.Linear layout) or [E, K, 2I] ("kn"), each expert's gate rows (or columns)
    first, then its up ones; returns [M_total, I]. Both products of an output tile come from the same row
    tile, so the [M_total, 2I] product is never written. Arguments as for :func:`grouped_mm` (no epilogue:
    SwiGLU is it). ``config`` names the tiles of the unfused [E, K, 2I] product: a tile of the fused
    kernel computes block_n / 2 output columns of each of the two halves, so that it holds as many
    accumulators; its tail tiles are not used. Default: timed on the first call of a shape (as
    :func:`grouped_mm` times an untuned one, and kept apart from its choices) among the distilled
    shortlist of its regime and, where the tuned table has the unfused shape, that entry's tiles. Gradients:
    for x_sorted, w_gate_up and row_scale, the SwiGLU backward fused into one grouped GEMM's epilogue."""
    call = GroupedCall.of(w_layout, "none", True, config, allow_tf32, validate)
    if records_grad(x_sorted, w_gate_up, row_scale):
        return autograd.grouped_mm_train(call, x_sorted, w_gate_up, group_offsets, out, row_scale)
    return contiguous.run(call, x_sorted, w_gate_up, group_offsets, out, row_scale)


def moe_ffn(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    w_layout: str = "nk",
    validate: bool = True,
    save_gate_up: bool | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t, j] * FFN_e(x[t]), e = topk_ids[t, j],
    FFN_e(v) = (silu(v G_e) * (v U_e)) D_e.

    x: [T, H]. topk_ids, topk_weights: [T, top_k] (the router's choice and gating weights). w_gate_up: the
    gate and up projections fused, gate first: [E, 2I, H] (w_layout="nk", the default: the nn.Linear layout
    Hugging Face and vLLM store) or [E, H, 2I] ("kn"); w_down: [E, H, I] ("nk") or [E, I, H] ("kn").
    Returns [T, H] in x's dtype. Errors name these arguments (each is checked here, before any step).

    Routing and the permutation first (:func:`moegemm.grouped.route_and_permute`: one launch at decode, three
    past 64 slots), then two grouped GEMM launches: gate and up for every expert at once with SwiGLU in the
    epilogue (:func:`grouped_mm_swiglu`: the [rows, 2I] product is never written), or the product and a
    separate SiLU * up where that is faster (see :func:`gate_up_act`), then down with the gating weights fused
    into its store; the un-permute last. No host sync with the default arguments (``validate`` checks the
    expert ids, on a GPU on the device, see :func:`moegemm.grouped.route`; the group offsets come from that
    routing, so the GEMMs do not check them again), so the layer can be captured in a CUDA graph; under
    torch.compile it traces with no graph break and runs the same kernels (custom ops). Gradients: for x,
    topk_weights (so the router learns), w_gate_up and w_down; deterministic, no host sync
    (:mod:`moegemm.grouped.autograd`).
    At decode (at most 512 routed rows), from the second call of a signature on, the whole layer is one
    CUDA-graph replay (:mod:`moegemm.grouped.layer_graphs`: the host's cost of a step a few copies and the
    replay; ``MOEGEMM_LAYER_GRAPHS=0`` switches it off).
    ``save_gate_up`` (training only): keep the [rows, 2I] gate/up product for the backward, which writes its
    gradient over it (True, the faster: then the graph backs one backward; a second, with retain_graph,
    raises), or recompute it there (False: 2 * I * top_k bytes per token fewer kept, any number of
    backwards); None: :data:`moegemm.grouped.autograd.SAVE_GATE_UP` (True).
    FP8 experts: w_gate_up and w_down in float8_e4m3fn ("nk") with their 128 x 128 block scales
    ``w_gate_up_scale`` and ``w_down_scale`` (:func:`moegemm.grouped.fp8.quantize_fp8_weights` makes both):
    the layer of :func:`moegemm.grouped.fp8.moe_ffn_fp8` (the activations quantised per token and 128
    channels inside it; inference only).
    """
    if w_gate_up_scale is not None or w_down_scale is not None or getattr(w_gate_up, "dtype", None) == FP8:
        scales = (w_gate_up_scale, w_down_scale)
        return _fp8_layer(x, topk_ids, topk_weights, w_gate_up, w_down, *scales, w_layout, validate)
    check_moe_ffn(x, topk_ids, topk_weights, w_gate_up, w_down, w_layout)
    if save_gate_up is not None and not isinstance(save_gate_up, bool):
        raise TypeError(f"save_gate_up: expected a bool or None, got {type(save_gate_up).__name__}")
    call = FFNCall.of(w_layout, validate, save_gate_up)
    if records_grad(x, topk_weights, w_gate_up, w_down):
        return autograd.moe_ffn_train(call, x, topk_ids, topk_weights, w_gate_up, w_down)
    return layer_graphs.forward(moe_ffn_forward, call, x, topk_ids, topk_weights, w_gate_up, w_down)


def _fp8_layer(
    x, topk_ids, topk_weights, w_gate_up, w_down, w_gate_up_scale, w_down_scale, w_layout, validate
):
    """moe_ffn with FP8 experts: both weights e4m3 with both scales, in the "nk" layout."""
    for name, w, scale in (("w_gate_up", w_gate_up, w_gate_up_scale), ("w_down", w_down, w_down_scale)):
        if getattr(w, "dtype", None) != FP8:
            raise TypeError(
                f"{name}: FP8 experts take float8_e4m3fn weights with their scales, got {w.dtype}"
            )
        if scale is None:
            raise ValueError(
                f"{name}_scale: FP8 experts need the weights' block scales (quantize_fp8_weights)"
            )
    if w_layout != "nk":
        raise ValueError(f"w_layout: FP8 experts are [E, N, K] ('nk'), got {w_layout!r}")
    return moe_ffn_fp8(
        x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, validate=validate
    )
