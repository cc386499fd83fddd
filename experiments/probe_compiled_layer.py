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

import torch

from experiments.common import ResultWriter, cli, load_config, provenance_fields, require_gpu, timing_settings
from experiments.e8_moe_layer import ffn_weights, hf_contender, layer_sizes, ref_ffn
from moegemm.bench.moe_loads import sample_topk
from moegemm.bench.runner import Contender, measure
from moegemm.bench.timing import input_sets_for
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
    args = cli(doc)
    require_gpu()
    cfg = load_config(args.config)
    g = cfg["grouped"]
    settings = dataclasses.replace(timing_settings(cfg, args.quick, "grouped"), rounds=ROUNDS)
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("model", "tokens", "load"))
    weights: dict = {}
    for model, t in cells[:1] if args.quick else cells:
        m = g["models"][model]
        e, top_k = m["experts"], m["top_k"]
        h, i = layer_sizes(m)
        t0 = time.perf_counter()
        if model not in weights:
            weights.clear()
            torch._dynamo.reset()
            weights[model] = ffn_weights(g["seed"] + 8, e, h, i)  # E8's weights
        w_gu, w_dn = weights[model]
        seed = g["seed"] + 8 * 1009 + t * 7 + sum(map(ord, load))  # E8's cell seed
        ids = sample_topk(t, e, top_k, load, seed).to(torch.int64)
        gx = torch.Generator(device="cuda").manual_seed(seed + 1)
        x = torch.randn(t, h, device="cuda", generator=gx).to(torch.bfloat16)
        wts = torch.softmax(torch.randn(t, top_k, device="cuda", generator=gx), -1)
        ref = ref_ffn(x, ids, wts, w_gu, w_dn)
        active = int(torch.unique(ids).numel())
        n_sets = input_sets_for(2 * active * 3 * h * i + 2 * t * top_k * (h + 2 * i))
        sets = [(w_gu, w_dn)] + [(w_gu.clone(), w_dn.clone()) for _ in range(n_sets - 1)]
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
