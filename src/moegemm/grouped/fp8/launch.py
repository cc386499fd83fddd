"""The FP8 grouped kernel's launch, and the custom op it traces as under ``torch.compile`` (the same
allocation and launch, so a compiled model runs the same kernel with no graph break)."""

from __future__ import annotations

import torch
import triton

from ..._runtime import device_sm_count
from ..tma import TensorDescriptor
from .kernels import _fp8_grouped_kernel
from .quant import AMAX_FLOOR, BLOCK, E4M3_MAX, FP8, blocks

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the op's out_dtype argument: an index


def _grid(tiles: int, x: torch.Tensor) -> tuple[int]:
    """A persistent grid of two programs per multiprocessor (one per tile where there are fewer)."""
    return (max(1, min(tiles, 2 * device_sm_count(x) if x.is_cuda else 4)),)


def _tma_ok(t: torch.Tensor) -> bool:
    """t's rows can be read as TMA boxes: last dimension contiguous, base and rows 16-byte aligned, and (3-D)
    its leading dimensions stacked densely, so that it is one 2-D [rows, K] matrix."""
    if TensorDescriptor is None or t.stride(-1) != 1 or t.data_ptr() % 16 or t.stride(-2) % 16:
        return False
    return t.dim() == 2 or t.stride(0) == t.shape[1] * t.stride(1)


def _descriptors(x_q, w_q, block_m: int, block_n: int):
    """(A's, W's) 2-D TMA descriptors with [block_m, 128] and [block_n, 128] boxes, or None where either
    operand cannot be read so."""
    if not (_tma_ok(x_q) and _tma_ok(w_q)):
        return None
    k = x_q.shape[-1]
    rows_a = x_q.numel() // k if k else 0
    rows_w = w_q.shape[0] * w_q.shape[1]
    return (
        TensorDescriptor(x_q, [rows_a, k], [x_q.stride(-2), 1], [block_m, BLOCK]),
        TensorDescriptor(w_q, [rows_w, k], [w_q.stride(-2), 1], [block_n, BLOCK]),
    )


def _shapes(x_q, swiglu: bool, out_dtype, n: int):
    """(y's shape and dtype, sy's shape or None, rows M or m_max, K)."""
    lead = tuple(x_q.shape[:-1])
    k = x_q.shape[-1]
    return (lead + (n,), FP8 if swiglu else out_dtype), (lead + (blocks(n),) if swiglu else None), lead[-1], k


def compute(x_q, x_scale, w_q, w_scale, counts, row_scale, out_dtype, cfg, masked, zero_tail, swiglu, e, n):
    """(y, sy): the product (e4m3 with SwiGLU, else out_dtype) and, with SwiGLU, its scales (else an empty
    tensor). cfg: (block_m, block_n, num_warps, num_stages, tma)."""
    (y_shape, y_dtype), sy_shape, m, k = _shapes(x_q, swiglu, out_dtype, n)
    y = torch.empty(y_shape, dtype=y_dtype, device=x_q.device)
    sy = torch.empty(sy_shape if swiglu else (0,), dtype=torch.float32, device=x_q.device)
    if not (e and m and n):
        return y, sy
    if k == 0:
        y.zero_()
        sy.fill_(AMAX_FLOOR / E4M3_MAX)
        return y, sy
    block_m, block_n, num_warps, num_stages, tma = cfg
    m_tiles = e * triton.cdiv(m, block_m) if masked else triton.cdiv(m, block_m) + e
    tiles = m_tiles * triton.cdiv(n, block_n)
    if tiles >= 2**31:
        raise ValueError(
            f"x_q: {m} rows x N={n} need {tiles} tiles, more than the kernel's int32 tile index holds"
        )

    def three(t):  # (expert, row, column) strides; the contiguous layout has no expert stride
        return tuple(t.stride()) if masked else (0, *t.stride())

    descs = _descriptors(x_q, w_q, block_m, block_n) if tma else None

    _fp8_grouped_kernel[_grid(tiles, x_q)](
        x_q, x_scale, w_q, w_scale, *(descs or (x_q, w_q)), y, sy if swiglu else y, counts.contiguous(),
        row_scale if row_scale is not None else x_scale,
        e, m, n, k,
        *three(x_q), *three(x_scale), *w_q.stride(), *w_scale.stride(), *three(y),
        *(three(sy)[:2] if swiglu else (0, 0)),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK=BLOCK, E_BLOCK=max(16, triton.next_power_of_2(e)),
        GROUP_M=8, MASKED=masked, ZERO_TAIL=zero_tail, HAS_SCALE=row_scale is not None, SWIGLU=swiglu,
        TMA=descs is not None, AMAX_FLOOR=AMAX_FLOOR, E4M3_MAX=E4M3_MAX, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return y, sy


@torch.library.custom_op("moegemm::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm_op(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    counts: torch.Tensor,
    row_scale: torch.Tensor | None,
    out_dtype: int,
    cfg: list[int],
    masked: bool,
    zero_tail: bool,
    swiglu: bool,
    e: int,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute` as a custom op (out_dtype: an index into OUT_DTYPES)."""
    return compute(
        x_q, x_scale, w_q, w_scale, counts, row_scale, OUT_DTYPES[out_dtype], tuple(cfg), masked, zero_tail,
        swiglu, e, n,
    )  # fmt: skip


@fp8_grouped_mm_op.register_fake
def _(x_q, x_scale, w_q, w_scale, counts, row_scale, out_dtype, cfg, masked, zero_tail, swiglu, e, n):
    (y_shape, y_dtype), sy_shape, _, _ = _shapes(x_q, swiglu, OUT_DTYPES[out_dtype], n)
    return x_q.new_empty(y_shape, dtype=y_dtype), x_q.new_empty(sy_shape or (0,), dtype=torch.float32)


def run(x_q, x_scale, w_q, w_scale, counts, row_scale, out_dtype, cfg, masked, zero_tail, swiglu, e, n):
    """(y, sy) through the custom op under ``torch.compile``, else launched directly (no dispatcher on the
    eager path's host time). cfg: an Fp8Config."""
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, int(cfg.tma))
    if torch.compiler.is_compiling():
        return fp8_grouped_mm_op(
            x_q, x_scale, w_q, w_scale, counts, row_scale, OUT_DTYPES.index(out_dtype), list(tiles), masked,
            zero_tail, swiglu, e, n,
        )  # fmt: skip
    return compute(
        x_q, x_scale, w_q, w_scale, counts, row_scale, out_dtype, tiles, masked, zero_tail, swiglu, e, n
    )
