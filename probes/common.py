"""What several probes share: the Decompose-K probes' command line and screen of configs, and the grouped
kernel's tile variants and even deal of rows (the prefill probes)."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from experiments.common import check_and_time, load_config, provenance_fields, require_gpu, timing_settings
from experiments.harness.runner import prewarm
from experiments.tune_grouped import SMEM, smem_bytes
from moegemm.decompose_k import DecomposeKConfig
from moegemm.decompose_k import matmul as dk_matmul


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
