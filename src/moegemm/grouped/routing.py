"""Routing for the expert GEMMs: group token copies by expert (the plan, the permutation of the rows and of
the gating weights). The way back to token order is :mod:`moegemm.grouped.token_order`.

All on the device with torch ops and no host synchronisation (on a GPU the value checks run on the device
too), and traceable by torch.compile.

Gradients: :func:`permute`, :func:`sorted_weights` and :func:`~moegemm.grouped.token_order.unpermute` are
differentiable in their
tensors (x; the gating weights; y_sorted and the gating weights), deterministically, eagerly and under
torch.compile: where a gradient is recorded they run as custom ops with registered autograd. permute's
backward sums each token's top_k row gradients in a fixed order (the un-permute's kernel, not an atomic
scatter); sorted_weights' places each row's gradient back in its slot (a permutation); unpermute's gathers
each row's token gradient (times its weight) and, for the weights, the dot product of that gradient with
the row. With no gradient recorded they take the plain paths (one gather, the one-launch routing at decode).
"""

from __future__ import annotations

import dataclasses

import torch

from .._runtime import records_grad, triton_here
from .routing_kernels import plan_and_gather, plan_arrays, plan_buffers
from .token_order import combine_any


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """Token copies grouped by expert (stable: within an expert, in token order).

    sorted_token_ids[i]: the token whose copy sits at row i of the permuted activations.
    sorted_slot[i]: its flat (token, k) slot, t * top_k + j, i.e. where row i's result goes back.
    slot_rows[s]: the inverse, the row of flat slot s (what the un-permute gathers).
    group_sizes[e]: rows of expert e; group_offsets: [E + 1] prefix sums (row ranges per expert).
    """

    sorted_token_ids: torch.Tensor
    sorted_slot: torch.Tensor
    slot_rows: torch.Tensor
    group_sizes: torch.Tensor
    group_offsets: torch.Tensor
    num_tokens: int
    top_k: int

    @property
    def num_experts(self) -> int:
        return self.group_sizes.numel()

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.top_k


def route(topk_ids: torch.Tensor, num_experts: int, validate: bool = True) -> RoutingPlan:
    """Plan for ``topk_ids`` [T, k] (int) over ``num_experts`` experts.

    ``validate=True`` checks that the ids lie in [0, num_experts): on the CPU with a ValueError, on a GPU (and
    while torch.compile traces) on the device, with no host sync, so that a call can be captured in a CUDA
    graph (a failed check is then a device-side assertion).

    Where Triton runs, the plan is three small kernels (one where T * top_k <= 128) and the check's assertion
    (:mod:`moegemm.grouped.routing_kernels`), and under torch.compile the same kernels as one custom op;
    elsewhere torch ops (a stable sort). Both give the same plan.
    """
    flat, t, k, on_device_check = _checked_flat(topk_ids, num_experts, validate)
    return _plan(flat, t, k, num_experts, on_device_check)


def _plan(flat: torch.Tensor, t: int, k: int, num_experts: int, on_device_check: bool) -> RoutingPlan:
    """route's plan from its checked flat ids."""
    if flat.numel() and triton_here(flat):
        # a few Triton launches (routing_kernels); under torch.compile the same, as one custom op
        if torch.compiler.is_compiling():
            arrays = route_op(flat, num_experts, k, on_device_check)
        else:
            arrays = route_arrays(flat, num_experts, k, on_device_check)
    else:
        arrays = _route_torch(flat.to(torch.int64), num_experts, k)
    return _plan_of(arrays, t, k)


def _plan_of(arrays, t: int, k: int) -> RoutingPlan:
    tok, slot, slot_rows, sizes, offsets = arrays
    return RoutingPlan(
        sorted_token_ids=tok,
        sorted_slot=slot,
        slot_rows=slot_rows,
        group_sizes=sizes,
        group_offsets=offsets,
        num_tokens=t,
        top_k=k,
    )


