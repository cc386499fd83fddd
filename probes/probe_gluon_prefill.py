"""Probe (not a pipeline step): a hand warp-specialized Gluon kernel (probes/gluon_grouped.py: a
producer warp of TMA copies, consumer warp groups of asynchronous MMAs, a ring of shared-memory slots between
them) against the library's grouped kernel at prefill, where both it and torch._grouped_mm are bound by the
tensor cores.

On the tune models' prefill cells (E7's weights, routing, float64 reference and timing): the library's
kernel with its tuned config on both grids, the Gluon kernel in each of its configs
(gluon_grouped.VARIANTS), and torch._grouped_mm. Before the cells, the Gluon kernel is checked against
float64 on small ragged shapes (an empty expert, experts of fewer rows than a tile, K and N not multiples
of the tile), its output poisoned with NaN first. Tune models only: what it finds would feed the tuner.

    python -m probes.probe_gluon_prefill --out probe_gluon_prefill.csv
"""

from __future__ import annotations

import torch

from experiments.common import load_config
from experiments.e7_grouped_skew import ref_rows, run_probe, torch_contender, tuned_contenders
from experiments.harness.correctness import check
from experiments.harness.runner import Contender
from probes.gluon_grouped import VARIANTS, ws_grouped_mm

# (rows per expert, N, K) of the small ragged shapes checked first
EDGES = (([300, 0, 7, 129, 1000], 384, 352), ([1, 2, 3, 500], 256, 64), ([4096, 4096, 4096], 1000, 1024))


def cells(g: dict) -> list[tuple]:
    return [
        (model, proj, t, load)
        for model, m in g["models"].items()
        if m["split"] == "tune"
        for proj in ("up", "down")
        for t in g["prefill_tokens"]
        for load in ("uniform", "zipf1.2")
    ]


def gluon_contender(offsets, name: str, block_n: int, stages: int, pingpong: bool) -> Contender:
    """The Gluon kernel in one config on an input set (x_sorted, w as [E, N, K]), into one output per set
    poisoned with NaN before its first call (a tile it failed to write fails the check)."""

    def bind(inp):
        y = torch.full(
            (inp[0].shape[0], inp[1].shape[1]), float("nan"), dtype=inp[0].dtype, device=inp[0].device
        )
        return lambda: ws_grouped_mm(
            inp[0], inp[1], offsets, y, block_n=block_n, stages=stages, pingpong=pingpong
        )

    return Contender(
        f"gluon-ws:{name}", bind, config={"block_n": block_n, "stages": stages, "pingpong": pingpong}
    )


def contenders_of(xs, plan, ref, w, t, e, k, n, g, cell, **_):
    off = plan.group_offsets
    return (
        tuned_contenders(xs, off, e, n)
        + [gluon_contender(off, *v) for v in VARIANTS]
        + [torch_contender(off)]
    )


def summary(rows: list[dict]) -> str:
    us = {r["contender"]: r.get("graph_us") for r in rows if r.get("status") == "ok"}
    mine = [v for c, v in us.items() if c.startswith("ours:")]
    glu = [v for c, v in us.items() if c.startswith("gluon-ws:")]
    if not mine or not glu:
        return " ".join(f"{r['contender']} {r['status']}" for r in rows)
    return (
        f"ours best {min(mine):.1f} us, gluon best {min(glu):.1f} us: ours/gluon {min(mine) / min(glu):.3f}"
    )


def check_edges() -> list[str]:
    """One line per (small ragged shape, config): the Gluon kernel's product against float64."""
    g = torch.Generator(device="cuda").manual_seed(7)
    lines = []
    for sizes, n, k in EDGES:
        e, m = len(sizes), sum(sizes)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(e, n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        off = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        ref = ref_rows(x, w, off)
        for name, block_n, stages, pingpong in VARIANTS:
            y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            ok, rel, why = check(
                ws_grouped_mm(x, w, off, y, block_n=block_n, stages=stages, pingpong=pingpong), ref, k
            )
            lines.append(f"edge {sizes} N={n} K={k} {name}: {'ok' if ok else 'WRONG ' + why} (rel {rel:.2e})")
    return lines


def main():
    g = load_config()["grouped"]
    if torch.cuda.is_available():
        for line in check_edges():
            print(line, flush=True)
    run_probe(__doc__, "probe_gluon_prefill", cells(g), contenders_of, summary)


if __name__ == "__main__":
    main()
