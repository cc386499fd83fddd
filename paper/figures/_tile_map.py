"""The grouped kernels' tile-to-expert map, read out of their own device code (for diagram_grouped).

One Triton kernel that runs the same map as ``_grouped_mm_kernel`` and ``_grouped_mm_masked_kernel``
(:mod:`moegemm.grouped.tiles`: ``_tile_plan`` or ``_masked_plan``, then ``_tile_coords`` in the kernels'
loop over tiles) and, in place of the GEMM, writes down what each tile is. Imported after the caller has
decided where Triton runs (``TRITON_INTERPRET=1`` on the CPU), since Triton reads that when it decorates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moegemm.grouped.tiles import _masked_plan, _tile_coords, _tile_plan

FIELDS = ("program", "expert", "row_start", "row_end", "row0", "col0")


@triton.jit
def _tile_map_kernel(
    counts_ptr,
    out_ptr,
    E,
    M,
    M_MAX,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    MASKED: tl.constexpr,
):
    """counts_ptr: the group offsets [E + 1] (contiguous layout) or masked_m [E] (MASKED). Row ``tile`` of
    out: (the program that took it, expert, its rows' [start, end), the tile's first row and column)."""
    if MASKED:
        e_offs, lo, hi, cum, total_tiles = _masked_plan(counts_ptr, E, M_MAX, N, BLOCK_M, BLOCK_N, E_BLOCK)
    else:
        e_offs, lo, hi, cum, total_tiles = _tile_plan(counts_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        expert, row_start, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        row = out_ptr + tile * 6
        tl.store(row + 0, tl.program_id(0))
        tl.store(row + 1, expert)
        tl.store(row + 2, row_start)
        tl.store(row + 3, row_end)
        tl.store(row + 4, row0)
        tl.store(row + 5, col0)


def tile_map(
    counts: torch.Tensor,
    e: int,
    n: int,
    block_m: int,
    block_n: int,
    group_m: int,
    programs: int,
    m_max: int = 0,
) -> list[dict]:
    """The tiles, in tile order, that a launch of ``programs`` programs computes: one dict of FIELDS each.
    ``m_max`` > 0: the masked layout (``counts`` is masked_m), else the contiguous one (group offsets)."""
    row_tiles = e * triton.cdiv(m_max, block_m) if m_max else triton.cdiv(int(counts[-1]), block_m) + e
    bound = row_tiles * triton.cdiv(n, block_n)  # at least the tiles there are
    out = torch.full((bound, 6), -1, dtype=torch.int32, device=counts.device)
    _tile_map_kernel[(programs,)](
        counts.to(torch.int32).contiguous(),
        out,
        e,
        0 if m_max else int(counts[-1]),  # the rows the offsets end at: the contiguous layout's M
        m_max,
        n,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        E_BLOCK=max(16, triton.next_power_of_2(e)),
        GROUP_M=group_m,
        MASKED=m_max > 0,
    )
    rows = out.cpu().tolist()
    return [dict(zip(FIELDS, r)) for r in rows if r[0] >= 0]
