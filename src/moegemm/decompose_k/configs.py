"""Decompose-K configurations: the config type, validated-operand bundle, the heuristic and the tuned table.

Config search lives in ``experiments/tune_decompose_k.py``; its results are data, one JSON file per GPU
under ``moegemm/tuned/decompose_k/<gpu-slug>.json``, read here; a GPU without a table of its own is served
by the nearest card's of its architecture (moegemm.tuned.serving). A shape missing from that table falls
back to :func:`heuristic_config`; on a GPU no table serves, the first call of a shape times a shortlist
around it (moegemm.decompose_k.first_call).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .. import tuned
from .._runtime import device_sm_count, gpu_slug
from .._triton_common import dot_meta
from ..epilogue import Epilogue
from ._partial import _partial_mm_kernel

KERNELS = ("two_stage", "flat", "single_launch")  # our Triton kernels
BACKENDS = KERNELS + ("cublas",)  # what a plan may run: cuBLAS (torch.mm) with the epilogue after it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def alloc_partials(split_k: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The fp32 [S, M, N] partial buffer (uninitialised; every element is written by stage 1).
    A module-level function so that tests can poison it."""
    return torch.empty((split_k, m, n), dtype=torch.float32, device=device)


def _pow2(name: str, v: int, lo: int, hi: int) -> None:
    if not isinstance(v, int) or v < lo or v > hi or v & (v - 1):
        raise ValueError(f"config.{name}: expected a power of two in [{lo}, {hi}], got {v!r}")


# Row tiles walked together, column by column, so that they share the columns of b in L2; and the flat
# reducer's warps. Every tuned entry took these values, so they are constants, not config fields.
GROUP_M = 8
REDUCE_WARPS = 4
# Fields older tables and CSVs hold, accepted by DecomposeKConfig.coerce at the constant's value only.
LEGACY = {"group_m": GROUP_M, "reduce_warps": REDUCE_WARPS}


