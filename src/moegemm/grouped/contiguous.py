"""The launcher of the contiguous layout (rows grouped by expert, one launch for all experts): a call spec
(:mod:`moegemm.grouped.call`) and its tensors in, the output out. A call like an earlier one in everything
its checks, config and compiled kernel depend on takes that call's plan (one dict lookup, then the compiled
kernel's launch); a first call is checked, configured (given, tuned, or timed on a shape's first call) and
launched. The custom op ``moegemm::grouped_mm`` that ``torch.compile`` traces runs the same launcher
(registered here, its schema generated from the spec)."""

from __future__ import annotations

import dataclasses

import torch

from .. import autotune
from .._runtime import INTERPRET, check_device, device_smem_per_block, gpu_slug
from .._triton_common import check_dtype
from ..epilogue import Epilogue
from .call import GroupedCall, register_op
from .checks import check_offsets, check_w
from .config import TIMED_SOURCES, GroupedConfig, choose, fitted_shortlist, swiglu_config, timed_key
from .launch import GroupedPlan, launch, launch_spec


def run(
    call: GroupedCall,
    x_sorted: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The grouped GEMM ``call`` describes, recording no gradient: the custom op under ``torch.compile``,
    else the plan of an earlier call like it, else a first call's checks, config and launch."""
    if torch.compiler.is_compiling():
        if out is None:
            n = w.shape[2] if call.w_layout == "kn" else w.shape[1]
            out = x_sorted.new_empty((x_sorted.shape[0], n // 2 if call.swiglu else n))
        grouped_mm_op(x_sorted, w, group_offsets, out, row_scale, *call.op_args())
        return out
    key = _plan_key(call, x_sorted, w, group_offsets, out, row_scale)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan.run(x_sorted, w, group_offsets, out, row_scale, call.validate)
    return _first_call(call, key, x_sorted, w, group_offsets, out, row_scale)


def _check(call: GroupedCall, x_sorted, w, group_offsets, out, row_scale) -> tuple:
    """The arguments' checks: (M_total, K, E, the weights' columns per expert, the output's, w's strides,
    the epilogue, row_scale made contiguous, out or a new output)."""
    swiglu = call.swiglu
    w_name = "w_gate_up" if swiglu else "w"
    if not isinstance(x_sorted, torch.Tensor):
        raise TypeError(f"x_sorted: expected a torch.Tensor, got {type(x_sorted).__name__}")
    if x_sorted.dim() != 2:
        raise ValueError(f"x_sorted: expected a 2-D [M_total, K] tensor, got shape {tuple(x_sorted.shape)}")
    check_dtype("x_sorted", x_sorted)
    check_device("x_sorted", x_sorted)
    m_total, k = x_sorted.shape
    e, n_w, *w_strides = check_w(w, x_sorted, call.w_layout, k, "x_sorted", w_name)
    epi = Epilogue.parse(call.epilogue)
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
    if call.validate:
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


def _first_call(call: GroupedCall, key, x_sorted, w, group_offsets, out, row_scale) -> torch.Tensor:
    """A call with no plan yet: checks, the config (tuned, autotuned on a shape's first call, or given), the
    launch; the plan that later calls of ``key`` take (see GroupedPlan), where one applies."""
    m_total, k, e, n_w, n, w_strides, epi, row_scale, out = _check(
        call, x_sorted, w, group_offsets, out, row_scale
    )
    if m_total == 0 or n == 0:
        return out
    if k == 0:  # every product is 0; silu(0) * 0 = 0
        acc = epi.torch_apply(torch.zeros((m_total, n), dtype=torch.float32, device=x_sorted.device))
        return out.copy_(acc * row_scale.float()[:, None] if row_scale is not None else acc)
    swiglu = call.swiglu
    offsets = group_offsets.to(torch.int32).contiguous()
    scale = row_scale if row_scale is not None else out

    def kernel_cfg(cfg: GroupedConfig) -> GroupedConfig:  # the tiles the launched kernel takes
        return swiglu_config(cfg) if swiglu else cfg

    def spec(cfg: GroupedConfig) -> tuple:
        return launch_spec(
            call,
            kernel_cfg(cfg),
            epi,
            x_sorted,
            w,
            w_strides,
            offsets,
            scale,
            row_scale is not None,
            out,
            e,
            n,
            k,
        )

    def kernel_of(cfg: GroupedConfig) -> GroupedConfig:  # the grid is the launch's, not the kernel's
        return dataclasses.replace(kernel_cfg(cfg), persistent=False)

    def run_cfg(cfg: GroupedConfig) -> None:
        kernel, work_items, args, kwargs, _ = spec(cfg)
        launch(kernel, work_items, kernel_cfg(cfg), x_sorted, args, kwargs)

    final = True  # the config is the one every later call of this shape takes (see GroupedPlan)
    w_layout = call.w_layout
    if call.config is not None:
        cfg = call.config
    else:
        slug = gpu_slug(x_sorted)
        smem = device_smem_per_block(x_sorted)
        cfg, source = choose(m_total, k, x_sorted.dtype, slug, e, n_w, w_layout, smem)
        if source in TIMED_SOURCES or swiglu:
            # The fused kernel's timed choices are its own (the unfused kernel's, choose has looked up
            # already). The tuned table holds unfused tiles, so on a tuned shape the fused kernel times that
            # entry's tiles against the regime's shortlist too.
            key_t = timed_key(m_total, k, x_sorted.dtype, e, n_w, w_layout, swiglu, slug)
            timed = autotune.lookup(slug, key_t) if swiglu else None
            if timed is not None:
                cfg = GroupedConfig.from_dict(timed)
            elif autotune.can_time(x_sorted):
                candidates = fitted_shortlist(m_total, e, n_w, slug, x_sorted.dtype, smem)
                if swiglu and source not in TIMED_SOURCES:
                    candidates = [cfg] + [c for c in candidates if swiglu_config(c) != swiglu_config(cfg)]
                cfg, times = autotune.fastest(run_cfg, candidates, parallel_compile=True, kernel_of=kernel_of)
                autotune.remember(slug, key_t, dataclasses.asdict(cfg), times)
            else:  # not timed now (a capture, autotuning off): a later call may time it, unless timing is
                #     off (the key holds whether it is, see _plan_key)
                final = not autotune.enabled()
    if key is not None and final and not torch.cuda.is_current_stream_capturing():
        offsets_ready = group_offsets.dtype == torch.int32 and group_offsets.is_contiguous()
        plan = GroupedPlan.make(
            spec(cfg), kernel_cfg(cfg), call, x_sorted, e, n_w, n, k, row_scale is not None, offsets_ready
        )
        if plan is not None:
            _PLANS[key] = plan
            return plan.run(x_sorted, w, group_offsets, out, row_scale, False)
    run_cfg(cfg)
    return out


_PLANS: dict = {}  # _plan_key -> GroupedPlan


def _plan_key(call: GroupedCall, x, w, offsets, out, row_scale) -> tuple | None:
    """What a call's checks, config and compiled kernel depend on: the call spec, the operands' shapes,
    strides, dtypes, devices and alignment (Triton specializes pointers on 16-byte alignment, TMA needs it),
    and with no config whether first calls may time (moegemm.autotune); None where no plan applies (not CUDA
    tensors, the interpreter, an unhashable argument)."""
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
        call.key,
        _operand_key(x),
        _operand_key(w),
        _operand_key(offsets),
        _operand_key(row_scale),
        _operand_key(out),
        call.config is None and autotune.enabled(),
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


# The custom op writes into an output it is given (mutates_args=("out",)), as the eager call can; its fake
# implementation checks nothing and writes nothing, the output's shape being the caller's.
grouped_mm_op = register_op(
    "moegemm::grouped_mm",
    GroupedCall,
    "Tensor x_sorted, Tensor w, Tensor group_offsets, Tensor(a!) out, Tensor? row_scale",
    run,  # (at run time, outside the trace: the eager launcher)
)
