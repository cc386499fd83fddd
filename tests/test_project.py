"""The project's promises about itself: pins, the test runner's workers, the pipeline's lint, the README's
library excerpt (the README's commands, paths and links: tests/test_readme.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from conftest import SNAKEMAKE_GROUP, checkout_state, dry_run_jobs, snakemake_env

ROOT = Path(__file__).resolve().parent.parent


def test_pins_match_what_we_run():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for extra in meta["optional-dependencies"].values():
        for req in extra:
            name, _, ver = req.partition("==")
            assert ver, f"optional dependency {req!r} is not pinned"
            pins[name.lower()] = ver
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torch", "triton", "numpy", "pytest"):
        try:
            got = version(name)
        except PackageNotFoundError:  # pragma: no cover
            continue
        if name == "torch" and "+" not in got and not got.startswith(pins[name]):
            pytest.skip(f"torch {got} is not the CPU test build")  # e.g. the GPU image's torch 2.11
        if name in ("torch", "triton") and not got.startswith(pins[name]):
            pytest.skip(f"{name} {got}: not the pinned CPU environment")
        assert got.split("+")[0] == pins[name], f"{name}: installed {got}, pinned {pins[name]}"


@pytest.mark.pipeline
@pytest.mark.xdist_group(SNAKEMAKE_GROUP)
def test_snakemake_lint_is_clean(tree_copy):
    pytest.importorskip("snakemake")  # installed by the `pipeline` extra (CI has it; the bare GPU image not)
    res = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint"],
        cwd=tree_copy,
        capture_output=True,
        text=True,
        timeout=300,
        env=snakemake_env(MOEGEMM_FORCE_CPU="1"),
        check=False,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "Lints for" not in out, out


@pytest.mark.pipeline
@pytest.mark.xdist_group(SNAKEMAKE_GROUP)  # its checkout snapshot runs `snakemake -n` in the checkout
def test_dry_run_check_leaves_no_trace(tree_copy):
    """conftest.dry_run_jobs: the jobs `snakemake -n` lists (in a fresh copy: the verify step among them),
    and Snakemake's directory put back as it was: none where there was none, its I/O cache restored."""
    got = dry_run_jobs(tree_copy)
    assert got["jobs"].get("verify") == 1 and any("verify.json" in o for o in got["outputs"]), got
    assert not (tree_copy / ".snakemake").exists()
    cache = tree_copy / ".snakemake" / "iocache" / "latest.pkl"
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"before")
    assert dry_run_jobs(tree_copy) == got
    assert cache.read_bytes() == b"before"
    assert sorted(p.name for p in (tree_copy / ".snakemake").rglob("*")) == ["iocache", "latest.pkl"]


@pytest.mark.pipeline
@pytest.mark.xdist_group(SNAKEMAKE_GROUP)
def test_pipeline_tests_leave_the_checkout_alone(checkout_before):
    """After the tests that run Snakemake (the same xdist group, so they ran before this one, in this
    process): `git status`, what `snakemake -n` would run, and the files where the pipeline writes are as
    the first of them found them."""
    after = checkout_state()
    for what in ("git status", "snakemake -n"):
        assert after[what] == checkout_before[what], (what, checkout_before[what], after[what])
    before, now = checkout_before["outputs"], after["outputs"]
    changed = sorted(p for p in set(before) | set(now) if before.get(p) != now.get(p))
    assert not changed, f"files the tests wrote into the checkout: {changed[:20]}"


def test_long_tests_and_the_snakemake_group_are_dealt_first():
    """conftest.long_first (`--dist loadgroup`): the tests marked long and those of an xdist group first, in
    their order, then the rest in theirs; none lost or doubled; without workers nothing moves."""
    from types import SimpleNamespace

    from conftest import long_first

    def item(i):
        group = i in (5, 50)

        def marker(name, g=group):
            return object() if g and name == "xdist_group" else None

        keywords = {"long"} if i in (3, 70) else set()
        return SimpleNamespace(name=f"t{i}", keywords=keywords, get_closest_marker=marker)

    items = [item(i) for i in range(100)]
    names = [it.name for it in items]
    long_first(items, 1)
    assert [it.name for it in items] == names
    long_first(items, 2)
    got = [it.name for it in items]
    assert got[:4] == ["t3", "t5", "t50", "t70"]
    assert got[4:] == [n for n in names if n not in got[:4]]


