"""Probe (not a pipeline step): the room E8's largest cells leave on the held-out models, as two dense GEMMs.

At T=4096 and 16384 the expert FFN is bound by the tensor cores. This times, side by side with E8's inputs
and timing, our ``moe_ffn`` and the ``torch._grouped_mm pipeline`` beside ``dense:ffn``: the FFN's two
GEMMs as two dense cuBLAS GEMMs over all the cell's rows, with one expert's gate/up and down weights (a
different expert each call) -- the same FLOPs with no ragged row counts, and nothing else: no routing, no
permutation, no SiLU, no combine. The pipeline's time over dense:ffn's is then more than any FFN can gain
over the pipeline unless its GEMMs outrun cuBLAS's dense GEMM of the same FLOPs; and since E8's best peer is
the faster of the pipeline and the compiled transformers backend, it bounds the gain over the best peer too.

Held-out models measured for reading only: nothing learns from this.

    python -m probes.probe_ffn_ceiling --out probe_ffn_ceiling.csv
"""

from __future__ import annotations

import itertools
import sys

import torch

from experiments import e8_moe_layer as e8
from experiments.common import Progress
from experiments.e7_grouped_skew import start
from experiments.harness.correctness import check
from experiments.harness.runner import Contender, measure
from moegemm.grouped import permute, route

TOKENS = (4096, 16384)
KEEP = ("ours:moe_ffn", "torch._grouped_mm pipeline")


def dense_ffn(xs: torch.Tensor, act: torch.Tensor, e: int, down0: torch.Tensor) -> Contender:
    """The FFN's two GEMMs as dense ones over all rows (``xs`` [rows, H] through gate/up, ``act`` [rows, I]
    through down) with one expert's weights per call, a different expert each call (so that back-to-back
    calls find no weights in L2), on an input set (gate_up [E, 2I, H], down [E, H, I]). It returns the down
    product, which its check compares with float64 against ``down0`` (the first input set's expert 0: the
    harness checks the first call on the first set)."""

    def bind(inp):
        gu, dn = inp
        turn = itertools.count()

        def call():
            j = next(turn) % e
            torch.mm(xs, gu[j].T)
            return torch.mm(act, dn[j].T)

        return call

    return Contender(
        "dense:ffn",
        bind,
        check=lambda out: check(out, act.double() @ down0.double().T, act.shape[1]),
        fields={"config_source": "cuBLAS, one expert's weights"},
    )


def cells(g: dict, loads: list[str]) -> list[tuple]:
    return [
        (model, t, load)
        for model, m in g["models"].items()
        if m["split"] == "heldout"
        for t in TOKENS
        for load in loads
    ]


def main():
    args, cfg, g, settings, prov, slug, writer = start(__doc__, e8.CELL_KEYS)
    e8cfg = cfg["moe_layer"]
    todo = cells(g, e8cfg["loads"])
    bar = Progress(len(todo), "probe")
    weights: dict = {}
    for model, t, load in todo:
        if writer.done(model=model, tokens=t, load=load):
            bar.update()
            continue
        m, e, top_k, h, i, ids, x, wts, ref, active, sets = e8.cell_inputs(g, model, t, load, weights)
        rows = t * top_k
        xs = permute(x, route(ids, e))
        gen = torch.Generator(device="cuda").manual_seed(g["seed"] + rows)
        act = torch.randn(rows, i, device="cuda", generator=gen).to(torch.bfloat16)
        dense = dense_ffn(xs, act, e, sets[0][1][0])
        cs = [c for c in e8.contenders(x, ids, wts, e, h, i, t, False, None) if c.name in KEEP] + [dense]
        out = measure(cs, sets, ref, h + i, settings)
        e8.annotate(out, "probe_ffn_ceiling", m, model, t, load, h, i, active, len(sets), slug, prov)
        writer.add(out)
        us = {r["contender"]: r.get("graph_us") for r in out}
        o, p, d = (us.get(c) for c in (*KEEP, "dense:ffn"))
        line = (
            f"pipeline/ours {p / o:.3f}  pipeline/dense {p / d:.3f}  ours/dense {o / d:.3f}"
            if o and p and d
            else " ".join(f"{r['contender']} {r['status']}" for r in out)
        )
        print(f"{model} T={t} {load}: {line}", file=sys.stderr, flush=True)
        del sets, cs, dense, xs, act
        bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
