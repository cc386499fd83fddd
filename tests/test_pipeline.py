"""The pipeline without a GPU: DAG shape on CPU and with (fake) GPUs, GPU pinning, paper build,
no hand-typed numbers, and the Dockerfile checked statically. Snakemake runs in a copy of the checkout
(conftest.copy_checkout), never in the checkout itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import SNAKEMAKE_GROUP, job_counts, snakemake_env

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("snakemake")
pytestmark = pytest.mark.pipeline
in_snakemake_group = pytest.mark.xdist_group(SNAKEMAKE_GROUP)


def _snake(tree: Path, *args, env_extra=None, timeout=600):
    """Snakemake in ``tree`` (a copy of the checkout, from the tree_copy fixture)."""
    assert tree != ROOT, "Snakemake runs in a copy of the checkout, never in it"
    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=snakemake_env(**(env_extra or {})),
        check=False,
    )


_job_counts = job_counts


@in_snakemake_group
def test_cpu_dag_rebuilds_write_up_from_committed_results(tree_copy):
    res = _snake(tree_copy, "-n", "--cores", "1", "--forceall", env_extra={"MOEGEMM_FORCE_CPU": "1"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    counts = _job_counts(out)
    assert counts.get("verify") == 1 and counts.get("figure") == 10 and counts.get("numbers") == 1, counts
    assert "measure" not in counts and "tune" not in counts and "floors" not in counts, counts
    assert "rebuilt from the committed results/nvidia-h200/" in out


@in_snakemake_group
def test_gpu_dag_splits_experiments_into_gpu_jobs(tree_copy):
    res = _snake(
        tree_copy,
        "-n",
        "--cores",
        "8",
        "--resources",
        "gpu=2",
        "--forceall",
        env_extra={"MOEGEMM_FAKE_GPUS": "NVIDIA H100 80GB HBM3,NVIDIA H100 80GB HBM3"},
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    counts = _job_counts(out)
    # E7, E8 and E9 as one shard per GPU, merged on the CPU; the other six experiments one job each
    assert (
        counts.get("measure") == 6 and counts.get("measure_shard") == 6 and counts.get("merge_shards") == 3
    ), counts
    assert counts.get("tune") == 1 and counts.get("tune_grouped") == 1 and counts.get("floors") == 1, counts
    assert "results/nvidia-h100-80gb-hbm3/router_gemm.csv" in out
    assert "results/nvidia-h100-80gb-hbm3/shards/moe_layer.1-of-2.csv" in out
    # Every GPU job runs through the pinning wrapper and asks for one GPU.
    for block in out.split("\nrule ")[1:]:
        name = block.split(":", 1)[0]
        if name in ("measure", "measure_shard", "tune", "tune_grouped", "floors"):
            assert "gpu=1" in block, block
    one = _snake(
        tree_copy,
        "-n",
        "--cores",
        "8",
        "--forceall",
        env_extra={"MOEGEMM_FAKE_GPUS": "NVIDIA H100 80GB HBM3"},
    )
    counts = _job_counts(one.stdout + one.stderr)
    assert counts.get("measure") == 9 and "measure_shard" not in counts and "merge_shards" not in counts, (
        counts
    )


def test_shards_deal_whole_models_and_merge_back(tmp_path):
    """shard_cells: every cell in exactly one shard, in its order, each model's cells together, the shards'
    cell counts within one model's of each other; merge_shards: the shards' rows under the union of their
    columns, and an error (no file written) for an empty or missing shard."""
    import csv

    import pytest

    from experiments.common import parse_shard, shard_cells
    from experiments.merge_shards import merge

    cells = [(m, t) for m, n in (("a", 14), ("b", 14), ("c", 30), ("d", 6), ("e", 14)) for t in range(n)]
    for n in (1, 2, 3, 4):
        parts = [shard_cells(cells, (i, n)) for i in range(n)]
        assert sorted(c for p in parts for c in p) == sorted(cells)
        for p in parts:
            assert p == [c for c in cells if c in p]  # the original order
        owners = {m: [i for i, p in enumerate(parts) if any(c[0] == m for c in p)] for m in "abcde"}
        assert all(len(v) == 1 for v in owners.values()), owners
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 30, sizes
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "x", "-1/2", "1/0"):
        with pytest.raises(Exception, match="--shard"):
            parse_shard(bad)
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("model,x\nm1,1\n")
    b.write_text("model,y,x\nm2,5,2\nm3,6,3\n")
    out = tmp_path / "out.csv"
    assert merge(out, [a, b]) == 3
    rows = list(csv.DictReader(out.open()))
    assert [r["model"] for r in rows] == ["m1", "m2", "m3"] and rows[0]["y"] == "" and rows[2]["x"] == "3"
    empty = tmp_path / "empty.csv"
    empty.write_text("model,x\n")
    for shards in ([a, empty], [a, tmp_path / "missing.csv"]):
        with pytest.raises(SystemExit, match="shards: "):
            merge(tmp_path / "never.csv", shards)
        assert not (tmp_path / "never.csv").exists()


def test_gpu_slot_pins_concurrent_jobs_to_distinct_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(MOEGEMM_GPU_COUNT="2", PYTHONPATH=str(ROOT))
    code = "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(1.5)"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "experiments.gpu_slot",
                "--lock-dir",
                str(tmp_path),
                "--",
                sys.executable,
                "-c",
                code,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(outs) in (["0", "0", "1"], ["0", "1", "1"]), outs  # the third waited for a free GPU
    assert len(set(outs)) == 2


def test_gpu_slot_honours_visible_devices(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.gpu_slot",
            "--lock-dir",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "3", out.stderr


@in_snakemake_group
def test_paper_builds_from_committed_results(tree_copy):
    """Figures, numbers and (with TeX) the paper, built by Snakemake in a copy of the checkout."""
    tex = shutil.which("latexmk") is not None
    if not tex and os.environ.get("CI") == "true":
        pytest.fail("CI must build the paper: latexmk is missing")
    pdf = tree_copy / "paper" / "build" / "nvidia-h200" / "paper.pdf"
    targets = [str(pdf.relative_to(tree_copy))] if tex else ["paper/build/nvidia-h200/generated/numbers.tex"]
    res = _snake(
        tree_copy,
        "--cores",
        "2",
        *targets,
        "figures/hero.png",
        "--forcerun",
        "numbers",
        env_extra={"MOEGEMM_FORCE_CPU": "1"},
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert (tree_copy / "figures" / "nvidia-h200" / "hero.png").stat().st_size > 10_000
    numbers = (tree_copy / "paper" / "build" / "nvidia-h200" / "generated" / "numbers.tex").read_text()
    if not tex:
        assert re.search(r"\\newcommand\{\\[A-Za-z]+\}", numbers)
        pytest.skip("latexmk not installed: figures and numbers built, the PDF not")
    assert pdf.stat().st_size > 100_000
    used = set(re.findall(r"\\([A-Za-z]+)", (tree_copy / "paper" / "paper.tex").read_text()))
    defined = set(re.findall(r"\\newcommand\{\\([A-Za-z]+)\}", numbers))
    assert defined and defined <= used | {"EFiveRows"} | defined  # every macro is well-formed
    log = (pdf.parent / "paper.log").read_text(errors="replace")
    assert "Undefined control sequence" not in log and "There were undefined references" not in log
    # the main text, its figures and tables with it (flushed before the appendices), in at most 8 pages
    aux = (pdf.parent / "paper.aux").read_text()
    start = re.search(r"\\newlabel\{(?:appstart|appendix-start)\}\{\{[^}]*\}\{(\d+)\}", aux)
    first_appendix_page = int(start.group(1))
    assert first_appendix_page - 1 <= 8, f"the main text takes {first_appendix_page - 1} pages"
    # the paper rule recorded the PDF's pages beside it (paper/manifest.py pages)
    pages = json.loads((pdf.parent / "pages.json").read_text())
    assert pages["pages"] >= first_appendix_page
    assert set(pages["labels"]) == {"mainend", "appstart", "paperend"}


def test_figures_refuse_small_print_and_many_panels(tmp_path):
    """figures.common.save: a figure printed at the paper's text width with a font below 7 pt, or with more
    than 4 panels, is refused (naming it); one within both is saved."""
    import matplotlib.pyplot as plt

    from figures import common

    common.setup()
    fig, ax = plt.subplots(figsize=(7.0, 2.0))
    ax.plot([1, 2], [3, 4])
    ax.set_title("small", fontsize=5)
    with pytest.raises(ValueError, match=r"tiny: prints its smallest font at [0-9.]+ pt"):
        common.save(fig, str(tmp_path / "tiny"))
    fig, axes = plt.subplots(1, 5, figsize=(7.0, 2.0))
    with pytest.raises(ValueError, match="with 5 panels"):
        common.save(fig, str(tmp_path / "five"))
    fig, ax = plt.subplots(figsize=(7.0, 2.0))
    ax.plot([1, 2], [3, 4])
    smallest, panels = common.print_check(fig)
    assert panels == 1 and smallest >= common.MIN_PT
    fig, ax = plt.subplots(figsize=(14.0, 4.0))  # printed at half its size
    ax.plot([1, 2], [3, 4])
    assert common.print_check(fig)[0] < common.MIN_PT


def test_no_number_typed_into_the_paper():
    """Measured numbers enter the paper only as generated macros: no decimal literal in its source."""
    text = (ROOT / "paper" / "paper.tex").read_text()
    body = "\n".join(line.split("%", 1)[0] for line in text.splitlines())
    assert not re.findall(r"(?<![\w.])\d+\.\d+", body), re.findall(r"(?<![\w.])\d+\.\d+", body)
    assert not re.findall(
        r"\d+(\.\d+)?\s*(\\times|x\b|\\,?\\mu ?s|\\%|TB/s|TFLOP)",
        body.replace("\\PeakTBs", "").replace("\\PeakTflops", ""),
    ), "a measured-looking quantity is typed in paper.tex"


def test_dockerfile_is_pinned_and_runs_the_readme_command():
    docker = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM\s+(\S+)", docker, flags=re.M).group(1)
    assert ":" in base and not base.endswith(":latest") and re.search(r"\d{8}", base), base
    smk = (ROOT / "Snakefile").read_text()
    assert base in smk, "the Snakefile's container directive must name the same image"
    cmd = re.search(r"^CMD\s+\[(.*)\]", docker, flags=re.M).group(1)
    assert [c.strip().strip('"') for c in cmd.split(",")] == ["snakemake", "--cores", "1"]
    readme = (ROOT / "README.md").read_text()
    assert "snakemake --cores 1" in readme
    # The pinned tools come from pyproject's own extras (one source of truth), the project without deps.
    assert "['pipeline'] + d['test']" in docker and "pip install --no-deps -e ." in docker
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all("==" in r for r in extras["pipeline"] + extras["test"])
    assert "latexmk" in docker
    # vLLM's wheel for E7's optional contender: hash-pinned, and the source E7 is pointed at is that wheel
    pin = re.search(r"vllm==([\d.]+) --hash=sha256:[0-9a-f]{64}", docker)
    assert pin and "--require-hashes" in docker
    source = re.search(r"^ENV MOEGEMM_VLLM_SOURCE=(\S+)$", docker, flags=re.M).group(1)
    assert source.startswith("/opt/vllm/vllm-" + pin.group(1) + "-") and source.endswith(".whl")
    # the seed's kernels (E3-E6's "seed: ..." contenders): a clone at the measured commit, pointed at
    from experiments.seed_dk import SEED_COMMIT, SEED_REPO

    assert f"github.com/{SEED_REPO}" in docker and f"checkout --quiet {SEED_COMMIT}" in docker
    seed_src = re.search(r"^ENV MOEGEMM_SEED_SOURCE=(\S+)$", docker, flags=re.M).group(1)
    assert seed_src.endswith("/decompose-k") and re.search(
        rf"clone [^\n]* {seed_src.rsplit('/', 1)[0]}\b", docker
    )
    for line in re.findall(r"^\s*(docker (?:build|run)[^\n]*)", docker, flags=re.M):
        assert line.strip() in readme, f"README must document: {line.strip()}"


def test_docker_image_prints_and_records_its_torch_and_triton(tmp_path):
    """The image's ENTRYPOINT runs the script its Dockerfile writes, then the command: that script, taken out
    of the Dockerfile and run here, prints this torch and Triton (and Triton's distribution: `pytorch-triton`
    in the nightly image) and writes them to results/<this machine's slug>/image_versions.json."""
    import torch
    import triton

    docker = (ROOT / "Dockerfile").read_text()
    block = docker.split("RUN printf '%s\\n' \\\n", 1)[1].split("> /usr/local/bin/moegemm-versions.py", 1)[0]
    script = "\n".join(re.fullmatch(r"\s*'(.*)' \\", line).group(1) for line in block.splitlines()[:-1])
    assert re.search(
        r'^ENTRYPOINT \["/bin/sh", "-c", "python /usr/local/bin/moegemm-versions.py && exec '
        r'\\"\$@\\"", "moegemm"\]$',
        docker,
        flags=re.MULTILINE,
    )
    (tmp_path / "versions.py").write_text(script + "\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
        "MOEGEMM_FORCE_CPU": "1",
        "MOEGEMM_COMMIT": "abc1234",
    }
    res = subprocess.run(
        [sys.executable, str(tmp_path / "versions.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"torch {torch.__version__}, Triton {triton.__version__} (" in res.stdout, res.stdout
    got = json.loads((tmp_path / "results" / "cpu-interpreter" / "image_versions.json").read_text())
    assert got["torch"] == torch.__version__ and got["triton"] == triton.__version__, got
    assert re.fullmatch(
        r"(pytorch-triton|triton) " + re.escape(triton.__version__.split("+")[0]) + r"\S*",
        got["triton_distribution"],
    ), got
    assert got["git_commit"] == "abc1234"


def test_readme_headline_is_generated_from_committed_results():
    from paper.numbers.readme import README_END, README_START, headline
    from paper.numbers.runtime import RUNTIME_END, RUNTIME_START, runtime_block

    text = (ROOT / "README.md").read_text()
    fix = (
        "run python -m paper.make_numbers --results results/nvidia-h200 --out "
        "paper/build/nvidia-h200/generated --readme README.md"
    )
    block = text.split(README_START, 1)[1].split(README_END, 1)[0].strip()
    assert block == headline(ROOT / "results" / "nvidia-h200").strip(), (
        f"README headline differs from results/: {fix}"
    )
    block = text.split(RUNTIME_START, 1)[1].split(RUNTIME_END, 1)[0].strip()
    assert block == runtime_block(ROOT / "results" / "nvidia-h200").strip(), f"README run time differs: {fix}"


def test_run_times_come_from_snakemake_benchmark_files(tmp_path):
    from paper.numbers.runtime import run_times, runtime_block

    (tmp_path / "benchmarks").mkdir()
    assert run_times(tmp_path) is None
    for step, s in (("grouped_skew", 200.5), ("verify", 61.0), ("tune", 40.0)):
        (tmp_path / "benchmarks" / f"{step}.tsv").write_text("s\th:m:s\tmax_rss\n" + f"{s}\t0:00:00\t1.0\n")
    df = run_times(tmp_path)
    assert list(df.step) == ["verify", "tune", "grouped_skew"]  # pipeline order
    assert abs(df.seconds.sum() - 301.5) < 1e-9
    (tmp_path / "verify.json").write_text('{"provenance": {"gpu": "Test GPU"}}')
    text = runtime_block(tmp_path)
    assert "5.0 minutes" in text and "Test GPU" in text and "3 of 13" in text and "router_gemm" in text
    assert "within the 20 minutes" in text
    (tmp_path / "benchmarks" / "tune.tsv").write_text("s\th:m:s\tmax_rss\n1000.0\t0:00:00\t1.0\n")
    assert "21.0 minutes" in runtime_block(tmp_path) and "over the 20 minutes" in runtime_block(tmp_path)
    # a step resumed over device calls counts each call's time (device_pipeline.sh's .calls file), not only
    # the benchmark file of the call that finished it; a sharded step, its shards' GPU time summed
    (tmp_path / "benchmarks" / "grouped_skew.calls").write_text("seconds\trc\n300\t124\n250\t0\n")
    for i, s in ((0, 100.0), (1, 140.0)):
        (tmp_path / "benchmarks" / f"moe_layer.{i}-of-2.tsv").write_text(
            f"s\th:m:s\tmax_rss\n{s}\t0:00:00\t1.0\n"
        )
    df = run_times(tmp_path).set_index("step")
    assert df.seconds["grouped_skew"] == 550 and df.calls["grouped_skew"] == 2
    assert df.seconds["moe_layer"] == 240 and df.shards["moe_layer"] == 2
    text = runtime_block(tmp_path)
    assert "grouped_skew 550 s over 2 device calls" in text and "moe_layer 240 s in 2 shards" in text


def test_headline_names_the_triton_each_result_used(tmp_path):
    """paper.numbers.readme.versions_text reads torch and Triton from the CSV rows (synthetic ones here): one
    pair for all, or each pair with the experiments measured with it."""
    import pandas as pd

    from paper.numbers.readme import EXPERIMENT_CSVS, versions_text

    for name in EXPERIMENT_CSVS[:6]:
        pd.DataFrame({"x": [1, 2], "torch": "2.11.0+cu130", "triton": "3.6.0"}).to_csv(
            tmp_path / f"{name}.csv"
        )
    assert versions_text(tmp_path) == "torch 2.11.0+cu130, Triton 3.6.0"
    for name in EXPERIMENT_CSVS[6:]:
        pd.DataFrame({"torch": ["2.11.0+cu130"] * 2, "triton": "3.7.1"}).to_csv(tmp_path / f"{name}.csv")
    pd.DataFrame({"torch": ["2.11.0+cu130", "2.11.0+cu130"], "triton": ["3.6.0", "3.7.1"]}).to_csv(
        tmp_path / "inductor_codegen.csv"
    )
    assert versions_text(tmp_path) == (
        "torch 2.11.0+cu130, Triton 3.6.0 for E1-E6; torch 2.11.0+cu130, Triton 3.7.1 for E2, E7, E8"
    )


def test_cpu_times_come_from_the_recorded_run(tmp_path):
    """paper.numbers.runtime.cpu_paragraph: the README's CPU times are the step files .ci/record-cpu-times
    wrote (synthetic ones here), the verify step and the figures and numbers from Snakemake's own benchmark
    files of that run, the machine and its load from machine.json; nothing recorded, nothing claimed."""
    from paper.numbers.runtime import cpu_paragraph, runtime_block

    cpu = tmp_path / "cpu"
    assert "not recorded" in cpu_paragraph(cpu)
    bench = cpu / "benchmarks"
    (bench / "pipeline").mkdir(parents=True)
    steps = (
        ("install", 75.0),
        ("pipeline", 412.0),
        ("tests", 205.0),
        ("pipeline_warm", 132.0),
        ("tests_warm", 96.0),
        ("pipeline/verify", 393.0),
        ("pipeline/figure_e1_compile_modes", 6.5),
        ("pipeline/numbers", 10.5),
    )
    for name, s in steps:
        (bench / f"{name}.tsv").write_text(f"s\th:m:s\n{s}\t0:00:00\n")
    assert "not recorded" in cpu_paragraph(cpu)  # no machine.json: not a recorded run
    (cpu / "machine.json").write_text(
        json.dumps({"commit": "0123456789", "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 23.4}})
    )
    for name in ("install", "tests", "pipeline_warm", "tests_warm"):  # a run stopped after the pipeline
        (bench / f"{name}.tsv").unlink()
    assert cpu_paragraph(cpu).endswith(
        "; not timed in that run: the install, the test command, the pipeline warm, the tests warm."
    ), cpu_paragraph(cpu)
    assert "shared with other work" not in cpu_paragraph(cpu)  # no load recorded, none claimed
    for name, s in steps:
        (bench / f"{name}.tsv").write_text(f"s\th:m:s\n{s}\t0:00:00\n")
    machine = {
        "commit": "0123456789abcdef",
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 23.4},
        "load_average_during": {
            "install": {"mean": 1.5, "exit_status": 0},
            "tests": {"mean": 4.25, "exit_status": 0},
            "tests_warm": {"mean": 3.0, "exit_status": 1},
        },
    }
    (cpu / "machine.json").write_text(json.dumps(machine))
    text = cpu_paragraph(cpu)
    for part in (
        "fresh clone at 0123456, on a 2-core Test CPU machine with 23 GiB, shared with other work "
        "(1-minute load average 1.5-4.2 while it ran",
        "the install took 75 s",
        "`snakemake --cores 1` 6.9 minutes from empty",
        "the verify step 6.5 minutes of it",
        "figures and numbers 17 s",
        "the PDF not built",
        "2.2 minutes again with the caches warm",
        "the test command 3.4 minutes from empty caches and 96 s warm, on 2 pytest-xdist workers "
        "(with failures: tests_warm)",
    ):
        assert part in text, (part, text)
    (bench / "pipeline" / "paper.tsv").write_text("s\th:m:s\n30.0\t0:00:30\n")
    assert "the PDF 30 s" in cpu_paragraph(cpu)
    (bench / "tests.tsv").write_text("s\th:m:s\tcpu_time\n205.0\t0:03:25\t330.0\n")  # with its CPU time
    assert "the test command 3.4 minutes (5.5 minutes of CPU time) from empty caches" in cpu_paragraph(cpu)
    (tmp_path / "gpu").mkdir()
    block = runtime_block(tmp_path / "gpu")
    assert block.startswith(cpu_paragraph(cpu)) and "GPU run time: not recorded" in block
    # a run on both cores holds the load near 2 by itself: not a shared machine
    for v in machine["load_average_during"].values():
        v["mean"] = 2.2
    (cpu / "machine.json").write_text(json.dumps(machine))
    assert "shared with other work" not in cpu_paragraph(cpu)


def test_e7_figure_and_numbers_on_a_synthetic_csv(tmp_path):
    """The E7 plotting and number code runs on a CSV of E7's schema. The values are synthetic test data
    made here (never written under results/); they check code paths, not measurements."""
    import numpy as np
    import pandas as pd

    res = tmp_path / "results" / "test-gpu"
    shutil.copytree(ROOT / "results" / "nvidia-h200", res)
    shutil.copytree(ROOT / "results" / "reference", tmp_path / "results" / "reference")
    rng = np.random.default_rng(0)
    rows = []
    base = pd.read_csv(res / "router_gemm.csv").iloc[0]
    for model in ("m1", "m2"):
        for proj in ("up", "down", "path(up)"):
            for t in (1, 64, 4096):
                for load, gini in (("uniform", 0.05), ("zipf1.2", 0.6), ("hot0.5", 0.3)):
                    if proj == "path(up)" and load != "uniform":
                        continue
                    names = (
                        ["path:ours", "path:torch._grouped_mm"]
                        if proj.startswith("path")
                        else ["ours:contiguous", "ours:persistent", "torch._grouped_mm", "per-expert-loop"]
                        + (["ours:masked", "ours:masked-pointer"] if t <= 64 else [])
                    )
                    for c in names:
                        g = float(rng.uniform(5, 50))
                        if (
                            model == "m1"
                            and c == "ours:contiguous"
                            and t <= 64
                            and not proj.startswith("path")
                        ):
                            g = 4.0  # at the floor: these 12 decode cells meet the decode target
                        rows.append(
                            {
                                "contender": c,
                                "status": "ok",
                                "model": model,
                                "proj": proj,
                                "tokens": t,
                                "load": load,
                                "gini": gini,
                                "graph_us": g,
                                "launch_us": g + 10,
                                "floor_us": 4.0,
                                "pct_floor_graph": 400.0 / g,
                                "bytes": 4.0e7,
                                "gpu": base.gpu,
                                "torch": base.torch,
                                "triton": base.triton,
                            }
                        )
    pd.DataFrame(rows).to_csv(res / "grouped_skew.csv", index=False)
    floors = json.loads((res / "floors.json").read_text())
    floors["measured"]["read_tb_s"] = 4.0  # synthetic, as above: the streaming-read path of the numbers
    (res / "floors.json").write_text(json.dumps(floors))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "figures.e7_grouped_skew",
            "--results",
            str(res),
            "--out",
            str(tmp_path / "fig" / "e7"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "fig" / "e7.pdf").stat().st_size > 10_000
    out = subprocess.run(
        [sys.executable, "-m", "paper.make_numbers", "--results", str(res), "--out", str(tmp_path / "gen")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    numbers = (tmp_path / "gen" / "numbers.tex").read_text()
    for macro in (
        "ESevenDecodePct",
        "ESevenPrefillPct",
        "ESevenTorchDecodePct",
        "ESevenSkewPenalty",
        "ESevenPathSpeedup",
        "ReadTBs",
        "ESevenDecodePctRead",
        "ESevenMaskedTmaGain",
    ):
        assert f"\\newcommand{{\\{macro}}}" in numbers, macro
    assert "\\newcommand{\\ESevenDecodeMet}{12}" in numbers
    assert "\\newcommand{\\ESevenDecodeMetByModel}{m1 12}" in numbers
    assert (tmp_path / "gen" / "table_e7.tex").exists()


def test_robust_tuning_numbers_on_a_synthetic_csv(tmp_path):
    """paper.numbers.e7_tuner.robust_tuning on a tuner CSV with loads (synthetic test data made here): cells
    counted where both loads were timed, the chosen config is the least geometric mean, its cost on the
    uniform load and its gain on the skewed one against the uniform load's fastest; a CSV without a load
    column (the tuner before the S7 runs) gives no numbers."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e7_tuner import robust_tuning

    rows = []
    for tokens, times in (
        (64, {"a": (100, 200), "b": (110, 120)}),  # b chosen: +10% uniform, 1.67x zipf
        (256, {"a": (100, 100), "b": (120, 90)}),
    ):  # a chosen (both: 100 vs 103.9)
        for cfg, (uni, zipf) in times.items():
            for load, us in (("uniform", uni), ("zipf1.2", zipf)):
                rows.append(
                    {
                        "model": "m",
                        "proj": "up",
                        "tokens": tokens,
                        "load": load,
                        "config": cfg,
                        "status": "ok",
                        "graph_us": float(us),
                    }
                )
    rows.append(
        {
            "model": "m",
            "proj": "up",
            "tokens": 1,
            "load": "uniform",
            "config": "a",
            "status": "ok",
            "graph_us": 5.0,
        }
    )
    pd.DataFrame(rows).to_csv(tmp_path / "tune_grouped.csv", index=False)
    n = Numbers()
    robust_tuning(n, tmp_path)
    assert n.items["TuneCells"] == "2" and n.items["TuneDiffers"] == "1"
    assert n.items["TuneUniformCostMax"] == "10.0" and n.items["TuneSkewGainMax"] == "67"
    assert n.items["TuneLoads"] == "zipf1.2"
    pd.DataFrame(rows).drop(columns="load").to_csv(tmp_path / "tune_grouped.csv", index=False)
    n = Numbers()
    robust_tuning(n, tmp_path)
    assert not n.items


def test_decode_routing_numbers_on_synthetic_csvs(tmp_path):
    """paper.numbers.e8.decode_routing_probe on the probe's CSV and an earlier run's under runs/ (synthetic
    test data made here): at T=1 the three-launch layer at 128-slot blocks over moe_ffn, per split, and the
    two parts of it; at a T with at most 64 slots and past it; the earlier run's lowest at 128 slots over 64
    or more experts (a failed row left out); no numbers without the current CSV."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import decode_routing_probe

    def rows(cells, commit):
        out = []
        for (model, split, t, k, e), (fast, three, old) in cells.items():
            for c, us in (
                ("ours:moe_ffn", fast),
                ("three-launch", three),
                ("three-launch, 128-slot plan", old),
            ):
                out.append(
                    dict(
                        model=model,
                        split=split,
                        tokens=t,
                        top_k=k,
                        experts=e,
                        contender=c,
                        graph_us=us,
                        status="ok",
                        git_commit=commit,
                    )
                )
        out.append(
            dict(
                model="a",
                split="tune",
                tokens=1,
                top_k=8,
                experts=128,
                contender="ours:moe_ffn",
                graph_us=1.0,
                status="wrong",
                git_commit=commit,
            )
        )
        return pd.DataFrame(out)

    cur = {
        ("a", "tune", 1, 8, 128): (40, 44, 48),
        ("b", "heldout", 1, 2, 8): (100, 102, 110),
        ("a", "tune", 4, 8, 128): (200, 204, 204),
        ("a", "tune", 16, 8, 128): (300, 300, 303),
    }
    early = {("a", "tune", 16, 8, 128): (310, 300, 303), ("b", "heldout", 64, 2, 8): (90, 80, 80)}
    n = Numbers()
    (tmp_path / "runs" / "S9-9").mkdir(parents=True)
    rows(early, "bbbbbbb00").to_csv(tmp_path / "runs" / "S9-9" / "probe_decode_routing.csv", index=False)
    decode_routing_probe(n, tmp_path)
    assert not n.items
    rows(cur, "aaaaaaa00").to_csv(tmp_path / "probe_decode_routing.csv", index=False)
    decode_routing_probe(n, tmp_path)
    got = n.items
    assert got["DecRouteCommit"] == "aaaaaaa" and got["DecRouteCells"] == "4" and got["DecRouteSlots"] == "64"
    assert (
        got["DecRouteOneTune"] == "1.20" and got["DecRouteOneHeld"] == "1.10" and got["DecRouteOne"] == "1.15"
    )
    assert (
        got["DecRouteOneLo"] == "1.10" and got["DecRouteOneHi"] == "1.20" and got["DecRouteOneHiModel"] == "a"
    )
    assert got["DecRouteOneGather"] == "1.06" and got["DecRouteOneSizing"] == "1.08"
    assert got["DecRouteFew"] == "1.02" and got["DecRouteFewLo"] == "1.02" and got["DecRoutePast"] == "1.00"
    assert got["DecRouteEarlyRun"] == "S9-9" and got["DecRouteEarlyCommit"] == "bbbbbbb"
    assert got["DecRouteEarlyLo"] == "0.97" and got["DecRouteEarlyCells"] == "1"


def test_compiled_small_numbers_on_synthetic_csvs(tmp_path):
    """paper.numbers.e8.compiled_small_probe (synthetic test data made here): eager over compiled graph time
    at T=1 and over all cells; per profiled (model, T) whether both list the same kernels as often, and the
    summed kernel time's ratio; nothing without both CSVs."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import compiled_small_probe

    times = {("a", 1): (50, 52), ("a", 16): (200, 200), ("b", 1): (100, 100)}
    rows = [
        dict(model=m, tokens=t, contender=c, graph_us=us, status="ok", git_commit="ccccccc00")
        for (m, t), (eager, comp) in times.items()
        for c, us in (("ours:hf-backend", eager), ("ours:hf-backend:compiled", comp))
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "probe_compiled_small.csv", index=False)
    n = Numbers()
    compiled_small_probe(n, tmp_path)
    assert not n.items
    kernels = [
        ("a", 1, "ours:hf-backend", "k1", 2, 30.0),
        ("a", 1, "ours:hf-backend:compiled", "k1", 2, 30.0),
        ("a", 1, "ours:hf-backend", "k2", 1, 10.0),
        ("a", 1, "ours:hf-backend:compiled", "k2", 1, 10.0),
        ("b", 1, "ours:hf-backend", "k1", 1, 44.0),
        ("b", 1, "ours:hf-backend:compiled", "k1", 2, 40.0),
    ]
    pd.DataFrame(kernels, columns=["model", "tokens", "contender", "kernel", "count", "us_per_call"]).to_csv(
        tmp_path / "probe_compiled_small.kernels.csv", index=False
    )
    compiled_small_probe(n, tmp_path)
    got = n.items
    assert got["CompSmallCommit"] == "ccccccc" and got["CompSmallCells"] == "3"
    assert got["CompSmallGraphOne"] == "0.98" and got["CompSmallGraphOneLo"] == "0.96"
    assert got["CompSmallGraph"] == "0.99"
    assert got["CompSmallProfiled"] == "2" and got["CompSmallSameKernels"] == "1"
    assert got["CompSmallKernelTime"] == "1.05"


def test_graph_clock_numbers_on_a_synthetic_csv(tmp_path):
    """paper.numbers.e8.graph_clock_probe (synthetic test data made here): at T=1 the eager backend over the
    compiled one under the old and the new clock, the calls per graph each got, every contender's shift and
    its split into the count's and the hold's; at the largest T the shift; the router's shifts and lead;
    a failed row is left out; nothing without the CSV."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import OURS_HF, OURS_HF_COMPILED, graph_clock_probe

    n = Numbers()
    graph_clock_probe(n, tmp_path)
    assert not n.items
    rows = []
    for model, t, name, calls, before, count, now in (
        ("a", 1, OURS_HF, 4, 40.0, 39.0, 38.0),
        ("a", 1, OURS_HF_COMPILED, 2, 44.0, 39.0, 38.0),
        ("b", 1, OURS_HF, 3, 50.0, 50.0, 50.0),
        ("b", 1, OURS_HF_COMPILED, 3, 50.0, 50.0, 50.0),
        ("a", 16, OURS_HF, 5, 200.0, 200.0, 198.0),
        ("a", 16, OURS_HF_COMPILED, 2, 202.0, 200.0, 198.0),
    ):
        rows.append(
            dict(
                experiment="E8",
                model=model,
                tokens=t,
                contender=name,
                status="ok",
                calls_before=calls,
                calls_now=10,
                graph_us_before=before,
                graph_us_count=count,
                graph_us_now=now,
                git_commit="ddddddd99",
            )
        )
    rows.append(dict(rows[0], contender="broken", status="error", graph_us_before=1.0, graph_us_now=100.0))
    for name, before, now in (("eager", 6.0, 5.8), ("ours:auto", 4.5, 4.35)):
        rows.append(
            dict(
                experiment="E6",
                model="router",
                tokens=1,
                contender=name,
                status="ok",
                calls_before=20,
                calls_now=20,
                graph_us_before=before,
                graph_us_count=before,
                graph_us_now=now,
                git_commit="ddddddd99",
            )
        )
    pd.DataFrame(rows).to_csv(tmp_path / "probe_graph_clock.csv", index=False)
    graph_clock_probe(n, tmp_path)
    got = n.items
    assert got["GClkCommit"] == "ddddddd" and got["GClkModels"] == "2" and got["GClkTokens"] == "1, 16"
    assert got["GClkCompiledBefore"] == "0.95" and got["GClkCompiledBeforeLo"] == "0.91"
    assert got["GClkCompiledNow"] == "1.00" and got["GClkCompiledNowLo"] == "1.00"
    assert (got["GClkCallsEagerBeforeLo"], got["GClkCallsEagerBeforeHi"]) == ("3", "4")
    assert (got["GClkCallsCompiledBeforeLo"], got["GClkCallsCompiledBeforeHi"]) == ("2", "3")
    assert got["GClkCallsNowLo"] == "10"
    assert got["GClkShiftOneLo"] == "0.864" and got["GClkShiftOneHi"] == "1.000"
    assert got["GClkTopTokens"] == "16" and got["GClkShiftTop"] == "0.985"
    assert got["GClkRouterEager"] == "0.967" and got["GClkRouterOurs"] == "0.967"
    assert got["GClkRouterLeadBefore"] == "1.33" and got["GClkRouterLeadNow"] == "1.33"
    assert float(got["GClkShiftOne"]) == pytest.approx(
        float(got["GClkCountOne"]) * float(got["GClkHoldOne"]), abs=2e-3
    )


def test_large_cells_numbers_on_synthetic_csvs(tmp_path):
    """paper.numbers.e8.large_cells_probe (synthetic test data made here): over the probe's cells the
    compiled backend over the eager one and the fused gate/up over the unfused (ranges), how far apart
    moe_ffn and the eager backend are at most; the same from E8's uniform cells of those (model, T); a
    failed row is left out; nothing without the CSV."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import OURS, OURS_HF, OURS_HF_COMPILED, UNFUSED, large_cells_probe

    n = Numbers()
    large_cells_probe(n, tmp_path)
    assert not n.items
    times = {("m", 4096): (100.0, 110.0, 101.0, 100.0), ("m", 16384): (400.0, 460.0, 404.0, 410.0)}
    names = (OURS, UNFUSED, OURS_HF, OURS_HF_COMPILED)
    rows = [
        dict(model=m, tokens=t, contender=c, status="ok", graph_us=us, rounds=4, git_commit="eeeeeee11")
        for (m, t), uss in times.items()
        for c, us in zip(names, uss)
    ]
    rows.append(dict(rows[0], status="error", graph_us=1.0))
    pd.DataFrame(rows).to_csv(tmp_path / "probe_large_cells.csv", index=False)
    e8 = [
        dict(model="m", split="heldout", tokens=16384, load=load, contender=c, status="ok", graph_us=us)
        for load, uss in (
            ("uniform", (460.0, 450.0, 400.0, 440.0)),
            ("zipf1.2", (400.0, 300.0, 400.0, 100.0)),
        )
        for c, us in zip(names, uss)
    ]
    pd.DataFrame(e8).to_csv(tmp_path / "moe_layer.csv", index=False)
    large_cells_probe(n, tmp_path)
    got = n.items
    assert got["LgCellsCommit"] == "eeeeeee" and got["LgCellsCells"] == "2" and got["LgCellsRounds"] == "4"
    assert got["LgCellsModels"] == "m" and got["LgCellsTokens"] == "4096, 16384"
    assert (got["LgCellsCompLo"], got["LgCellsCompHi"]) == ("0.99", "1.01")
    assert (got["LgCellsFusionLo"], got["LgCellsFusionHi"]) == ("1.10", "1.15")
    assert got["LgCellsSamePct"] == "1"
    assert got["LgCellsEEightCompLo"] == "0.91" and got["LgCellsEEightFusionLo"] == "0.98"
    assert got["LgCellsEEightSamePct"] == "13"


def test_compiled_samples_numbers_on_synthetic_csvs(tmp_path):
    """paper.numbers.e8.compiled_samples_probe on the probe's CSVs (synthetic test data made here): one under
    runs/ without the host columns and the newest with them; per run and cell the eager backend's median
    replay over the compiled one's; the host columns from the run that has them; no CSV, no numbers."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import OURS_HF, OURS_HF_COMPILED, compiled_samples_probe

    def rows(model, us_eager, us_compiled, host=True):
        out = []
        for name, series in ((OURS_HF, us_eager), (OURS_HF_COMPILED, us_compiled)):
            for i, us in enumerate(series):
                r = {"model": model, "cell": "T=16384 uniform", "contender": name, "replay": i, "us": us}
                if host:
                    r.update(host_ms=0.05 * (i + 1), children=1, dynamo_graphs=4 + (name == OURS_HF_COMPILED))
                out.append(r)
        return out

    n = Numbers()
    compiled_samples_probe(n, tmp_path)
    assert not n.items
    (tmp_path / "runs" / "A").mkdir(parents=True)
    pd.DataFrame(rows("a-model", [90, 100, 110], [100, 125, 200], host=False)).to_csv(
        tmp_path / "runs" / "A" / "probe_compiled_samples.csv", index=False
    )
    pd.DataFrame(rows("b_model", [100, 100, 100], [90, 100, 400])).to_csv(
        tmp_path / "probe_compiled_samples.csv", index=False
    )
    compiled_samples_probe(n, tmp_path)
    assert n.items["EEightSampleRuns"] == "2" and n.items["EEightSampleTokens"] == "16384"
    assert n.items["EEightSampleModels"] == "a-model and b\\_model"
    assert n.items["EEightSampleLo"] == "0.80" and n.items["EEightSampleHi"] == "1.00"
    assert n.items["EEightSampleHostMs"] == "0.2" and n.items["EEightSampleChildren"] == "1"
    assert n.items["EEightSampleNewGraphs"] == "1"  # a graph compiled between the two backends' replays


def test_tuner_feature_numbers_fall_back_to_the_newest_kept_run(tmp_path):
    """paper.numbers.e7_tuner.extra_rows (and tma_splits, the same helper) on synthetic tuner CSVs made here:
    from the current CSV when it timed the feature, else from the newest kept run that did (runs/S8-10
    before runs/S8-9: numeric order), named by ExtraRun; nothing where no CSV timed it."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e7_tuner import extra_rows

    def csv(path, with_extra, us):
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            {
                "model": "m",
                "proj": "up",
                "tokens": 64,
                "load": "uniform",
                "status": "ok",
                "config": "{'block_m': 64, 'extra_m': 0}",
                "graph_us": 100.0,
            }
        ]
        if with_extra:
            rows.append({**rows[0], "config": "{'block_m': 64, 'extra_m': 16}", "graph_us": us})
        pd.DataFrame(rows).to_csv(path, index=False)

    csv(tmp_path / "tune_grouped.csv", False, 0)
    n = Numbers()
    extra_rows(n, tmp_path)
    assert not n.items
    csv(tmp_path / "runs" / "S8-9" / "tune_grouped.csv", True, 125.0)
    csv(tmp_path / "runs" / "S8-10" / "tune_grouped.csv", True, 80.0)
    extra_rows(n, tmp_path)
    assert n.items["ExtraRun"] == "S8-10" and n.items["ExtraWins"] == "1" and n.items["ExtraLo"] == "1.25"
    csv(tmp_path / "tune_grouped.csv", True, 200.0)
    n = Numbers()
    extra_rows(n, tmp_path)
    assert "ExtraRun" not in n.items and n.items["ExtraHi"] == "0.500"


def test_tuner_rows_are_the_screen(tmp_path):
    """paper.numbers.e7_tuner.tuner_rows keeps the screen's correct rows (and those of CSVs from before the
    tuner had a final, without a stage column); the final's second timings are left out."""
    import pandas as pd

    from paper.numbers.e7_tuner import tuner_rows

    rows = [
        {"config": "a", "status": "ok", "graph_us": 1.0, "stage": "screen"},
        {"config": "b", "status": "wrong", "graph_us": 2.0, "stage": "screen"},
        {"config": "a", "status": "ok", "graph_us": 3.0, "stage": "final"},
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "t.csv", index=False)
    assert tuner_rows(tmp_path / "t.csv").graph_us.tolist() == [1.0]
    pd.DataFrame(rows).drop(columns="stage").to_csv(tmp_path / "t.csv", index=False)
    assert tuner_rows(tmp_path / "t.csv").graph_us.tolist() == [1.0, 3.0]
    assert tuner_rows(tmp_path / "none.csv") is None


def test_paper_and_readme_name_no_internal_work_items():
    """The write-up speaks of the work, not of how it was organised: no issue numbers, sessions or work
    items in the paper, its generated tables' captions or the README."""
    pattern = re.compile(r"\b(issues?\s*#?\d+|issue tracker|sessions?\s*\d+|work items?)\b", re.I)
    texts = {
        "paper/paper.tex": (ROOT / "paper" / "paper.tex").read_text(),
        "README.md": (ROOT / "README.md").read_text(),
        **{
            str(p.relative_to(ROOT)): p.read_text()
            for p in sorted((ROOT / "paper").rglob("*.py"))
            if "build" not in p.parts
        },
    }
    for name, text in texts.items():
        assert not pattern.findall(text), f"{name} names {pattern.findall(text)}"
    assert not (ROOT / "results" / "reference" / "issue5-h200").exists()


def test_figure_index_lists_every_figure_with_its_csvs():
    """figures/README.md has one row per figure the Snakefile draws, naming every CSV it reads."""
    smk = (ROOT / "Snakefile").read_text()
    block = smk.split("FIGURE_INPUTS = {", 1)[1].split("\n}", 1)[0]
    entries = dict(re.findall(r'"(\w+)": (\[[^\n]*?\](?: \+ \([^\n]*?\))?)(?:,|$)', block, flags=re.M))
    index = (ROOT / "figures" / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|[^|]*\|(.*)\|$", index, flags=re.M)}
    assert entries and set(rows) == set(entries), (sorted(rows), sorted(entries))
    for name, inputs in entries.items():
        for csv in set(re.findall(r'"(\w+)"', inputs)) - {"WRITEUP"}:
            assert f"`{csv}.csv`" in rows[name], (name, csv)
        assert (ROOT / "figures" / f"{name}.py").exists()


def test_related_work_cites_the_sources_it_builds_on():
    """The paper cites, from paper/references.bib, the seed's post and repository, the custom-op autotuning
    talk, Triton's grouped-GEMM tutorial, CUTLASS, DeepGEMM, MegaBlocks, vLLM, torch's grouped_mm and the
    Hugging Face experts backends; every key it cites is in the .bib."""
    tex = (ROOT / "paper" / "paper.tex").read_text()
    bib = (ROOT / "paper" / "references.bib").read_text()
    keys = set(re.findall(r"^@\w+\{([\w-]+),", bib, flags=re.M))
    cited = {k.strip() for group in re.findall(r"\\cite\{([^}]*)\}", tex) for k in group.split(",")}
    required = {
        "seed-blog",
        "seed-repo",
        "ellison-zhang-talk",
        "triton-grouped-gemm",
        "cutlass",
        "deepgemm",
        "megablocks",
        "vllm",
        "torch-grouped-mm",
        "hf-experts",
    }
    assert required <= cited, required - cited
    assert cited <= keys, cited - keys
    assert "\\bibliography{references}" in tex


def test_abstract_is_at_most_200_words():
    tex = (ROOT / "paper" / "paper.tex").read_text()
    abstract = tex.split("\\begin{abstract}", 1)[1].split("\\end{abstract}", 1)[0]
    words = re.sub(r"\\[A-Za-z]+|[{}$\\]", " ", abstract).split()
    assert len(words) <= 200, len(words)


def test_e8_numbers_and_figure_on_a_synthetic_csv(tmp_path):
    """paper.numbers.e8 and figures/e8_moe_layer on a moe_layer CSV (synthetic test data made here, not a
    measurement): ours against the faster peer, vLLM at prefill, the fusion's gain, the compiled backend
    against the eager one; the table; a figure that passes the print check; no CSV, no numbers."""
    import subprocess
    import sys

    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import e8

    n = Numbers()
    e8(n, tmp_path, tmp_path)
    assert not n.items
    times = {
        "ours:moe_ffn": 100.0,
        "ours:unfused-swiglu": 120.0,
        "hf:grouped_mm:compiled": 150.0,
        "torch._grouped_mm pipeline": 130.0,
        "vllm:fused_experts": 110.0,
        "ours:hf-backend": 105.0,
        "ours:hf-backend:compiled": 100.0,
        "hf:grouped_mm": 160.0,
    }
    rows = [
        {
            "model": m,
            "split": s,
            "tokens": t,
            "load": ld,
            "contender": c,
            "status": "ok",
            "graph_us": us * (2.0 if (m, t, c) == ("b", 4096, "torch._grouped_mm pipeline") else 1.0),
            "gpu": "Test GPU",
            "torch": "x",
            "triton": "y",
        }
        for m, s in (("a", "tune"), ("b", "heldout"), ("c", "heldout"))
        for t in (16, 4096)
        for ld in ("uniform", "zipf1.2")
        for c, us in times.items()
    ]
    rows.append({**rows[0], "contender": "vllm:fused_experts", "status": "error", "graph_us": float("nan")})
    pd.DataFrame(rows).to_csv(tmp_path / "moe_layer.csv", index=False)
    e8(n, tmp_path, tmp_path)
    assert n.items["EEightModels"] == "3" and n.items["EEightHeldPeerCells"] == "8"
    # vLLM (110 us) is the fastest peer in every cell: the best peer is vLLM's time
    assert n.items["EEightHeldVsPeer"] == "1.10" and n.items["EEightHeldVsPeerMin"] == "1.10"
    assert n.items["EEightHeldDecodeVsPeerGpu"].startswith("1.10x")
    # held-out prefill: b's two cells at 2.6, c's at 1.3 (one round each: the interval spans the cells)
    assert n.items["EEightHeldPrefillVsTorchGpu"] == "1.84x [1.30, 2.60]"
    assert n.items["EEightHeldPrefillVsVllm"] == "1.10" and n.items["EEightFusionGain"] == "1.20"
    assert n.items["EEightCompiledVsEager"] == "1.05" and n.items["EEightFusionSlower"] == "0"
    assert "tab:e8" in (tmp_path / "table_e8.tex").read_text()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "figures.e8_moe_layer",
            "--results",
            str(tmp_path),
            "--out",
            str(tmp_path / "e8"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "e8.pdf").exists()


@in_snakemake_group
def test_experiments_wait_only_for_the_tables_they_read(tree_copy, monkeypatch):
    """With several GPUs, E7 and E8 start once the grouped tables exist (not after the Decompose-K or seed
    tuners), E1-E6 once the Decompose-K table does; no experiment waits for the floors (the write-up reads
    them)."""
    from experiments import schedule

    monkeypatch.setattr(schedule, "ROOT", tree_copy)  # Snakemake writes its log where it runs
    nodes, edges = schedule.dag(2, "NVIDIA H100 80GB HBM3")
    parents: dict = {}
    for a, b in edges:
        parents.setdefault(b, set()).add(a)

    def ancestors(i, seen=None):
        seen = set() if seen is None else seen
        for p in parents.get(i, ()):
            if p not in seen:
                seen.add(p)
                ancestors(p, seen)
        return {nodes[j]["rule"] for j in seen}

    jobs = {(n["rule"], n["wildcards"].get("experiment")): i for i, n in nodes.items()}
    e8 = ancestors(jobs[("measure_shard", "moe_layer")])
    assert {"verify", "tune_grouped", "distill_grouped"} <= e8 and not {"tune", "tune_seed", "floors"} & e8, (
        e8
    )
    e5 = ancestors(jobs[("measure", "decompose_k_grid")])
    assert {"verify", "tune", "tune_seed"} <= e5 and not {"tune_grouped", "floors"} & e5, e5
    assert "floors" in ancestors(next(i for i, n in nodes.items() if n["rule"] == "numbers"))


def test_schedule_is_list_scheduling_on_the_gpus():
    """The predictor: GPU jobs never overlap beyond the GPU count, each starts after its inputs, and the
    makespan is at least the critical path and the GPU work per GPU."""
    from experiments.schedule import schedule

    nodes = {
        0: {"rule": "verify", "wildcards": {}},
        1: {"rule": "tune", "wildcards": {}},
        2: {"rule": "measure", "wildcards": {"experiment": "a"}},
        3: {"rule": "measure", "wildcards": {"experiment": "b"}},
        4: {"rule": "measure", "wildcards": {"experiment": "c"}},
        5: {"rule": "numbers", "wildcards": {}},
    }
    edges = [(0, 1), (1, 2), (1, 3), (1, 4), (2, 5), (3, 5), (4, 5)]
    dur = {0: 10.0, 1: 5.0, 2: 30.0, 3: 20.0, 4: 10.0, 5: 1.0}
    makespan, critical, log = schedule(nodes, edges, dur, gpus=2)
    assert critical == 46.0 and makespan == 46.0  # c runs after b on the GPU b frees
    starts = {label: (s, e) for s, e, label in log}
    assert starts["measure a"] == (15.0, 45.0) and starts["measure b"] == (15.0, 35.0)
    assert starts["measure c"] == (35.0, 45.0)
    one, _, _ = schedule(nodes, edges, dur, gpus=1)
    assert one == 10 + 5 + 30 + 20 + 10 + 1


def test_compiled_order_and_ffn_ceiling_numbers_on_synthetic_csvs(tmp_path):
    """paper.numbers.e8's compiled_order_probe (per order, the eager backend's time over the compiled one's,
    over the loads; rotation read from its first and last measurement) and ffn_ceiling_probe (the pipeline's
    and ours' times over dense:ffn's), on synthetic CSVs made here; a wrong row left out; no CSV, no
    numbers."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import (
        OURS,
        OURS_HF,
        OURS_HF_COMPILED,
        TORCH,
        compiled_order_probe,
        ffn_ceiling_probe,
    )

    n = Numbers()
    compiled_order_probe(n, tmp_path)
    ffn_ceiling_probe(n, tmp_path)
    assert not n.items
    base = {"model": "m", "tokens": 16384, "git_commit": "1234567890", "status": "ok"}
    compiled = {
        ("rotate", "uniform"): 125,
        ("rotate", "zipf1.2"): 110,
        ("rotate-again", "uniform"): 101,
        ("balanced", "uniform"): 100,
        ("balanced", "zipf1.2"): 98,
        ("balanced-4", "uniform"): 100,
    }
    rows = []
    for (variant, load), us in compiled.items():
        rounds = 4 if variant == "balanced-4" else 2
        rows += [
            dict(base, variant=variant, load=load, rounds=rounds, contender=OURS_HF, graph_us=100.0),
            dict(
                base,
                variant=variant,
                load=load,
                rounds=rounds,
                contender=OURS_HF_COMPILED,
                graph_us=float(us),
            ),
        ]
    rows.append(
        dict(
            base,
            variant="after-eager",
            load="uniform",
            rounds=2,
            contender=OURS_HF_COMPILED,
            graph_us=float("nan"),
            status="wrong",
        )
    )
    pd.DataFrame(rows).to_csv(tmp_path / "probe_compiled_order.csv", index=False)
    ffn = []
    for model, (ours, pipe) in {"a": (110, 116), "b": (150, 200)}.items():
        for c, us in ((OURS, ours), (TORCH, pipe), ("dense:ffn", 100)):
            ffn.append(dict(base, model=model, load="uniform", contender=c, graph_us=float(us)))
    ffn.append(
        dict(base, model="c", load="uniform", contender="dense:ffn", graph_us=float("nan"), status="wrong")
    )
    pd.DataFrame(ffn).to_csv(tmp_path / "probe_ffn_ceiling.csv", index=False)
    compiled_order_probe(n, tmp_path)
    ffn_ceiling_probe(n, tmp_path)
    got = n.items
    assert (
        got["EEightOrderModel"] == "m"
        and got["EEightOrderTokens"] == "16384"
        and got["EEightOrderRounds"] == "2"
    )
    assert (got["EEightOrderRotateLo"], got["EEightOrderRotateHi"]) == ("0.80", "0.99")
    assert (got["EEightOrderBalancedLo"], got["EEightOrderBalancedHi"]) == ("1.00", "1.02")
    assert got["EEightOrderBalancedFourLo"] == "1.00" and "EEightOrderAfterEagerLo" not in got
    assert (
        got["EEightCeilCells"] == "2"
        and got["EEightCeilModels"] == "2"
        and got["EEightCeilCommit"] == "1234567"
    )
    assert got["EEightCeilPipeVsDenseMin"] == "1.16" and got["EEightCeilPipeVsDenseMinModel"] == "a"
    assert (got["EEightCeilOursVsDenseLo"], got["EEightCeilOursVsDenseHi"]) == ("1.10", "1.50")


def test_rotation_run_numbers_compare_the_same_cells(tmp_path):
    """paper.numbers.e7_tuner.rotation_runs (synthetic test data made here): per experiment, over the cells
    both runs hold, the balanced run's time over the rotated one's for ours and for the peers (geomeans), and
    the rotated run's held-out headline; a cell only one run holds is left out; the current run is not
    read."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e7_tuner import ROTATED_RUNS, rotation_runs

    def e7(torch_us, extra=False):
        cells = [("h", "up", 4096, "uniform", "heldout"), ("t", "up", 4096, "uniform", "tune")]
        if extra:
            cells.append(("h", "down", 4096, "uniform", "heldout"))
        return [
            {
                "model": m,
                "proj": p,
                "tokens": t,
                "load": ld,
                "split": sp,
                "contender": c,
                "status": "ok",
                "graph_us": us,
                "git_commit": "aaaaaaa111",
            }
            for m, p, t, ld, sp in cells
            for c, us in (("ours:auto", 100.0), ("torch._grouped_mm", torch_us))
        ]

    def e8(peer_us):
        return [
            {
                "model": "h",
                "tokens": 16384,
                "load": "uniform",
                "split": "heldout",
                "contender": c,
                "status": "ok",
                "graph_us": us,
                "git_commit": "bbbbbbb222",
            }
            for c, us in (
                ("ours:moe_ffn", 100.0),
                ("torch._grouped_mm pipeline", peer_us),
                ("hf:grouped_mm:compiled", peer_us * 0.9),
            )
        ]

    n = Numbers()
    rotation_runs(n, tmp_path)
    assert not n.items
    for exp, rows_old, rows_new in (("E7", e7(130.0, extra=True), e7(117.0)), ("E8", e8(150.0), e8(135.0))):
        run, balanced, name, _ = ROTATED_RUNS[exp]
        for r, rows in ((run, rows_old), (balanced, rows_new)):
            (tmp_path / "runs" / r).mkdir(parents=True)
            pd.DataFrame(rows).to_csv(tmp_path / "runs" / r / name, index=False)
        pd.DataFrame(rows_old).to_csv(tmp_path / name, index=False)  # a current run: not what is compared
    rotation_runs(n, tmp_path)
    got = n.items
    assert got["RotESevenRun"] == ROTATED_RUNS["E7"][0] and got["RotESevenCommit"] == "aaaaaaa"
    assert got["RotEEightBalanced"] == ROTATED_RUNS["E8"][1]
    assert got["RotESevenOursTime"] == "1.000" and got["RotESevenPeerTime"] == "0.900"
    assert got["RotESevenHeldPrefillVsTorch"] == "1.30"
    assert got["RotEEightOursTime"] == "1.000" and got["RotEEightPeerTime"] == "0.900"
    assert got["RotEEightHeldVsPeer"] == "1.35"
