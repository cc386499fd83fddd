"""Probe (not a pipeline step): does tuning on a skewed load as well as the uniform one pay on E7's own
inputs? Measured side by side in one process.

tune_grouped keeps per cell the config of the least geometric-mean time over the uniform
and a Zipf 1.2 load (its own routing seeds). Here, in every tuned cell (model, projection, T; T=1 and
T=16384 left out) where that choice differs from the uniform load's fastest config, both run on E7's
inputs (E7's seeds) under a uniform, a Zipf 1.2 and a hot-expert load, interleaved
(experiments.harness.runner.measure, E7's timing settings):
- ``tuned:both-loads``: the config the tuner keeps (the table's entry);
- ``tuned:uniform-only``: the uniform load's fastest, what a tuner on the uniform load alone would keep.
Both come from the committed tuner CSV (results/<slug>/tune_grouped.csv).

    python -m probes.probe_robust_tuning --out results/<slug>/probe_robust_tuning.csv
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from experiments.common import ROOT, require_gpu
from experiments.e7_grouped_skew import ours, run_probe
from experiments.harness.runner import Contender
from experiments.tune_grouped import robust_order
from moegemm.grouped import GroupedConfig

LOADS = ("uniform", "zipf1.2", "hot0.5")


def choices(tune_csv: Path) -> dict:
    """{(model, proj, T): (config kept on both loads, uniform load's fastest)} for the tuned cells with
    both loads where the two differ, from the tuner's CSV."""
    df = pd.read_csv(tune_csv)
    if "load" not in df.columns:
        raise ValueError(f"{tune_csv}: a tuner CSV with a load column is needed")
    out = {}
    for (model, proj, t), g in df.groupby(["model", "proj", "tokens"]):
        rows = g.to_dict("records")
        loads = tuple(sorted(set(g.load), key=lambda ld: ld != "uniform"))
        if len(loads) < 2:
            continue
        both = robust_order(rows, loads)[0][1]
        uni = robust_order(rows, ("uniform",))[0][1]
        if both != uni:
            out[model, proj, int(t)] = (json.loads(both), json.loads(uni))
    return out


def cells_of(picks: dict, skip_tokens=(1, 16384)) -> list[tuple]:
    return [
        (model, proj, t, load) for (model, proj, t) in sorted(picks) if t not in skip_tokens for load in LOADS
    ]


def contenders(xs, plan, t: int, model: str, proj: str, picks: dict) -> list[Contender]:
    both, uni = picks[model, proj, t]
    return [
        Contender(
            name,
            ours(plan.group_offsets, GroupedConfig.from_dict(c)),
            config=c,
            fields={"config_source": "tune_grouped.csv"},
            parallel_compile=True,
        )
        for name, c in (("tuned:both-loads", both), ("tuned:uniform-only", uni))
    ]


def speedup(out: list[dict]) -> str:
    t = {r["contender"]: r.get("graph_us", math.nan) for r in out}
    return f"uniform-only / both-loads time = {t['tuned:uniform-only'] / t['tuned:both-loads']:.3f}"


def main():
    import torch

    from moegemm._runtime import slugify

    require_gpu()
    picks = choices(ROOT / "results" / slugify(torch.cuda.get_device_name(0)) / "tune_grouped.csv")
    run_probe(
        __doc__,
        "probe_robust_tuning",
        cells_of(picks),
        lambda xs, plan, ref, w, t, e, k, n, g, cell: contenders(xs, plan, t, cell[0], cell[1], picks),
        speedup,
    )


if __name__ == "__main__":
    main()
