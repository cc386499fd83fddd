"""Probe (not a pipeline step): does the place of a contender in E8's rounds move its time?

Why: in E8 our compiled transformers backend took 0.87-0.97x the eager one's speed at T=16384 on some
models, and probes that time the two alone find them equal. In E8 the harness rotates the contenders by one
place per round, and the largest cells get two rounds, so every contender keeps nearly the same place, and
the compiled backend always runs right after the torch._grouped_mm pipeline. This runs E8's sequence for one
model (its cells in E8's order, inputs, contenders and timing, Dynamo reset as E8 resets it) and, at the
largest T, measures each cell several times over, one after another, with the contenders ordered in turn:

- ``rotate``: as E8 (the list rotated by one place per round);
- ``balanced``: rounds in pairs, a rotation and then the same rotation reversed (bench.runner.round_order);
- ``after-eager``: rotated as E8, the compiled backend moved to right after the eager one in the list;
- ``balanced-4``: balanced, four rounds instead of two;
- ``rotate-again``: as the first, last (what drifted over the probe).

    python -m probes.probe_compiled_order --out probe_compiled_order.csv [--model gpt-oss-120b]
"""

from __future__ import annotations

import dataclasses
import sys

from experiments import e8_moe_layer as e8
from experiments.common import ResultWriter, provenance_fields
from experiments.e7_grouped_skew import Vllm
from experiments.harness import runner
from probes.common import one_model_setup

EAGER, COMPILED = "ours:hf-backend", "ours:hf-backend:compiled"


def after_eager(cs: list) -> list:
    """The contenders with the compiled backend moved to right after the eager one."""
    moved = [c for c in cs if c.name == COMPILED]
    rest = [c for c in cs if c.name != COMPILED]
    at = next((i for i, c in enumerate(rest) if c.name == EAGER), len(rest) - 1) + 1
    return rest[:at] + moved + rest[at:]


def variants(settings: runner.Settings) -> list[tuple[str, runner.Settings, object]]:
    """(name, settings, how the contender list is arranged) of each measurement of a largest-T cell."""
    same = list
    return [
        ("rotate", settings, same),
        ("balanced", dataclasses.replace(settings, order="balanced"), same),
        ("after-eager", settings, after_eager),
        ("balanced-4", dataclasses.replace(settings, order="balanced", rounds=4), same),
        ("rotate-again", settings, same),
    ]


def main():
    out, model, g, e8cfg, settings, top = one_model_setup(sys.argv[1:])
    prov = provenance_fields()
    writer = ResultWriter(out, ("model", "tokens", "load", "variant"))
    vllm = Vllm()
    vllm.load()
    weights: dict = {}
    summary = []
    for t in e8cfg["tokens"]:
        for load in e8cfg["loads"]:
            m, e, top_k, h, i, ids, x, wts, ref, active, sets = e8.cell_inputs(g, model, t, load, weights)
            cs = e8.contenders(x, ids, wts, e, h, i, t, t in e8cfg["compiled_tokens"], vllm.kernel)
            if t != top:  # E8's sequence up to the largest cells, as E8 measures it
                runner.measure(cs, sets, ref, h + i, settings)
                continue
            for name, st, arrange in variants(settings):
                rows = runner.measure(arrange(cs), sets, ref, h + i, st)
                for r in rows:
                    r.update(
                        experiment="probe_compiled_order",
                        model=model,
                        split=m["split"],
                        tokens=t,
                        load=load,
                        variant=name,
                        order=st.order,
                        rounds=st.rounds,
                        place=[c.name for c in arrange(cs)].index(r["contender"]),
                        **prov,
                    )
                writer.add(rows)
                med = {r["contender"]: r.get("graph_us") for r in rows}
                summary.append((load, name, med.get(EAGER), med.get(COMPILED)))
            del sets, cs
    writer.finish()
    print(f"{'load':9s} {'variant':13s} {'eager us':>9s} {'compiled us':>11s} {'eager/compiled':>14s}")
    for load, name, eg, cp in summary:
        ratio = eg / cp if eg and cp else float("nan")
        print(f"{load:9s} {name:13s} {eg or float('nan'):9.1f} {cp or float('nan'):11.1f} {ratio:14.3f}")


if __name__ == "__main__":
    main()
