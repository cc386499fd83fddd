"""``grouped_mm`` (contiguous layout) and ``grouped_mm_masked`` (masked layout): validation and launch."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from .. import tuned
from .._runtime import INTERPRET, check_device, device_sm_count, device_smem_per_sm, gpu_slug
from .._triton_common import BoundKernel, check_dtype, dot_meta, raw_stream
from ..epilogue import Epilogue
from . import autotune
from .kernels import (_grouped_mm_kernel, _grouped_mm_masked_kernel, _grouped_mm_masked_tma_kernel,
                      _grouped_mm_swiglu_tma_kernel, _grouped_mm_tma_kernel)

try:  # host-side tensor descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel serves every config
    TensorDescriptor = None


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False
    group_m: int = 8  # row tiles of one expert walked together, column by column (1: row by row)
    tma: bool = False  # tiles loaded by the tensor-memory accelerator (16-bit, TMA-compatible strides)
    # with tma: Triton's warp_specialize flag on the persistent loop; on sm_90 Triton 3.6 flattens the tile
    # and K loops into one software pipeline instead of splitting warps (the next tile's loads overlap the
    # epilogue; seen in the compiled TTGIR)
    warp_specialize: bool = False
    tail_m: int = 0  # with tma: a tile of <= tail_m rows of its expert is computed as a tail_m-row tile
    merge_tail: bool = False  # with tail_m: an expert's last <= tail_m rows after a whole row tile computed by
    #                           that tile's program from the same weight tiles (no tile of their own)
    mix: int = 0  # with tma: the tiles of experts of at least this many row tiles (tensor-bound: each weight
    #               tile reused from L2) dealt out in proportion among the other experts' (memory-bound), not
    #               in expert order (0); a skewed load then keeps tensor cores and memory busy together

    # Options measured and removed (they never won a cell; see docs/grouped.md): K split inside each tile
    # (split_k), the last waves dealt out by K steps (stream_k), TMA stores (tma_store) and row tiles with
    # extra rows (extra_m). Tables and CSVs written before hold them at their no-op values.
    REMOVED = {"split_k": 1, "stream_k": False, "tma_store": 0, "extra_m": 0}

    @classmethod
    def from_dict(cls, d: dict) -> "GroupedConfig":
        """A config from its dict (a tuned table's entry, a CSV's config column); removed options are
        accepted at their no-op values only."""
        d = dict(d)
        for name, noop in cls.REMOVED.items():
            if name in d and d.pop(name) != noop:
                raise ValueError(f"config.{name}: this option was removed (it never won a measured cell)")
        return cls(**d)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v > 256 or v & (v - 1):
                raise ValueError(f"config.{name}: expected a power of two in [16, 256], got {v!r}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"config.group_m: expected a positive int, got {self.group_m!r}")
        if self.warp_specialize and not self.tma:
            raise ValueError("config.warp_specialize: needs tma=True")
        t = self.tail_m
        if t and (not isinstance(t, int) or t < 16 or t & (t - 1) or t >= self.block_m):
            raise ValueError(f"config.tail_m: expected 0 or a power of two in [16, block_m), got {t!r}")
        if t and not self.tma:
            raise ValueError("config.tail_m: tail tiles are a TMA-kernel feature; needs tma=True")
        if self.merge_tail and not self.tail_m:
            raise ValueError("config.merge_tail: merges tail tiles into row tiles; needs tail_m > 0")
        if not isinstance(self.mix, int) or isinstance(self.mix, bool) or self.mix < 0 or self.mix == 1:
            raise ValueError(f"config.mix: expected 0 (expert order) or a number of row tiles >= 2, got {self.mix!r}")
        if self.mix and not self.tma:
            raise ValueError("config.mix: the mixed tile order is the TMA kernel's; needs tma=True")


def rows_bucket(rows: int, num_experts: int) -> int | float:
    """Mean rows per expert rounded up to a power of two, the key the tuned table is indexed by. Below one
    row per expert it is a fraction (1/16: a row for every 16 experts), so that decode of the many-expert
    models at one token (8 of 256 experts busy) and at eight (64 of them) are tuned apart."""
    e, rows = max(num_experts, 1), max(rows, 1)
    if rows >= e:
        return 1 << (-(-rows // e) - 1).bit_length()
    return 2.0 ** -((e // rows).bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _tuned_table(slug: str) -> dict:
    """{(dtype, E, K, N, w_layout, rows_bucket): GroupedConfig} written by experiments/tune_grouped.py."""
    return {(e["dtype"], e["experts"], e["k"], e["n"], e["w_layout"], e["rows_bucket"]):
            GroupedConfig.from_dict(e["config"])
            for e in tuned.entries("grouped", slug)}


# Regimes of mean rows per expert (upper bounds), each with its own distilled shortlist: decode of a row or
# less per expert, decode, the middle, prefill (the tuner's candidate regimes, decode split at one row).
REGIMES = (1, 16, 64, math.inf)


def regime_of(mean_rows: float) -> int:
    return next(i for i, b in enumerate(REGIMES) if mean_rows <= b)


@functools.lru_cache(maxsize=None)
def _default_table(slug: str) -> tuple:
    """Per regime, the distilled shortlist (experiments/distill_grouped.py) for this GPU; () if none."""
    entries = tuned.entries("grouped_default", slug)
    if len(entries) != len(REGIMES):
        return ()
    return tuple(tuple(GroupedConfig.from_dict(c) for c in e["configs"]) for e in entries)


def shortlist(rows: int, num_experts: int, n: int, slug: str) -> tuple[GroupedConfig, ...]:
    """The configs the first call of a shape no tuned entry covers chooses from: the distilled shortlist
    of its regime on this GPU, else :func:`heuristic_config` alone."""
    table = _default_table(slug)
    if table:
        return table[regime_of(rows / max(num_experts, 1))]
    return (heuristic_config(rows, num_experts, n),)


def choose_config(x: torch.Tensor, num_experts: int, n: int, w_layout: str) -> tuple[GroupedConfig, str]:
    """(config, source) for this GPU, shape and mean rows per expert, without timing anything. source is
    'tuned' for an exact entry of the tuned table, 'tuned-nearest' for the entry of the same (dtype, E, K,
    N) whose rows bucket is nearest (log scale; the same w layout preferred), 'autotuned' for a choice an
    earlier call timed (moegemm.grouped.autotune), else 'default' (the first of the distilled shortlist)
    or, on a GPU without one, 'heuristic'. :func:`grouped_mm` with no config times the shortlist where
    this says 'default' and it can (see moegemm.grouped.autotune)."""
    rows, k = x.shape
    return _choose(rows, k, x.dtype, gpu_slug(x), num_experts, n, w_layout)


def autotune_key(rows: int, k: int, dtype: torch.dtype, num_experts: int, n: int, w_layout: str) -> tuple:
    return (str(dtype).replace("torch.", ""), num_experts, k, n, w_layout, rows_bucket(rows, num_experts))


def _choose(rows: int, k: int, dtype: torch.dtype, slug: str, num_experts: int, n: int,
            w_layout: str) -> tuple[GroupedConfig, str]:
    dtype_s = str(dtype).replace("torch.", "")
    bucket = rows_bucket(rows, num_experts)
    table = _tuned_table(slug)
    hit = table.get((dtype_s, num_experts, k, n, w_layout, bucket))
    if hit is not None:
        return hit, "tuned"
    near = [(abs(math.log2(b) - math.log2(bucket)), lay != w_layout, b, lay)
            for (d, e, kk, nn, lay, b) in table if (d, e, kk, nn) == (dtype_s, num_experts, k, n)]
    if near:
        _, _, b, lay = min(near)
        return table[(dtype_s, num_experts, k, n, lay, b)], "tuned-nearest"
    timed = autotune.lookup(slug, autotune_key(rows, k, dtype, num_experts, n, w_layout))
    if timed is not None:
        return GroupedConfig.from_dict(timed), "autotuned"
    if _default_table(slug):
        return shortlist(rows, num_experts, n, slug)[0], "default"
    return heuristic_config(rows, num_experts, n), "heuristic"


def heuristic_config(rows: int, num_experts: int, n: int) -> GroupedConfig:
    """Row tiles sized to the mean rows per expert, for a GPU with no distilled shortlist. Decode (<= 16
    rows per expert) streams the weights: 16-row tiles, narrow N tiles and deep K steps for many loads in
    flight. Otherwise 128-wide N tiles, with the row tiles of an expert walked together (group_m) so that
    they share its weights in L2."""
    mean = rows / max(num_experts, 1)
    if mean <= 16:
        return GroupedConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    bm = 32 if mean <= 32 else 64 if mean <= 64 else 128
    bn = 64 if n <= 64 else 128
    return GroupedConfig(block_m=bm, block_n=bn, block_k=64, num_warps=4 if bm * bn <= 64 * 128 else 8)


def check_offsets(group_offsets: torch.Tensor, m_total: int) -> None:
    """group_offsets starts at 0, ends at m_total and never decreases. On the CPU a ValueError naming what is
    wrong; on a GPU a device-side assertion (moegemm.grouped.checks: two small launches), so that the check
    costs no host sync and a call can be captured in a CUDA graph (a failed check then stops the process at
    the next sync, as a CUDA device assertion does)."""
    if group_offsets.device.type == "cpu":
        off = group_offsets.tolist()
        if off[0] != 0 or off[-1] != m_total:
            raise ValueError(f"group_offsets: must start at 0 and end at M_total={m_total}, got {off[0]}..{off[-1]}")
        if any(b < a for a, b in zip(off, off[1:])):
            raise ValueError("group_offsets: must be non-decreasing (offsets not monotone)")
        return
    from .checks import assert_offsets

    assert_offsets(group_offsets, m_total)


def _check_w(w: torch.Tensor, x: torch.Tensor, w_layout: str, k: int) -> tuple[int, int, int, int, int]:
    """(E, N, stride_we, stride_wk, stride_wn) for w in either layout."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 3:
        raise ValueError(f"w: expected a 3-D [E, K, N] or [E, N, K] tensor, got shape {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"w: dtype {w.dtype} differs from x's {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: on {w.device}, but x is on {x.device}")
    if w_layout == "kn":
        e, wk, n = w.shape
        s_e, s_k, s_n = w.stride()
    elif w_layout == "nk":
        e, n, wk = w.shape
        s_e, s_n, s_k = w.stride()
    else:
        raise ValueError(f"w_layout: expected 'kn' ([E, K, N]) or 'nk' ([E, N, K]), got {w_layout!r}")
    if wk != k:
        raise ValueError(f"w: K={wk} (layout {w_layout!r}) differs from x's K={k}")
    return e, n, s_e, s_k, s_n


def grouped_mm(
    x_sorted: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    w_layout: str = "kn",
    epilogue: str | Epilogue = "none",
    row_scale: torch.Tensor | None = None,
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """Y[rows of e] = epilogue(X[rows of e] @ W_e) * row_scale[rows], for every expert e, in ONE launch.

    x_sorted: [M_total, K], rows grouped by expert; group_offsets: int [E + 1], non-decreasing, from 0 to
    M_total (row range of each expert; m_e = 0 allowed). w: [E, K, N] (w_layout="kn") or [E, N, K] ("nk",
    the nn.Linear convention). row_scale: optional [M_total] (e.g. the gating weights in sorted order).
    ``validate`` checks the offsets' values: on a GPU on the device, with no host sync (a call can be
    captured in a CUDA graph; a failed check is a device-side assertion), on the CPU with a ValueError.
    Under ``torch.compile`` this traces as the custom op ``moegemm::grouped_mm``.
    config: tiles, grid and load path; default: :func:`choose_config` (this GPU's tuned table, else a
    config autotuned on the first call of an unseen shape, else the distilled default). A config with
    ``tma=True`` uses the TMA kernel where the inputs allow it (16-bit, rows 16-byte aligned, experts
    stacked densely; "kn" needs K % block_k == 0) and the pointer kernel with the same tiles elsewhere;
    with ``tail_m`` it computes a tile holding at most tail_m rows of its expert as a smaller, transposed
    tile (prefill: the last row tile of most experts), or with ``merge_tail`` beside the expert's previous
    row tile, from the same weight tiles; with ``mix`` the tiles of experts of at least that many row
    tiles are dealt out in proportion among the other experts' (a skewed load: a hot expert's
    tensor-bound tiles run beside cold experts' memory-bound ones, not before or after them).
    """
    if torch.is_grad_enabled() and _any_requires_grad(x_sorted, w, row_scale):  # training: autograd
        from .autograd import grouped_mm_train

        return grouped_mm_train(x_sorted, w, group_offsets, w_layout=w_layout, epilogue=epilogue,
                                row_scale=row_scale, config=config, out=out, allow_tf32=allow_tf32,
                                validate=validate, swiglu=False)
    if torch.compiler.is_compiling():
        from . import ops

        return ops.traced_grouped_mm(x_sorted, w, group_offsets, w_layout, epilogue, row_scale, config, out,
                                     allow_tf32, validate)
    return _grouped(x_sorted, w, group_offsets, w_layout, epilogue, row_scale, config, out, allow_tf32, validate,
                    swiglu=False)


def grouped_mm_swiglu(
    x_sorted: torch.Tensor,
    w_gate_up: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    w_layout: str = "kn",
    row_scale: torch.Tensor | None = None,
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """Y[rows of e] = silu(X[rows of e] @ G_e) * (X[rows of e] @ U_e) * row_scale[rows], for every expert e,
    in ONE launch: the gate and up projections fused with SwiGLU in the epilogue. w_gate_up: [E, K, 2I]
    ("kn") or [E, 2I, K] ("nk", the nn.Linear layout), each expert's gate columns (or rows) first, then its
    up ones; returns [M_total, I]. Both products of an output tile come from the same row tile, so the
    [M_total, 2I] product is never written. Arguments as for :func:`grouped_mm` (no epilogue: SwiGLU is
    it). ``config`` names the tiles of the unfused [E, K, 2I] product: a tile of the fused kernel computes
    block_n / 2 output columns of each of the two halves, so that it holds as many accumulators; its tail
    tiles are not used. Default: timed on the first call of a shape (as :func:`grouped_mm` times an untuned
    one, and kept apart from its choices) among the distilled shortlist of its regime and, where the tuned
    table has the unfused shape, that entry's tiles."""
    if torch.is_grad_enabled() and _any_requires_grad(x_sorted, w_gate_up, row_scale):  # training: autograd
        from .autograd import grouped_mm_train

        return grouped_mm_train(x_sorted, w_gate_up, group_offsets, w_layout=w_layout, epilogue="none",
                                row_scale=row_scale, config=config, out=out, allow_tf32=allow_tf32,
                                validate=validate, swiglu=True)
    if torch.compiler.is_compiling():
        from . import ops

        return ops.traced_grouped_mm_swiglu(x_sorted, w_gate_up, group_offsets, w_layout, row_scale, config, out,
                                            allow_tf32, validate)
    return _grouped(x_sorted, w_gate_up, group_offsets, w_layout, "none", row_scale, config, out, allow_tf32,
                    validate, swiglu=True)


def _any_requires_grad(*tensors) -> bool:
    """Whether one of the operands requires grad (then the call records gradients: grouped.autograd)."""
    return any(getattr(t, "requires_grad", False) for t in tensors)


def swiglu_config(cfg: GroupedConfig) -> GroupedConfig:
    """The fused SwiGLU kernel's tiles for a config of the unfused product: half the columns per half (as
    many accumulators in all), no tail tiles."""
    return dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2), tail_m=0, merge_tail=False)


def _grouped(x_sorted, w, group_offsets, w_layout, epilogue, row_scale, config, out, allow_tf32, validate,
             swiglu: bool) -> torch.Tensor:
    """grouped_mm, or with ``swiglu`` grouped_mm_swiglu: checks, the config (tuned, autotuned on a shape's
    first call, or given), the launch. A call like an earlier one in everything the checks, the config and
    the compiled kernel depend on (see _plan_key) goes straight to that call's launch (_GroupedPlan)."""
    key = _plan_key(x_sorted, w, group_offsets, row_scale, out, w_layout, epilogue, config, allow_tf32, swiglu)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan.run(x_sorted, w, group_offsets, row_scale, out, validate)
    if not isinstance(x_sorted, torch.Tensor):
        raise TypeError(f"x_sorted: expected a torch.Tensor, got {type(x_sorted).__name__}")
    if x_sorted.dim() != 2:
        raise ValueError(f"x_sorted: expected a 2-D [M_total, K] tensor, got shape {tuple(x_sorted.shape)}")
    check_dtype("x_sorted", x_sorted)
    check_device("x_sorted", x_sorted)
    m_total, k = x_sorted.shape
    e, n, *w_strides = _check_w(w, x_sorted, w_layout, k)
    epi = Epilogue.parse(epilogue)
    n_w = n  # the weights' columns per expert; the output's are half as many with swiglu
    if swiglu:
        if n % 2:
            raise ValueError(f"w_gate_up: expected an even gate/up width 2I, got {n}")
        n = n // 2
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
            raise ValueError(f"row_scale: expected shape ({m_total},), got {getattr(row_scale, 'shape', None)}")
        if row_scale.device != x_sorted.device:
            raise ValueError(f"row_scale: on {row_scale.device}, but x_sorted is on {x_sorted.device}")
        row_scale = row_scale.contiguous()
    if out is None:
        out = torch.empty((m_total, n), dtype=x_sorted.dtype, device=x_sorted.device)
    elif tuple(out.shape) != (m_total, n) or out.dtype != x_sorted.dtype or out.device != x_sorted.device:
        raise ValueError(f"out: expected a ({m_total}, {n}) {x_sorted.dtype} tensor on {x_sorted.device}")
    if m_total == 0 or n == 0:
        return out
    if k == 0:  # every product is 0; silu(0) * 0 = 0
        acc = torch.zeros((m_total, n), dtype=torch.float32, device=x_sorted.device)
        acc = epi.torch_apply(acc)
        return out.copy_(acc * row_scale.float()[:, None] if row_scale is not None else acc)
    offsets = group_offsets.to(torch.int32).contiguous()
    scale = row_scale if row_scale is not None else out

    def spec(cfg: GroupedConfig) -> tuple:
        if swiglu:
            return _spec_swiglu(swiglu_config(cfg), x_sorted, w, w_strides, w_layout, offsets, scale,
                                row_scale is not None, out, e, n, k, allow_tf32)
        return _spec_contiguous(cfg, x_sorted, w, w_strides, w_layout, offsets, scale, row_scale is not None, out,
                                e, n, k, epi, allow_tf32)

    def launch(cfg: GroupedConfig) -> None:
        kernel, work_items, args, kwargs, _ = spec(cfg)
        _launch(kernel, work_items, swiglu_config(cfg) if swiglu else cfg, x_sorted, args, kwargs)

    final = True  # the config is the one every later call of this shape takes (see _GroupedPlan)
    if config is not None:
        cfg = config
    else:
        slug = gpu_slug(x_sorted)
        cfg, source = _choose(m_total, k, x_sorted.dtype, slug, e, n_w, w_layout)
        if source == "default" or swiglu:
            # The fused kernel's timed choices are its own (the unfused kernel's, _choose has looked up
            # already). The tuned table holds unfused tiles, so on a tuned shape the fused kernel times that
            # entry's tiles against the regime's shortlist too.
            key_t = autotune_key(m_total, k, x_sorted.dtype, e, n_w, w_layout + ("+swiglu" if swiglu else ""))
            timed = autotune.lookup(slug, key_t) if swiglu else None
            if timed is not None:
                cfg = GroupedConfig.from_dict(timed)
            elif autotune.can_time(x_sorted):
                candidates = list(shortlist(m_total, e, n_w, slug))
                if swiglu and source != "default":
                    candidates = [cfg] + [c for c in candidates if swiglu_config(c) != swiglu_config(cfg)]
                cfg, times = autotune.fastest(launch, candidates)
                autotune.remember(slug, key_t, dataclasses.asdict(cfg), times)
            else:  # not timed now (a capture, autotuning off): a later call may time it, unless timing is
                #     off (the key holds whether it is, see _plan_key)
                final = not autotune.enabled()
    if key is not None and final and not torch.cuda.is_current_stream_capturing():
        plan = _GroupedPlan.make(spec(cfg), swiglu_config(cfg) if swiglu else cfg, x_sorted, w, w_layout, e,
                                 n_w, n, k, swiglu, row_scale is not None,
                                 group_offsets.dtype == torch.int32 and group_offsets.is_contiguous())
        if plan is not None:
            _PLANS[key] = plan
            return plan.run(x_sorted, w, group_offsets, row_scale, out, False)
    launch(cfg)
    return out


# Arguments of each kernel that change from call to call, for _GroupedPlan (the rest are fixed by its key).
_TMA_SLOTS = ("a_desc", "w_desc", "at_desc", "y_ptr", "offsets_ptr", "scale_ptr")
_SWIGLU_TMA_SLOTS = ("a_desc", "w_desc", "y_ptr", "offsets_ptr", "scale_ptr")
_PTR_SLOTS = ("a_ptr", "w_ptr", "y_ptr", "offsets_ptr", "scale_ptr")

_PLANS: dict = {}  # _plan_key -> _GroupedPlan


def _plan_key(x, w, offsets, row_scale, out, w_layout, epilogue, config, allow_tf32, swiglu) -> tuple | None:
    """What a call's checks, config and compiled kernel depend on: the operands' shapes, strides, dtypes,
    devices and alignment (Triton specializes pointers on 16-byte alignment, TMA needs it), the other
    arguments, and with no config whether first calls may time (moegemm.grouped.autotune); None where no plan
    applies (not CUDA tensors, the interpreter, an unhashable argument)."""
    if INTERPRET or type(x) is not torch.Tensor or type(w) is not torch.Tensor or type(offsets) is not torch.Tensor \
            or not x.is_cuda:
        return None
    key = (_operand_key(x), _operand_key(w), _operand_key(offsets), _operand_key(row_scale), _operand_key(out),
           w_layout, epilogue, config, allow_tf32, swiglu, config is None and autotune.enabled())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _operand_key(t) -> tuple | None:
    if t is None:
        return None
    if type(t) is not torch.Tensor:
        return (type(t),)  # the checks reject it; never a plan's key (see _GroupedPlan.make)
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


@dataclasses.dataclass(eq=False)
class _GroupedPlan:
    """One (shapes, strides, dtypes, alignment, arguments) of grouped_mm or grouped_mm_swiglu, checked and
    configured once: a later call builds its TMA descriptors (where the kernel takes them) and launches the
    compiled kernel directly (moegemm._triton_common.BoundKernel). Holds no tensor."""

    kernel: object  # the Triton kernel it launches
    bound: BoundKernel
    cfg: GroupedConfig
    tma: bool
    w_layout: str
    e: int
    n_w: int
    n: int
    k: int
    swiglu: bool
    has_scale: bool
    offsets_ready: bool  # group_offsets is already int32 and contiguous

    @classmethod
    def make(cls, spec: tuple, cfg: GroupedConfig, x, w, w_layout, e, n_w, n, k, swiglu, has_scale,
             offsets_ready) -> "_GroupedPlan | None":
        kernel, work_items, args, kwargs, slots = spec
        if not hasattr(kernel, "warmup"):
            return None
        per_sm = _per_sm(kernel, cfg, x, args, kwargs) if cfg.persistent else 2
        try:
            bound = BoundKernel(kernel, (_grid(work_items, cfg, x, per_sm),), args, kwargs, slots)
        except Exception:  # noqa: BLE001 - a Triton without these APIs: every call goes through Triton's launch
            return None
        return cls(kernel=kernel, bound=bound, cfg=cfg, tma=slots is not _PTR_SLOTS, w_layout=w_layout, e=e,
                   n_w=n_w, n=n, k=k, swiglu=swiglu, has_scale=has_scale, offsets_ready=offsets_ready)

    def run(self, x, w, group_offsets, row_scale, out, validate: bool) -> torch.Tensor:
        m_total = x.shape[0]
        if validate:
            check_offsets(group_offsets, m_total)
        if out is None:
            out = torch.empty((m_total, self.n), dtype=x.dtype, device=x.device)
        offsets = group_offsets if self.offsets_ready else group_offsets.to(torch.int32).contiguous()
        scale = row_scale.contiguous() if self.has_scale else out
        stream = raw_stream(x.device.index)
        if self.tma:
            descs = _tma_descriptors(x, w, self.w_layout, self.e, self.n_w, self.k, self.cfg)
            if self.swiglu:
                descs = descs[:2]
            self.bound(stream, *descs, out, offsets, scale)
        else:
            self.bound(stream, x, w, out, offsets, scale)
        return out


def _spec_contiguous(cfg: GroupedConfig, x_sorted: torch.Tensor, w: torch.Tensor, w_strides, w_layout: str,
                     offsets: torch.Tensor, scale: torch.Tensor, has_scale: bool, out: torch.Tensor, e: int, n: int,
                     k: int, epi: Epilogue, allow_tf32: bool) -> tuple:
    """(kernel, work items, args, kwargs, slots) of one launch of the contiguous layout's kernel for ``cfg``
    (TMA where the inputs allow it); w_strides: (expert, K, N) strides of w, as _check_w gives them; slots:
    the arguments that change from call to call (see _GroupedPlan)."""
    m_total = x_sorted.shape[0]
    s_e, s_k, s_n = w_strides
    n_tiles = triton.cdiv(n, cfg.block_n)
    # An upper bound on the tiles known without a sync: at most min(E, M_total) experts hold rows, and
    # each adds at most one partly filled row tile to ceil(M_total / BLOCK_M).
    max_tiles = (triton.cdiv(m_total, cfg.block_m) + min(e, m_total)) * n_tiles
    if max_tiles >= 2**31:
        raise ValueError(f"x_sorted: {m_total} rows x N={n} need {max_tiles} tiles of "
                         f"{cfg.block_m}x{cfg.block_n}, more than the kernel's int32 tile index holds")
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  E_BLOCK=max(16, triton.next_power_of_2(e)), GROUP_M=cfg.group_m,
                  HAS_SCALE=has_scale, EPILOGUE=int(epi), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    descs = _tma_descriptors(x_sorted, w, w_layout, e, n, k, cfg) if cfg.tma else None
    if descs is not None:
        return _grouped_mm_tma_kernel, max_tiles, (
            *descs, out, offsets, scale, n, k, e, out.stride(0), out.stride(1),
        ), dict(TAIL_M=cfg.tail_m, W_KN=w_layout == "kn", WARP_SPECIALIZE=cfg.warp_specialize,
                FLATTEN=cfg.warp_specialize, MERGE_TAIL=cfg.merge_tail, MIX=cfg.mix,
                UPCAST=dot_meta(x_sorted.dtype, allow_tf32)["UPCAST"], **common), _TMA_SLOTS
    return _grouped_mm_kernel, max_tiles, (
        x_sorted, w, out, offsets, scale,
        n, k, e,
        x_sorted.stride(0), x_sorted.stride(1), s_e, s_k, s_n, out.stride(0), out.stride(1),
    ), dict(EVEN_K=k % cfg.block_k == 0, SWIGLU=False, **common, **dot_meta(x_sorted.dtype, allow_tf32)), _PTR_SLOTS


def _spec_swiglu(cfg: GroupedConfig, x_sorted: torch.Tensor, w: torch.Tensor, w_strides, w_layout: str,
                 offsets: torch.Tensor, scale: torch.Tensor, has_scale: bool, out: torch.Tensor, e: int,
                 n: int, k: int, allow_tf32: bool) -> tuple:
    """(kernel, work items, args, kwargs, slots) of one launch of the fused SwiGLU kernel (``cfg`` already
    swiglu_config's; n: the output's columns, the weights have 2n per expert), TMA where the inputs allow
    it."""
    m_total = x_sorted.shape[0]
    s_e, s_k, s_n = w_strides
    max_tiles = (triton.cdiv(m_total, cfg.block_m) + min(e, m_total)) * triton.cdiv(n, cfg.block_n)
    if max_tiles >= 2**31:
        raise ValueError(f"x_sorted: {m_total} rows x I={n} need {max_tiles} tiles of "
                         f"{cfg.block_m}x{cfg.block_n}, more than the kernel's int32 tile index holds")
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  E_BLOCK=max(16, triton.next_power_of_2(e)), GROUP_M=cfg.group_m, HAS_SCALE=has_scale,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    descs = _tma_descriptors(x_sorted, w, w_layout, e, 2 * n, k, cfg) if cfg.tma else None
    if descs is not None:
        return _grouped_mm_swiglu_tma_kernel, max_tiles, (
            descs[0], descs[1], out, offsets, scale, n, k, e, out.stride(0), out.stride(1),
        ), dict(W_KN=w_layout == "kn", WARP_SPECIALIZE=cfg.warp_specialize, FLATTEN=cfg.warp_specialize,
                MIX=cfg.mix, UPCAST=dot_meta(x_sorted.dtype, allow_tf32)["UPCAST"], **common), _SWIGLU_TMA_SLOTS
    return _grouped_mm_kernel, max_tiles, (
        x_sorted, w, out, offsets, scale, n, k, e,
        x_sorted.stride(0), x_sorted.stride(1), s_e, s_k, s_n, out.stride(0), out.stride(1),
    ), dict(EVEN_K=k % cfg.block_k == 0, EPILOGUE=0, SWIGLU=True, **common,
            **dot_meta(x_sorted.dtype, allow_tf32)), _PTR_SLOTS


def _grid(work_items: int, cfg: GroupedConfig, x: torch.Tensor, per_sm: int = 2) -> int:
    """Programs to launch: one per work item (an upper bound; extra programs exit at once), or on the
    persistent grid ``per_sm`` per SM (as many as can be resident at once, see _per_sm), each looping over
    the items."""
    return min(work_items, per_sm * device_sm_count(x)) if cfg.persistent else work_items


_PER_SM: dict = {}


def _launch(kernel, work_items: int, cfg: GroupedConfig, x: torch.Tensor, args: tuple, kwargs: dict) -> None:
    """Launch ``kernel`` on the grid _grid gives, the persistent one sized by _per_sm."""
    per_sm = _per_sm(kernel, cfg, x, args, kwargs) if cfg.persistent else 2
    grid = _grid(work_items, cfg, x, per_sm)
    kernel[(grid,)](*args, **kwargs)


def _per_sm(kernel, cfg: GroupedConfig, x: torch.Tensor, args: tuple, kwargs: dict) -> int:
    """Programs of this compiled kernel that fit on one multiprocessor together, capped at two: by its
    shared memory and registers as compiled (Triton's metadata, read once per kernel variant), one for the
    warp-specialized loop. Programs beyond what fits only wait for a resident one to finish all its tiles.
    Measured side by side (experiments/probe_persistent_grid.py, runs S5), neither one nor two per SM is
    the better for tiles of which only one fits: in six prefill cells two took 2-8% less time in four
    (DeepSeek-V3, T=4096), one 6-9% less in the other two; the plain grid was faster than both in five of
    the six, and the tuner picks the grid per cell. Where two fit, one per SM took up to 23% longer. Where
    the metadata cannot be had (the interpreter), two."""
    if cfg.warp_specialize:
        return 1
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), x.dtype, x.device.index,
           tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, str)))))
    hit = _PER_SM.get(key)
    if hit is None:
        hit = 2
        if torch.cuda.is_available() and x.is_cuda and hasattr(kernel, "warmup"):
            try:
                compiled = kernel.warmup(*args, grid=(1,), **kwargs)  # compiles (cached), no launch
                if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
                    compiled = compiled.result()
                compiled._init_handles()  # loads it; sets n_regs
                hit = fit_per_sm(compiled.metadata.shared, compiled.n_regs, cfg.num_warps, device_smem_per_sm(x))
            except Exception:  # noqa: BLE001 - an API this Triton lacks: the grid of two per SM, as before
                hit = 2
        _PER_SM[key] = hit
    return hit


