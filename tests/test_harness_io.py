"""The harness's CPU-testable plumbing: resumable atomic CSVs, code inspection, the pipeline's slugs,
config and provenance, and how the test chunks are dealt out."""

from __future__ import annotations

import csv
import json

import pytest

from experiments.common import ResultWriter
from experiments.pipeline import CPU_SLUG, machine_slug, results_slug
from moegemm.inductor.codegen import inspect


def test_result_writer_resumes_and_writes_atomically(tmp_path, monkeypatch):
    from experiments.common import KEEP_PARTIAL

    monkeypatch.delenv(KEEP_PARTIAL, raising=False)  # (set where experiments/device_pipeline.sh runs verify)
    out = tmp_path / "r" / "x.csv"
    w = ResultWriter(out, ("m",))
    w.add([{"m": 1, "v": 0.5}])
    assert not out.exists(), "nothing is published before finish()"
    # A killed run: a new writer resumes from the partial log and skips what is done.
    w2 = ResultWriter(out, ("m",))
    assert w2.done(m=1) and not w2.done(m=2)
    w2.add([{"m": 2, "v": 0.25, "extra": "y"}])
    w2.finish()
    rows = list(csv.DictReader(out.open()))
    assert [(r["m"], r["v"], r["extra"]) for r in rows] == [("1", "0.5", ""), ("2", "0.25", "y")]
    assert not (tmp_path / "r" / "x.csv.partial").exists()
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["x.csv"]  # no temp files left behind


def test_a_kept_partial_log_resumes_a_step_whose_csv_was_removed(tmp_path, monkeypatch):
    """Under MOEGEMM_KEEP_PARTIAL=1 (experiments/device_pipeline.sh), finish() leaves the .partial log: a
    step interrupted after its CSV was written, whose CSV Snakemake then removed, resumes with every row
    done and writes the same CSV again without measuring anything."""
    from experiments.common import KEEP_PARTIAL

    monkeypatch.setenv(KEEP_PARTIAL, "1")
    out = tmp_path / "x.csv"
    w = ResultWriter(out, ("m",))
    w.add([{"m": 1, "v": 0.5}, {"m": 2, "v": 0.25}])
    w.finish()
    first = out.read_text()
    assert (tmp_path / "x.csv.partial").exists()
    out.unlink()  # what Snakemake does to the output of an interrupted job
    again = ResultWriter(out, ("m",))
    assert again.done(m=1) and again.done(m=2)
    again.finish()
    assert out.read_text() == first


def test_atomic_path_leaves_old_file_on_failure(tmp_path):
    from experiments._io import atomic_path

    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


GPU_DK = """
def triton_per_fused_sum_0(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
def triton_poi_fused_relu_1(in_out_ptr0, xnumel):
    pass
def call(args):
    buf0 = empty_strided_cuda((32, 16, 16), (256, 16, 1), torch.float32)
    extern_kernels.bmm(reinterpret_tensor(arg0_1, (32, 16, 256), (256, 8192, 1), 0), arg1_1, out=buf0)
    buf1 = empty_strided_cuda((16, 16), (16, 1), torch.bfloat16)
    triton_per_fused_sum_0.run(buf0, buf1, 256, 32, stream=stream0)
    triton_poi_fused_relu_1.run(buf1, 256, stream=stream0)
"""


GPU_TEMPLATE = """
def triton_tem_fused_mm_relu_0(arg_A, arg_B, out_ptr0):
    pass
def call(args):
    buf0 = empty_strided_cuda((16, 16), (16, 1), torch.bfloat16)
    triton_tem_fused_mm_relu_0.run(arg0_1, arg1_1, buf0, stream=stream0)
"""


