"""Drawing helpers for the two diagrams (diagram_reduction, diagram_grouped): one axes whose units are inches
of the printed figure, so that boxes, text and gaps are laid out at the size they print at (the paper prints
every figure at its text width, paper.figures.common.TEXT_WIDTH_IN)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from paper.figures.common import setup

MONO = "DejaVu Sans Mono"  # code names (the library's own identifiers) in a typewriter face
FS = 7.5  # body text in pt (paper.figures.common.MIN_PT: 7 at the least)
SMALL = 7.0
# One colour per expert (light fills, so that black text reads on them)
EXPERT_COLORS = ["#9ecae1", "#fdae6b", "#a1d99b", "#dadaeb", "#fcbba1", "#c7e9c0", "#fdd0a2", "#bcbddc"]


def canvas(width: float, height: float):
    """(fig, ax): a ``width`` x ``height`` inch figure whose one axes spans it in inch units, no frame."""
    setup()
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def box(ax, x, y, w, h, text="", fc="white", ec="black", lw=0.8, fs=FS, mono=False, ls="-", hatch=None, **kw):
    """A rectangle with its lower left corner at (x, y) and ``text`` centred in it."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=fc, edgecolor=ec, lw=lw, ls=ls, hatch=hatch))
    if text:
        label(ax, x + w / 2, y + h / 2, text, fs=fs, mono=mono, ha="center", va="center", **kw)


def label(ax, x, y, text, fs=FS, mono=False, ha="left", va="center", **kw):
    return ax.text(x, y, text, fontsize=fs, ha=ha, va=va, family=MONO if mono else None, **kw)


def arrow(ax, start, end, color="black", lw=0.9, style="-|>", ls="-", rad=0.0, ms=7):
    """An arrow from ``start`` to ``end`` (inches), optionally bent (``rad``)."""
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle=style,
            mutation_scale=ms,
            color=color,
            lw=lw,
            ls=ls,
            shrinkA=0,
            shrinkB=0,
            connectionstyle=f"arc3,rad={rad}",
        )
    )


def bracket(ax, x, y0, y1, text="", side="right", tick=0.05, fs=SMALL, mono=False, color="black"):
    """A square bracket along x from y0 to y1 with ``text`` beside its middle."""
    d = tick if side == "right" else -tick
    ax.plot([x, x + d, x + d, x], [y0, y0, y1, y1], color=color, lw=0.8)
    if text:
        ha = "left" if side == "right" else "right"
        label(ax, x + d + (0.04 if side == "right" else -0.04), (y0 + y1) / 2, text, fs=fs, mono=mono, ha=ha)
