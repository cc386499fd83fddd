"""Back to token order: the un-permute of the expert GEMMs' rows, each token's top_k rows summed in a fixed
order (deterministic, no atomics), with its gradient for the rows and the gating weights."""

from __future__ import annotations

import torch

from .._runtime import records_grad, triton_here
from .pointwise import combine, combine_op


def unpermute(y_sorted: torch.Tensor, plan, topk_weights: torch.Tensor | None) -> torch.Tensor:
    """y_sorted [T * top_k, N] -> y [T, N] = sum_j weight[t, j] * (row of slot (t, j)), in fp32, cast back;
    ``plan``: the :class:`~moegemm.grouped.routing.RoutingPlan` the rows were permuted by.

    Deterministic: each token gathers its top_k rows (``plan.slot_rows``) and sums them in a fixed order, in
    one Triton kernel on a GPU (:func:`moegemm.grouped.pointwise.combine`). ``topk_weights=None`` means the
    gating weights were already applied (e.g. fused as ``row_scale`` into the grouped GEMM).
    """
    if not isinstance(y_sorted, torch.Tensor) or y_sorted.dim() != 2:
        raise ValueError(f"y_sorted: expected a 2-D tensor, got {getattr(y_sorted, 'shape', None)}")
    if y_sorted.shape[0] != plan.num_rows:
        raise ValueError(f"y_sorted: has {y_sorted.shape[0]} rows, expected T*top_k = {plan.num_rows}")
    t, k = plan.num_tokens, plan.top_k
    if topk_weights is not None and tuple(topk_weights.shape) != (t, k):
        raise ValueError(f"topk_weights: expected shape ({t}, {k}), got {tuple(topk_weights.shape)}")
    if y_sorted.device != plan.slot_rows.device:
        raise ValueError(f"y_sorted: on {y_sorted.device}, but the plan is on {plan.slot_rows.device}")
    if triton_here(y_sorted):  # one Triton kernel; under torch.compile the same, as a custom op
        if torch.compiler.is_compiling() or records_grad(y_sorted, topk_weights):
            return combine_op(y_sorted, plan.slot_rows, k, topk_weights)
        return combine(y_sorted, plan.slot_rows, k, topk_weights)
    return _combine_torch(y_sorted, plan.slot_rows, k, topk_weights)


def _combine_torch(y_sorted, slot_rows, k, topk_weights):
    """The un-permute in torch ops (on the CPU without the interpreter), differentiable as they are."""
    t, n = y_sorted.shape[0] // max(k, 1), y_sorted.shape[1]
    slots = y_sorted.index_select(0, slot_rows).view(t, k, n).float()
    if topk_weights is not None:
        slots = slots * topk_weights.float().unsqueeze(-1)
    return slots.sum(dim=1).to(y_sorted.dtype)


def combine_any(y_sorted, slot_rows, k, topk_weights):
    """The un-permute's sum where it runs: the Triton kernel (as its custom op, which a backward traced by
    torch.compile can hold), or torch ops."""
    if triton_here(y_sorted):
        return combine_op(y_sorted, slot_rows, k, topk_weights)
    return _combine_torch(y_sorted, slot_rows, k, topk_weights)


def _combine_setup(ctx, inputs, output):
    y_sorted, slot_rows, top_k, topk_weights = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(y_sorted, slot_rows, topk_weights)


def _combine_backward(ctx, grad):
    """dy_sorted[slot_rows[s]] = grad[s // top_k] * w[s] (each row once: a permutation, no atomics);
    dw[t, j] = <grad[t], y_sorted[slot_rows[t * top_k + j]]> in fp32."""
    y_sorted, slot_rows, w = ctx.saved_tensors
    k = ctx.top_k
    need_y, _, _, need_w = ctx.needs_input_grad
    per_slot = grad.repeat_interleave(k, dim=0)  # [T * k, N], slot order
    dy = dw = None
    if need_y:
        src = per_slot if w is None else (per_slot.float() * w.reshape(-1, 1).float()).to(grad.dtype)
        dy = torch.empty_like(y_sorted).index_copy(0, slot_rows.to(torch.int64), src)
    if need_w and w is not None:
        rows = y_sorted.index_select(0, slot_rows).float()
        dw = (rows * per_slot.float()).sum(-1).view(w.shape).to(w.dtype)
    return dy, None, None, dw


combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)
