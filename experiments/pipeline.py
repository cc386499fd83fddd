"""Helpers for the Snakefile: which GPU this machine has, where results are read from and written to, and
how long each GPU step took (its benchmark files; read by experiments.schedule and the write-up).

Kept out of the Snakefile so that it can be tested without a GPU.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from moegemm._runtime import slugify

CPU_SLUG = "cpu-interpreter"


def local_gpus() -> list[str]:
    """Names of the CUDA GPUs visible here (``nvidia-smi -L``, honouring CUDA_VISIBLE_DEVICES), or []."""
    if os.environ.get("MOEGEMM_FORCE_CPU") == "1":
        return []
    if os.environ.get("MOEGEMM_FAKE_GPUS"):  # for testing the DAG without a GPU: comma-separated names
        return [g.strip() for g in os.environ["MOEGEMM_FAKE_GPUS"].split(",") if g.strip()]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        idx = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        names = [names[i] for i in idx if i < len(names)]
    return names


def machine_slug(gpus: list[str]) -> str:
    """The results folder this machine writes: the first GPU's slug, or 'cpu-interpreter'."""
    return slugify(gpus[0]) if gpus else CPU_SLUG


def results_slug(gpus: list[str], committed: str) -> str:
    """Where the write-up reads measurements from: fresh ones on a GPU, else the committed GPU's."""
    return machine_slug(gpus) if gpus else committed


# The GPU steps in pipeline order (the names of their benchmark files)
STEP_ORDER = [
    "verify",
    "floors",
    "tune",
    "tune_seed",
    "tune_grouped",
    "tune_unsloth",
    "compile_modes",
    "inductor_codegen",
    "epilogue_fusion",
    "split_sweep",
    "decompose_k_grid",
    "router_gemm",
    "grouped_skew",
    "moe_layer",
    "moe_train",
    "fp8_grouped",
]


def run_times(results: Path):
    """Wall time of each GPU step of the pipeline, from the benchmark files Snakemake wrote
    (results/<gpu>/benchmarks/<step>.tsv), in pipeline order, as a DataFrame (step, seconds, calls, shards);
    None where the run left none."""
    import pandas as pd  # only here: the Snakefile imports this module

    files = sorted((results / "benchmarks").glob("*.tsv"))
    if not files:
        return None
    rows = []
    for f in files:
        # <step>.<i>-of-<n>.tsv: one shard of a step run over several GPUs (their GPU time is summed)
        row = {
            "step": f.stem.split(".")[0],
            "seconds": float(pd.read_csv(f, sep="\t")["s"].iloc[0]),
            "calls": 1,
            "shards": 1,
        }
        calls = f.with_suffix(".calls")  # a step resumed over several device calls: their sum
        if calls.exists():
            c = pd.read_csv(calls, sep="\t")
            if len(c) > 1:
                row.update(seconds=float(c.seconds.sum()), calls=len(c))
        rows.append(row)
    rows = [
        {
            "step": step,
            "seconds": sum(r["seconds"] for r in rs),
            "calls": max(r["calls"] for r in rs),
            "shards": len(rs),
        }
        for step, rs in _by_step(rows).items()
    ]
    df = pd.DataFrame(rows)
    df["order"] = df.step.map(lambda s: STEP_ORDER.index(s) if s in STEP_ORDER else len(STEP_ORDER))
    return df.sort_values(["order", "step"]).drop(columns="order").reset_index(drop=True)


def _by_step(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["step"], []).append(r)
    return out