@dataclasses.dataclass(frozen=True)
class DecomposeKConfig:
    """Tile and launch parameters. ``xblock``/``rblock`` are the flat reducer's."""

    split_k: int
    block_m: int = 16
    block_n: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    xblock: int = 64
    rblock: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"config.split_k: expected an int >= 1, got {self.split_k!r}")
        for name in ("block_m", "block_n", "block_k"):
            _pow2(name, getattr(self, name), 16, 256)
        _pow2("xblock", self.xblock, 1, 4096)
        _pow2("rblock", self.rblock, 1, 1024)
        _pow2("num_warps", self.num_warps, 1, 16)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config.num_stages: expected an int >= 1, got {self.num_stages!r}")

    @classmethod
    def coerce(cls, config: "DecomposeKConfig | dict") -> "DecomposeKConfig":
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            config = dict(config)
            for name, value in LEGACY.items():
                if name in config and config.pop(name) != value:
                    raise ValueError(f"config.{name}: no longer a config field; it is always {value}")
            unknown = set(config) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"config: unknown keys {sorted(unknown)}")
            if "split_k" not in config:
                raise ValueError("config: missing key 'split_k'")
            return cls(**config)
        raise TypeError(f"config: expected DecomposeKConfig or dict, got {type(config).__name__}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Prepared:
    """Validated operands of one call, shared by the three launchers."""

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    bias: torch.Tensor | None
    epilogue: Epilogue
    allow_tf32: bool

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def k(self) -> int:
        return self.a.shape[1]

    @property
    def n(self) -> int:
        return self.b.shape[1]

    @property
    def bias_arg(self) -> torch.Tensor:
        return self.bias if self.bias is not None else self.out  # never read when HAS_BIAS is False

    @property
    def dot_meta(self) -> dict:
        return dot_meta(self.a.dtype, self.allow_tf32)

    def k_per_split(self, cfg: DecomposeKConfig) -> int:
        return cdiv(self.k, cfg.split_k)

    def even_k(self, cfg: DecomposeKConfig) -> bool:
        """True when every split is full and a whole number of BLOCK_K steps (no K masks needed)."""
        kps = self.k_per_split(cfg)
        return self.k % cfg.split_k == 0 and kps % cfg.block_k == 0

    def stage1(self, cfg: DecomposeKConfig) -> torch.Tensor:
        partials = alloc_partials(cfg.split_k, self.m, self.n, self.a.device)
        tiles = cdiv(self.m, cfg.block_m) * cdiv(self.n, cfg.block_n)
        _partial_mm_kernel[(tiles, cfg.split_k)](
            self.a,
            self.b,
            partials,
            self.m,
            self.n,
            self.k,
            self.k_per_split(cfg),
            self.a.stride(0),
            self.a.stride(1),
            self.b.stride(0),
            self.b.stride(1),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=GROUP_M,
            EVEN_K=self.even_k(cfg),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **self.dot_meta,
        )
        return partials


def _block(dim: int) -> int:
    return 16 if dim <= 16 else 32 if dim <= 32 else 64 if dim <= 512 else 128


def heuristic_config(m: int, n: int, k: int, dtype: torch.dtype, sm_count: int) -> DecomposeKConfig:
    """The documented fallback when no tuned entry exists.

    16-bit inputs, the single-launch kernel's rule, distilled from the H200 tuning table (the grid and the
    router shapes): about one program per SM, small tiles. BLOCK_M 16 up to M = 32, else 64; BLOCK_N 16 where
    M and N are both small (N <= 16, or 64-row tiles and N <= 64), else 32; S the largest power of two that
    keeps the programs within one wave and each split at least 128 long; BLOCK_K 256, 128 or 64 as the split
    holds at least 512, 128 or fewer elements; one warp on 16x16 tiles, else four.

    fp32 (and shapes past 512 in M or N): blocks 16/32/64 (128 past 512) that cover M and N, BLOCK_K 64
    for fp32, 128 else, and S for about two waves, never so many that a split is under one BLOCK_K step.
    """
    if dtype != torch.float32 and max(m, n) <= 512:
        bm = 16 if m <= 32 else 64
        bn = 16 if (n <= 16 or (bm == 64 and n <= 64)) else 32
        tiles = cdiv(m, bm) * cdiv(n, bn)
        s = max(1, min(sm_count // tiles, k // 128))
        s = 1 << (s.bit_length() - 1)
        kps = cdiv(k, s)
        bk = 256 if kps >= 512 else 128 if kps >= 128 else 64
        bk = min(bk, max(16, next_pow2(k)))
        return DecomposeKConfig(
            split_k=s, block_m=bm, block_n=bn, block_k=bk, num_warps=1 if bm * bn <= 256 else 4
        )
    bm, bn = _block(m), _block(n)
    bk = 64 if dtype == torch.float32 else 128
    bk = min(bk, max(16, next_pow2(k)))
    tiles = cdiv(m, bm) * cdiv(n, bn)
    want = max(1, (2 * sm_count) // tiles)
    cap = max(1, k // bk)
    s = min(want, cap)
    s = 1 << (s.bit_length() - 1)  # largest power of two <= s
    warps = 4 if bm * bn <= 64 * 64 else 8
    return DecomposeKConfig(split_k=s, block_m=bm, block_n=bn, block_k=bk, num_warps=warps)


HEURISTIC_KERNEL = "single_launch"
# Decompose-K pays where the output is small against K: few output tiles, each a long dot product. Past
# this many output elements (the DeepSeek-V3 router at 256 tokens) cuBLAS's own tiling fills the GPU.
DK_MAX_OUTPUT = 256 * 256


def heuristic_choice(m: int, n: int, k: int) -> str:
    """The backend ``auto`` takes for a shape the tuned table lacks: our single-launch kernel for skinny,
    long-K products (at most DK_MAX_OUTPUT outputs and K at least twice the larger of M and N), else
    cuBLAS."""
    return HEURISTIC_KERNEL if m * n <= DK_MAX_OUTPUT and k >= 2 * max(m, n) else "cublas"


@functools.lru_cache(maxsize=None)
def _tuned_table(slug: str) -> dict:
    """{(dtype, m, n, k, epilogue): (best backend, {kernel: config}, {backend: best us}, activation us)} for
    one GPU; {} when none is packaged. The best backend may be "cublas", which has no config."""
    table = {}
    for e in tuned.entries("decompose_k", slug):
        key = (e["dtype"], e["m"], e["n"], e["k"], e["epilogue"])
        per_kernel = {name: DecomposeKConfig.coerce(c) for name, c in e["per_kernel"].items()}
        table[key] = (e["kernel"], per_kernel, e.get("backend_us", {}), float(e.get("activation_us", 0.0)))
    return table


# our kernels that reduce the partials in a second launch
TWO_LAUNCH = ("flat", "two_stage")


def _charged_best(best: str, per_kernel: dict, times: dict, activation_us: float, epilogue: Epilogue) -> str:
    """The tuned best backend for a call with ``epilogue``: the least of each backend's tuned time plus one
    tiny kernel's time (the table's ``activation_us``, about what a launch costs inside a CUDA graph) for
    each launch it adds, the table's best on a tie:
    - cuBLAS, where there is an epilogue: the table is tuned without one, and cuBLAS then runs the
      activation as a launch of its own, which our kernels fuse into their store;
    - a two-launch kernel (TWO_LAUNCH): its second launch. The table times every kernel in a CUDA graph,
      where that launch costs little; called from Python it costs far more (fp32, M = N = 48 and 64 on the
      H200: the two-launch `flat` won by at most 9% on the graph clock and took several times the single
      launch's time launch-inclusive)."""
    cost = {}
    for name, t in times.items():
        if name != "cublas" and name not in per_kernel:
            continue
        extra = (name in TWO_LAUNCH) + (name == "cublas" and epilogue is not Epilogue.NONE)
        cost[name] = t + activation_us * extra
    if best not in cost:
        return best
    return min(cost, key=lambda name: (cost[name], name != best))


def choose(
    a: torch.Tensor, n: int, epilogue: Epilogue, kernel: str = "auto"
) -> tuple[str, DecomposeKConfig | None, str]:
    """(backend, config, source) where source is 'tuned' (the table that serves this GPU: its own, or the
    nearest card's of its architecture, moegemm.tuned.serving), 'heuristic' (a shape that table lacks) or
    'generic' (a GPU no table serves: the heuristic's choice, which the plan's first call replaces by the
    fastest of :func:`moegemm.decompose_k.first_call.shortlist` where it can time); config is None for
    cuBLAS. An explicit kernel gets its own tuned config when the table has one."""
    m, k = a.shape
    table = tuned.serving("decompose_k", gpu_slug(a)) if a.device.type == "cuda" else "cpu-interpreter"
    return _choose(table, a.dtype, m, n, k, epilogue, kernel, device_sm_count(a))


@functools.lru_cache(maxsize=4096)
def _choose(slug, dtype, m, n, k, epilogue, kernel, sms):
    """:func:`choose` from the table named ``slug`` (None: no table serves the GPU)."""
    if kernel == "cublas":
        return "cublas", None, "explicit"
    table = _tuned_table(slug) if slug is not None else {}
    dt = str(dtype).replace("torch.", "")
    hit = table.get((dt, m, n, k, epilogue.name.lower()))
    if hit is None and epilogue is not Epilogue.NONE:
        hit = table.get((dt, m, n, k, "none"))  # the epilogue barely moves the best tiling
    if hit is None and dt == "float16":  # same element size and tensor-core rate as bf16
        hit = table.get(("bfloat16", m, n, k, "none"))
    if hit is not None:
        best, per_kernel, times, activation_us = hit
        name = _charged_best(best, per_kernel, times, activation_us, epilogue) if kernel == "auto" else kernel
        if name == "cublas":
            return "cublas", None, "tuned"
        if name in per_kernel:
            return name, per_kernel[name], "tuned"
    source = "heuristic" if slug is not None else "generic"
    name = heuristic_choice(m, n, k) if kernel == "auto" else kernel
    if name == "cublas":
        return "cublas", None, source
    return name, heuristic_config(m, n, k, dtype, sms), source
