"""Probe (not a pipeline step): does dealing the last waves of tiles out by K steps (Stream-K) pay where a
cell's tiles make only a few waves on the GPU? Measured side by side in one process, on E7's inputs.

In each cell below (few waves of tiles past decode: Mixtral at T=256 and T=1024, Qwen3-30B-A3B at
T=1024; Mixtral's T=4096 down projection, about eight waves, as the edge), uniform and Zipf 1.2 loads,
interleaved (moegemm.bench.runner.measure, E7's timing settings):
- ``tuned``: what the library picks (the tuned table's tiles and grid);
- ``stream-k:BMxBN``: 128 x 256, 128 x 128 and 64 x 128 tiles on the persistent grid, the last one to
  two waves dealt out by K steps;
- ``whole:BMxBN``: the same tiles on the same persistent grid, every tile whole (round robin): what the
  dealing itself changes.

    python -m experiments.probe_stream_k --out results/<slug>/probe_stream_k.csv
"""

from __future__ import annotations

import dataclasses
import math

from experiments.e7_grouped_skew import ours, run_probe
from moegemm.bench.runner import Contender
from moegemm.grouped import GroupedConfig, choose_config

CELLS = [(model, proj, t, load)
         for model, proj, t in [("mixtral-8x7b", "down", 1024), ("mixtral-8x7b", "up", 1024),
                                ("qwen3-30b-a3b", "up", 1024), ("qwen3-30b-a3b", "down", 1024),
                                ("mixtral-8x7b", "down", 256), ("mixtral-8x7b", "up", 256),
                                ("mixtral-8x7b", "down", 4096)]
         for load in ("uniform", "zipf1.2")]

TILES = {"128x256": GroupedConfig(128, 256, 64, num_warps=8, num_stages=4, persistent=True, tma=True),
         "128x128": GroupedConfig(128, 128, 64, num_warps=8, num_stages=4, persistent=True, tma=True),
         "64x128": GroupedConfig(64, 128, 64, num_warps=4, num_stages=4, persistent=True, tma=True)}


def contenders(xs, plan, e: int, n: int) -> list[Contender]:
    tuned, source = choose_config(xs, e, n, "nk")
    cs = [Contender("tuned", ours(plan.group_offsets, tuned), config=dataclasses.asdict(tuned),
                    fields={"config_source": source}, parallel_compile=True)]
    for name, c in TILES.items():
        for kind, cfg in (("stream-k", dataclasses.replace(c, stream_k=True)), ("whole", c)):
            cs.append(Contender(f"{kind}:{name}", ours(plan.group_offsets, cfg), config=dataclasses.asdict(cfg),
                                fields={"config_source": "probe"}, parallel_compile=True))
    return cs


def speedup(out: list[dict]) -> str:
    t = {r["contender"]: r.get("graph_us", math.nan) for r in out}
    best = min([(v, k) for k, v in t.items() if k.startswith("stream-k") and v == v] or [(math.nan, "-")])
    return (f"tuned {t.get('tuned', math.nan):.1f} us; best Stream-K {best[1]} {best[0]:.1f} us "
            f"(tuned / it = {t.get('tuned', math.nan) / best[0]:.3f})")


def main():
    from experiments.common import require_gpu

    require_gpu()
    run_probe(__doc__, "probe_stream_k", CELLS,
              lambda xs, plan, ref, w, t, e, k, n, g, cell: contenders(xs, plan, e, n), speedup)


if __name__ == "__main__":
    main()
