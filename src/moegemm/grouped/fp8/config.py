"""The FP8 kernel's tiles: the config type, each regime's shortlist, and the first call's choice.

No table of FP8 configs is tuned per GPU. A call with no config takes its regime's shortlist (by mean rows
per expert: a decode step's few rows, the middle, prefill); where it can time (:mod:`moegemm.autotune`: a
CUDA tensor, outside a capture, a trace and the interpreter), the first call of a shape times the shortlist
on its own inputs and keeps the fastest, in memory and on disk, so later calls and later processes take it
with no timing. Where it cannot, it takes the shortlist's first config (the untimed start) and remembers
nothing, so that a later call that can time still does."""

from __future__ import annotations

import dataclasses

import torch

from ... import autotune
from ..._runtime import gpu_slug
from ..config import rows_bucket
from .quant import BLOCK


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """Tiles and launch of the FP8 kernel. BLOCK_K is the scale block, 128; block_n, a power of two, divides
    128 or is a multiple of it (the SwiGLU variant needs 128: one output scale block per tile). ``tma``:
    operand tiles through the tensor-memory accelerator where both operands allow it (rows 16-byte aligned,
    experts stacked densely), else pointer loads with the same tiles."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = True  # operand tiles through the tensor-memory accelerator where the operands allow it

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"config.{name}: expected a power of two >= 16, got {v!r}")


# (most mean rows per expert of the regime, or None: any more; its (block_m, block_n, num_warps,
# num_stages) candidates, the untimed start first). Row tiles near the rows an expert holds; wider column
# tiles and deeper pipelines where the rows make the weight tiles' reuse worth their shared memory. At most
# (128 + 2 * 128) x 128 bytes per stage, in four stages: inside sm_90's 227 KiB per program.
SHORTLISTS = (
    (16, ((16, 128, 4, 3), (32, 128, 4, 4), (16, 256, 4, 3), (64, 128, 4, 3))),
    (32, ((32, 128, 4, 3), (16, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4))),
    (128, ((64, 128, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 4))),
    (None, ((128, 128, 8, 3), (128, 256, 8, 3), (64, 256, 8, 4), (128, 128, 8, 4), (64, 128, 4, 3))),
)


def shortlist(rows_per_expert: float, swiglu: bool) -> list[Fp8Config]:
    """The regime's candidates for ``rows_per_expert`` mean rows per expert (the SwiGLU variant's take
    128-column tiles only), the untimed start first."""
    tiles = next(t for most, t in SHORTLISTS if most is None or rows_per_expert <= most)
    return [Fp8Config(*t) for t in tiles if not swiglu or t[1] == BLOCK]


def default_config(rows_per_expert: float, swiglu: bool) -> Fp8Config:
    """The untimed start: row tiles near the rows an expert holds (decode: 16-32 rows; prefill: 64-128)."""
    return shortlist(rows_per_expert, swiglu)[0]


def choice_key(
    masked: bool, swiglu: bool, out_dtype: torch.dtype, e: int, k: int, n: int, rows: int
) -> tuple:
    """What a timed choice is kept under: the layout and variant, the output's dtype, the shape and the rows
    bucket (``rows``: all rows of the contiguous layout, E * m_max of the masked one)."""
    layout = "masked" if masked else "contiguous"
    dtype = str(out_dtype).replace("torch.", "")
    return ("fp8", layout, swiglu, dtype, e, k, n, rows_bucket(rows, e))


def choose(x_q: torch.Tensor, key: tuple, rows_per_expert: float, swiglu: bool, launch) -> Fp8Config:
    """The config of a call with none given: the choice kept for ``key`` (choice_key's) on this GPU, else
    the regime's shortlist timed now (``launch(config)``: one call of the kernel with it, on the call's own
    inputs) where the call can time, else the untimed start."""
    cands = shortlist(rows_per_expert, swiglu)
    slug = gpu_slug(x_q)
    hit = autotune.lookup(slug, key)
    if hit is not None:
        return Fp8Config(**hit)
    if len(cands) == 1 or not autotune.can_time(x_q):
        return cands[0]
    best, times = autotune.fastest(launch, cands, parallel_compile=True)
    autotune.remember(slug, key, dataclasses.asdict(best), times)
    return best


def chosen(x_q: torch.Tensor, key: tuple, rows_per_expert: float, swiglu: bool) -> tuple[Fp8Config, str]:
    """(the config a call of ``key`` takes now, where it came from: 'autotuned' for a choice kept by an
    earlier call's timing, 'default' for the untimed start), timing nothing: for a report of the config a
    measured call ran."""
    hit = autotune.lookup(gpu_slug(x_q), key)
    if hit is not None:
        return Fp8Config(**hit), "autotuned"
    return default_config(rows_per_expert, swiglu), "default"
