"""Probe (not a pipeline step): the grouped kernel's tiles in expert order against the mixed order
(GroupedConfig.mix), measured side by side in one process, in E7's prefill cells, on E7's rows.

Why: in expert order the programs running together are a few consecutive experts' tiles. Under a skewed
load a hot expert's tiles reuse each weight tile from L2 (tensor-bound, memory idle) and the cold
experts' tiles each stream their weights once (memory-bound, tensor cores idle), so a launch could
alternate between the two bounds instead of overlapping them. Every row carries ``model_us``: the
launch of that contender's config on that cell's group sizes as waves of tiles, each as slow as the
larger of its bytes at the datasheet's HBM bandwidth and its FLOPs at the datasheet's tensor peak
(moegemm.grouped.schedule.wave_model_us), which shows that effect alone; the timing says whether it is
what costs the time.

Per cell, interleaved (experiments.harness.runner.measure, E7's timing settings):
- ``tuned``: what the library picks (the tuned table's config, which may already mix);
- ``order:expert``: the tuned config in expert order (mix=0);
- ``order:mix2`` / ``order:mix4``: experts of at least 2 / 4 row tiles dealt out among the others';
- ``even:ours``: the tuned config on the same rows dealt out evenly (E7's row count, no skew): what the
  load's skew costs at most.
Timed in ROUNDS interleaved rounds (E7 takes config.yaml's fewer): the ratios sought are a few percent.

    python -m probes.probe_mixed_order --out results/<slug>/probe_mixed_order.csv
"""

from __future__ import annotations

import dataclasses
import math

from experiments.e7_grouped_skew import ours, ref_rows, run_probe
from experiments.harness.correctness import check
from experiments.harness.floors import datasheet
from experiments.harness.runner import Contender
from moegemm._runtime import device_sm_count, gpu_slug
from moegemm.grouped import choose_config
from moegemm.grouped.schedule import tile_order, wave_model_us
from probes.common import even_offsets

MIXES = (2, 4)
ROUNDS = 6
CELLS = [
    (model, proj, t, load)
    for model, proj, t in (("deepseek-v3", "up", 4096), ("deepseek-v3", "down", 4096))
    for load in ("uniform", "zipf0.8", "zipf1.2", "zipf1.5", "hot0.5")
] + [
    ("deepseek-v3", "up", 16384, "zipf1.2"),
    ("deepseek-v3", "down", 1024, "zipf1.2"),
    ("qwen3-30b-a3b", "up", 4096, "zipf1.2"),
    ("qwen3-30b-a3b", "down", 4096, "zipf1.2"),
    ("qwen3-30b-a3b", "up", 4096, "uniform"),
    ("mixtral-8x7b", "down", 1024, "zipf1.2"),
    ("mixtral-8x7b", "up", 4096, "zipf1.2"),
]


def model_us(sizes: list[int], n: int, k: int, cfg, xs) -> float:
    """wave_model_us of ``cfg``'s tiles on these group sizes, one program per multiprocessor running at a
    time (the prefill tiles' shared memory leaves room for one), at this GPU's datasheet peaks."""
    d = datasheet(gpu_slug(xs))
    return wave_model_us(
        tile_order(sizes, n, cfg),
        n,
        k,
        cfg,
        device_sm_count(xs),
        d["hbm_tb_s"] * 1e12,
        d["bf16_tflops"] * 1e12,
    )


def contenders(xs, plan, w, e: int, n: int, k: int) -> list[Contender]:
    """The tuned config, in expert order and mixed, and on the rows dealt evenly (its own float64 check);
    each with the wave model's time for its config and rows (field ``model_us``)."""
    off = plan.group_offsets
    sizes = plan.group_sizes.tolist()
    tuned, source = choose_config(xs, e, n, "nk")

    def mine(name, offsets, c, why, sizes=sizes, **more):
        return Contender(
            name,
            ours(offsets, c),
            config=dataclasses.asdict(c),
            parallel_compile=True,
            fields={"config_source": why, "model_us": model_us(sizes, n, k, c, xs)},
            **more,
        )

    cs = [mine("tuned", off, tuned, source)]
    if tuned.tma:
        for name, mix in [("order:expert", 0)] + [(f"order:mix{m}", m) for m in MIXES]:
            c = dataclasses.replace(tuned, mix=mix)
            if c != tuned:
                cs.append(mine(name, off, c, "tuned, tile order changed"))
    even = even_offsets(xs.shape[0], e, xs.device)
    even_ref = ref_rows(xs, w, even)
    cs.append(
        mine(
            "even:ours",
            even,
            tuned,
            "tuned (of the skewed cell)",
            sizes=even.diff().tolist(),
            check=lambda out: check(out, even_ref, k),
        )
    )
    return cs


def summary(out: list[dict]) -> str:
    return "us (model) " + ", ".join(
        f"{r['contender']}={r.get('graph_us', math.nan):.0f} ({r['model_us']:.0f})" for r in out
    )


def main():
    run_probe(
        __doc__,
        "probe_mixed_order",
        CELLS,
        lambda xs, plan, ref, w, t, e, k, n, g, cell: contenders(xs, plan, w, e, n, k),
        summary,
        rounds=ROUNDS,
    )


if __name__ == "__main__":
    main()
