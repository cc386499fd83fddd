"""Decompose-K's single-launch reduction (src/moegemm/decompose_k/single_launch.py, ``_single_launch_kernel``)
for one output tile, as the code runs it: the grid (tiles, S), each program's fp32 partial over its K chunk
written to the workspace, who waits on whom, who reduces, in which order, and where the epilogue runs; the
cooperative form (``COOP=True``, what a plan launches where the whole grid is resident at once) and the
last-arriver form (``COOP=False``: a grid too large for that, a direct launch, the CPU interpreter).

Every name in the drawing is the code's (NAMES lists them; a test checks each is in the kernel's source).
No measured data is read (``--results`` is accepted for a uniform command line)."""

from __future__ import annotations

import textwrap

from matplotlib.patches import Rectangle

from paper.figures import diagrams as d
from paper.figures.common import args, save

S = 4  # splits drawn
# The code's names the drawing uses, each found in src/moegemm/decompose_k/single_launch.py
NAMES = (
    "_single_launch_kernel",
    "tile_id",
    "split",
    "counter_ptr",
    "flag",
    "KPS",
    "p_tile",
    "SLICE",
    "CHUNK",
    "COOP",
    "tl.sum",
    "apply_epilogue",
    "atomic_add",
    "atomic_xchg",
    "acq_rel",
    "ticket == S - 1",
    "debug_barrier",
    "launch_cooperative_grid",
)


def draw():
    W, H = 6.9, 3.35
    fig, ax = d.canvas(W, H)
    col = d.EXPERT_COLORS

    # (a) the cooperative form -----------------------------------------------------------------------------
    d.label(ax, 0.0, H - 0.1, "(a) COOP=True: every program reduces a slice", weight="bold")
    # the tile's launch counter: read first by every program, bumped once per launch, never reset
    cy = H - 0.5
    d.box(ax, 0.0, cy, 1.45, 0.24, "counter_ptr[tile_id]", mono=True, fs=d.SMALL, fc="#eeeeee")
    d.label(
        ax,
        1.52,
        cy + 0.12,
        "read first by every program: flag = counter + 1;\n"
        "split 0 adds 1 after its wait (atomic_add): no reset",
        fs=d.SMALL,
    )

    lane_h, lane_gap = 0.24, 0.05
    top = H - 0.88  # the first lane's top
    lane_y = [top - (s + 1) * lane_h - s * lane_gap for s in range(S)]  # bottoms
    # the S programs of the tile: grid (tiles, S); (tile_id, split) = (program_id(0), program_id(1))
    lw = 1.45
    d.label(ax, 0.0, top + 0.1, "program (tile_id, split)", fs=d.SMALL)
    for s in range(S):
        d.box(ax, 0.0, lane_y[s], lw, lane_h, f"(t, {s}): acc over K chunk {s}", fc=col[s], fs=d.SMALL)

    # the workspace: the tile's S fp32 partials, each element one 64-bit word (flag above the value's bits)
    gx, cw = 2.0, 0.52
    d.label(
        ax,
        gx + S * cw / 2,
        top + 0.29,
        "p_tile: S partials, words (flag << 32) | fp32 bits",
        fs=d.SMALL,
        ha="center",
    )
    for s in range(S):
        for q in range(S):
            d.box(ax, gx + q * cw, lane_y[s], cw, lane_h, fc=col[s], lw=0.5)
        d.arrow(ax, (lw + 0.02, lane_y[s] + lane_h / 2), (gx - 0.02, lane_y[s] + lane_h / 2))
    d.label(ax, (lw + gx) / 2, top + 0.1, "store", fs=d.SMALL, ha="center")
    for q in range(S):
        d.label(ax, gx + (q + 0.5) * cw, top + 0.1, f"slice {q}", fs=d.SMALL, ha="center")
    # the readers: program (t, q) waits on slice q of all S partials, then reduces it into C
    ry = lane_y[-1] - 0.48
    for q in range(S):
        x = gx + q * cw
        ax.add_patch(
            Rectangle(
                (x + 0.03, lane_y[-1] + 0.025),
                cw - 0.06,
                top - lane_y[-1] - 0.05,
                fill=False,
                ec="black",
                lw=1.0,
                ls=(0, (2, 1.5)),
            )
        )
        d.arrow(ax, (x + cw / 2, lane_y[-1] - 0.01), (x + cw / 2, ry + 0.22))
        d.box(ax, x + 0.03, ry, cw - 0.06, 0.22, f"(t, {q})", fc=col[q], fs=d.SMALL)
        d.arrow(ax, (x + cw / 2, ry - 0.01), (x + cw / 2, ry - 0.18))
        d.box(ax, x, ry - 0.4, cw, 0.22, f"C {q}", fs=d.SMALL)
    d.label(ax, gx + S * cw + 0.05, ry + 0.11, "wait,\nreduce", fs=d.SMALL)
    d.label(ax, gx + S * cw + 0.05, ry - 0.29, "C tile", fs=d.SMALL)
    reduce_text = (
        "K chunk s: [s*KPS, (s+1)*KPS), KPS = ceil(K/S); slice q: SLICE ~ TILE/S elements. "
        "Program (t, q) spins until every word of slice q, in all S partials, carries flag; "
        "sums the S values with tl.sum (a fixed tree: bitwise the same every run) and applies "
        "apply_epilogue (+ bias, relu / sigmoid) as it stores slice q of C."
    )
    d.label(ax, 0.0, 0.0, textwrap.fill(reduce_text, 37), fs=d.SMALL, va="bottom")

    # (b) the last-arriver form ----------------------------------------------------------------------------
    bx, bw = 4.55, 2.33
    d.label(ax, bx, H - 0.1, "(b) COOP=False: last arriver reduces", weight="bold")
    steps = [
        ("each (t, s): acc over K chunk s ->\np_tile[s] in fp32; debug_barrier", 0.34),
        ("ticket = atomic_add(counter, 1, acq_rel)", 0.24),
        (
            "ticket == S - 1 (the last to arrive): sums\nthe S partials with tl.sum (a fixed tree),\nCHUNK "
            "elements at a time; apply_epilogue;\nstores the whole C tile",
            0.62,
        ),
        ("atomic_xchg(counter, 0): reset for the\nnext launch and CUDA-graph replay", 0.34),
    ]
    y = H - 0.28
    for i, (text, h) in enumerate(steps):
        y -= h
        d.box(ax, bx, y, bw, h, text, fc="#eeeeee" if "counter" in text else "white", fs=d.SMALL)
        if i < len(steps) - 1:
            d.arrow(ax, (bx + bw / 2, y - 0.01), (bx + bw / 2, y - 0.13))
            y -= 0.14
    notes = (
        "The other S - 1 programs exit after taking their ticket. A plan launches (a) where the whole grid "
        "(tiles x S) is resident at once (launch_cooperative_grid), else (b); both are deterministic."
    )
    d.label(ax, bx, 0.0, textwrap.fill(notes, 44), fs=d.SMALL, va="bottom")
    return fig


def main():
    a = args(__doc__)
    save(draw(), a.out)


if __name__ == "__main__":
    main()
