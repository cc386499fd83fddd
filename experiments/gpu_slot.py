"""Run a command pinned to one free GPU of this host.

Snakemake's ``--resources gpu=G`` bounds how many GPU jobs run at once but does not say which GPU each
gets. This wrapper takes the first GPU whose lock file it can lock (non-blocking ``flock``), sets
``CUDA_VISIBLE_DEVICES`` to it for the child, and holds the lock until the child exits, so concurrent
jobs land on distinct GPUs. Under SLURM each job already sees only its own GPU(s).

    python -m experiments.gpu_slot [--lock-dir DIR] -- COMMAND...
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else 0..n-1 from nvidia-smi
    (MOEGEMM_GPU_COUNT overrides the count, for tests)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip():
        return [g.strip() for g in vis.split(",") if g.strip()]
    if "MOEGEMM_GPU_COUNT" in os.environ:
        return [str(i) for i in range(int(os.environ["MOEGEMM_GPU_COUNT"]))]
    from experiments.pipeline import local_gpus

    return [str(i) for i in range(len(local_gpus()))]


def acquire(lock_dir: Path, gpus: list[str], timeout_s: float = 24 * 3600):
    """(gpu id, open locked file) for the first free GPU; waits while all are taken."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    while True:
        for g in gpus:
            f = open(lock_dir / f"gpu{g}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return g, f
            except BlockingIOError:
                f.close()
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"no free GPU among {gpus} after {timeout_s}s")
        time.sleep(0.5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lock-dir", default=".snakemake/gpu-locks")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given")
    gpus = visible_gpus()
    if not gpus:
        print("gpu_slot: no GPU visible", file=sys.stderr)
        return 2
    gpu, lock = acquire(Path(a.lock_dir), gpus)
    try:
        print(f"gpu_slot: running on GPU {gpu}: {' '.join(cmd)}", file=sys.stderr)
        return subprocess.call(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
    finally:
        lock.close()


if __name__ == "__main__":
    sys.exit(main())
