"""The grouped GEMM's tile-to-expert map, on a small example the library computes itself: top-k expert ids per
token -> route() (group sizes, offsets, the permuted rows) -> each expert's rows in row tiles, not padded ->
the tile each program of the one launch computes, found in-kernel from the group offsets -> and the masked
layout (decode, CUDA-graph capturable) on the same tokens.

Nothing here is drawn by hand: the plan is ``moegemm.grouped.route`` on a fixed ``topk_ids`` (5 experts, one
of them empty, one hot), and the tile table is the kernels' own device code (``_tile_plan`` /
``_masked_plan`` and ``_tile_coords``, paper/figures/_tile_map.py) run on the CPU under Triton's interpreter,
with the grid the launcher sizes (``_max_tiles``). No measured data is read (``--results`` is accepted for
a uniform command line)."""

from __future__ import annotations

import os
import textwrap
import types

from paper.figures import diagrams as d
from paper.figures.common import args, save

# topk_ids [T = 8, top_k = 2] over E = 5 experts: expert 0 hot (7 of the 16 copies), expert 3 empty
TOPK_IDS = [[0, 1], [0, 2], [4, 0], [1, 0], [2, 0], [0, 1], [1, 4], [0, 2]]
NUM_EXPERTS = 5
# Tile sizes of the drawing (a real config takes 16 to 256): small, so that every row can be drawn
BLOCK_M, BLOCK_N, N = 4, 4, 8


