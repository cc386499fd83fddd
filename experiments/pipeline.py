"""Helpers for the Snakefile: which GPU this machine has, and where results are read from and written to.

Kept out of the Snakefile so that it can be tested without a GPU.
"""

from __future__ import annotations

import os
import subprocess

from moegemm._runtime import slugify

CPU_SLUG = "cpu-interpreter"


def local_gpus() -> list[str]:
    """Names of the CUDA GPUs visible here (``nvidia-smi -L``, honouring CUDA_VISIBLE_DEVICES), or []."""
    if os.environ.get("MOEGEMM_FORCE_CPU") == "1":
        return []
    if os.environ.get("MOEGEMM_FAKE_GPUS"):  # for testing the DAG without a GPU: comma-separated names
        return [g.strip() for g in os.environ["MOEGEMM_FAKE_GPUS"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
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
