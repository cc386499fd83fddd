"""Shared helpers of the generated numbers: provenance, our default path and the seed's names; the Numbers
collection, geometric means and LaTeX tables (experiments.report, re-exported)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments.report import Numbers, gm, table, tex_escape  # noqa: F401  (re-exported)

# Our default path (kernel="auto": the tuned table, else the heuristic; our kernel or cuBLAS): every headline
# ratio is against it, not against the per-shape best of our kernels picked afterwards.
OURS = ["ours:auto"]


SEEDS = ("seed: optimized", "seed: original")  # the seed's Triton kernels, loaded from its own source


def commits_of(csv_path: Path) -> pd.Series | None:
    """The git_commit column of a results CSV (None if it has none), with the documented corrections of
    ``provenance_corrections.csv`` beside it applied (rows matched by file and UTC start time; the CSV
    itself is left as measured)."""
    df = pd.read_csv(csv_path)
    if "git_commit" not in df.columns:
        return None
    commits = df["git_commit"].astype(str)
    fix = csv_path.parent / "provenance_corrections.csv"
    if fix.exists():
        for _, c in pd.read_csv(fix).iterrows():
            if c["file"] == csv_path.name:
                hit = (df["utc"].astype(str) == c["utc"]) & (commits == c["recorded_commit"])
                commits = commits.where(~hit, c["actual_commit"])
    return commits


def provenance(n: Numbers, results: Path) -> None:
    df = pd.read_csv(results / "decompose_k_grid.csv")
    r = df.iloc[0]
    n.add("GPU", r["gpu"])
    n.add("SMs", int(r["sm_count"]), "{}")
    n.add("Driver", str(r["driver"]))
    n.add("CudaVersion", str(r["cuda"]))
    n.add("TorchVersion", str(r["torch"]))
    n.add("TritonVersion", str(r["triton"]))
    per_file = [commits_of(p) for p in results.glob("*.csv")]
    commits = sorted(set().union(*[set(c) for c in per_file if c is not None]))
    n.add("Commits", ", ".join(c[:7] for c in commits))
    fl = json.loads((results / "floors.json").read_text())
    n.add("TinyKernelUs", fl["measured"]["tiny_kernel_graph_us"])
    n.add("CopyTBs", fl["measured"]["copy_tb_s"])
    if "read_tb_s" in fl["measured"]:  # measured by the floors step since the S5 runs
        n.add("ReadTBs", fl["measured"]["read_tb_s"], "{:.2f}")
        n.add("ReadPct", 100 * fl["measured"]["read_tb_s"] / fl["datasheet"]["hbm_tb_s"], "{:.0f}")
    n.add("MatmulTflops", fl["measured"]["bf16_matmul_tflops"], "{:.0f}")
    n.add("PeakTBs", fl["datasheet"]["hbm_tb_s"], "{:.1f}")
    n.add("PeakTflops", fl["datasheet"]["bf16_tflops"], "{:.0f}")
    v = json.loads((results / "verify.json").read_text())
    n.add("GpuTestsPassed", v["counts"]["passed"], "{}")
    n.add("GpuTestsFailed", v["counts"]["failed"], "{}")
