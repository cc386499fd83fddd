"""FP8 e4m3 quantisation with DeepSeek-V3's block scales: one fp32 scale per token and 128 channels for the
activations, one per 128 x 128 block for the weights. A tensor is the product of its e4m3 values and their
block's scale (the scale multiplies; checkpoints call it ``weight_scale_inv``). Each block's scale maps its
largest magnitude to e4m3's largest finite value, 448, so no value of a block saturates; a block of zeros
gets the scale of a tiny amax, and its values stay zeros.

The activations' quantisation runs as one Triton kernel that can gather its rows (``rows``): the routing's
permutation then writes e4m3 rows and their scales directly, with no separate pass over x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # channels per scale (both operands) and rows per weight scale
# the smallest amax a block's scale is computed from: a block of zeros (or of values below it) gets a finite,
# normal scale, and its values quantise to zeros (or to e4m3's subnormals)
AMAX_FLOOR = 1e-10


def blocks(n: int) -> int:
    """Scale blocks along a dimension of n elements."""
    return (n + BLOCK - 1) // BLOCK


def _check_float(name: str, t, dims: int, shape: str) -> None:
    """``t`` is a ``dims``-D float tensor to quantise (not already e4m3), or an error naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D {shape} tensor, got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point or t.dtype == FP8:
        raise TypeError(f"{name}: expected a float tensor to quantise, got {t.dtype}")


