"""Verify the kernels: run the test suite and write a machine-readable report.

On a machine with a CUDA GPU the suite runs natively, the real-shape ``gpu`` tests included (``selection``
says which tests are left out); without one every kernel runs under Triton's interpreter on small shapes and
the ``gpu`` tests are reported as skipped. Exit status is pytest's: the report is written only when every
selected test passed.

    python -m experiments.verify --out results/<slug>/verify.json [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from experiments._io import write_json


def _parse_junit(path: Path) -> dict:
    root = ET.parse(path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        outcome = "passed"
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        cases.append(
            {
                "id": f"{tc.get('classname')}::{tc.get('name')}",
                "outcome": outcome,
                "seconds": float(tc.get("time", 0)),
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return {"counts": counts, "cases": cases}


def workers(has_gpu: bool) -> int:
    """pytest-xdist processes to spread the tests over (1: none). Most of the suite's time is Triton and
    Inductor compiling, one CPU core per process, so on a GPU machine several processes share the GPU;
    MOEGEMM_TEST_WORKERS overrides (1 turns it off)."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return 1
    if os.environ.get("MOEGEMM_TEST_WORKERS"):
        return max(1, int(os.environ["MOEGEMM_TEST_WORKERS"]))
    from moegemm._runtime import usable_cpus

    cpus = usable_cpus()
    # on a GPU at most 8, half the CPUs: the compiles bound the step (on the H200's 16 cores, 11 workers took
    # 362 s inside pytest against 299 s for 8, its slowest tests up to 5x longer), and the real-shape grouped
    # tests hold up to ~10 GB of GPU memory each
    return max(1, min(8, cpus // 2) if has_gpu else min(4, cpus))


def xdist_dist() -> list[str]:
    """Work stealing (pytest-xdist >= 3.2): a few long tests otherwise hold up the process they were dealt
    to."""
    from importlib.metadata import version

    major, minor = (int(v) for v in version("pytest-xdist").split(".")[:2])
    return ["--dist", "worksteal"] if (major, minor) >= (3, 2) else []


def selection(has_gpu: bool) -> str:
    """The tests this step runs (a pytest -m expression). Never the pipeline's own tests, which run
    Snakemake, nor those of the committed outputs, which check what the steps after this one rebuild (after
    a change to their inputs they fail until that rebuild, which this step would then block), nor the
    probes' tests (probes/ are one-off investigations the pipeline does not run; on the H200 their GPU tests
    took 628 s of the step's 2194 s of worker time). On a GPU not the sm_90 compile check either: the native
    tests compile and run the kernels there. Every CI run (on a CPU) keeps all of these."""
    return "not pipeline and not outputs and not probe" + (" and not compile_only" if has_gpu else "")


# Without a GPU the step checks the kernels' correctness core under the interpreter: the kernels against
# float64 (Decompose-K, the grouped GEMMs and their gradients, the FP8 grouped GEMMs), their behaviour on
# bad input, and the choice of their tables. The rest of the suite (the sm_90 compile check, the harness, the
# experiments, the write-up) is the README's test command's, which a CPU user runs besides; on a GPU the step
# runs the whole suite's selection, the real-shape tests among it.
CPU_CORE = (
    "tests/test_decompose_k.py",
    "tests/test_grouped.py",
    "tests/test_grouped_backward.py",
    "tests/test_fp8.py",
    "tests/test_bad_input.py",
    "tests/test_tables.py",
)


def core_paths(has_gpu: bool) -> list[str]:
    """The test files the step runs: every one on a GPU (pytest's testpaths), the correctness core without."""
    return [] if has_gpu else list(CPU_CORE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON report to write")
    ap.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        import torch

        gpu = torch.cuda.is_available()
        n = workers(gpu)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            selection(gpu),
            f"--junitxml={junit}",
            *(["-n", str(n), *xdist_dist()] if n > 1 else []),
            *core_paths(gpu),
            *args.pytest_args,
        ]
        env = dict(os.environ)
        if n > 1:  # the test processes already share the CPUs: no Inductor compile pool inside each
            env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        t0 = time.time()
        rc = subprocess.call(cmd, env=env)
        wall = time.time() - t0
        report = _parse_junit(junit) if junit.exists() else {"counts": {}, "cases": []}

    from experiments.harness.provenance import provenance

    report.update(
        command=" ".join(cmd[2:]),
        workers=n,
        exit_code=rc,
        wall_seconds=round(wall, 1),
        provenance=provenance(),
        mode=("native GPU" if provenance()["sm_count"] else "CPU, Triton interpreter (gpu tests skipped)"),
    )
    print(f"verify: {report['counts']} in {wall:.0f}s ({report['mode']})")
    if rc != 0 or report["counts"].get("failed", 0) or not report["counts"].get("passed", 0):
        print("verify: FAILED; no report written", file=sys.stderr)
        return rc or 1
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
