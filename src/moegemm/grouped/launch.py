"""Launching the grouped kernels: the arguments of one launch of each (TMA descriptors where the inputs
allow them), the grid and its occupancy, and the plans that let a repeat call skip all of it."""

from __future__ import annotations

import dataclasses

import torch
import triton

from .._runtime import device_sm_count
from .._triton_common import BoundKernel, compile_only, compiled_per_sm, dot_meta, programs_per_sm, raw_stream
from ..epilogue import Epilogue
from . import config
from .checks import check_offsets
from .config import GroupedConfig
from .kernels import _grouped_mm_kernel, _grouped_mm_swiglu_tma_kernel, _grouped_mm_tma_kernel
from .tma import tma_descriptors

# -- one launch's arguments -----------------------------------------------------------------------------

# How many leading arguments of each kernel change from call to call (the operands, the output, the
# offsets and scales); a plan keeps the rest (see GroupedPlan).
_TMA_SLOTS, _SWIGLU_TMA_SLOTS, _PTR_SLOTS = 6, 5, 5


def _max_tiles(m_total: int, e: int, n: int, cfg: GroupedConfig, what: str) -> int:
    """An upper bound on the tiles known without a sync: at most min(E, M_total) experts hold rows, and
    each adds at most one partly filled row tile to ceil(M_total / BLOCK_M)."""
    max_tiles = (triton.cdiv(m_total, cfg.block_m) + min(e, m_total)) * triton.cdiv(n, cfg.block_n)
    if max_tiles >= 2**31:
        raise ValueError(
            f"x_sorted: {m_total} rows x {what}={n} need {max_tiles} tiles of "
            f"{cfg.block_m}x{cfg.block_n}, more than the kernel's int32 tile index holds"
        )
    return max_tiles


def launch_spec(
    call, cfg: GroupedConfig, epi: Epilogue, x_sorted, w, w_strides, offsets, scale, has_scale, out, e, n, k
):
    """(kernel, work items, args, kwargs, slots) of one launch of ``call``'s kernel for ``cfg`` (with
    ``call.swiglu`` already swiglu_config's), TMA where the inputs allow it. w_strides: (expert, K, N)
    strides of w; n: the output's columns (the fused SwiGLU kernel's weights have 2n per expert); slots: how
    many leading arguments change from call to call."""
    swiglu = call.swiglu
    max_tiles = _max_tiles(x_sorted.shape[0], e, n, cfg, "I" if swiglu else "N")
    common = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        E_BLOCK=max(16, triton.next_power_of_2(e)),
        GROUP_M=config.GROUP_M,
        HAS_SCALE=has_scale,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    dot = dot_meta(x_sorted.dtype, call.allow_tf32)
    descs = (
        tma_descriptors(x_sorted, w, call.w_layout, e, 2 * n if swiglu else n, k, cfg) if cfg.tma else None
    )
    if descs is not None:
        meta = dict(
            W_KN=call.w_layout == "kn",
            WARP_SPECIALIZE=cfg.flatten,
            FLATTEN=cfg.flatten,
            MIX=cfg.mix,
            UPCAST=dot["UPCAST"],
            **common,
        )
        if swiglu:  # the fused kernel reads x and w alone, with no tail tiles and no other epilogue
            kernel, descs, slots = _grouped_mm_swiglu_tma_kernel, descs[:2], _SWIGLU_TMA_SLOTS
        else:
            kernel, slots = _grouped_mm_tma_kernel, _TMA_SLOTS
            meta.update(TAIL_M=cfg.tail_m, MERGE_TAIL=cfg.merge_tail, EPILOGUE=int(epi))
        tail = (out, offsets, scale, n, k, e, x_sorted.shape[0], out.stride(0), out.stride(1))
        return kernel, max_tiles, (*descs, *tail), meta, slots
    s_e, s_k, s_n = w_strides
    return (
        _grouped_mm_kernel,
        max_tiles,
        (
            x_sorted,
            w,
            out,
            offsets,
            scale,
            n,
            k,
            e,
            x_sorted.shape[0],
            x_sorted.stride(0),
            x_sorted.stride(1),
            s_e,
            s_k,
            s_n,
            out.stride(0),
            out.stride(1),
        ),
        dict(EVEN_K=k % cfg.block_k == 0, EPILOGUE=int(epi), SWIGLU=swiglu, **common, **dot),
        _PTR_SLOTS,
    )


# -- the grid -------------------------------------------------------------------------------------------


def grid_size(work_items: int, cfg: GroupedConfig, x: torch.Tensor, per_sm: int = 2) -> int:
    """Programs to launch: one per work item (an upper bound; extra programs exit at once), or on the
    persistent grid ``per_sm`` per SM (as many as can be resident at once, see per_sm), each looping over
    the items."""
    return min(work_items, per_sm * device_sm_count(x)) if cfg.persistent else work_items


