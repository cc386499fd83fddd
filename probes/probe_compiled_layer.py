"""Probe (not a pipeline step): our transformers backend compiled against eager, at prefill, side by side.

Why: in E8 at T=16384 the compiled backend ran up to 12% slower than the eager one, on cells where the
GEMMs take almost all of the time. Since that run the traced layer also gathers rows through a custom op
(moegemm::gather_rows), so that compiled and eager run the same kernels from routing to the un-permute;
this measures whether the gap remains. Cells: the E8 models where compiled lost most at T=16384, at
T=4096 and 16384, uniform load, with E8's inputs (same seeds), timed interleaved in ROUNDS rounds:
``ours:hf-backend``, ``ours:hf-backend:compiled`` and ``ours:moe_ffn``, each checked against float64.

    python -m experiments.probe_compiled_layer --out results/<slug>/probe_compiled_layer.csv
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

from experiments.e7_grouped_skew import start
from experiments.e8_moe_layer import CELL_KEYS, cell_inputs, hf_contender
from moegemm.bench.runner import Contender, measure
from moegemm.grouped import moe_ffn

MODELS = ("gpt-oss-120b", "llama-4-scout", "mixtral-8x22b", "olmoe-1b-7b")
CELLS = [(model, t) for model in MODELS for t in (4096, 16384)]
ROUNDS = 4


def contenders(x, ids, wts, e: int) -> list[Contender]:
    return [hf_contender("ours:hf-backend", "moegemm", x, ids, wts, False),
            hf_contender("ours:hf-backend:compiled", "moegemm", x, ids, wts, True),
            Contender("ours:moe_ffn", lambda inp: (lambda: moe_ffn(x, ids, wts, inp[0], inp[1])))]


def run_cells(doc: str, name: str, cells: list, make_contenders, load: str = "uniform") -> None:
    """E8's inputs (weights, ids, tokens, gating weights: the same seeds) for each (model, T) of ``cells`` in
    turn, ``make_contenders(x, ids, wts, E)`` timed side by side in ROUNDS interleaved rounds, each checked
    against E8's float64 reference; rows to --out."""
    args, _, g, settings, prov, _, writer = start(doc, CELL_KEYS)
    settings = dataclasses.replace(settings, rounds=ROUNDS)
    weights: dict = {}
    for model, t in cells[:1] if args.quick else cells:
        t0 = time.perf_counter()
        m, e, top_k, h, i, ids, x, wts, ref, active, sets = cell_inputs(g, model, t, load, weights)  # E8's
        cs = make_contenders(x, ids, wts, e)
        out = measure(cs, sets, ref, h + i, settings)
        for r in out:
            r.update(experiment=name, model=model, split=m["split"], tokens=t, load=load, experts=e, top_k=top_k,
                     hidden=h, intermediate=i, rounds=ROUNDS, **prov)
        writer.add(out)
        got = {r["contender"]: r.get("graph_us", math.nan) for r in out}
        print(f"{model} T={t}: " + ", ".join(f"{k} {v:.0f} us" for k, v in got.items())
              + f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        del sets, cs
    writer.finish()


if __name__ == "__main__":
    run_cells(__doc__, "probe_compiled_layer", CELLS, contenders)