def _api_calls(src: str, api: set[str]) -> set[tuple[str, str | None]]:
    """(function, keyword) of every call in ``src`` of a name in ``api`` (plain or as an attribute), keyword
    None for the call itself."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in api:
                out |= {(name, None)} | {(name, k.arg) for k in node.keywords}
    return out


def test_readme_library_excerpt_is_what_the_quickstart_runs():
    """The README's library code (its Python blocks after the first, which runs as written: test_quickstart)
    is an excerpt of examples/quickstart.py, which runs in CI: every moegemm function it calls, with every
    keyword it passes, is called so in the quick start."""
    import ast
    import importlib

    blocks = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.DOTALL)[1:]
    quickstart = ROOT / "examples" / "quickstart.py"
    if not quickstart.exists():
        pytest.skip("examples/quickstart.py is not in this tree")
    for code in blocks:
        api = set()
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("moegemm"):
                api |= {a.name for a in node.names}
        for m in {a for a in api if (ROOT / "src" / "moegemm" / a).is_dir()}:
            api |= {n for n in dir(importlib.import_module(f"moegemm.{m}")) if not n.startswith("_")}
        shown = _api_calls(code, api)
        assert shown, "a README Python block that calls no moegemm function"
        missing = shown - _api_calls(quickstart.read_text(), api)
        assert not missing, (
            f"the README shows calls examples/quickstart.py does not make: {sorted(missing, key=str)}"
        )


def test_auto_workers_use_the_cpus_and_spare_the_gpu(monkeypatch):
    """conftest's `-n auto`: a worker per usable CPU without a GPU; with one, at most 8, one per two CPUs;
    MOEGEMM_TEST_WORKERS wins."""
    import conftest
    from moegemm import _runtime

    monkeypatch.delenv("MOEGEMM_TEST_WORKERS", raising=False)
    monkeypatch.setattr(_runtime, "usable_cpus", lambda: 64)
    monkeypatch.setattr(conftest, "HAS_CUDA", False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 64
    monkeypatch.setattr(conftest, "HAS_CUDA", True)
    assert conftest.pytest_xdist_auto_num_workers(None) == 8
    monkeypatch.setattr(_runtime, "usable_cpus", lambda: 6)
    assert conftest.pytest_xdist_auto_num_workers(None) == 3
    monkeypatch.setenv("MOEGEMM_TEST_WORKERS", "2")
    assert conftest.pytest_xdist_auto_num_workers(None) == 2


def test_verify_leaves_the_compile_check_to_ci_on_a_gpu_only():
    """The pipeline's verify step: never the pipeline's, the outputs' or the probes' tests, nor the sm_90
    compile check (on a GPU the native tests compile and run the kernels; on a CPU the step runs the kernels'
    correctness core); the test command keeps it."""
    from experiments.verify import CPU_CORE, core_paths, selection

    assert core_paths(True) == [] and core_paths(False) == list(CPU_CORE)
    assert all((ROOT / f).is_file() for f in CPU_CORE)  # without a GPU: the kernels' correctness core
    assert "tests/test_compile_sm90.py" not in CPU_CORE
    assert selection(False) == "not pipeline and not outputs and not probe"
    assert selection(True) == "not pipeline and not outputs and not probe and not compile_only"
    src = (ROOT / "tests" / "test_compile_sm90.py").read_text()
    assert "@pytest.mark.compile_only" in src
    for f in (ROOT / "probes" / "tests").glob("test_*.py"):
        assert "pytestmark = pytest.mark.probe" in f.read_text(), f.name


def test_the_interpreter_casts_to_bf16_by_truncation():
    """What the README and docs/training.md say of the CPU tests' bf16 rounding holds for the Triton
    installed: under the interpreter an fp32 to bf16 cast truncates (where torch, like the GPU, rounds to
    nearest). On a GPU, or once a Triton rounds to nearest there too, the claim is checked natively or fails
    and must change."""
    import torch
    import triton
    import triton.language as tl

    from moegemm._runtime import INTERPRET

    if not INTERPRET:
        pytest.skip("the claim is about Triton's interpreter")

    @triton.jit
    def cast(x_ptr, y_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.bfloat16))

    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    y = torch.empty(1024, dtype=torch.bfloat16)
    cast[(1,)](x, y, 1024)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(y, truncated) and not torch.equal(y, x.to(torch.bfloat16))


def test_dependencies_are_bounded_by_what_the_suite_has_passed_on():
    """torch and triton are bounded from above (a pip install never resolves to a pair nobody tested), the
    `cpu` extra's pins lie inside the ranges, and a recorded run of .ci/test-next-pair at or above a bound
    that passed would have raised it."""
    import json

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {r.name: r for r in map(Requirement, project["dependencies"])}
    for name in ("torch", "triton"):
        uppers = [s for s in reqs[name].specifier if s.operator in ("<", "<=")]
        assert uppers, f"{name}: no upper bound"
    pins = {r.name: r for r in map(Requirement, project["optional-dependencies"]["cpu"])}
    for name in ("torch", "triton"):
        pinned = next(iter(pins[name].specifier)).version
        assert Version(pinned) in reqs[name].specifier, (name, pinned)
    for record in (ROOT / "results" / "cpu").glob("next-pair-*.json"):
        run = json.loads(record.read_text())
        inside = all(Version(run[name].split("+")[0]) in reqs[name].specifier for name in ("torch", "triton"))
        if run["exit_status"] == 0:
            assert inside, f"{record.name} passed: raise the bounds to admit it"
