"""Provenance of a run: which GPU, driver, CUDA, torch, triton, commit, when. Carried on every CSV row."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import subprocess

import torch

from .._runtime import INTERPRET, slugify


def _git(*args: str, cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "n/a"


@functools.lru_cache(maxsize=None)
def _static(repo: str | None) -> dict:
    import triton

    # Whoever ships a source tree elsewhere (the Docker build context, a tarball, a copy on a lent GPU
    # machine) records the commit it was built from in MOEGEMM_COMMIT (and MOEGEMM_DIRTY); that record
    # wins over a .git found there, which can be stale (on 2026-11-30 the lent machine's copy carried the
    # session's first commit and reported it, dirty, for later code; see results/nvidia-h200/RUNS.md).
    shipped = os.environ.get("MOEGEMM_COMMIT")
    commit = shipped or _git("rev-parse", "HEAD", cwd=repo) or "unknown"
    recorded_dirty = "MOEGEMM_DIRTY" in os.environ
    status = (
        None
        if shipped and recorded_dirty
        else _git("status", "--porcelain", "--untracked-files=no", cwd=repo)
    )
    if status is None and recorded_dirty:  # recorded by whoever shipped the tree (or no git here)
        status = "dirty" if os.environ["MOEGEMM_DIRTY"] == "1" else ""
    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "n/a",
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": (bool(status) if status is not None else "unknown"),
        "host": platform.node(),
    }
    if torch.cuda.is_available() and not INTERPRET:
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_slug=slugify(props.name),
            sm_count=props.multi_processor_count,
            gpu_mem_gib=round(props.total_memory / 2**30, 1),
            driver=_driver(),
        )
    else:
        info.update(
            gpu="none (CPU, Triton interpreter)",
            gpu_slug="cpu-interpreter",
            sm_count=0,
            gpu_mem_gib=0.0,
            driver="n/a",
        )
    return info


def provenance(repo: str | None = None) -> dict:
    """Static facts of this process plus the current UTC time."""
    info = dict(_static(repo))
    info["utc"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return info
