"""Probe (not a pipeline step): the grouped kernel's tiles in expert order against the mixed order
(GroupedConfig.mix), measured side by side in one process, in E7's prefill cells, on E7's rows.

Why: in expert order the programs running together are a few consecutive experts' tiles. Under a skewed
load a hot expert's tiles reuse each weight tile from L2 (tensor-bound, memory idle) and the cold
experts' tiles each stream their weights once (memory-bound, tensor cores idle), so a launch alternates
between the two bounds instead of overlapping them. A model of the launch as waves of 132 tiles, each
wave as slow as the larger of its bytes at 4 TB/s and its FLOPs at 700 TFLOP/s, predicts 1.18-1.21x
for DeepSeek-V3 at T=4096 under Zipf 1.2 in expert order and 1.01x with the heavy experts' tiles dealt
out in proportion among the light ones' (``mix``). This probe measures it.

Per cell, interleaved (moegemm.bench.runner.measure, E7's timing settings):
- ``tuned``: what the library picks (the tuned table's config, which may already mix);
- ``order:expert``: the tuned config in expert order (mix=0);
- ``order:mix2`` / ``order:mix4``: experts of at least 2 / 4 row tiles dealt out among the others';
- ``even:ours``: the tuned config on the same rows dealt out evenly (E7's row count, no skew): what the
  load's skew costs at most.

    python -m experiments.probe_mixed_order --out results/<slug>/probe_mixed_order.csv
"""

from __future__ import annotations

import dataclasses
import math

from experiments.e7_grouped_skew import ours, ref_rows, run_probe
from experiments.probe_prefill_tiles import even_offsets
from moegemm.bench.correctness import check
from moegemm.bench.runner import Contender
from moegemm.grouped import choose_config

MIXES = (2, 4)
CELLS = [(model, proj, t, load) for model, proj, t in (
    ("deepseek-v3", "up", 4096), ("deepseek-v3", "down", 4096))
    for load in ("uniform", "zipf0.8", "zipf1.2", "zipf1.5", "hot0.5")] + [
    ("deepseek-v3", "up", 16384, "zipf1.2"), ("deepseek-v3", "down", 1024, "zipf1.2"),
    ("qwen3-30b-a3b", "up", 4096, "zipf1.2"), ("qwen3-30b-a3b", "down", 4096, "zipf1.2"),
    ("qwen3-30b-a3b", "up", 4096, "uniform"), ("mixtral-8x7b", "down", 1024, "zipf1.2"),
    ("mixtral-8x7b", "up", 4096, "zipf1.2"),
]


def contenders(xs, plan, w, e: int, n: int, k: int) -> list[Contender]:
    """The tuned config, in expert order and mixed, and on the rows dealt evenly (its own float64 check)."""
    off = plan.group_offsets
    tuned, source = choose_config(xs, e, n, "nk")
    cs = [Contender("tuned", ours(off, tuned), config=dataclasses.asdict(tuned), fields={"config_source": source},
                    parallel_compile=True)]
    if tuned.tma and tuned.split_k == 1 and not tuned.stream_k:
        for name, mix in [("order:expert", 0)] + [(f"order:mix{m}", m) for m in MIXES]:
            c = dataclasses.replace(tuned, mix=mix)
            if c != tuned:
                cs.append(Contender(name, ours(off, c), config=dataclasses.asdict(c),
                                    fields={"config_source": "tuned, tile order changed"}, parallel_compile=True))
    even = even_offsets(xs.shape[0], e, xs.device)
    even_ref = ref_rows(xs, w, even)
    cs.append(Contender("even:ours", ours(even, tuned), config=dataclasses.asdict(tuned),
                        fields={"config_source": "tuned (of the skewed cell)"},
                        check=lambda out: check(out, even_ref, k), parallel_compile=True))
    return cs


def summary(out: list[dict]) -> str:
    return "us " + ", ".join(f"{r['contender']}={r.get('graph_us', math.nan):.0f}" for r in out)


def main():
    run_probe(__doc__, "probe_mixed_order", CELLS,
              lambda xs, plan, ref, w, t, e, k, n, g, cell: contenders(xs, plan, w, e, n, k), summary)


if __name__ == "__main__":
    main()
