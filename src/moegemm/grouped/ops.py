"""The grouped GEMMs as torch custom ops, so that ``torch.compile(fullgraph=True)`` traces a function that
calls :func:`moegemm.grouped.grouped_mm`, :func:`moegemm.grouped.grouped_mm_swiglu` or
:func:`moegemm.grouped.grouped_mm_masked` with no graph break.

Each op writes into an output it is given (``mutates_args=("out",)``): the masked layout leaves the rows past
masked_m as they were, which only an op that writes in place can promise. The op's real implementation is
the eager function (config choice, autotuning on a shape's first call, launch); its fake implementation
checks nothing and writes nothing, the output's shape being the caller's. Eager calls do not pass through
the ops: they go straight to the launcher.
"""

from __future__ import annotations

import dataclasses

import torch

from .api import GroupedConfig

# Read here, not while tracing (Dynamo does not trace dataclasses.fields on a class).
_FIELDS = tuple((f.name, f.type in (bool, "bool")) for f in dataclasses.fields(GroupedConfig))


def config_list(config: GroupedConfig | None) -> list[int] | None:
    """A config as the ops take it: its fields in order, as ints (None: the library's choice)."""
    return None if config is None else [int(getattr(config, name)) for name, _ in _FIELDS]


def config_of(fields: list[int] | None) -> GroupedConfig | None:
    if not fields:
        return None
    return GroupedConfig(**{name: bool(v) if is_bool else int(v) for (name, is_bool), v in zip(_FIELDS, fields)})


@torch.library.custom_op("moegemm::grouped_mm", mutates_args=("out",))
def grouped_mm_op(x_sorted: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, out: torch.Tensor,
                  w_layout: str, epilogue: str, row_scale: torch.Tensor | None, config: list[int] | None,
                  allow_tf32: bool, validate: bool) -> None:
    from .api import grouped_mm

    grouped_mm(x_sorted, w, group_offsets, w_layout=w_layout, epilogue=epilogue, row_scale=row_scale,
               config=config_of(config), out=out, allow_tf32=allow_tf32, validate=validate)


@grouped_mm_op.register_fake
def _(x_sorted, w, group_offsets, out, w_layout, epilogue, row_scale, config, allow_tf32, validate):
    return None


@torch.library.custom_op("moegemm::grouped_mm_swiglu", mutates_args=("out",))
def grouped_mm_swiglu_op(x_sorted: torch.Tensor, w_gate_up: torch.Tensor, group_offsets: torch.Tensor,
                         out: torch.Tensor, w_layout: str, row_scale: torch.Tensor | None, config: list[int] | None,
                         allow_tf32: bool, validate: bool) -> None:
    from .api import grouped_mm_swiglu

    grouped_mm_swiglu(x_sorted, w_gate_up, group_offsets, w_layout=w_layout, row_scale=row_scale,
                      config=config_of(config), out=out, allow_tf32=allow_tf32, validate=validate)


@grouped_mm_swiglu_op.register_fake
def _(x_sorted, w_gate_up, group_offsets, out, w_layout, row_scale, config, allow_tf32, validate):
    return None


@torch.library.custom_op("moegemm::grouped_mm_masked", mutates_args=("out",))
def grouped_mm_masked_op(x: torch.Tensor, w: torch.Tensor, masked_m: torch.Tensor, out: torch.Tensor,
                         w_layout: str, epilogue: str, config: list[int] | None, allow_tf32: bool) -> None:
    from .api import grouped_mm_masked

    grouped_mm_masked(x, w, masked_m, w_layout=w_layout, epilogue=epilogue, config=config_of(config), out=out,
                      allow_tf32=allow_tf32)


@grouped_mm_masked_op.register_fake
def _(x, w, masked_m, out, w_layout, epilogue, config, allow_tf32):
    return None


def traced_grouped_mm(x_sorted, w, group_offsets, w_layout, epilogue, row_scale, config, out, allow_tf32,
                      validate):
    """What :func:`grouped_mm` does while being traced: allocate ``out`` where none is given (its shape from
    the operands), then the custom op."""
    n = w.shape[2] if w_layout == "kn" else w.shape[1]
    if out is None:
        out = x_sorted.new_empty((x_sorted.shape[0], n))
    epi = epilogue if isinstance(epilogue, str) else epilogue.name.lower()
    grouped_mm_op(x_sorted, w, group_offsets, out, w_layout, epi, row_scale, config_list(config), allow_tf32,
                  validate)
    return out


