"""The weight gradient of a grouped GEMM, dW_e = A_e^T B_e over each expert's own rows (a grouped GEMM whose
reduction length is the expert's row count): the launcher of the pointer and TMA kernels of
:mod:`moegemm.grouped.backward_kernels`, and their tiles."""

from __future__ import annotations

import torch
import triton

from .._runtime import INTERPRET
from .._triton_common import dot_meta
from .backward_kernels import _grouped_dw_kernel, _grouped_dw_tma_kernel
from .tma import TensorDescriptor, tma_rows_ok

# Tiles of the weight-gradient kernels on a GPU, per operand dtype (module-level so that they can be
# measured and changed); the interpreter takes 16-wide tiles.
DW_TILES = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=8, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=8, num_stages=3),
    torch.float32: dict(BLOCK_M=32, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=8, num_stages=2),
}
# The TMA weight-gradient kernel's tiles (16-bit operands; BLOCK_K x BLOCK_N output tiles, BLOCK_M rows a
# step): the config of least geometric-mean time over the tune split's cells of probes/probe_backward.py
# (DW_CONFIGS; results/nvidia-h200/probe_backward.csv).
DW_TMA_TILES = dict(BLOCK_M=32, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=4, num_stages=5)
_INTERPRET_DW = dict(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16, GROUP_K=2, num_warps=4, num_stages=1)


def other_layout(w_layout: str) -> str:
    """The layout under which a weight of ``w_layout`` is the operand of dY @ W^T."""
    return "nk" if w_layout == "kn" else "kn"


def w_dims(w: torch.Tensor, w_layout: str) -> tuple[int, int, int, int, int, int]:
    """(E, K, N, stride over E, over K, over N) of a weight of the forward product X[., K] @ W_e[K, N]."""
    if w_layout == "kn":
        e, k, n = w.shape
        s_e, s_k, s_n = w.stride()
    else:
        e, n, k = w.shape
        s_e, s_n, s_k = w.stride()
    return e, k, n, s_e, s_k, s_n


def grouped_dw(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    w_like: torch.Tensor,
    w_layout: str,
    *,
    a_idx: torch.Tensor | None = None,
    b_idx: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    tiles: dict | None = None,
) -> torch.Tensor:
    """dW, shaped and laid out as ``w_like`` ([E, K, N] for "kn", [E, N, K] for "nk"), with
    dW_e[k, n] = sum over rows r of expert e of A[r, k] * B[r, n] * scale[r], r in order; rows of A read
    through ``a_idx`` (A[a_idx[r]]) and of B through ``b_idx`` where given. A, B: [*, K] and [*, N] in w's
    dtype; group_offsets: int32 [E + 1]. Deterministic; exact zeros for an expert with no rows.

    With no gather, 16-bit operands whose rows TMA can read go through the TMA kernel (s B made first where
    scaled), the operands ordered so that its output tiles' columns run along dW's unit stride; the rest
    through the pointer kernel. ``tiles``: the TMA kernel's tiles (default :data:`DW_TMA_TILES`)."""
    dw = torch.empty(w_like.shape, dtype=w_like.dtype, device=w_like.device)
    e, k, n, s_e, s_k, s_n = w_dims(dw, w_layout)
    if e == 0 or k == 0 or n == 0:
        return dw
    if a.shape[0] == 0:  # no rows at all (a rank that received no tokens): every expert's dW is zero
        return dw.zero_()
    offsets = group_offsets.to(torch.int32).contiguous()
    if a_idx is None and b_idx is None and _dw_tma_ok(a, b, dw):
        if scale is not None:  # s B made first, rounded to B's dtype as the pointer kernel rounds it
            b = (b.float() * scale.float()[:, None]).to(b.dtype)
        _dw_tma(a, b, dw, offsets, e, k, n, s_e, s_k, s_n, tiles)
        return dw
    meta = dict(_INTERPRET_DW if INTERPRET else DW_TILES[dw.dtype])
    grid = e * triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n, meta["BLOCK_N"])
    _grouped_dw_kernel[(grid,)](
        a,
        a_idx if a_idx is not None else offsets,
        b,
        b_idx if b_idx is not None else offsets,
        scale.contiguous() if scale is not None else offsets,
        offsets,
        dw,
        k,
        n,
        e,
        _rows_of(a, a_idx, b, b_idx, scale),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        s_e,
        s_k,
        s_n,
        A_IDX=a_idx is not None,
        B_IDX=b_idx is not None,
        HAS_SCALE=scale is not None,
        **dot_meta(dw.dtype, False),
        **meta,
    )
    return dw


def _rows_of(a, a_idx, b, b_idx, scale) -> int:
    """The rows the group offsets may name: as many as every array read per row holds (the kernels bound the
    offsets into them)."""
    n = min((a_idx if a_idx is not None else a).shape[0], (b_idx if b_idx is not None else b).shape[0])
    return min(n, scale.shape[0]) if scale is not None else n


def _dw_tma_ok(a, b, dw) -> bool:
    """Whether the TMA weight-gradient kernel can read A and B into dW: one 16-bit dtype, rows TMA reads."""
    return a.dtype == b.dtype == dw.dtype and tma_rows_ok(a) and tma_rows_ok(b)


def _dw_tma(a, b, dw, offsets, e, k, n, s_e, s_k, s_n, tiles=None) -> None:
    """Launch the TMA weight-gradient kernel (operands that _dw_tma_ok accepts; see grouped_dw)."""
    if s_n != 1 and s_k == 1:  # dW's unit stride runs along K: compute its transpose, dW^T = B^T A
        a, b, k, n, s_k, s_n = b, a, n, k, s_n, s_k
    meta = dict(_INTERPRET_DW if INTERPRET else tiles or DW_TMA_TILES)
    bm, bk, bn = meta["BLOCK_M"], meta["BLOCK_K"], meta["BLOCK_N"]
    a_desc = TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(b, [b.shape[0], n], [b.stride(0), 1], [bm, bn])
    grid = e * triton.cdiv(k, bk) * triton.cdiv(n, bn)
    _grouped_dw_tma_kernel[(grid,)](
        a_desc,
        b_desc,
        a,
        b,
        offsets,
        dw,
        k,
        n,
        e,
        min(a.shape[0], b.shape[0]),
        a.stride(0),
        b.stride(0),
        s_e,
        s_k,
        s_n,
        UPCAST=dot_meta(dw.dtype, False)["UPCAST"],
        **meta,
    )
