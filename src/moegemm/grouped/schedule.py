"""The order in which the contiguous-layout TMA kernel takes its tiles, written out in Python (host side,
for analysis; the kernel computes it on the GPU from the group offsets). Tests check the kernel against it
under Triton's interpreter; :func:`wave_model_us` models a launch from it."""

from __future__ import annotations

import dataclasses

from . import config
from .config import GroupedConfig


@dataclasses.dataclass(frozen=True)
class Tile:
    expert: int
    row0: int  # first row of the tile in x_sorted
    rows: int  # rows of the expert the tile stores (<= computed)
    computed: int  # rows the tile computes: block_m (+ tail_m where a tail rides with it),
    #               or tail_m for a tail tile of its own
    col0: int


def row_tiles(m: int, cfg: GroupedConfig) -> int:
    """Row tiles of an expert of m rows (a merged tail has none of its own)."""
    step = cfg.block_m
    if m == 0:
        return 0
    if cfg.merge_tail:
        return max(-(-(m - cfg.tail_m) // step), 1)
    return -(-m // step)


def tile_order(group_sizes: list[int], n: int, cfg: GroupedConfig) -> list[Tile]:
    """The kernel's tiles in tile-number order (the order the plain grid's programs take them; the persistent
    grid's program p takes numbers p, p + grid, ...): experts in order, and inside an expert bands of
    config.GROUP_M row tiles walked column by column; with ``cfg.mix`` the tiles of experts of at least mix
    row tiles dealt out in proportion among the others' (tile t of the launch is one of the heavy experts'
    where floor((t + 1) H / total) > floor(t H / total), H of them in all)."""
    step = cfg.block_m
    n_tiles = -(-n // cfg.block_n)
    starts = [sum(group_sizes[:e]) for e in range(len(group_sizes))]

    def expert_tiles(e: int) -> list[Tile]:
        m, mt, out = group_sizes[e], row_tiles(group_sizes[e], cfg), []
        for band in range(0, mt, config.GROUP_M):
            band_rows = min(config.GROUP_M, mt - band)
            for tn in range(n_tiles):
                for j in range(band_rows):
                    r = (band + j) * step
                    rows = min(m - r, step) if not cfg.merge_tail or band + j < mt - 1 else m - r
                    if cfg.tail_m and rows <= cfg.tail_m:  # (merged: only an expert of at most tail_m rows)
                        computed = cfg.tail_m
                    elif cfg.merge_tail and rows > cfg.block_m:
                        computed = cfg.block_m + cfg.tail_m
                    else:
                        computed = step
                    out.append(Tile(e, starts[e] + r, rows, computed, tn * cfg.block_n))
        return out

    per_expert = [expert_tiles(e) for e in range(len(group_sizes))]
    if not cfg.mix:
        return [t for tiles in per_expert for t in tiles]
    heavy = [t for m, tiles in zip(group_sizes, per_expert) if row_tiles(m, cfg) >= cfg.mix for t in tiles]
    light = [t for m, tiles in zip(group_sizes, per_expert) if row_tiles(m, cfg) < cfg.mix for t in tiles]
    total, order = len(heavy) + len(light), []
    for t in range(total):
        before = t * len(heavy) // total
        order.append(heavy[before] if (t + 1) * len(heavy) // total > before else light[t - before])
    return order


def wave_model_us(
    tiles: list[Tile],
    n: int,
    k: int,
    cfg: GroupedConfig,
    programs: int,
    hbm_bytes_s: float,
    flops_s: float,
    elt: int = 2,
) -> float:
    """A launch as consecutive waves of ``programs`` tiles (the tiles running together), each as slow as the
    larger of its HBM bytes at ``hbm_bytes_s`` and its tensor FLOPs (the rows and columns the tile
    computes, not those it keeps) at ``flops_s``. A tile's HBM bytes: the weight slice of its (expert,
    column tile) and the rows of its (expert, row tile) the first time a tile needs them (L2 holds them
    for the tiles after), and its output. A model of where a skewed load's time goes (it has no L2
    bandwidth, and a wave's tiles end together), not a prediction of absolute time."""
    seen_w, seen_a, total = set(), set(), 0.0
    for i in range(0, len(tiles), programs):
        nbytes = flops = 0.0
        for t in tiles[i : i + programs]:
            cols = min(cfg.block_n, n - t.col0)
            if (t.expert, t.col0) not in seen_w:
                seen_w.add((t.expert, t.col0))
                nbytes += k * cols * elt
            if (t.expert, t.row0) not in seen_a:
                seen_a.add((t.expert, t.row0))
                nbytes += t.rows * k * elt
            nbytes += t.rows * cols * elt
            flops += 2.0 * t.computed * cfg.block_n * k
        total += max(nbytes / hbm_bytes_s, flops / flops_s)
    return total * 1e6
