"""Distil the grouped tuner's measurements into the library's default for shapes it was never tuned on: per
regime of mean rows per expert, a shortlist of tile configs, chosen from the tune-set models' cells of
results/<slug>/tune_grouped.csv alone (config.yaml's grouped.models with split "tune"). On the first call of
an unseen (dtype, E, K, N, layout, rows bucket) the library times the shortlist on that call's own inputs
and keeps the fastest (moegemm.autotune); where it cannot time (inside a CUDA-graph capture, under
Triton's interpreter, MOEGEMM_AUTOTUNE=0) it takes the shortlist's first config.

The shortlist of a regime is built greedily: first the config of the least geometric-mean slowdown against
each cell's best (over the tuning loads, the tuner's screen times), then, one at a time, the config that most
lowers that slowdown when the fastest of the shortlist is taken per cell. A config the tuner did not time in
a cell (it screens the persistent grid and the mixed tile order only on a cell's best few) counts there as
that cell's slowest config. The same construction, left one tune model out at a time and scored on its
cells, gives the out-of-sample slowdown written to results/<slug>/distill_grouped.csv: what the shortlist's
first config, and the best of the shortlist, lose against the tuner's best on a model they did not see.

    python -m experiments.distill_grouped --csv results/<slug>/tune_grouped.csv \
        --out src/moegemm/tuned/grouped_default/<slug>.json --loo results/<slug>/distill_grouped.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict

from experiments._io import atomic_path, write_json
from experiments.common import config_cell, load_config
from moegemm.grouped.config import REGIMES, GroupedConfig, regime_of

SHORTLIST = 6  # configs timed on the first call of an unseen shape


def cell_times(rows: list[dict], tune_models: set[str]) -> tuple[dict, dict]:
    """({cell: {config JSON: geometric-mean screen time over the cell's loads}}, {cell: mean rows per
    expert}) for the tune models' cells (model, projection, tokens); only configs timed under every load the
    cell was tuned on."""
    per: dict = defaultdict(lambda: defaultdict(dict))
    mean_rows, loads = {}, defaultdict(set)
    for r in rows:
        if r["model"] not in tune_models or r.get("stage", "screen") != "screen" or r["status"] != "ok":
            continue
        raw = config_cell(r["config"])
        if any(raw.get(name, noop) != noop for name, noop in GroupedConfig.LEGACY.items()):
            continue  # a config of an option since removed from the kernels (it never won a cell)
        cell = (r["model"], r["proj"], int(r["tokens"]))
        cfg = json.dumps(dataclass_dict(raw), sort_keys=True)
        per[cell][cfg][r.get("load") or "uniform"] = float(r["graph_us"])
        loads[cell].add(r.get("load") or "uniform")
        mean_rows[cell] = float(r["rows_mean"])
    out = {}
    for cell, cfgs in per.items():
        n = len(loads[cell])
        out[cell] = {
            c: math.exp(sum(math.log(v) for v in t.values()) / n) for c, t in cfgs.items() if len(t) == n
        }
    return out, mean_rows


def dataclass_dict(d: dict) -> dict:
    import dataclasses

    return dataclasses.asdict(GroupedConfig.from_dict(d))


def slowdown(cells: list, times: dict, chosen: list[str]) -> float:
    """Geometric mean over ``cells`` of (the fastest of ``chosen`` in the cell) / (the cell's best)."""
    logs = []
    for c in cells:
        t = times[c]
        here = [t[x] for x in chosen if x in t] or [max(t.values())]
        logs.append(math.log(min(here) / min(t.values())))
    return math.exp(sum(logs) / len(logs))


def shortlist(cells: list, times: dict, size: int = SHORTLIST) -> list[str]:
    """The greedy shortlist (see the module's docstring) for these cells."""
    pool = sorted(set().union(*(times[c] for c in cells)))
    chosen: list[str] = []
    while len(chosen) < min(size, len(pool)):
        chosen.append(
            min((x for x in pool if x not in chosen), key=lambda x: slowdown(cells, times, chosen + [x]))
        )
    return chosen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", required=True, help="the tuner's CSV (results/<slug>/tune_grouped.csv)")
    p.add_argument("--out", required=True, help="the library's default table to write")
    p.add_argument("--loo", required=True, help="the leave-one-model-out CSV to write")
    p.add_argument("--config", default=None)
    args = p.parse_args(argv)
    cfg = load_config(args.config) if args.config else load_config()
    models = cfg["grouped"]["models"]
    tune = {m for m, v in models.items() if v["split"] == "tune"}
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{args.csv}: no rows")
    for r in rows:  # mean rows per expert of the cell (the regime's key)
        m = models.get(r["model"])
        r["rows_mean"] = int(r["tokens"]) * m["top_k"] / m["experts"] if m else math.nan
    times, mean_rows = cell_times(rows, tune)
    if not times:
        raise SystemExit(f"{args.csv}: no timed rows of the tune models {sorted(tune)}")
    entries, loo = [], []
    for i, bound in enumerate(REGIMES):
        cells = sorted(c for c in times if regime_of(mean_rows[c]) == i)
        if not cells:
            raise SystemExit(f"{args.csv}: no tune cell in the regime of at most {bound} rows per expert")
        chosen = shortlist(cells, times)
        entries.append(
            {
                "max_mean_rows": bound if bound != math.inf else None,
                "cells": len(cells),
                "slowdown_first": slowdown(cells, times, chosen[:1]),
                "slowdown_shortlist": slowdown(cells, times, chosen),
                "configs": [json.loads(c) for c in chosen],
            }
        )
        for left in sorted({c[0] for c in cells}):
            seen = [c for c in cells if c[0] != left]
            if not seen:
                continue
            picked = shortlist(seen, times)
            for c in (c for c in cells if c[0] == left):
                best = min(times[c].values())
                first = times[c].get(picked[0], math.nan)
                timed = [times[c][x] for x in picked if x in times[c]]
                loo.append(
                    {
                        "model": c[0],
                        "proj": c[1],
                        "tokens": c[2],
                        "mean_rows": mean_rows[c],
                        "regime": i,
                        "best_us": best,
                        "first_us": first,
                        "shortlist_us": min(timed) if timed else math.nan,
                        "shortlist_timed": len(timed),
                        "first_slowdown": first / best,
                        "shortlist_slowdown": min(timed) / best if timed else math.nan,
                    }
                )
    git = sorted({r["git_commit"] for r in rows if r["model"] in tune})
    write_json(
        args.out,
        {
            "gpu": rows[0]["gpu"],
            "clock": "CUDA-graph replay",
            "provenance": {
                "source": args.csv,
                "tune_models": sorted(tune),
                "tuner_commits": git,
                "shortlist": SHORTLIST,
            },
            "entries": entries,
        },
    )
    with atomic_path(args.loo) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(loo[0]))
        w.writeheader()
        w.writerows(loo)
    for e in entries:
        print(
            f"<= {e['max_mean_rows']} rows/expert: {e['cells']} cells, first {e['slowdown_first']:.3f}x, "
            f"best of {len(e['configs'])} {e['slowdown_shortlist']:.3f}x of the tuned best"
        )


if __name__ == "__main__":
    main()
