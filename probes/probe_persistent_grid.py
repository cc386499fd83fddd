"""Probe (not a pipeline step): how many programs per SM the persistent grid of the grouped kernels should
launch, measured side by side in one process.

Two runs of E7 on different machines disagreed on the persistent grid: sized by the compiled kernel (as
many programs per SM as fit at once, at most two; one for DeepSeek-V3's prefill tiles of 192 KB of shared
memory), it took up to 1.43x the plain grid's time in those cells, and launched two per SM, up to 1.24x.
Here the same tiles run on the plain
grid and on persistent grids of one, two and the sized number ("auto") of programs per SM, for the same
inputs, interleaved (experiments.harness.runner.measure, E7's timing settings), at E7's seeds and loads;
decode cells also with the masked layout, which always walks a persistent grid.

    python -m probes.probe_persistent_grid --out results/<slug>/probe_persistent_grid.csv
"""

from __future__ import annotations

import dataclasses
import math

from experiments.e7_grouped_skew import masked_inputs, ours, run_probe
from experiments.harness.correctness import check
from experiments.harness.runner import Contender
from moegemm.grouped import choose_config, contiguous, grouped_mm_masked, launch
from moegemm.grouped.config import masked_config

CELLS = [  # (model, projection, tokens, load): E7's cells where the grids differed most, and a few others
    ("deepseek-v3", "up", 4096, "uniform"),
    ("deepseek-v3", "down", 4096, "uniform"),
    ("deepseek-v3", "up", 4096, "hot0.25"),
    ("deepseek-v3", "up", 4096, "zipf1.2"),
    ("deepseek-v3", "up", 16384, "uniform"),
    ("mixtral-8x7b", "down", 4096, "uniform"),
    ("qwen3-30b-a3b", "up", 4096, "uniform"),
    ("deepseek-v3", "up", 64, "uniform"),
    ("mixtral-8x7b", "up", 256, "uniform"),
    ("qwen3-30b-a3b", "down", 256, "zipf1.2"),
]
SHIPPED, SHIPPED_PLAN_KEY = launch.per_sm, contiguous._plan_key


def _no_plan(*args):
    return None


def with_per_sm(per_sm, fn, fields: dict):
    """``fn`` with the persistent grid forced to ``per_sm`` programs per SM ("auto": what the library
    decides, recorded in ``fields``), each call launched through Triton (no plan of a repeat call).
    Graph capture records the grid of the launch it captures."""

    def forced(kernel, cfg, x, args, kwargs):
        got = SHIPPED(kernel, cfg, x, args, kwargs) if per_sm == "auto" else per_sm
        fields["per_sm"] = got
        return got

    def call():
        # and no plan (launch.GroupedPlan keeps the grid it was made with)
        launch.per_sm, contiguous._plan_key = forced, _no_plan
        try:
            return fn()
        finally:
            launch.per_sm, contiguous._plan_key = SHIPPED, SHIPPED_PLAN_KEY

    return call


def contenders(xs, plan, ref, k, decode: bool, e: int, n: int) -> list[Contender]:
    off = plan.group_offsets
    base, source = choose_config(xs, e, n, "nk")
    plain, pers = dataclasses.replace(base, persistent=False), dataclasses.replace(base, persistent=True)
    cs = [
        Contender(
            "plain",
            ours(off, plain),
            config=dataclasses.asdict(plain),
            fields={"config_source": source, "per_sm": ""},
        )
    ]
    for v in (1, 2, "auto"):
        f = {"config_source": source}
        cs.append(
            Contender(
                f"persistent:{v}",
                lambda inp, v=v, f=f: with_per_sm(v, ours(off, pers)(inp), f),
                config=dataclasses.asdict(pers),
                fields=f,
            )
        )
    if decode:
        xm, ym, sizes, expert, pos = masked_inputs(xs, plan, e, n)
        mcfg = {"m_max": xm.shape[1], **dataclasses.asdict(masked_config(xm, n, "nk"))}
        for v in (1, 2, "auto"):
            f = {"config_source": "masked_config"}
            cs.append(
                Contender(
                    f"masked:{v}",
                    lambda inp, v=v, f=f: with_per_sm(
                        v, lambda: grouped_mm_masked(xm, inp[1], sizes, w_layout="nk", out=ym), f
                    ),
                    config=mcfg,
                    fields=f,
                    check=lambda out: check(out[expert, pos], ref, k),
                )
            )
    return cs


def ratios(out: list[dict]) -> str:
    """Each contender's GPU time over the plain grid's, with the programs per SM it launched."""
    base = next(r for r in out if r["contender"] == "plain").get("graph_us", math.nan)
    return ", ".join(
        f"{r['contender']}={r.get('graph_us', math.nan) / base:.3f}"
        + (f"[{r['per_sm']}]" if r.get("per_sm") else "")
        for r in out
    )


def main():
    run_probe(
        __doc__,
        "probe_persistent_grid",
        CELLS,
        lambda xs, plan, ref, w, t, e, k, n, g, cell: contenders(
            xs, plan, ref, k, t in g["decode_tokens"], e, n
        ),
        ratios,
    )


if __name__ == "__main__":
    main()
