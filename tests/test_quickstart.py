"""examples/quickstart.py runs as a user runs it (a fresh interpreter, the public API with its defaults) and
every step it prints matches its float64 reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = (
    "decompose_k.matmul",
    "route + permute",
    "grouped_mm",
    "grouped_mm + unpermute",
    "grouped_mm_masked",
    "moe_ffn",
)


def test_quickstart_runs_and_every_step_matches_float64():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRITON_INTERPRET", None)  # the script decides it, as it does for a user
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    lines = {
        m.group(1).strip(): (m.group(2), float(m.group(3)), m.group(4))
        for m in re.finditer(r"^(.+?)\s+(\([0-9, ]+\))\s+rel\. error (\S+)\s+(ok|FAILED)$", out, re.M)
    }
    assert set(lines) == set(STEPS), out
    for step, (_, err, verdict) in lines.items():
        assert verdict == "ok" and err <= 2e-2, (step, err, out)
    assert lines["route + permute"][1] == 0.0  # a permutation copies rows exactly
    assert out.rstrip().endswith("quick start: every step matches its float64 reference"), out


def test_python_m_moegemm_reports_the_setup_and_checks_each_kernel():
    """`python -m moegemm` in a fresh interpreter: torch, Triton, where the kernels run (on a GPU: which
    tuned table serves it for each family, and the cache folder), then each public kernel's check against
    float64, every one ok, exit status 0."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-m", "moegemm"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert re.search(r"^moegemm \S+: torch \S+, Triton \S+$", out, re.M), out
    on_gpu = re.search(r"^GPU: ", out, re.M) is not None
    assert on_gpu or "no CUDA GPU" in out
    if on_gpu:
        assert len(re.findall(r"^  tuned table, \w+: ", out, re.M)) == 3 and "first-call choices" in out
    checks = re.findall(r"^  (\S+(?: \(\w+\))?)\s+(\S+)\s+(ok|FAILED.*)$", out, re.M)
    names = [c[0] for c in checks]
    assert names == ["decompose_k.matmul (sigmoid)", "grouped_mm", "grouped_mm_masked", "moe_ffn"], out
    assert all(c[2] == "ok" for c in checks) and out.rstrip().splitlines()[-1].startswith("all right")


def test_the_readmes_first_code_block_runs_as_written():
    """The README's first Python block, as a user copies it into a fresh interpreter (no environment set up
    for it: it picks the GPU or Triton's interpreter itself), runs and prints a [T, H] bf16 output."""
    block = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.DOTALL)[0]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", block], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.fullmatch(r"torch\.Size\(\[\d+, \d+\]\) torch\.bfloat16\n", done.stdout), done.stdout