def example() -> dict:
    """The example as the library computes it: the routing plan's arrays, the contiguous layout's tile table
    and grid, and the masked layout's (masked_m = the plan's group sizes, m_max = the largest)."""
    import torch
    import triton

    from moegemm._runtime import INTERPRET
    from moegemm.grouped import route
    from moegemm.grouped.config import GROUP_M
    from moegemm.grouped.launch import _max_tiles
    from paper.figures._tile_map import tile_map

    device = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
    ids = torch.tensor(TOPK_IDS, dtype=torch.int32, device=device)
    plan = route(ids, NUM_EXPERTS)
    rows = plan.num_rows
    tiles = types.SimpleNamespace(block_m=BLOCK_M, block_n=BLOCK_N)
    programs = _max_tiles(rows, NUM_EXPERTS, N, tiles, "N")  # the contiguous launch's grid
    sizes = plan.group_sizes
    m_max = int(sizes.max())
    masked_programs = (
        NUM_EXPERTS * triton.cdiv(m_max, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    )  # grouped_mm_masked's
    return {
        "topk_ids": TOPK_IDS,
        "num_experts": NUM_EXPERTS,
        "block_m": BLOCK_M,
        "block_n": BLOCK_N,
        "n": N,
        "group_m": GROUP_M,
        "group_sizes": sizes.cpu().tolist(),
        "group_offsets": plan.group_offsets.cpu().tolist(),
        "sorted_token_ids": plan.sorted_token_ids.cpu().tolist(),
        "sorted_slot": plan.sorted_slot.cpu().tolist(),
        "programs": programs,
        "tiles": tile_map(plan.group_offsets, NUM_EXPERTS, N, BLOCK_M, BLOCK_N, GROUP_M, programs),
        "m_max": m_max,
        "masked_programs": masked_programs,
        "masked_tiles": tile_map(
            sizes, NUM_EXPERTS, N, BLOCK_M, BLOCK_N, GROUP_M, masked_programs, m_max=m_max
        ),
    }


def span(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}-{last}"


def draw(ex: dict):
    E, bm, bn, n = ex["num_experts"], ex["block_m"], ex["block_n"], ex["n"]
    ids, off, sizes = ex["topk_ids"], ex["group_offsets"], ex["group_sizes"]
    rows, m_max = off[-1], ex["m_max"]
    color = d.EXPERT_COLORS
    W, H = 6.9, 3.78
    fig, ax = d.canvas(W, H)
    rh = 0.15  # one permuted row
    top = H - 0.5  # the row blocks hang from here
    head = top + 0.12  # headings (bottom-aligned here)
    y_of = lambda r: top - (r + 1) * rh  # noqa: E731 (the bottom of permuted row r)

    def heading(x, text, mono=False):
        d.label(ax, x, head, text, mono=mono, va="bottom", fs=d.SMALL)

    # 1. topk_ids [T, k]: each token's two copies level with the two permuted rows they become
    xa, cw = 0.2, 0.2
    heading(0.0, f"topk_ids\n[T={len(ids)}, k={len(ids[0])}]", mono=True)
    for t, pair in enumerate(ids):
        y = top - (t + 1) * 2 * rh
        d.label(ax, xa - 0.04, y + rh, f"t{t}", fs=d.SMALL, ha="right")
        for j, e in enumerate(pair):
            d.box(ax, xa + j * cw, y, cw, 2 * rh, str(e), fc=color[e], lw=0.5, fs=d.SMALL)

    # 2. route(): copies grouped by expert, token order kept within each; x_sorted = permute(x, plan)
    xb = 1.22
    mid = top - rows * rh / 2
    d.arrow(ax, (xa + 2 * cw + 0.05, mid), (xb - 0.22, mid))
    d.label(ax, (xa + 2 * cw + xb - 0.17) / 2, mid + 0.1, "route()", mono=True, ha="center", fs=d.SMALL)
    heading(xb - 0.16, "x_sorted =\npermute(x, plan)", mono=True)
    for r, tok in enumerate(ex["sorted_token_ids"]):
        e = next(i for i in range(E) if off[i] <= r < off[i + 1])
        d.label(ax, xb - 0.03, y_of(r) + rh / 2, str(r), fs=d.SMALL, ha="right", color="#555555")
        d.box(ax, xb, y_of(r), 0.24, rh, f"t{tok}", fc=color[e], lw=0.4, fs=d.SMALL)
    for e in range(E):  # each expert's rows: [group_offsets[e], group_offsets[e+1])
        if sizes[e]:
            d.bracket(
                ax, xb + 0.27, y_of(off[e]) + rh - 0.01, y_of(off[e + 1] - 1) + 0.01, f"e{e}: {sizes[e]}"
            )
        else:  # an empty expert: a boundary with no rows
            ax.plot([xb - 0.02, xb + 0.3], [y_of(off[e]) + rh] * 2, color="black", lw=1.0, ls=(0, (2, 1)))
            d.label(ax, xb + 0.36, y_of(off[e]) + rh, f"e{e}: 0", fs=d.SMALL, color="#444444")
    d.label(
        ax,
        0.0,
        y_of(rows - 1) - 0.06,
        f"group_sizes={sizes}\ngroup_offsets={off}".replace(" ", ""),
        fs=d.SMALL,
        mono=True,
        va="top",
    )

    # 3. Y = grouped_mm(x_sorted, w, group_offsets): each tile with the program that computes it
    xy, tw = 2.3, 0.3
    heading(xy, "Y [rows, N]:\ntile <- program")
    for tile in ex["tiles"]:
        r0, r1 = tile["row0"], min(tile["row0"] + bm, tile["row_end"])
        x = xy + tile["col0"] // bn * tw
        d.box(
            ax,
            x,
            y_of(r1 - 1),
            tw,
            (r1 - r0) * rh,
            f"p{tile['program']}",
            fc=color[tile["expert"]],
            lw=0.8,
            fs=d.SMALL,
        )

    # 4. the tile table, computed in-kernel from group_offsets: no host sync, no padding
    xt = 3.2
    heading(xt, "each program's tile, found\nin-kernel (_tile_coords)")
    lines = [("pid", "e", "rows", "cols")]
    for tile in ex["tiles"]:
        r0, r1 = tile["row0"], min(tile["row0"] + bm, tile["row_end"])
        lines.append(
            (
                f"p{tile['program']}",
                f"{tile['expert']}",
                f"{r0}-{r1 - 1}",
                f"{tile['col0']}-{tile['col0'] + bn - 1}",
            )
        )
    used = len(ex["tiles"])
    lines.append((f"p{span(used, ex['programs'] - 1)}: exit (pid >= {used} tiles)", "", "", ""))
    cols = (0.0, 0.36, 0.62, 1.02)
    lh = rows * rh / len(lines)
    for i, line in enumerate(lines):
        y = top - (i + 0.5) * lh
        for c, text in zip(cols, line):
            d.label(ax, xt + c, y, text, fs=d.SMALL, mono=True)
    ax.plot([xt, xt + 1.3], [top - lh, top - lh], color="black", lw=0.5)

    # 5. the masked layout: static [E, m_max] row blocks, masked_m[e] rows of each live
    xm, bw, gap = 4.72, 0.4, 0.04
    heading(
        xm,
        f"grouped_mm_masked (decode):\nx [E, m_max={m_max}, K] -> Y [E, m_max, N],\nmasked_m = group_sizes",
    )
    for e in range(E):
        x = xm + e * (bw + gap)
        for c in range(n // bn):
            d.box(
                ax,
                x + c * bw / 2,
                top - m_max * rh,
                bw / 2,
                m_max * rh,
                fc="#f4f4f4",
                ec="#aaaaaa",
                lw=0.4,
                hatch="////",
            )
        d.label(ax, x + bw / 2, top - m_max * rh - 0.09, f"e{e}", fs=d.SMALL, ha="center")
    for tile in ex["masked_tiles"]:
        e = tile["expert"]
        r0, r1 = tile["row0"], min(tile["row0"] + bm, tile["row_end"])
        x = xm + e * (bw + gap) + tile["col0"] // bn * bw / 2
        d.box(
            ax,
            x,
            top - r1 * rh,
            bw / 2,
            (r1 - r0) * rh,
            f"p{tile['program']}",
            fc=color[e],
            lw=0.8,
            fs=d.SMALL,
        )
    mused = len(ex["masked_tiles"])
    row_tiles = -(-m_max // bm)
    notes = (
        f"a fixed grid, E x {row_tiles} x {n // bn} = {ex['masked_programs']} programs:\n"
        f"one CUDA-graph capture serves\nany masked_m; p{span(mused, ex['masked_programs'] - 1)} exit.\n"
        "Hatched rows (past masked_m[e]):\nneither read nor written."
    )
    d.label(ax, xm, top - m_max * rh - 0.2, notes, fs=d.SMALL, va="top")

    # the launch, the order and the tile sizes of the drawing
    notes = (
        "grouped_mm: one launch of (ceil(rows/BLOCK_M) + min(E, rows)) x ceil(N/BLOCK_N) = "
        f"{ex['programs']} programs, a bound with no host sync (_max_tiles). Program p takes "
        f"tiles p, p + grid, ... below the {used} tiles it counts from group_offsets "
        f"(_tile_plan): expert by expert, in an expert GROUP_M = {ex['group_m']} row tiles "
        "column by column. An expert's last row tile may be short: its rows past the expert's "
        f"end are masked, none padded. Drawn with BLOCK_M = BLOCK_N = {bm}, N = {n} "
        "(a config's tiles: 16 to 256)."
    )
    d.label(ax, 0.0, 0.0, textwrap.fill(notes, 122), fs=d.SMALL, va="bottom")
    return fig


def main():
    a = args(__doc__)
    import torch

    if not torch.cuda.is_available():  # the kernels' device code on the CPU (read before moegemm's import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    save(draw(example()), a.out)


if __name__ == "__main__":
    main()