def launch(kernel, work_items: int, cfg: GroupedConfig, x: torch.Tensor, args: tuple, kwargs: dict) -> None:
    """Launch ``kernel`` through Triton on the grid grid_size gives, the persistent one sized by per_sm."""
    n = per_sm(kernel, cfg, x, args, kwargs) if cfg.persistent else 2
    kernel[(grid_size(work_items, cfg, x, n),)](*args, **kwargs)


_PER_SM: dict = {}


def per_sm(kernel, cfg: GroupedConfig, x: torch.Tensor, args: tuple, kwargs: dict) -> int:
    """Programs of this compiled kernel that fit on one multiprocessor together, capped at two: by its
    shared memory and registers as compiled (Triton's metadata, read once per kernel variant; the shared
    occupancy model of moegemm._triton_common), one for the flattened loop. Programs beyond what fits only
    wait for a resident one to finish all its tiles. For tiles of which only one fits, neither one nor two
    per SM is the better in every cell, so the tuner chooses between this grid and the plain one per cell;
    where two fit, one per SM leaves the multiprocessor half idle. Where the metadata cannot be had (the
    interpreter), two."""
    if cfg.flatten:
        return 1
    key = (
        kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel),
        x.dtype,
        x.device.index,
        tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, str)))),
    )
    hit = _PER_SM.get(key)
    if hit is None:
        hit = 2
        if torch.cuda.is_available() and x.is_cuda and hasattr(kernel, "warmup"):
            try:
                compiled = compile_only(kernel, (1,), args, kwargs)
                device = x.device.index if x.device.index is not None else torch.cuda.current_device()
                hit = max(1, min(2, compiled_per_sm(compiled, cfg.num_warps, device)))
            except Exception:  # noqa: BLE001 - an API this Triton lacks: the grid of two per SM
                hit = 2
        _PER_SM[key] = hit
    return hit


def fit_per_sm(shared_bytes: int, regs_per_thread: int, num_warps: int, smem_per_sm: int) -> int:
    """per_sm's answer for a kernel of these resources: the programs that fit together, in [1, 2]."""
    return max(1, min(2, programs_per_sm(shared_bytes, regs_per_thread, num_warps, smem_per_sm=smem_per_sm)))


# -- plans ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class GroupedPlan:
    """One (shapes, strides, dtypes, alignment, call spec) of grouped_mm or grouped_mm_swiglu, checked and
    configured once: a later call builds its TMA descriptors (where the kernel takes them) and launches the
    compiled kernel directly (moegemm._triton_common.BoundKernel). Holds no tensor."""

    kernel: object  # the Triton kernel it launches
    bound: BoundKernel
    cfg: GroupedConfig
    call: object  # the call spec (moegemm.grouped.call.GroupedCall)
    tma: bool
    e: int
    n_w: int
    n: int
    k: int
    has_scale: bool
    offsets_ready: bool  # group_offsets is already int32 and contiguous

    @classmethod
    def make(cls, spec: tuple, cfg: GroupedConfig, call, x, e, n_w, n, k, has_scale, offsets_ready):
        """The plan of one launch (``spec``: launch_spec's), or None where this Triton cannot bind one."""
        kernel, work_items, args, kwargs, slots = spec
        if not hasattr(kernel, "warmup"):
            return None
        n_sm = per_sm(kernel, cfg, x, args, kwargs) if cfg.persistent else 2
        try:
            bound = BoundKernel(kernel, (grid_size(work_items, cfg, x, n_sm),), args, kwargs, slots)
        except Exception:  # noqa: BLE001 - a Triton without these APIs: every call goes through Triton's launch
            return None
        tma = kernel is not _grouped_mm_kernel
        return cls(kernel, bound, cfg, call, tma, e, n_w, n, k, has_scale, offsets_ready)

    def run(self, x, w, group_offsets, out, row_scale, validate: bool) -> torch.Tensor:
        m_total = x.shape[0]
        if validate:
            check_offsets(group_offsets, m_total)
        if out is None:
            out = torch.empty((m_total, self.n), dtype=x.dtype, device=x.device)
        offsets = group_offsets if self.offsets_ready else group_offsets.to(torch.int32).contiguous()
        scale = row_scale.contiguous() if self.has_scale else out
        stream = raw_stream(x.device.index)
        if self.tma:
            descs = tma_descriptors(x, w, self.call.w_layout, self.e, self.n_w, self.k, self.cfg)
            if self.call.swiglu:
                descs = descs[:2]
            self.bound(stream, *descs, out, offsets, scale)
        else:
            self.bound(stream, x, w, out, offsets, scale)
        return out
