"""The SwiGLU backward fused into the epilogue of the down projection's dX GEMM, its tiles brought in by TMA
(a probe, not part of the library): one launch computes P = dY D_e^T per tile and applies the backward to it
in registers, so P is never stored.

The library runs the two-launch form instead (P through the forward's grouped GEMM, then the pointwise pass
of :func:`moegemm.grouped.backward.swiglu_backward`): measured by the backward's probe
(probes/probe_backward.py, pieces ``dswiglu``), this kernel ran at 0.68x against its 0.80x of
``torch._grouped_mm``'s speed on the plain GEMM, slower in every cell of the tune split, the training step
1.00-1.04x slower. On Triton for sm_90 the tile's long epilogue runs after its main loop, not beside it.
The probe keeps it so that the comparison can be run again (``probe_backward --pieces dswiglu``,
``probe_separate_accuracy``).

:data:`FUSED_TILES` is the config of least geometric-mean time of its sweep over the tune split's cells
(probe_backward.DSWIGLU_CONFIGS; results/nvidia-h200/probe_backward.csv and probe_dswiglu_split.csv, the
epilogue in column chunks, EPI_SPLIT).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moegemm._runtime import INTERPRET
from moegemm._triton_common import dot_meta
from moegemm.grouped import backward as bw
from moegemm.grouped.backward_kernels import _dswiglu_store
from moegemm.grouped.config import GroupedConfig
from moegemm.grouped.tiles import _tile_coords, _tile_plan, _tma_k_loop
from moegemm.grouped.tma import TensorDescriptor, tma_rows_ok, w_descriptor

FUSED_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, EPI_SPLIT=4)
_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "EPI_SPLIT"}


def fused_swiglu_grad(
    group_offsets, dys, gu, w_down, w_layout, *, scale, rowdot, store_act, in_place, tiles=None
):
    """:func:`moegemm.grouped.backward.swiglu_grad`'s result in one launch of :func:`_dswiglu_tma_kernel`
    (``tiles``, default :data:`FUSED_TILES`; the interpreter's are 16 wide), where TMA can read the
    operands; elsewhere the library's pointer kernel (P in its K loop, the backward in its epilogue)."""
    e, i, h, *_ = bw._w_dims(w_down, w_layout)
    rows = dys.shape[0]
    dgu = gu if in_place else torch.empty_like(gu)
    act = torch.empty((rows, i), dtype=gu.dtype, device=gu.device) if store_act else None
    meta = dict(tiles if tiles is not None else bw._INTERPRET_SWIGLU if INTERPRET else FUSED_TILES)
    split = meta.get("EPI_SPLIT", 1)
    if split not in (1, 2, 4) or meta["BLOCK_N"] % split:
        raise ValueError(f"tiles: EPI_SPLIT must be 1, 2 or 4 and divide BLOCK_N, got {meta}")
    unknown = set(meta) - _KEYS
    if unknown:
        raise ValueError(f"tiles: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    cfg = GroupedConfig(meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], tma=True)
    wd_desc = (
        w_descriptor(w_down, bw.other_layout(w_layout), e, i, h, cfg)
        if rows and i and h and tma_rows_ok(dys) and gu.dtype == dys.dtype == w_down.dtype
        else None
    )
    if wd_desc is None:
        args = (scale, rowdot, store_act, dgu, act)
        return bw.swiglu_pass(group_offsets, dys, gu, w_down, w_layout, *args)
    n_tiles = triton.cdiv(i, meta["BLOCK_N"])
    n_part = n_tiles * split  # a partial per epilogue chunk of a tile
    part = torch.empty((rows, n_part), dtype=torch.float32, device=gu.device) if rowdot else None
    offsets = group_offsets.to(torch.int32).contiguous()
    grid = (triton.cdiv(rows, meta["BLOCK_M"]) + min(e, rows)) * n_tiles
    dy_desc = TensorDescriptor(dys, [rows, h], [dys.stride(0), 1], [meta["BLOCK_M"], meta["BLOCK_K"]])
    _dswiglu_tma_kernel[(grid,)](
        dy_desc, wd_desc, gu, scale.contiguous() if scale is not None else offsets, offsets, dgu,
        act if act is not None else dgu, part if part is not None else offsets,
        i, h, e, rows, gu.stride(0), gu.stride(1), dgu.stride(0), dgu.stride(1),
        act.stride(0) if act is not None else 0, act.stride(1) if act is not None else 0,
        part.stride(0) if part is not None else 0,
        E_BLOCK=max(16, triton.next_power_of_2(e)), W_KN=bw.other_layout(w_layout) == "kn",
        HAS_SCALE=scale is not None, ROWDOT=rowdot, STORE_ACT=store_act,
        IN_PLACE=dgu.data_ptr() == gu.data_ptr(), UPCAST=dot_meta(gu.dtype, False)["UPCAST"],
        **meta,
    )  # fmt: skip
    return dgu, act, (part.sum(1) if rowdot else None)


@triton.jit
def _dswiglu_tma_kernel(
    dy_desc, wd_desc, gu_ptr, scale_ptr, offsets_ptr, dgu_ptr, act_ptr, part_ptr,
    N_I, H, E, M,
    stride_gm, stride_gn, stride_om, stride_on, stride_am, stride_an, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr, GROUP_M: tl.constexpr,
    W_KN: tl.constexpr, HAS_SCALE: tl.constexpr, ROWDOT: tl.constexpr, STORE_ACT: tl.constexpr,
    IN_PLACE: tl.constexpr, UPCAST: tl.constexpr, EPI_SPLIT: tl.constexpr = 1,
):  # fmt: skip
    """The SwiGLU backward in the epilogue of the down projection's dX GEMM, its tiles brought in by TMA: per
    tile of rows of one expert and BLOCK_N of the I activation columns, P = dY[rows] @ D_e^T[:, cols] (dY:
    the permuted rows of the layer's output gradient [rows, H]; D_e^T read through the 2-D descriptor of
    the down weight in the layout of a forward [H, I] operand, W_KN as in _grouped_mm_tma_kernel), then
    _dswiglu_store with G, U loaded from gu [rows, 2I] (which dGU may overwrite: IN_PLACE). Tiles numbered
    as in the forward kernels (from the group offsets, in-kernel: no host sync)."""
    e_offs, lo, hi, cum, total_tiles = _tile_plan(offsets_ptr, E, M, N_I, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    CHUNK: tl.constexpr = BLOCK_N // EPI_SPLIT
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N_I, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        p = _tma_k_loop(
            dy_desc, wd_desc, row0, col0, expert, N_I, H, BLOCK_M, BLOCK_N, BLOCK_K, W_KN, False, UPCAST
        )
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows_c = tl.minimum(rows, row_end - 1).to(tl.int64)
        # the accumulator's column halves (quarters), each through the epilogue in turn: fewer values live
        # at once than the whole tile's (each split made once, before its first chunk)
        for j in tl.static_range(EPI_SPLIT):
            if EPI_SPLIT == 1:
                chunk = p
            elif EPI_SPLIT == 2:
                chunk = _halves(p, BLOCK_M, BLOCK_N)[j]
            else:
                chunk = _halves(_halves(p, BLOCK_M, BLOCK_N)[j // 2], BLOCK_M, BLOCK_N // 2)[j % 2]
            cols = col0 + j * CHUNK + tl.arange(0, CHUNK)
            n_c = cols % N_I
            g_ptrs = gu_ptr + rows_c[:, None] * stride_gm + n_c[None, :] * stride_gn
            _dswiglu_store(
                chunk, tl.load(g_ptrs).to(tl.float32), tl.load(g_ptrs + N_I * stride_gn).to(tl.float32),
                scale_ptr, dgu_ptr, act_ptr, part_ptr,
                rows_c, row_ok, cols, cols < N_I, col0 + j * CHUNK, N_I,
                stride_om, stride_on, stride_am, stride_an, stride_pm,
                CHUNK, HAS_SCALE, ROWDOT, STORE_ACT, IN_PLACE,
            )  # fmt: skip


@triton.jit
def _halves(p, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The first and the second COLS // 2 columns of p [ROWS, COLS]."""
    return tl.split(tl.permute(tl.reshape(p, (ROWS, 2, COLS // 2)), (0, 2, 1)))
