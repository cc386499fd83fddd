"""The grouped GEMM's configs and their choice: :class:`GroupedConfig`, the tuned table that serves this GPU
(its own, or the nearest card's of its architecture: moegemm.tuned.serving; exact or nearest entry), the
distilled shortlist of a regime of rows per expert, the generic shortlist for a GPU no table serves, and the
configs the masked and fused-SwiGLU kernels derive from the contiguous kernel's."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from .. import autotune, tuned
from .._runtime import device_smem_per_block, gpu_slug

# Row tiles of one expert walked together, column by column, so that they share the expert's weights in L2
# (the kernels' GROUP_M, read from here at each launch). Every tuned config took 8, and the tuner searches
# no other value.
GROUP_M = 8


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False
    tma: bool = False  # tiles loaded by the tensor-memory accelerator (16-bit, TMA-compatible strides)
    # with tma: the persistent loop over tiles flattened with the K loop into one software pipeline (so the
    # next tile's loads overlap this tile's epilogue), one program per SM. Triton asks for it with
    # tl.range(flatten=True, warp_specialize=True); on sm_90 that compiles to the flattened loop, with no
    # warps set apart.
    flatten: bool = False
    tail_m: int = 0  # with tma: a tile of <= tail_m rows of its expert is computed as a tail_m-row tile
    # with tail_m: an expert's last <= tail_m rows after a whole row tile computed by that tile's program
    # from the same weight tiles (no tile of their own)
    merge_tail: bool = False
    mix: int = 0  # with tma: the tiles of experts of at least this many row tiles (tensor-bound: each weight
    #               tile reused from L2) dealt out in proportion among the other experts' (memory-bound), not
    #               in expert order (0); a skewed load then keeps tensor cores and memory busy together

    # Fields of configs written before (tables, CSVs' config columns), each read at the one value it may
    # take: options that never won a measured cell (docs/grouped.md), the walk order now a constant, and
    # the flattened loop's former name.
    LEGACY = {"split_k": 1, "stream_k": False, "tma_store": 0, "extra_m": 0, "group_m": GROUP_M}
    RENAMED = {"warp_specialize": "flatten"}

    @classmethod
    def from_dict(cls, d: dict) -> "GroupedConfig":
        """A config from its dict (a tuned table's entry, a CSV's config column, a cached choice)."""
        d = dict(d)
        for name, value in cls.LEGACY.items():
            if name in d and d.pop(name) != value:
                raise ValueError(f"config.{name}: no longer an option; configs may only hold {value!r}")
        for old, new in cls.RENAMED.items():
            if old in d:
                d.setdefault(new, d.pop(old))
        return cls(**d)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v > 256 or v & (v - 1):
                raise ValueError(f"config.{name}: expected a power of two in [16, 256], got {v!r}")
        if self.flatten and not self.tma:
            raise ValueError("config.flatten: needs tma=True")
        t = self.tail_m
        if t and (not isinstance(t, int) or t < 16 or t & (t - 1) or t >= self.block_m):
            raise ValueError(f"config.tail_m: expected 0 or a power of two in [16, block_m), got {t!r}")
        if t and not self.tma:
            raise ValueError("config.tail_m: tail tiles are a TMA-kernel feature; needs tma=True")
        if self.merge_tail and not self.tail_m:
            raise ValueError("config.merge_tail: merges tail tiles into row tiles; needs tail_m > 0")
        if not isinstance(self.mix, int) or isinstance(self.mix, bool) or self.mix < 0 or self.mix == 1:
            raise ValueError(
                f"config.mix: expected 0 (expert order) or a number of row tiles >= 2, got {self.mix!r}"
            )
        if self.mix and not self.tma:
            raise ValueError("config.mix: the mixed tile order is the TMA kernel's; needs tma=True")


# A config as the custom ops take it: its fields in order, as ints. Read here, not while tracing (Dynamo
# does not trace dataclasses.fields on a class).
_FIELDS = tuple((f.name, f.type in (bool, "bool")) for f in dataclasses.fields(GroupedConfig))


def config_arg(config) -> GroupedConfig | None:
    """A public call's ``config`` argument: None, a GroupedConfig, or its dict (as a tuned table holds
    it); anything else is a TypeError naming ``config`` (a bad field's value a ValueError naming it)."""
    if config is None or isinstance(config, GroupedConfig):
        return config
    if isinstance(config, dict):
        try:
            return GroupedConfig.from_dict(config)
        except TypeError as exc:  # an unknown field
            raise TypeError(f"config: {exc}") from None
    raise TypeError(f"config: expected a GroupedConfig, a dict or None, got {type(config).__name__}")


def config_list(config: GroupedConfig | None) -> list[int] | None:
    """A config as the custom ops take it (None: the library's choice)."""
    return None if config is None else [int(getattr(config, name)) for name, _ in _FIELDS]


def config_of(fields: list[int] | None) -> GroupedConfig | None:
    """The inverse of :func:`config_list`."""
    if not fields:
        return None
    return GroupedConfig(
        **{name: bool(v) if is_bool else int(v) for (name, is_bool), v in zip(_FIELDS, fields)}
    )


def rows_bucket(rows: int, num_experts: int) -> int | float:
    """Mean rows per expert rounded up to a power of two, the key the tuned table is indexed by. Below one
    row per expert it is a fraction (1/16: a row for every 16 experts), so that decode of the many-expert
    models at one token (8 of 256 experts busy) and at eight (64 of them) are tuned apart."""
    e, rows = max(num_experts, 1), max(rows, 1)
    if rows >= e:
        return 1 << (-(-rows // e) - 1).bit_length()
    return 2.0 ** -((e // rows).bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _tuned_table(slug: str | None) -> dict:
    """{(dtype, E, K, N, w_layout, rows_bucket): GroupedConfig} of the table named ``slug`` (written by
    experiments/tune_grouped.py); {} for None."""
    return {
        (e["dtype"], e["experts"], e["k"], e["n"], e["w_layout"], e["rows_bucket"]): GroupedConfig.from_dict(
            e["config"]
        )
        for e in tuned.entries("grouped", slug)
    }


# Regimes of mean rows per expert (upper bounds), each with its own distilled shortlist: decode of a row or
# less per expert, decode, the middle, prefill (the tuner's candidate regimes, decode split at one row).
REGIMES = (1, 16, 64, math.inf)


def regime_of(mean_rows: float) -> int:
    return next(i for i, b in enumerate(REGIMES) if mean_rows <= b)


@functools.lru_cache(maxsize=None)
def _default_table(slug: str | None) -> tuple:
    """Per regime, the distilled shortlist (experiments/distill_grouped.py) of the table named ``slug``; ()
    if none."""
    entries = tuned.entries("grouped_default", slug)
    if len(entries) != len(REGIMES):
        return ()
    return tuple(tuple(GroupedConfig.from_dict(c) for c in e["configs"]) for e in entries)


def shortlist(rows: int, num_experts: int, n: int, slug: str) -> tuple[GroupedConfig, ...]:
    """The configs the first call of a shape no tuned entry covers chooses from, on the GPU named ``slug``:
    the distilled shortlist of its regime from the table that serves that GPU, else the
    :func:`generic_shortlist`."""
    table = _default_table(tuned.serving("grouped_default", slug))
    if table:
        return table[regime_of(rows / max(num_experts, 1))]
    return generic_shortlist(rows, num_experts, n)


def choose_config(
    x: torch.Tensor, num_experts: int, n: int, w_layout: str = "nk"
) -> tuple[GroupedConfig, str]:
    """(config, source) for this GPU, shape and mean rows per expert, without timing anything. source is
    'tuned' for an exact entry of the tuned table, 'tuned-nearest' for the entry of the same (dtype, E, K,
    N) whose rows bucket is nearest (log scale; the same w layout preferred), 'autotuned' for a choice an
    earlier call timed (moegemm.autotune), else 'default' (the first of the distilled shortlist)
    or, on a GPU no table serves, 'generic' (the first of :func:`generic_shortlist`; those two fitted to
    the dtype's shared memory on this device, see :func:`fitted`). The tables are those that serve this
    GPU (moegemm.tuned.serving). :func:`moegemm.grouped.grouped_mm` with no config times the shortlist
    where this says 'default' or 'generic' and it can (see moegemm.autotune)."""
    rows, k = x.shape
    return choose(rows, k, x.dtype, gpu_slug(x), num_experts, n, w_layout, device_smem_per_block(x))


def autotune_key(
    rows: int, k: int, dtype: torch.dtype, num_experts: int, n: int, w_layout: str, slug: str | None = None
) -> tuple:
    """The key a timed choice is kept under: the shape's, and, given the GPU's ``slug``, the table whose
    shortlist was timed (that GPU's own, the nearest card's, or 'generic'), so that a choice made from one
    shortlist is not taken where another serves (MOEGEMM_HIDE_TABLES, a new table)."""
    key = (str(dtype).replace("torch.", ""), num_experts, k, n, w_layout, rows_bucket(rows, num_experts))
    if slug is None:
        return key
    return (*key, tuned.serving("grouped_default", slug) or "generic")


def timed_key(
    rows: int, k: int, dtype: torch.dtype, num_experts: int, n: int, w_layout: str, swiglu: bool, slug: str
) -> tuple:
    """The key a first call's timed config is kept under (:func:`autotune_key`): the fused SwiGLU kernel's
    choices apart from the plain product's."""
    return autotune_key(rows, k, dtype, num_experts, n, w_layout + ("+swiglu" if swiglu else ""), slug)


def shared_bytes(cfg: GroupedConfig, itemsize: int) -> int:
    """The shared memory of a config's software pipeline, counted high: ``num_stages`` buffers of a row tile
    and a weight tile of ``block_k`` (the fused SwiGLU kernel's gate and up halves take as many columns in
    all). Triton allocates this much for the pointer kernel in fp32 with TF32 (128 x 256 x 64 in three
    stages: 294912 bytes, which did not launch on the H200) and one stage's buffers fewer without it."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize


def fitted(cfg: GroupedConfig, dtype: torch.dtype, limit: int | None) -> GroupedConfig:
    """``cfg``, or where its tiles in ``dtype`` take more than ``limit`` bytes of shared memory (the
    device's limit per program; None: no limit, the interpreter), the same tiles in fewer stages (down to
    two), then with half the K step (down to 16), until they fit. The distilled shortlists and the
    heuristic are written for 16-bit operands: in fp32 their deepest pipelines would not launch."""
    if limit is None:
        return cfg
    while shared_bytes(cfg, dtype.itemsize) > limit:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 16:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def fitted_shortlist(
    rows: int, num_experts: int, n: int, slug: str, dtype: torch.dtype, limit: int | None
) -> list[GroupedConfig]:
    """:func:`shortlist`, each config :func:`fitted` to ``dtype`` and ``limit`` (in order, no repeats)."""
    return list(dict.fromkeys(fitted(c, dtype, limit) for c in shortlist(rows, num_experts, n, slug)))


def choose(
    rows: int,
    k: int,
    dtype: torch.dtype,
    slug: str,
    num_experts: int,
    n: int,
    w_layout: str,
    smem: int | None = None,
) -> tuple[GroupedConfig, str]:
    """:func:`choose_config` from the shape's numbers; ``smem``: the device's shared memory per program,
    which the untuned configs (default, heuristic) are :func:`fitted` to (None: not fitted; a caller with a
    CUDA tensor passes :func:`moegemm._runtime.device_smem_per_block`)."""
    dtype_s = str(dtype).replace("torch.", "")
    bucket = rows_bucket(rows, num_experts)
    table = _tuned_table(tuned.serving("grouped", slug))
    hit = table.get((dtype_s, num_experts, k, n, w_layout, bucket))
    if hit is not None:
        return hit, "tuned"
    near = [
        (abs(math.log2(b) - math.log2(bucket)), lay != w_layout, b, lay)
        for (d, e, kk, nn, lay, b) in table
        if (d, e, kk, nn) == (dtype_s, num_experts, k, n)
    ]
    if near:
        _, _, b, lay = min(near)
        return table[(dtype_s, num_experts, k, n, lay, b)], "tuned-nearest"
    timed = autotune.lookup(slug, autotune_key(rows, k, dtype, num_experts, n, w_layout, slug))
    if timed is not None:
        return GroupedConfig.from_dict(timed), "autotuned"
    first = fitted_shortlist(rows, num_experts, n, slug, dtype, smem)[0]
    return first, "default" if _default_table(tuned.serving("grouped_default", slug)) else "generic"


# Where choose's config is a shortlist's first, which a call that can time replaces by the fastest
TIMED_SOURCES = ("default", "generic")


def heuristic_config(rows: int, num_experts: int, n: int) -> GroupedConfig:
    """Row tiles sized to the mean rows per expert, measured on no GPU (the first of the generic shortlist,
    and the tests' plain tiles). Decode (<= 16 rows per expert) streams the weights: 16-row tiles, narrow N
    tiles and deep K steps for many loads in flight. Otherwise 128-wide N tiles, with the row tiles of an
    expert walked together (GROUP_M) so that they share its weights in L2."""
    mean = rows / max(num_experts, 1)
    if mean <= 16:
        return GroupedConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    bm = 32 if mean <= 32 else 64 if mean <= 64 else 128
    bn = 64 if n <= 64 else 128
    return GroupedConfig(block_m=bm, block_n=bn, block_k=64, num_warps=4 if bm * bn <= 64 * 128 else 8)


def generic_shortlist(rows: int, num_experts: int, n: int) -> tuple[GroupedConfig, ...]:
    """The configs a GPU that no tuned table serves (another architecture) times on the first call of each
    shape: :func:`heuristic_config`, then tiles around it, all with pointer loads (TMA is Hopper's).
    Decode: narrow and deep weight tiles; the middle and prefill: square tiles of 64 and 128 rows, wider
    ones and deeper pipelines. No measurement chose them: the timing on the caller's inputs does."""
    first = heuristic_config(rows, num_experts, n)
    mean = rows / max(num_experts, 1)
    if mean <= 16:
        more = [
            GroupedConfig(16, 128, 128, num_warps=4, num_stages=4),
            GroupedConfig(16, 64, 256, num_warps=4, num_stages=3),
            GroupedConfig(32, 64, 64, num_warps=4, num_stages=4),
        ]
    elif mean <= 64:
        more = [
            GroupedConfig(64, 128, 64, num_warps=4, num_stages=3),
            GroupedConfig(64, 64, 64, num_warps=4, num_stages=4),
            GroupedConfig(32, 128, 64, num_warps=4, num_stages=4),
        ]
    else:
        more = [
            GroupedConfig(128, 256, 64, num_warps=8, num_stages=3),
            GroupedConfig(64, 128, 64, num_warps=4, num_stages=4),
            GroupedConfig(128, 128, 32, num_warps=4, num_stages=4),
        ]
    return tuple(dict.fromkeys([first, *more]))


def swiglu_config(cfg: GroupedConfig) -> GroupedConfig:
    """The fused SwiGLU kernel's tiles for a config of the unfused product: half the columns per half (as
    many accumulators in all), no tail tiles."""
    return dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2), tail_m=0, merge_tail=False)


def masked_config(
    x: torch.Tensor, n: int, w_layout: str = "nk", config: GroupedConfig | None = None
) -> GroupedConfig:
    """The config grouped_mm_masked runs x ([E, m_max, K]) with: ``config``, or this GPU's tuned tiles for
    m_max rows per expert on the persistent grid (at decode most of the E * m_max rows are usually past
    masked_m); row tiles no taller than m_max needs; no tail tiles (merged or not), mixed order or
    flattened loop (the masked kernels have none of them). Whether TMA loads are taken also depends on
    the inputs (see grouped_mm_masked)."""
    e, m_max, k = x.shape
    if config is None:
        config = dataclasses.replace(
            choose(e * m_max, k, x.dtype, gpu_slug(x), e, n, w_layout, device_smem_per_block(x))[0],
            persistent=True,
        )
    return dataclasses.replace(
        config,
        block_m=min(config.block_m, max(16, triton.next_power_of_2(m_max))),
        flatten=False,
        tail_m=0,
        merge_tail=False,
        mix=0,
    )