def _checked_flat(topk_ids, num_experts, validate: bool):
    """route's argument checks: (the flat ids, T, top_k, whether the id check runs on the device); with
    ``validate`` and no GPU, the ids' range checked here (a ValueError) or, while traced, asserted."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected a 2-D [T, top_k] tensor, got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise TypeError(f"topk_ids: expected an integer tensor, got {topk_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    t, k = topk_ids.shape
    if k > num_experts:
        raise ValueError(f"topk_ids: top_k={k} exceeds num_experts={num_experts}")
    flat = topk_ids.reshape(-1)
    if flat.numel() >= 2**31:
        raise ValueError(f"topk_ids: T * top_k = {flat.numel()} slots; at most 2^31 - 1 are supported")
    on_device_check = validate and flat.device.type == "cuda"
    if validate and flat.numel() and not on_device_check:
        if torch.compiler.is_compiling():  # traced on the CPU: torch ops
            torch._assert_async(
                (flat.min() >= 0) & (flat.max() < num_experts),
                f"topk_ids: expert ids must be in [0, {num_experts})",
            )
        else:
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= num_experts:
                raise ValueError(
                    f"topk_ids: expert ids must be in [0, {num_experts}), got range [{lo}, {hi}]"
                )
    return flat, t, k, on_device_check


def route_and_permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    validate: bool = True,
) -> tuple[RoutingPlan, torch.Tensor, torch.Tensor]:
    """(plan, x_sorted, weights_sorted): :func:`route`, :func:`permute` and :func:`sorted_weights` in one
    call, with the same results. Where Triton runs and x's columns are unit stride, the plan's kernels move
    the rows and weights as they place them (:func:`moegemm.grouped.routing_kernels.plan_and_gather`: one
    launch up to 64 slots, T * top_k, ``routing_kernels.GATHER_SLOTS``, three past them; under
    torch.compile the same, as a custom op); else (and where a gradient is recorded) the three in turn."""
    flat, t, k, on_device_check = _checked_flat(topk_ids, num_experts, validate)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, K] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[0] != t:
        raise ValueError(f"x: has {x.shape[0]} rows but topk_ids routes {t} tokens")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (t, k):
        got = getattr(topk_weights, "shape", None)
        raise ValueError(f"topk_weights: expected shape ({t}, {k}), got {got}")
    for name, v in (("x", x), ("topk_weights", topk_weights)):
        if v.device != flat.device:
            raise ValueError(f"{name}: on {v.device}, but topk_ids is on {flat.device}")
    if not _gathers(flat, x, topk_weights):
        plan = _plan(flat, t, k, num_experts, on_device_check)
        return plan, permute(x, plan), sorted_weights(topk_weights, plan)
    flat, w = flat.contiguous(), topk_weights.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        *arrays, xs, ws = route_gather_op(flat, x, w, num_experts, k, on_device_check)
    else:
        *arrays, xs, ws = gather_arrays(flat, num_experts, k, x, w, on_device_check)
    return _plan_of(arrays, t, k), xs, ws


def route_with_weights(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, validate: bool
) -> tuple[RoutingPlan, torch.Tensor]:
    """(plan, weights_sorted): :func:`route_and_permute` without the permuted rows, for a layer whose
    gate/up reads x's rows by token id (moegemm.grouped.gather); the arguments checked as there. Where
    Triton runs, x's columns are unit stride and no gradient is recorded, the gathering plan's kernels
    with nothing copied; else :func:`route` and :func:`sorted_weights`."""
    flat, t, k, on_device_check = _checked_flat(topk_ids, num_experts, validate)
    if not _gathers(flat, x, topk_weights):
        plan = _plan(flat, t, k, num_experts, on_device_check)
        return plan, sorted_weights(topk_weights, plan)
    w = topk_weights.reshape(-1).contiguous()
    *arrays, _, ws = gather_arrays(flat.contiguous(), num_experts, k, x, w, on_device_check, copy_x=False)
    return _plan_of(arrays, t, k), ws


def _gathers(flat: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor) -> bool:
    """Whether the gathering plan's kernels serve: slots to route, Triton running, x's columns unit stride,
    and no gradient recorded (those kernels have none: where one is recorded, the steps in turn)."""
    return bool(flat.numel() and triton_here(x) and x.stride(1) == 1) and not records_grad(x, topk_weights)


def route_arrays(flat: torch.Tensor, num_experts: int, top_k: int, check: bool):
    """The plan's five arrays from the Triton routing kernels; ``check``: assert on the device that every id
    lies in [0, num_experts)."""
    *arrays, ok = plan_arrays(flat.contiguous(), num_experts, top_k)
    _assert_ids(ok, num_experts, check)
    return tuple(arrays)


def gather_arrays(
    flat: torch.Tensor,
    num_experts: int,
    top_k: int,
    x: torch.Tensor,
    flat_weights: torch.Tensor,
    check: bool,
    copy_x: bool = True,
):
    """route_arrays' five arrays, the permuted rows of x and the weights in row order, from the gathering
    kernels (:func:`moegemm.grouped.routing_kernels.plan_and_gather`, ``copy_x`` as there); ``check`` as
    route_arrays'."""
    *arrays, ok, xs, ws = plan_and_gather(flat, num_experts, top_k, x, flat_weights, copy_x=copy_x)
    _assert_ids(ok, num_experts, check)
    return (*arrays, xs, ws)


# The routing steps as custom ops, for the traced path to run the same kernels as the eager one. Each returns
# new tensors (no mutation); its fake implementation gives their shapes.


