"""The memory-bound steps around the expert GEMMs, one launch each.

- :func:`combine`, the un-permute as one gather: each token's top-k result rows read from the permuted
  output, weighted where asked, summed in fp32 in a fixed order and stored once in the output's dtype. The
  [T * top_k, N] fp32 slot buffer a scatter needs is never written: one read of the rows, one write of [T, N].
- :func:`silu_mul`, SiLU(gate) * up of an unfused gate/up product [rows, 2I], in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import launch


@triton.jit
def _combine_kernel(
    y_ptr,
    rows_ptr,
    w_ptr,
    out_ptr,
    N,
    M,
    stride_y,
    stride_o,
    TOP_K: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[t, n-block] = sum_j w[t, j] * y[rows[t * TOP_K + j], n-block] (j in order; fp32); a row index
    outside y's M rows (a plan not made by route) reads row 0 or M - 1, never past y."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        r = tl.minimum(tl.maximum(tl.load(rows_ptr + t * TOP_K + j).to(tl.int64), 0), M - 1)
        v = tl.load(y_ptr + r * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(
    y_sorted: torch.Tensor, slot_rows: torch.Tensor, top_k: int, topk_weights: torch.Tensor | None
) -> torch.Tensor:
    """[T, N] from y_sorted [T * top_k, N] and slot_rows [T * top_k] (the permuted row of each flat (token, k)
    slot); topk_weights [T, top_k] or None. A y_sorted without unit stride along N is copied first."""
    if y_sorted.stride(1) != 1:
        y_sorted = y_sorted.contiguous()
    rows, n = y_sorted.shape
    t = rows // max(top_k, 1)
    out = torch.empty((t, n), dtype=y_sorted.dtype, device=y_sorted.device)
    if t == 0 or n == 0:
        return out.zero_()
    block_n = min(triton.next_power_of_2(n), 1024)
    w = topk_weights.reshape(-1).contiguous() if topk_weights is not None else slot_rows
    launch(
        _combine_kernel,
        (t, triton.cdiv(n, block_n)),
        (y_sorted, slot_rows, w, out, n, rows, y_sorted.stride(0), out.stride(0)),
        dict(
            TOP_K=top_k, HAS_W=topk_weights is not None, BLOCK_N=block_n, num_warps=4 if block_n >= 512 else 2
        ),
    )
    return out


@torch.library.custom_op("moegemm::combine", mutates_args=())
def combine_op(
    y_sorted: torch.Tensor, slot_rows: torch.Tensor, top_k: int, topk_weights: torch.Tensor | None
) -> torch.Tensor:
    """:func:`combine` as the custom op ``unpermute`` traces as under torch.compile."""
    return combine(y_sorted, slot_rows, top_k, topk_weights)


@combine_op.register_fake
def _(y_sorted, slot_rows, top_k, topk_weights):
    return y_sorted.new_empty((y_sorted.shape[0] // max(top_k, 1), y_sorted.shape[1]))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, HALF, stride_g, stride_o, BLOCK: tl.constexpr):
    """out[r, block] = silu(gu[r, block]) * gu[r, HALF + block], in fp32 (HALF: I, half gu's columns)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HALF
    g = tl.load(gu_ptr + r * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * stride_g + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """[rows, I] = SiLU(gu[:, :I]) * gu[:, I:] of gu [rows, 2I] (copied first where its columns are not unit
    stride)."""
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    rows, two_i = gu.shape
    i = two_i // 2
    out = torch.empty((rows, i), dtype=gu.dtype, device=gu.device)
    if rows == 0 or i == 0:
        return out
    block = min(triton.next_power_of_2(i), 1024)
    launch(
        _silu_mul_kernel,
        (rows, triton.cdiv(i, block)),
        (gu, out, i, gu.stride(0), out.stride(0)),
        dict(BLOCK=block, num_warps=4 if block >= 512 else 2),
    )
    return out