def traced_grouped_mm_swiglu(x_sorted, w_gate_up, group_offsets, w_layout, row_scale, config, out, allow_tf32,
                             validate):
    """What :func:`grouped_mm_swiglu` does while being traced (see traced_grouped_mm)."""
    n2 = w_gate_up.shape[2] if w_layout == "kn" else w_gate_up.shape[1]
    if out is None:
        out = x_sorted.new_empty((x_sorted.shape[0], n2 // 2))
    grouped_mm_swiglu_op(x_sorted, w_gate_up, group_offsets, out, w_layout, row_scale, config_list(config),
                         allow_tf32, validate)
    return out


def traced_grouped_mm_masked(x, w, masked_m, w_layout, epilogue, config, out, allow_tf32):
    """What :func:`grouped_mm_masked` does while being traced (see traced_grouped_mm)."""
    n = w.shape[2] if w_layout == "kn" else w.shape[1]
    if out is None:
        out = x.new_empty((x.shape[0], x.shape[1], n))
    epi = epilogue if isinstance(epilogue, str) else epilogue.name.lower()
    grouped_mm_masked_op(x, w, masked_m, out, w_layout, epi, config_list(config), allow_tf32)
    return out


# The steps around the GEMMs, for the traced path to run the same kernels as the eager one. Each returns new
# tensors (no mutation); its fake implementation gives their shapes.

@torch.library.custom_op("moegemm::route", mutates_args=())
def route_op(flat_ids: torch.Tensor, num_experts: int, top_k: int, check: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .routing import route_arrays

    return route_arrays(flat_ids, num_experts, top_k, check)


@route_op.register_fake
def _(flat_ids, num_experts, top_k, check):
    from .routing_kernels import plan_buffers

    return plan_buffers(flat_ids, num_experts)[:5]


@torch.library.custom_op("moegemm::route_gather", mutates_args=())
def route_gather_op(flat_ids: torch.Tensor, x: torch.Tensor, flat_weights: torch.Tensor, num_experts: int, top_k: int,
                    check: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor, torch.Tensor]:
    from .routing import gather_arrays

    return gather_arrays(flat_ids, num_experts, top_k, x, flat_weights, check)


@route_gather_op.register_fake
def _(flat_ids, x, flat_weights, num_experts, top_k, check):
    from .routing_kernels import plan_buffers

    n = flat_ids.shape[0]
    return (*plan_buffers(flat_ids, num_experts)[:5], x.new_empty((n, x.shape[1])), flat_weights.new_empty(n))


@torch.library.custom_op("moegemm::combine", mutates_args=())
def combine_op(y_sorted: torch.Tensor, slot_rows: torch.Tensor, top_k: int,
               topk_weights: torch.Tensor | None) -> torch.Tensor:
    from .pointwise import combine

    return combine(y_sorted, slot_rows, top_k, topk_weights)


@combine_op.register_fake
def _(y_sorted, slot_rows, top_k, topk_weights):
    return y_sorted.new_empty((y_sorted.shape[0] // max(top_k, 1), y_sorted.shape[1]))


@torch.library.custom_op("moegemm::silu_mul", mutates_args=())
def silu_mul_op(gu: torch.Tensor) -> torch.Tensor:
    from .pointwise import silu_mul

    return silu_mul(gu)


@silu_mul_op.register_fake
def _(gu):
    return gu.new_empty((gu.shape[0], gu.shape[1] // 2))


@torch.library.custom_op("moegemm::gate_up_act", mutates_args=())
def gate_up_act_op(xs: torch.Tensor, w_gate_up: torch.Tensor, group_offsets: torch.Tensor, w_layout: str
                   ) -> torch.Tensor:
    from .ffn import gate_up_act

    return gate_up_act(xs, w_gate_up, group_offsets, w_layout)


@gate_up_act_op.register_fake
def _(xs, w_gate_up, group_offsets, w_layout):
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    return xs.new_empty((xs.shape[0], two_i // 2))


@torch.library.custom_op("moegemm::gather_rows", mutates_args=())
def gather_rows_op(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return src.index_select(0, index)


@gather_rows_op.register_fake
def _(src, index):
    return src.new_empty((index.shape[0], *src.shape[1:]))
