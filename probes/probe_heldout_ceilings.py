"""Probe (not a pipeline step): how much room the held-out models' grouped GEMM cells leave, at decode and
at prefill, beside the default path and torch._grouped_mm.

E7 measures its two ceilings only on the tune models. This measures them on the held-out ones, at one decode
and one prefill token count (T=256 and T=4096; the uniform load, where the lowest ratios are), side by side
with E7's weights, routing and timing:

- ``ours:auto`` (grouped_mm with no config, as E7) and ``torch._grouped_mm``;
- ``dense-reference``: one dense cuBLAS GEMM over all the cell's rows with one expert's weights (the same
  FLOPs with no ragged row counts; E7's yardstick), the tensor-bound cells' ceiling;
- ``ceiling:stream``: one kernel that only moves the cell's bytes (the active experts' weights, the rows in
  and out; E7's memory ceiling), the memory-bound cells' ceiling.

Held-out models measured for reading only: nothing learns from this.

    python -m probes.probe_heldout_ceilings --out probe_heldout_ceilings.csv
"""

from __future__ import annotations

from experiments.common import load_config
from experiments.e7_grouped_skew import (
    dense_contender,
    heldout_contenders,
    run_probe,
    stream_contender,
    stream_search,
)

TOKENS = (256, 4096)
KEEP = ("ours:auto", "torch._grouped_mm")


def cells(g: dict) -> list[tuple]:
    return [
        (model, proj, t, "uniform")
        for model, m in g["models"].items()
        if m["split"] == "heldout"
        for proj in ("up", "down")
        for t in TOKENS
    ]


def contenders_of(xs, plan, ref, w, t, e, k, n, g, cell, ws, settings, **_):
    cs = [c for c in heldout_contenders(xs, plan, e, n) if c.name in KEEP]
    return cs + [dense_contender(e), stream_contender(stream_search(ws, xs, plan, settings), w, xs, plan)]


def summary(rows: list[dict]) -> str:
    us = {r["contender"]: r.get("graph_us") for r in rows}
    ours, torch_, dense, stream = (us.get(c) for c in (*KEEP, "dense-reference", "ceiling:stream"))
    if not (ours and torch_ and dense and stream):
        return " ".join(f"{r['contender']} {r['status']}" for r in rows)
    return (
        f"torch/ours {torch_ / ours:.3f}  torch/dense {torch_ / dense:.3f}  torch/stream "
        f"{torch_ / stream:.3f}  ours/dense {ours / dense:.3f}  ours/stream {ours / stream:.3f}"
    )


def main():
    g = load_config()["grouped"]
    run_probe(__doc__, "probe_heldout_ceilings", cells(g), contenders_of, summary, with_sets=True)


if __name__ == "__main__":
    main()
