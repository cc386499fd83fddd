"""The forward of ``grouped_mm`` and ``grouped_mm_swiglu``, the contiguous layout (rows grouped by expert, one
launch for all experts): argument checks, the config (given, tuned, or timed on a shape's first call), the
launch, and the plan a repeat call of the same shape takes. Each is also a torch custom op (registered here,
beside the implementation it runs), which is what ``torch.compile`` traces."""

from __future__ import annotations

import dataclasses

import torch

from .. import autotune
from .._runtime import INTERPRET, check_device, device_smem_per_block, gpu_slug
from .._triton_common import check_dtype
from ..epilogue import Epilogue
from .checks import check_offsets, check_w
from .config import (
    TIMED_SOURCES,
    GroupedConfig,
    autotune_key,
    choose,
    config_list,
    config_of,
    fitted_shortlist,
    swiglu_config,
)
from .launch import GroupedPlan, launch, spec_contiguous, spec_swiglu


def grouped_mm_forward(
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
    """:func:`moegemm.grouped.grouped_mm` recording no gradient: the custom op under ``torch.compile``,
    else the launch."""
    if torch.compiler.is_compiling():
        n = w.shape[2] if w_layout == "kn" else w.shape[1]
        out = x_sorted.new_empty((x_sorted.shape[0], n)) if out is None else out
        epi = epilogue if isinstance(epilogue, str) else epilogue.name.lower()
        grouped_mm_op(
            x_sorted,
            w,
            group_offsets,
            out,
            w_layout,
            epi,
            row_scale,
            config_list(config),
            allow_tf32,
            validate,
        )
        return out
    return _grouped(
        x_sorted,
        w,
        group_offsets,
        w_layout,
        epilogue,
        row_scale,
        config,
        out,
        allow_tf32,
        validate,
        swiglu=False,
    )


def grouped_mm_swiglu_forward(
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
    """:func:`moegemm.grouped.grouped_mm_swiglu` recording no gradient: the custom op under
    ``torch.compile``, else the launch."""
    if torch.compiler.is_compiling():
        n2 = w_gate_up.shape[2] if w_layout == "kn" else w_gate_up.shape[1]
        out = x_sorted.new_empty((x_sorted.shape[0], n2 // 2)) if out is None else out
        grouped_mm_swiglu_op(
            x_sorted,
            w_gate_up,
            group_offsets,
            out,
            w_layout,
            row_scale,
            config_list(config),
            allow_tf32,
            validate,
        )
        return out
    return _grouped(
        x_sorted,
        w_gate_up,
        group_offsets,
        w_layout,
        "none",
        row_scale,
        config,
        out,
        allow_tf32,
        validate,
        swiglu=True,
    )


def _check(x_sorted, w, group_offsets, row_scale, out, w_layout, epilogue, validate, swiglu) -> tuple:
    """The arguments' checks: (M_total, K, E, the weights' columns per expert, the output's, w's strides,
    the epilogue, row_scale made contiguous, out or a new output)."""
    w_name = "w_gate_up" if swiglu else "w"
    if not isinstance(x_sorted, torch.Tensor):
        raise TypeError(f"x_sorted: expected a torch.Tensor, got {type(x_sorted).__name__}")
    if x_sorted.dim() != 2:
        raise ValueError(f"x_sorted: expected a 2-D [M_total, K] tensor, got shape {tuple(x_sorted.shape)}")
    check_dtype("x_sorted", x_sorted)
    check_device("x_sorted", x_sorted)
    m_total, k = x_sorted.shape
    e, n_w, *w_strides = check_w(w, x_sorted, w_layout, k, "x_sorted", w_name)
    epi = Epilogue.parse(epilogue)
    if swiglu and n_w % 2:
        raise ValueError(f"w_gate_up: expected an even gate/up width 2I, got {n_w}")
    n = n_w // 2 if swiglu else n_w  # the output's columns
    if not isinstance(group_offsets, torch.Tensor) or group_offsets.dim() != 1:
        raise ValueError("group_offsets: expected a 1-D int tensor of length E + 1")
    if group_offsets.numel() != e + 1:
        raise ValueError(f"group_offsets: expected length E + 1 = {e + 1}, got {group_offsets.numel()}")
    if group_offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"group_offsets: expected int32 or int64, got {group_offsets.dtype}")
    if group_offsets.device != x_sorted.device:
        raise ValueError(f"group_offsets: on {group_offsets.device}, but x_sorted is on {x_sorted.device}")
    if validate:
        check_offsets(group_offsets, m_total)
    if row_scale is not None:
        if not isinstance(row_scale, torch.Tensor) or tuple(row_scale.shape) != (m_total,):
            got = getattr(row_scale, "shape", None)
            raise ValueError(f"row_scale: expected shape ({m_total},), got {got}")
        if row_scale.device != x_sorted.device:
            raise ValueError(f"row_scale: on {row_scale.device}, but x_sorted is on {x_sorted.device}")
        if not row_scale.is_floating_point():
            raise TypeError(f"row_scale: expected a floating-point tensor, got {row_scale.dtype}")
        row_scale = row_scale.contiguous()
    if out is None:
        out = torch.empty((m_total, n), dtype=x_sorted.dtype, device=x_sorted.device)
    elif tuple(out.shape) != (m_total, n) or out.dtype != x_sorted.dtype or out.device != x_sorted.device:
        raise ValueError(f"out: expected a ({m_total}, {n}) {x_sorted.dtype} tensor on {x_sorted.device}")
    return m_total, k, e, n_w, n, w_strides, epi, row_scale, out


def _grouped(
    x_sorted, w, group_offsets, w_layout, epilogue, row_scale, config, out, allow_tf32, validate, swiglu: bool
) -> torch.Tensor:
    """grouped_mm, or with ``swiglu`` grouped_mm_swiglu: checks, the config (tuned, autotuned on a shape's
    first call, or given), the launch. A call like an earlier one in everything the checks, the config and
    the compiled kernel depend on (see _plan_key) goes straight to that call's launch (GroupedPlan)."""
    key = _plan_key(
        x_sorted, w, group_offsets, row_scale, out, w_layout, epilogue, config, allow_tf32, swiglu
    )
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan.run(x_sorted, w, group_offsets, row_scale, out, validate)
    m_total, k, e, n_w, n, w_strides, epi, row_scale, out = _check(
        x_sorted, w, group_offsets, row_scale, out, w_layout, epilogue, validate, swiglu
    )
    if m_total == 0 or n == 0:
        return out
    if k == 0:  # every product is 0; silu(0) * 0 = 0
        acc = epi.torch_apply(torch.zeros((m_total, n), dtype=torch.float32, device=x_sorted.device))
        return out.copy_(acc * row_scale.float()[:, None] if row_scale is not None else acc)
    offsets = group_offsets.to(torch.int32).contiguous()
    scale = row_scale if row_scale is not None else out

    def spec(cfg: GroupedConfig) -> tuple:
        if swiglu:
            return spec_swiglu(
                swiglu_config(cfg),
                x_sorted,
                w,
                w_strides,
                w_layout,
                offsets,
                scale,
                row_scale is not None,
                out,
                e,
                n,
                k,
                allow_tf32,
            )
        return spec_contiguous(
            cfg,
            x_sorted,
            w,
            w_strides,
            w_layout,
            offsets,
            scale,
            row_scale is not None,
            out,
            e,
            n,
            k,
            epi,
            allow_tf32,
        )

    def kernel_of(cfg: GroupedConfig) -> GroupedConfig:  # the grid is the launch's, not the kernel's
        return dataclasses.replace(swiglu_config(cfg) if swiglu else cfg, persistent=False)

    def run(cfg: GroupedConfig) -> None:
        kernel, work_items, args, kwargs, _ = spec(cfg)
        launch(kernel, work_items, swiglu_config(cfg) if swiglu else cfg, x_sorted, args, kwargs)

    final = True  # the config is the one every later call of this shape takes (see GroupedPlan)
    if config is not None:
        cfg = config
    else:
        slug = gpu_slug(x_sorted)
        smem = device_smem_per_block(x_sorted)
        cfg, source = choose(m_total, k, x_sorted.dtype, slug, e, n_w, w_layout, smem)
        if source in TIMED_SOURCES or swiglu:
            # The fused kernel's timed choices are its own (the unfused kernel's, choose has looked up
            # already). The tuned table holds unfused tiles, so on a tuned shape the fused kernel times that
            # entry's tiles against the regime's shortlist too.
            layout_t = w_layout + ("+swiglu" if swiglu else "")
            key_t = autotune_key(m_total, k, x_sorted.dtype, e, n_w, layout_t, slug)
            timed = autotune.lookup(slug, key_t) if swiglu else None
            if timed is not None:
                cfg = GroupedConfig.from_dict(timed)
            elif autotune.can_time(x_sorted):
                candidates = fitted_shortlist(m_total, e, n_w, slug, x_sorted.dtype, smem)
                if swiglu and source not in TIMED_SOURCES:
                    candidates = [cfg] + [c for c in candidates if swiglu_config(c) != swiglu_config(cfg)]
                cfg, times = autotune.fastest(run, candidates, parallel_compile=True, kernel_of=kernel_of)
                autotune.remember(slug, key_t, dataclasses.asdict(cfg), times)
            else:  # not timed now (a capture, autotuning off): a later call may time it, unless timing is
                #     off (the key holds whether it is, see _plan_key)
                final = not autotune.enabled()
    if key is not None and final and not torch.cuda.is_current_stream_capturing():
        offsets_ready = group_offsets.dtype == torch.int32 and group_offsets.is_contiguous()
        plan = GroupedPlan.make(
            spec(cfg),
            swiglu_config(cfg) if swiglu else cfg,
            x_sorted,
            w_layout,
            e,
            n_w,
            n,
            k,
            swiglu,
            row_scale is not None,
            offsets_ready,
        )
        if plan is not None:
            _PLANS[key] = plan
            return plan.run(x_sorted, w, group_offsets, row_scale, out, False)
    run(cfg)
    return out


_PLANS: dict = {}  # _plan_key -> GroupedPlan


def _plan_key(x, w, offsets, row_scale, out, w_layout, epilogue, config, allow_tf32, swiglu) -> tuple | None:
    """What a call's checks, config and compiled kernel depend on: the operands' shapes, strides, dtypes,
    devices and alignment (Triton specializes pointers on 16-byte alignment, TMA needs it), the other
    arguments, and with no config whether first calls may time (moegemm.autotune); None where no plan
    applies (not CUDA tensors, the interpreter, an unhashable argument)."""
    tensor = torch.Tensor
    if (
        INTERPRET
        or type(x) is not tensor
        or type(w) is not tensor
        or type(offsets) is not tensor
        or not x.is_cuda
    ):
        return None
    key = (
        _operand_key(x),
        _operand_key(w),
        _operand_key(offsets),
        _operand_key(row_scale),
        _operand_key(out),
        w_layout,
        epilogue,
        config,
        allow_tf32,
        swiglu,
        config is None and autotune.enabled(),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _operand_key(t) -> tuple | None:
    if t is None:
        return None
    if type(t) is not torch.Tensor:
        return (type(t),)  # the checks reject it; never a plan's key (see GroupedPlan.make)
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


# The custom ops write into an output they are given (mutates_args=("out",)), as the eager functions can;
# their fake implementations check nothing and write nothing, the output's shape being the caller's.


@torch.library.custom_op("moegemm::grouped_mm", mutates_args=("out",))
def grouped_mm_op(
    x_sorted: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    out: torch.Tensor,
    w_layout: str,
    epilogue: str,
    row_scale: torch.Tensor | None,
    config: list[int] | None,
    allow_tf32: bool,
    validate: bool,
) -> None:
    _grouped(
        x_sorted,
        w,
        group_offsets,
        w_layout,
        epilogue,
        row_scale,
        config_of(config),
        out,
        allow_tf32,
        validate,
        swiglu=False,
    )


@grouped_mm_op.register_fake
def _(x_sorted, w, group_offsets, out, w_layout, epilogue, row_scale, config, allow_tf32, validate):
    return None


@torch.library.custom_op("moegemm::grouped_mm_swiglu", mutates_args=("out",))
def grouped_mm_swiglu_op(
    x_sorted: torch.Tensor,
    w_gate_up: torch.Tensor,
    group_offsets: torch.Tensor,
    out: torch.Tensor,
    w_layout: str,
    row_scale: torch.Tensor | None,
    config: list[int] | None,
    allow_tf32: bool,
    validate: bool,
) -> None:
    _grouped(
        x_sorted,
        w_gate_up,
        group_offsets,
        w_layout,
        "none",
        row_scale,
        config_of(config),
        out,
        allow_tf32,
        validate,
        swiglu=True,
    )


@grouped_mm_swiglu_op.register_fake
def _(x_sorted, w_gate_up, group_offsets, out, w_layout, row_scale, config, allow_tf32, validate):
    return None