def test_inspect_inductor_code():
    dk = inspect(GPU_DK, 16, 16)
    assert dk["decompose_k"] and dk["split_k"] == 32 and dk["relu"] == "separate-kernel"
    assert dk["kernels"] == ["triton_per_fused_sum_0", "triton_poi_fused_relu_1"]
    assert dk["extern_calls"] == ["bmm"] and dk["n_kernel_launches"] == 3
    t = inspect(GPU_TEMPLATE, 16, 16)
    assert not t["decompose_k"] and t["mm_template"] and t["relu"] == "fused-into-mm-template"
    assert t["n_kernel_launches"] == 1


@pytest.mark.long
def test_inspect_real_cpu_compile():
    """What Inductor really emits (CPU backend) for the seed's decomposeK + ReLU: bmm + one fused kernel."""
    import torch

    from moegemm.inductor.codegen import run_and_get_code
    from moegemm.inductor.custom_op import decompose_k_relu_impl

    torch._dynamo.reset()
    a, b = torch.randn(16, 2048), torch.randn(2048, 8)
    out, code, _ = run_and_get_code(torch.compile(lambda x, y: decompose_k_relu_impl(x, y, 16)), a, b)
    torch.testing.assert_close(out, torch.relu(a @ b), rtol=1e-4, atol=1e-4)
    info = inspect(code, 16, 8)
    assert info["decompose_k"] and info["split_k"] == 16 and info["relu"] == "fused-into-reduction", info


def test_pipeline_slugs():
    assert machine_slug([]) == CPU_SLUG
    assert machine_slug(["NVIDIA H200", "NVIDIA H200"]) == "nvidia-h200"
    assert results_slug([], "nvidia-h200") == "nvidia-h200"
    assert results_slug(["NVIDIA H100 80GB HBM3"], "nvidia-h200") == "nvidia-h100-80gb-hbm3"