def quantize_fp8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q, w_scale) for expert weights w: [E, N, K] (nn.Linear's layout, as the FP8 grouped GEMMs take
    them): w_q e4m3 of w's shape, w_scale fp32 [E, ceil(N/128), ceil(K/128)], so that w ~ w_q * w_scale
    per 128 x 128 block. Any float dtype and device; N and K need not be multiples of 128."""
    _check_float("w", w, 3, "[E, N, K]")
    e, n, k = w.shape
    nb, kb = blocks(n), blocks(k)
    wf = torch.zeros(e, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    wf[:, :n, :k] = w.float()
    tiles = wf.view(e, nb, BLOCK, kb, BLOCK)
    amax = tiles.abs().amax(dim=(2, 4)).clamp_min(AMAX_FLOOR)
    scale = amax / E4M3_MAX
    q = (tiles / scale[:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    w_q = q.view(e, nb * BLOCK, kb * BLOCK)[:, :n, :k].to(FP8).contiguous()
    return w_q, scale.contiguous()


def dequantize_fp8_weights(w_q: torch.Tensor, w_scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """w_q * w_scale, block by block, in ``dtype`` ([E, N, K]): the operand an FP8 GEMM computes with."""
    e, n, k = w_q.shape
    s = w_scale.to(dtype).repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return w_q.to(dtype) * s[:, :n, :k]


def dequantize_fp8_rows(x_q: torch.Tensor, x_scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """x_q * x_scale per row and 128 channels, in ``dtype`` (x_q: [..., K], x_scale: [..., ceil(K/128)])."""
    k = x_q.shape[-1]
    return x_q.to(dtype) * x_scale.to(dtype).repeat_interleave(BLOCK, dim=-1)[..., :k]


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to nearest, ties to even, on e4m3's grid: 3 mantissa bits at and above
    2**-6, multiples of 2**-9 below (the subnormals). The conversion to e4m3 after it is then exact on every
    backend (Triton's CPU interpreter loses the carry of a rounding into the exponent: 126.3 became 64)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0  # 1.5 * 2**14: its ulp is 2**-9
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_group(v, AMAX_FLOOR: tl.constexpr, E4M3_MAX: tl.constexpr):
    """(e4m3 values, fp32 scale per row) of an fp32 [ROWS, 128] group: the row's amax maps to 448."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), AMAX_FLOOR)
    scale = amax / E4M3_MAX
    q = _round_to_e4m3(tl.clamp(v / scale[:, None], -E4M3_MAX, E4M3_MAX))
    return q.to(tl.float8e4nv), scale


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    rows_ptr,
    q_ptr,
    s_ptr,
    R,
    K,
    X_ROWS,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    GATHER: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    E4M3_MAX: tl.constexpr,
):
    """q[r, g-th 128 channels], s[r, g] for ROWS output rows and one channel group per program; row r reads
    x[rows[r]] (GATHER) or x[r]. A gathered index outside [0, X_ROWS) reads nothing (zeros)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    r_ok = r < R
    if GATHER:
        src = tl.load(rows_ptr + r, mask=r_ok, other=0).to(tl.int64)
        r_ok_src = r_ok & (src >= 0) & (src < X_ROWS)
    else:
        src = r.to(tl.int64)
        r_ok_src = r_ok
    v = tl.load(
        x_ptr + src[:, None] * stride_xm + cols[None, :] * stride_xk,
        mask=r_ok_src[:, None] & (cols[None, :] < K),
        other=0.0,
    ).to(tl.float32)
    q, scale = _quantize_group(v, AMAX_FLOOR, E4M3_MAX)
    r64 = r.to(tl.int64)
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], q, mask=r_ok[:, None] & (cols[None, :] < K))
    tl.store(s_ptr + r64 * stride_sm + g, scale, mask=r_ok)


def quantize_fp8_rows(x: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, x_scale) for activations x: [M, K] (any float dtype and strides): x_q e4m3 [R, K], x_scale fp32
    [R, ceil(K/128)], one scale per row and 128 channels. ``rows`` (int [R], optional) gathers: output row r
    quantises x[rows[r]] (the routing's permutation, fused: no permuted copy of x is written); every index
    must lie in [0, M) (checked on the CPU; on a GPU an index outside reads zeros, never outside x)."""
    _check_float("x", x, 2, "[M, K]")
    m, k = x.shape
    if rows is not None:
        if (
            not isinstance(rows, torch.Tensor)
            or rows.dim() != 1
            or rows.dtype not in (torch.int32, torch.int64)
        ):
            raise TypeError("rows: expected a 1-D int32 or int64 tensor of row indices into x")
        if rows.device != x.device:
            raise ValueError(f"rows: on {rows.device}, but x is on {x.device}")
        host_check = rows.device.type == "cpu" and not torch.compiler.is_compiling()
        if host_check and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= m):
            raise ValueError(
                f"rows: indices must lie in [0, {m}), got [{int(rows.min())}, {int(rows.max())}]"
            )
        rows = rows.contiguous()
    if torch.compiler.is_compiling():
        return quantize_rows_op(x, rows)
    return _quantize_rows(x, rows)


def _quantize_rows(x: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    r = m if rows is None else rows.numel()
    q = torch.empty(r, k, dtype=FP8, device=x.device)
    s = torch.empty(r, blocks(k), dtype=torch.float32, device=x.device)
    if r and k:
        n_rows = 16
        _quantize_rows_kernel[(triton.cdiv(r, n_rows), blocks(k))](
            x,
            rows if rows is not None else q,
            q,
            s,
            r,
            k,
            m,
            x.stride(0),
            x.stride(1),
            q.stride(0),
            s.stride(0),
            GATHER=rows is not None,
            ROWS=n_rows,
            BLOCK=BLOCK,
            AMAX_FLOOR=AMAX_FLOOR,
            E4M3_MAX=E4M3_MAX,
        )
    return q, s


@torch.library.custom_op("moegemm::fp8_quantize_rows", mutates_args=())
def quantize_rows_op(x: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8_rows` as the custom op it traces as under ``torch.compile``."""
    return _quantize_rows(x, rows)


@quantize_rows_op.register_fake
def _(x, rows):
    r = x.shape[0] if rows is None else rows.shape[0]
    return x.new_empty((r, x.shape[1]), dtype=FP8), x.new_empty((r, blocks(x.shape[1])), dtype=torch.float32)