def fit_per_sm(shared_bytes: int, regs_per_thread: int, num_warps: int, smem_per_sm: int) -> int:
    """Programs that fit on one multiprocessor together (1 KB of shared memory reserved per program, 64K
    registers), capped at two; at least one."""
    by_smem = smem_per_sm // (shared_bytes + 1024)
    by_regs = 65536 // max(1, regs_per_thread * 32 * num_warps)
    return max(1, min(2, by_smem, by_regs))


def _tma_descriptors(x: torch.Tensor, w: torch.Tensor, w_layout: str, e: int, n: int, k: int,
                     cfg: GroupedConfig):
    """(x descriptor, w descriptor, x descriptor of tail_m-row boxes) for the TMA kernel, or None where the
    inputs do not allow it: 16-bit dtypes; x and w contiguous along their last dimension with 16-byte
    aligned rows and base; w's experts stacked densely (so that it is one 2-D [E*N, K] or [E*K, N]
    matrix); for "kn", K a multiple of BLOCK_K (a K tail would read the next expert's rows). The pointer
    kernel, same tiles, serves the rest. Without tail_m the third descriptor is the first (the kernel does
    not use it)."""
    if not _tma_rows_ok(x):
        return None
    b = _w_descriptor(w, w_layout, e, n, k, cfg)
    if b is None:
        return None
    a = TensorDescriptor(x, [x.shape[0], k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    at = TensorDescriptor(x, [x.shape[0], k], [x.stride(0), 1], [cfg.tail_m, cfg.block_k]) if cfg.tail_m else a
    return a, b, at


def _tma_rows_ok(x: torch.Tensor) -> bool:
    """x can be read by TMA boxes along its last dimension: 16-bit, that dimension contiguous, base and
    every other stride 16-byte aligned (x of the contiguous layout [M_total, K], or of the masked one)."""
    if TensorDescriptor is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all((s * x.element_size()) % 16 == 0 for s in x.stride()[:-1]))


def _w_descriptor(w: torch.Tensor, w_layout: str, e: int, n: int, k: int, cfg: GroupedConfig):
    """w as one 2-D TMA descriptor, [E*N, K] ("nk") or [E*K, N] ("kn"), or None where it cannot be: not
    16-bit, last dimension not contiguous, rows or base not 16-byte aligned, experts not stacked densely,
    or "kn" with K not a multiple of BLOCK_K (a K tail would read the next expert's rows)."""
    if TensorDescriptor is None or w.dtype not in (torch.bfloat16, torch.float16):
        return None
    if w.stride(2) != 1 or w.data_ptr() % 16 or (w.stride(1) * 2) % 16:
        return None
    if e > 1 and w.stride(0) != w.shape[1] * w.stride(1):
        return None
    if w_layout == "kn" and k % cfg.block_k:
        return None
    rows_w, cols_w = (e * n, k) if w_layout == "nk" else (e * k, n)
    box = [cfg.block_n, cfg.block_k] if w_layout == "nk" else [cfg.block_k, cfg.block_n]
    return TensorDescriptor(w, [rows_w, cols_w], [w.stride(1), 1], box)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for descriptors made in-kernel (Triton calls this at launch; inside a CUDA-graph
    capture the tensor comes from the graph's pool and stays with the graph)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Triton's allocator for in-kernel descriptors, unless the caller set one. It lives in a context
    variable, which a new thread does not inherit, so this runs before every such launch."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # pragma: no cover - a Triton without the allocator API has no in-kernel descriptors
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_scratch)


def masked_config(x: torch.Tensor, n: int, w_layout: str, config: GroupedConfig | None = None) -> GroupedConfig:
    """The config grouped_mm_masked runs x ([E, m_max, K]) with: ``config``, or this GPU's tuned tiles for
    m_max rows per expert on the persistent grid (at decode most of the E * m_max rows are usually past
    masked_m); row tiles no taller than m_max needs; no tail tiles (merged or not), TMA stores or
    warp-specialized loop (the masked kernels have none of them). Whether TMA loads are taken also depends
    on the inputs (see grouped_mm_masked)."""
    e, m_max, k = x.shape
    if config is None:
        config = dataclasses.replace(_choose(e * m_max, k, x.dtype, gpu_slug(x), e, n, w_layout)[0],
                                     persistent=True)
    return dataclasses.replace(config, block_m=min(config.block_m, max(16, triton.next_power_of_2(m_max))),
                               warp_specialize=False, tail_m=0, merge_tail=False, mix=0)


def grouped_mm_masked(
    x: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    w_layout: str = "kn",
    epilogue: str | Epilogue = "none",
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """Y[e, :masked_m[e]] = epilogue(X[e, :masked_m[e]] @ W_e); rows at or past masked_m[e] are neither read
    nor written (``out`` keeps whatever they held). Static shapes: capturable in a CUDA graph, and correct
    on replay with new masked_m values. x: [E, m_max, K]; masked_m: int [E] (values clamped to [0, m_max]).
    config: tiles, grid and load path (``warp_specialize``, ``tail_m``, ``merge_tail`` and ``mix`` are
    not used); default: this GPU's tuned tiles for m_max rows per expert,
    on the persistent grid. With ``tma=True`` and 16-bit inputs whose rows are 16-byte aligned (w as for
    :func:`grouped_mm`), x's rows come in by TMA through a descriptor made in-kernel for each expert's first
    masked_m[e] rows, so rows past them are still not read; other inputs take the pointer kernel with the
    same tiles."""
    if torch.compiler.is_compiling():
        from . import ops

        return ops.traced_grouped_mm_masked(x, w, masked_m, w_layout, epilogue, config, out, allow_tf32)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x: expected a 3-D [E, m_max, K] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    check_dtype("x", x)
    check_device("x", x)
    ex, m_max, k = x.shape
    e, n, s_e, s_k, s_n = _check_w(w, x, w_layout, k)
    if e != ex:
        raise ValueError(f"w: has {e} experts but x has {ex}")
    if not isinstance(masked_m, torch.Tensor) or tuple(masked_m.shape) != (e,):
        raise ValueError(f"masked_m: expected an int tensor of shape ({e},), got {getattr(masked_m, 'shape', None)}")
    if masked_m.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"masked_m: expected int32 or int64, got {masked_m.dtype}")
    if masked_m.device != x.device:
        raise ValueError(f"masked_m: on {masked_m.device}, but x is on {x.device}")
    epi = Epilogue.parse(epilogue)
    if out is None:
        out = torch.empty((e, m_max, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (e, m_max, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected an ({e}, {m_max}, {n}) {x.dtype} tensor on {x.device}")
    if e == 0 or m_max == 0 or n == 0 or k == 0:
        if k == 0 and e and m_max and n:
            raise ValueError("x: K = 0 is not supported by the masked layout")
        return out
    cfg = masked_config(x, n, w_layout, config)
    max_tiles = e * triton.cdiv(m_max, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if max_tiles >= 2**31:
        raise ValueError(f"x: {e} x {m_max} rows x N={n} need {max_tiles} tiles of {cfg.block_m}x{cfg.block_n}, "
                         "more than the kernel's int32 tile index holds")
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  E_BLOCK=max(16, triton.next_power_of_2(e)), GROUP_M=cfg.group_m, EPILOGUE=int(epi),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    w_desc = _w_descriptor(w, w_layout, e, n, k, cfg) if cfg.tma and _tma_rows_ok(x) else None
    if w_desc is not None:
        _ensure_allocator()
        _launch(_grouped_mm_masked_tma_kernel, max_tiles, cfg, x, (
            x, w_desc, out, masked_m, e, m_max, n, k,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), out.stride(2),
        ), dict(W_KN=w_layout == "kn", UPCAST=dot_meta(x.dtype, allow_tf32)["UPCAST"], **common))
        return out
    _launch(_grouped_mm_masked_kernel, max_tiles, cfg, x, (
        x, w, out, masked_m,
        e, m_max, n, k,
        x.stride(0), x.stride(1), x.stride(2), s_e, s_k, s_n, out.stride(0), out.stride(1), out.stride(2),
    ), dict(EVEN_K=k % cfg.block_k == 0, **common, **dot_meta(x.dtype, allow_tf32)))
    return out
