"""The seed's own config search for its two Triton kernels (see experiments/seed_dk.py), once per shape, so
that E3-E6 time each at its best config. Every config tried is a row (checked against float64 first, then
timed on the GPU clock); ``best`` marks each search's winner.

Shapes: the M=N x K grid in each of decompose_k.seed_grid_dtypes (bf16; float32 where listed, the seed's own
benchmark's practice: then E5's fp32 suite runs its own winners) and the router at every decode token count
E6 measures, in bf16. The bf16 winners also serve fp16 (the same element size and tensor-core rate), the
ReLU suite (whose ReLU only changes the seed's reducer) and a dtype not searched. Without
``MOEGEMM_SEED_SOURCE`` the CSV holds one row that says so, and the experiments run without the seed's
kernels.

    python -m experiments.tune_seed --out results/<slug>/tune_seed.csv
"""

from __future__ import annotations

import torch

from experiments import dk, seed_dk
from experiments.common import (
    DTYPES,
    Progress,
    ResultWriter,
    cli,
    load_config,
    provenance_fields,
    require_gpu,
    timing_settings,
)


def grid_dtypes(cfg: dict) -> list[str]:
    """The dtypes the grid is searched in (the router: bf16 alone, E6's dtype)."""
    return list(cfg["decompose_k"].get("seed_grid_dtypes", ["bfloat16"]))


def shapes(cfg: dict) -> list[tuple[tuple[int, int, int], str]]:
    grid = dk.grid_shapes(cfg)
    r = cfg["decompose_k"]["router"]
    router = [(t, r["n"], r["k"]) for t in r["tokens"] if t <= r["seed_max_tokens"]]
    return [(s, dt) for dt in grid_dtypes(cfg) for s in grid] + [(s, "bfloat16") for s in router]


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    torch.backends.cuda.matmul.allow_tf32 = False
    settings = timing_settings(cfg)
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("variant", "dtype", "m", "n", "k"))
    seed = seed_dk.load()
    if seed is None:
        writer.add(
            [
                {
                    "variant": "none",
                    "status": "unavailable",
                    "note": "MOEGEMM_SEED_SOURCE is not set: the seed's kernels were not measured",
                    **prov,
                }
            ]
        )
        writer.finish()
        return
    todo = shapes(cfg)
    bar = Progress(len(todo) * len(seed_dk.VARIANTS), "tune_seed")
    for (m, n, k), dt in todo:
        sets, ref = dk.shape_inputs(m, n, k, DTYPES[dt], seed=m * 5 + n * 11 + k)
        for variant in seed_dk.VARIANTS:
            if writer.done(variant=variant, dtype=dt, m=m, n=n, k=k):
                bar.update()
                continue
            log: list = []
            best, _, _ = seed_dk.search(seed.modules[variant], variant, sets, ref, k, "none", settings, log)
            best_d = seed_dk.config_dict(best) if best is not None else None
            rows = [
                {
                    "variant": variant,
                    "dtype": dt,
                    "m": m,
                    "n": n,
                    "k": k,
                    "best": best_d is not None and all(r.get(f) == v for f, v in best_d.items()),
                    "seed_origin": seed.origin,
                    **r,
                    **prov,
                }
                for r in log
            ]
            if not rows:
                rows = [
                    {
                        "variant": variant,
                        "dtype": dt,
                        "m": m,
                        "n": n,
                        "k": k,
                        "best": False,
                        "status": "no-split",
                        "note": "the seed offers no split for this shape",
                        "seed_origin": seed.origin,
                        **prov,
                    }
                ]
            writer.add(rows)
            bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
