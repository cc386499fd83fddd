"""Provenance of a run: which GPU, driver, CUDA, torch, triton, commit, when. Carried on every CSV row."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import subprocess

import torch

from moegemm._runtime import INTERPRET, slugify


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


# What a measurement runs: every tracked path but the measured results and what is built or written from
# them (the write-up, the figures, the docs and the prose files). A commit that changes none of these, such
# as one that adds a run's CSVs or rebuilds the paper, leaves the measured code as it was.
NOT_MEASURED = ("results", "paper", "figures", "docs", ".ci", "*.md", "CITATION.cff", "LICENSE")
MEASURED_PATHSPEC = (":(top)", *(f":(top,exclude){p}" for p in NOT_MEASURED))


def code_commit(repo: str | None = None) -> tuple[str, bool] | None:
    """(the newest commit up to HEAD that changed what a measurement runs, whether the tree has uncommitted
    changes there, new files included) from git; None without git or a repository. A run recorded under this
    commit ran that commit's code, whichever later commit (of results or write-up only) the checkout was at.
    Tuners' outputs under results/ are not code: a step that reads them reads them as its run made them, and
    each carries its own provenance rows."""
    commit = _git("log", "-1", "--format=%H", "HEAD", "--", *MEASURED_PATHSPEC, cwd=repo)
    # untracked files count too (a new module a run would import), those git ignores not
    status = _git("status", "--porcelain", "--untracked-files=normal", "--", *MEASURED_PATHSPEC, cwd=repo)
    if not commit or status is None:
        return None
    return commit, bool(status)


@functools.lru_cache(maxsize=None)
def _static(repo: str | None) -> dict:
    import triton

    # Whoever ships a source tree elsewhere (the Docker build context, a tarball, a copy on a lent GPU
    # machine) records the commit it was built from in MOEGEMM_COMMIT (and MOEGEMM_DIRTY); that record
    # wins over a .git found there, which can be stale (a copy of a checkout carries the commit it was
    # copied at, and reports it, dirty, for any code edited after).
    # Without it, the commit is that of the code measured (code_commit), dirty for uncommitted changes there.
    shipped = os.environ.get("MOEGEMM_COMMIT")
    if shipped is not None and not shipped.strip():  # e.g. $(python -m experiments.code_commit) that failed
        raise ValueError("MOEGEMM_COMMIT: set but empty; give the commit of the code shipped, or unset it")
    recorded_dirty = "MOEGEMM_DIRTY" in os.environ
    local = None if shipped and recorded_dirty else code_commit(repo)
    commit = shipped or (local[0] if local else None) or "unknown"
    status = None if local is None else ("dirty" if local[1] else "")
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
