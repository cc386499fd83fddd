"""What several probes share: the Decompose-K probes' command line and screen of configs, E8's cells timed
side by side (the layer probes), a kernel-by-kernel profile of a contender's call, and the grouped kernel's
tile variants and even deal of rows (the prefill probes)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
import time

import torch

from experiments._io import atomic_path
from experiments.common import check_and_time, load_config, provenance_fields, require_gpu, timing_settings
from experiments.e7_grouped_skew import start
from experiments.e8_moe_layer import CELL_KEYS, cell_inputs
from experiments.harness.runner import measure, prewarm
from experiments.tune_grouped import SMEM, smem_bytes
from moegemm.decompose_k import DecomposeKConfig
from moegemm.decompose_k import matmul as dk_matmul

ROUNDS = 4  # the layer probes' interleaved rounds (run_cells)


def probe_cli(description: str, default_shapes: str, flags: tuple[str, ...] = ()):
    """The Decompose-K probes' command line: (args with out and shapes as [(m, k, n)], timing settings,
    provenance fields, SM count). ``--shapes`` takes MxKxN items, comma-separated; ``flags``: the probe's
    own on/off switches."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=default_shapes)
    for f in flags:
        ap.add_argument(f, action="store_true")
    args = ap.parse_args()
    require_gpu()
    args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    return (
        args,
        timing_settings(load_config()),
        provenance_fields(),
        torch.cuda.get_device_properties(0).multi_processor_count,
    )


def run_cells(doc: str, name: str, cells: list, make_contenders, load: str = "uniform") -> None:
    """E8's inputs (weights, ids, tokens, gating weights: the same seeds) for each (model, T) of ``cells`` in
    turn, ``make_contenders(x, ids, wts, E)`` timed side by side in ROUNDS interleaved rounds, each checked
    against E8's float64 reference; rows to --out."""
    _, _, g, settings, prov, _, writer = start(doc, CELL_KEYS)
    settings = dataclasses.replace(settings, rounds=ROUNDS)
    weights: dict = {}
    for model, t in cells:
        t0 = time.perf_counter()
        m, e, top_k, h, i, ids, x, wts, ref, _, sets = cell_inputs(g, model, t, load, weights)  # E8's
        cs = make_contenders(x, ids, wts, e)
        out = measure(cs, sets, ref, h + i, settings)
        for r in out:
            r.update(
                experiment=name,
                model=model,
                split=m["split"],
                tokens=t,
                load=load,
                experts=e,
                top_k=top_k,
                hidden=h,
                intermediate=i,
                rounds=ROUNDS,
                **prov,
            )
        writer.add(out)
        got = {r["contender"]: r.get("graph_us", math.nan) for r in out}
        print(
            f"{model} T={t}: "
            + ", ".join(f"{k} {v:.0f} us" for k, v in got.items())
            + f" ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        del sets, cs
    writer.finish()


def one_model_setup(argv: list[str]):
    """(--out, --model (default gpt-oss-120b), config.yaml's grouped and moe_layer sections, E8's timing
    settings, E8's largest T) of a probe that runs E8's sequence for one model, on the GPU."""
    out = argv[argv.index("--out") + 1]
    model = argv[argv.index("--model") + 1] if "--model" in argv else "gpt-oss-120b"
    require_gpu()
    cfg = load_config()
    e8cfg = cfg["moe_layer"]
    return out, model, cfg["grouped"], e8cfg, timing_settings(cfg, "grouped"), max(e8cfg["tokens"])


CALLS = 3  # calls profiled per contender (profile_once)


def _profile(name: str, fn) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if us:
            rows.append(
                {
                    "contender": name,
                    "kernel": ev.key[:160],
                    "count": ev.count // CALLS,
                    "us_per_call": round(us / CALLS, 2),
                }
            )
    return sorted(rows, key=lambda r: -r["us_per_call"])


def profile_once(c, kernels: list[dict], **tags) -> None:
    """Make contender ``c`` profile its first input set's call once per ``tags`` (after the warm-up call, its
    compile): the rows, tagged, added to ``kernels``."""
    inner = c.bind

    def bind(inp):
        call = inner(inp)
        if not any(r["contender"] == c.name and all(r[k] == v for k, v in tags.items()) for r in kernels):
            kernels.extend({**tags, **r} for r in _profile(c.name, call))
        return call

    c.bind = bind


def write_kernels(out: str, kernels: list[dict], tags: tuple[str, ...] = ()) -> None:
    """The profiled rows (their ``tags`` columns first) with provenance, atomically to
    ``<out>.kernels.csv``."""
    prov = provenance_fields()
    with atomic_path(out + ".kernels.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*tags, "contender", "kernel", "count", "us_per_call", *prov])
        w.writeheader()
        w.writerows({**r, **prov} for r in kernels)


def variant(cfg, **changes):
    """``cfg`` with ``changes``, one stage fewer at a time where its shared memory would not fit; None where
    it cannot be (a pointer-load config, or it never fits)."""
    if not cfg.tma:
        return None
    c = dataclasses.replace(cfg, **changes)
    while (
        smem_bytes(c.block_m, c.block_n, c.block_k, c.num_stages, c.flatten, c.tail_m if c.merge_tail else 0)
        > SMEM
    ):
        if c.num_stages <= 2:
            return None
        c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    return c


def even_offsets(m: int, e: int, device) -> torch.Tensor:
    """Group offsets dealing m rows out evenly: m // E rows to each expert, the last taking the remainder."""
    return torch.tensor([i * (m // e) for i in range(e)] + [m], dtype=torch.int32, device=device)


def screen_single_launch(
    sets: list[tuple], ref: torch.Tensor, cands: list[DecomposeKConfig], settings, epilogue: str = "relu"
) -> list[tuple[float, DecomposeKConfig, dict]]:
    """The probes' screen of single-launch configs: each checked against ``ref``, then timed on the GPU
    clock (``experiments.common.check_and_time``); [(graph_us, config, row)] of the correct ones, fastest
    first (compiles from a thread pool first)."""
    a0, b0, _ = sets[0]
    k = a0.shape[1]
    prewarm(
        [(lambda c=c: dk_matmul(a0, b0, kernel="single_launch", config=c, epilogue=epilogue)) for c in cands]
    )
    timed = []
    for c in cands:
        calls = [
            (lambda a=a, b=b, c=c: dk_matmul(a, b, kernel="single_launch", config=c, epilogue=epilogue))
            for a, b, _ in sets
        ]
        row = check_and_time(calls, ref, k, settings)
        if row["status"] == "ok":
            timed.append((row["graph_us"], c, row))
    return sorted(timed, key=lambda x: x[0])