@torch.library.custom_op("moegemm::route", mutates_args=())
def route_op(
    flat_ids: torch.Tensor, num_experts: int, top_k: int, check: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return route_arrays(flat_ids, num_experts, top_k, check)


@route_op.register_fake
def _(flat_ids, num_experts, top_k, check):
    return plan_buffers(flat_ids, num_experts)[:5]


@torch.library.custom_op("moegemm::route_gather", mutates_args=())
def route_gather_op(
    flat_ids: torch.Tensor,
    x: torch.Tensor,
    flat_weights: torch.Tensor,
    num_experts: int,
    top_k: int,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return gather_arrays(flat_ids, num_experts, top_k, x, flat_weights, check)


@route_gather_op.register_fake
def _(flat_ids, x, flat_weights, num_experts, top_k, check):
    n = flat_ids.shape[0]
    return (*plan_buffers(flat_ids, num_experts)[:5], x.new_empty((n, x.shape[1])), flat_weights.new_empty(n))


def _assert_ids(ok: torch.Tensor, num_experts: int, check: bool) -> None:
    if check:
        torch._assert_async(ok.squeeze(0), f"topk_ids: expert ids must be in [0, {num_experts})")


def _route_torch(flat: torch.Tensor, num_experts: int, k: int):
    """The same arrays from torch ops (a stable sort; where Triton does not run)."""
    # flat slots grouped by expert, token order kept; 16-bit keys where the ids fit (a radix sort's passes
    # scale with the key's width)
    keys = flat.to(torch.int16) if num_experts <= torch.iinfo(torch.int16).max else flat
    order = torch.sort(keys, stable=True).indices
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync on CUDA).
    sizes = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    sizes.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(sizes, 0)
    slot_rows = torch.empty_like(order, dtype=torch.int32)
    slot_rows.scatter_(0, order, torch.arange(order.numel(), dtype=torch.int32, device=order.device))
    return (order // max(k, 1)).to(torch.int32), order.to(torch.int32), slot_rows, sizes, offsets


def permute(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """x [T, K] -> x_sorted [T * top_k, K]: each token copied once per chosen expert, grouped by expert."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, K] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"x: has {x.shape[0]} rows but the plan routes {plan.num_tokens} tokens")
    if x.device != plan.sorted_token_ids.device:
        raise ValueError(f"x: on {x.device}, but the plan is on {plan.sorted_token_ids.device}")
    if records_grad(x):
        return permute_rows_op(x, plan.sorted_token_ids, plan.slot_rows, plan.top_k)
    return gather_rows(x, plan.sorted_token_ids)


@torch.library.custom_op("moegemm::permute_rows", mutates_args=())
def permute_rows_op(
    x: torch.Tensor, sorted_token_ids: torch.Tensor, slot_rows: torch.Tensor, top_k: int
) -> torch.Tensor:
    """:func:`permute` where a gradient is recorded: the gather, with a deterministic backward."""
    return x.index_select(0, sorted_token_ids)


@permute_rows_op.register_fake
def _(x, sorted_token_ids, slot_rows, top_k):
    return x.new_empty((sorted_token_ids.shape[0], x.shape[1]))


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])
    ctx.top_k = inputs[3]


def _permute_backward(ctx, grad):
    # each token's gradient: its top_k rows' gradients, summed in a fixed order
    (slot_rows,) = ctx.saved_tensors
    return combine_any(grad, slot_rows, ctx.top_k, None), None, None, None


permute_rows_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("moegemm::gather_slots", mutates_args=())
def gather_slots_op(src: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """src.index_select(0, perm) for a permutation ``perm`` (:func:`sorted_weights` where a gradient is
    recorded), whose backward puts each gradient back at its index."""
    return src.index_select(0, perm)


@gather_slots_op.register_fake
def _(src, perm):
    return src.new_empty((perm.shape[0], *src.shape[1:]))


def _slots_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.n = inputs[0].shape[0]


def _slots_backward(ctx, grad):
    (perm,) = ctx.saved_tensors
    return grad.new_zeros((ctx.n, *grad.shape[1:])).index_copy(0, perm.to(torch.int64), grad), None


gather_slots_op.register_autograd(_slots_backward, setup_context=_slots_setup)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src.index_select(0, index); under torch.compile the same ATen kernel as a custom op, so that the traced
    layer gathers as the eager one does."""
    if torch.compiler.is_compiling():
        return gather_rows_op(src, index)
    return src.index_select(0, index)


@torch.library.custom_op("moegemm::gather_rows", mutates_args=())
def gather_rows_op(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return src.index_select(0, index)


@gather_rows_op.register_fake
def _(src, index):
    return src.new_empty((index.shape[0], *src.shape[1:]))


def row_positions(group_offsets: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, position within that expert's rows) of every permuted row, int64, on the device."""
    rows = torch.arange(num_rows, device=group_offsets.device, dtype=torch.int64)
    offsets = group_offsets.to(torch.int64)
    expert = torch.bucketize(rows, offsets[1:], right=True)
    return expert, rows - offsets[expert]


def sorted_weights(topk_weights: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Gating weights in permuted row order, for ``grouped_mm(..., row_scale=...)``."""
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"topk_weights: expected a torch.Tensor, got {type(topk_weights).__name__}")
    if tuple(topk_weights.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(
            f"topk_weights: expected shape ({plan.num_tokens}, {plan.top_k}), got {tuple(topk_weights.shape)}"
        )
    if records_grad(topk_weights):
        return gather_slots_op(topk_weights.reshape(-1), plan.sorted_slot)
    return gather_rows(topk_weights.reshape(-1), plan.sorted_slot)