def test_config_validates():
    from experiments.common import load_config

    cfg = load_config()
    assert cfg["committed_results"] and cfg["decompose_k"]["grid_k"][0] == 8192
    import jsonschema
    import yaml

    from experiments.common import ROOT

    schema = yaml.safe_load((ROOT / "experiments" / "config.schema.yaml").read_text())
    bad = json.loads(json.dumps(cfg))
    bad["timing"]["rounds"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_provenance_prefers_the_shipped_commit_record(monkeypatch):
    """A commit recorded by whoever shipped the tree wins over a (possibly stale) .git found there."""
    from experiments.harness import provenance as prov

    prov._static.cache_clear()
    monkeypatch.setenv("MOEGEMM_COMMIT", "abc1234")
    monkeypatch.setenv("MOEGEMM_DIRTY", "0")
    try:
        info = prov.provenance()
        assert info["git_commit"] == "abc1234" and info["git_dirty"] is False
        prov._static.cache_clear()
        monkeypatch.setenv("MOEGEMM_DIRTY", "1")
        assert prov.provenance()["git_dirty"] is True
        prov._static.cache_clear()
        monkeypatch.delenv("MOEGEMM_COMMIT")
        monkeypatch.delenv("MOEGEMM_DIRTY")
        local = prov.code_commit()
        assert prov.provenance()["git_commit"] == (local[0] if local else "unknown")
        prov._static.cache_clear()
        monkeypatch.setenv("MOEGEMM_COMMIT", "")  # a failed $(python -m experiments.code_commit)
        with pytest.raises(ValueError, match="MOEGEMM_COMMIT"):
            prov.provenance()
    finally:
        prov._static.cache_clear()


def test_the_commit_recorded_is_that_of_the_code_measured(tmp_path):
    """code_commit: a commit of results, write-up, figures or docs alone leaves the recorded commit at the
    last one that changed code; uncommitted changes mark it dirty only where they touch code; a run from a
    subfolder reads the same."""
    import subprocess

    from experiments.harness import provenance as prov

    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    for d in ("src/pkg", "results/gpu", "paper", "figures", "docs"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "src/pkg/k.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("a\n")
    git("add", "-A")
    git("commit", "-qm", "code")
    code = git("rev-parse", "HEAD")
    assert prov.code_commit(str(tmp_path)) == (code, False)
    for f in ("results/gpu/e.csv", "paper/p.tex", "figures/f.png", "docs/d.md", "README.md", "src/pkg/N.md"):
        (tmp_path / f).write_text("b\n")
        git("add", "-A")
        git("commit", "-qm", f"only {f}")
        assert prov.code_commit(str(tmp_path)) == (code, False), f
    assert git("rev-parse", "HEAD") != code
    (tmp_path / "results/gpu/e.csv").write_text("c\n")  # uncommitted, not code
    assert prov.code_commit(str(tmp_path)) == (code, False)
    assert prov.code_commit(str(tmp_path / "src/pkg")) == (code, False)
    (tmp_path / "src/pkg/new.py").write_text("y = 1\n")  # a new module, not yet committed
    assert prov.code_commit(str(tmp_path)) == (code, True)
    (tmp_path / "src/pkg/new.py").unlink()
    (tmp_path / "src/pkg/k.py").write_text("x = 2\n")
    assert prov.code_commit(str(tmp_path)) == (code, True)
    git("commit", "-qam", "code again")
    assert prov.code_commit(str(tmp_path)) == (git("rev-parse", "HEAD"), False)
    assert prov.code_commit(str(tmp_path.parent / "no-repo-here")) is None


def test_the_code_commit_command_refuses_uncommitted_code(tmp_path, monkeypatch, capsys):
    """python -m experiments.code_commit prints the commit of the code (what a shipped tree records in
    MOEGEMM_COMMIT), and exits 1 with no commit printed where the code has uncommitted changes."""
    import subprocess

    from experiments import code_commit as cli

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    git("init", "-q")
    (tmp_path / "k.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "code")
    monkeypatch.chdir(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert cli.main([]) == 0 and capsys.readouterr().out.strip() == head
    assert cli.main(["--short"]) == 0 and capsys.readouterr().out.strip() == head[:7]
    (tmp_path / "k.py").write_text("x = 2\n")
    assert cli.main([]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "uncommitted" in out.err


def test_long_tests_head_the_chunks_xdist_deals_out():
    """conftest.spread_long_tests: each test marked long heads one worker's first chunk; the others keep
    their order; no test is lost or doubled; without workers nothing moves."""
    from types import SimpleNamespace

    from conftest import spread_long_tests

    items = [
        SimpleNamespace(name=f"t{i}", keywords={"long"} if i in (0, 1, 2, 40, 97) else set())
        for i in range(100)
    ]
    names = [it.name for it in items]
    spread_long_tests(items, 1)
    assert [it.name for it in items] == names
    spread_long_tests(items, 8)
    got = [it.name for it in items]
    assert sorted(got) == sorted(names)
    heads = [got[round(j * 100 / 8)] for j in range(5)]
    assert heads == ["t0", "t1", "t2", "t40", "t97"]
    rest = [n for n in got if n not in heads]
    assert rest == [n for n in names if n not in heads]


def test_the_tests_that_run_one_at_a_time_head_the_first_chunk_in_series():
    """conftest.spread_long_tests: the tests marked gpu_memory (one at a time under a lock whatever the
    worker) head the first chunk together, in their order; the long tests head the other chunks; nothing
    is lost or doubled."""
    from types import SimpleNamespace

    from conftest import spread_long_tests

    def item(i):
        big = i in (60, 61, 62, 90)
        return SimpleNamespace(
            name=f"t{i}",
            keywords={"long"} if i in (5, 70) else set(),
            get_closest_marker=lambda name, big=big: object() if big and name == "gpu_memory" else None,
        )

    items = [item(i) for i in range(100)]
    names = [it.name for it in items]
    spread_long_tests(items, 4)
    got = [it.name for it in items]
    assert sorted(got) == sorted(names)
    assert got[:4] == ["t60", "t61", "t62", "t90"]
    assert got[25] == "t5" and got[50] == "t70"
    moved = {"t60", "t61", "t62", "t90", "t5", "t70"}
    assert [n for n in got if n not in moved] == [n for n in names if n not in moved]
