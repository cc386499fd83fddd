"""Probe (not a pipeline step): tile configs the tuner does not try, at 32-64 rows per expert, on the tune
models, side by side with the tuned table's config.

Why: in the middle regime (16-64 mean rows per expert) our kernel streams each expert's weights once per
row tile and stays at 75-88% of the floor, where the memory ceiling of E7 streams the same bytes at 91-95%.
The tuner's middle candidates load K in steps of 64 or 128 elements: 128-256 bytes per weight row per TMA
box, where the ceiling reads 512-byte rows. Here: K steps of 256 (fewer, longer DRAM bursts per box, two or
three stages), four stages of 128, 64 x 256 tiles (half the activation traffic from L2), 8 warps on 64 x 128,
each with and without 32-row tail tiles, on both grids; against ``tuned`` (the tuned table's entry for the
cell). Cells: the tune models at the token counts whose mean rows per expert fall in the middle regime
(DeepSeek-V3 and Qwen3-30B-A3B at T=1024, Mixtral 8x7B at T=256), both projections, uniform and Zipf 1.2
loads: E7's inputs and timing settings, each contender checked against float64. Held-out models are not
measured here: what this probe finds may enter the tuner's candidates, which only the tune set sees.

    python -m probes.probe_middle_tiles --out results/<slug>/probe_middle_tiles.csv
"""

from __future__ import annotations

import dataclasses
import math

from experiments.e7_grouped_skew import ours, run_probe
from experiments.harness.runner import Contender
from moegemm.grouped import GroupedConfig
from moegemm.grouped.config import choose_config

CELLS = [
    (model, proj, t, load)
    for model, t in (("deepseek-v3", 1024), ("qwen3-30b-a3b", 1024), ("mixtral-8x7b", 256))
    for proj in ("up", "down")
    for load in ("uniform", "zipf1.2")
]

_BASE = dict(tma=True)
NEW = {  # name -> (block_m, block_n, block_k, num_warps, num_stages, tail_m)
    "k256-s2": (64, 128, 256, 4, 2, 0),
    "k256-s2-t32": (64, 128, 256, 4, 2, 32),
    "n64-k256-s3": (64, 64, 256, 4, 3, 0),
    "n64-k256-s3-t32": (64, 64, 256, 4, 3, 32),
    "k128-s4": (64, 128, 128, 4, 4, 0),
    "k128-s4-t32": (64, 128, 128, 4, 4, 32),
    "n256-k64-s4": (64, 256, 64, 4, 4, 0),
    "n256-k64-s4-t32": (64, 256, 64, 4, 4, 32),
    "w8-k128-s3": (64, 128, 128, 8, 3, 0),
    "w8-k128-s3-t32": (64, 128, 128, 8, 3, 32),
}


def configs() -> dict[str, GroupedConfig]:
    out = {}
    for name, (bm, bn, bk, warps, stages, tail) in NEW.items():
        for persistent in (False, True):
            out[name + ("-persistent" if persistent else "")] = GroupedConfig(
                block_m=bm,
                block_n=bn,
                block_k=bk,
                num_warps=warps,
                num_stages=stages,
                tail_m=tail,
                persistent=persistent,
                **_BASE,
            )
    return out


def contenders(xs, plan, ref, w, t, e, k, n, g, cell) -> list[Contender]:
    tuned, source = choose_config(xs, e, n, "nk")
    if source != "tuned":
        raise RuntimeError(f"{cell}: expected a tuned-table entry, got {source!r}")
    named = {"tuned": tuned, **configs()}
    return [
        Contender(
            name,
            ours(plan.group_offsets, c),
            config=dataclasses.asdict(c),
            fields={"config_source": "tuned table" if name == "tuned" else "probe"},
            parallel_compile=True,
        )
        for name, c in named.items()
    ]


def summary(out: list[dict]) -> str:
    t = {r["contender"]: r.get("graph_us", math.nan) for r in out if r.get("status") == "ok"}
    base = t.pop("tuned", math.nan)
    best = min(t, key=t.get) if t else "-"
    return (
        f"tuned {base:.1f} us; best new {best} {t.get(best, math.nan):.1f} us "
        f"({base / t.get(best, math.nan):.3f}x)"
    )


if __name__ == "__main__":
    run_probe(__doc__, "probe_middle_tiles", CELLS, contenders, summary)
