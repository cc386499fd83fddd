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
    assert counts.get("verify") == 1 and counts.get("figure") == 11 and counts.get("numbers") == 1, counts
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
    # E7-E10 as one shard per GPU, merged on the CPU; the other six experiments one job each
    assert (
        counts.get("measure") == 6 and counts.get("measure_shard") == 8 and counts.get("merge_shards") == 4
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
    assert counts.get("measure") == 10 and "measure_shard" not in counts and "merge_shards" not in counts, (
        counts
    )


@in_snakemake_group
def test_the_budgeted_remeasurement_keeps_the_tuners_outputs(tree_copy):
    """The README's re-measurement on the committed GPU (`--forcerun measure verify floors --config
    keep_tuned=1`) runs verify, floors and E1-E10 and no tuner; without keep_tuned a verify run again runs
    every tuner again; on a GPU without tuner outputs keep_tuned still runs them."""
    remeasure = ("-n", "--cores", "1", "--forcerun", "measure", "verify", "floors")
    h200 = {"MOEGEMM_FAKE_GPUS": "NVIDIA H200"}
    tuners = ("tune", "tune_grouped", "tune_seed", "tune_unsloth")
    res = _snake(tree_copy, *remeasure, "--config", "keep_tuned=1", env_extra=h200)
    counts = _job_counts(res.stdout + res.stderr)
    assert res.returncode == 0 and counts.get("measure") == 10 and counts.get("verify") == 1, counts
    assert not any(t in counts for t in tuners), counts
    counts = _job_counts(_snake(tree_copy, *remeasure, env_extra=h200).stdout)
    assert all(counts.get(t) == 1 for t in tuners), counts
    fresh = {"MOEGEMM_FAKE_GPUS": "NVIDIA H100 80GB HBM3"}
    counts = _job_counts(_snake(tree_copy, *remeasure, "--config", "keep_tuned=1", env_extra=fresh).stdout)
    assert all(counts.get(t) == 1 for t in tuners), counts


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
    assert not unquoted_macros(numbers, (tree_copy / "paper" / "paper.tex").read_text())
    log = (pdf.parent / "paper.log").read_text(errors="replace")
    assert "Undefined control sequence" not in log and "There were undefined references" not in log
    assert not re.search(r"LaTeX Warning: (Reference|Citation) .* undefined", log)
    # nothing runs into the margin: a table wider than the text is fitted (report.table's fit) or narrowed
    wide = [float(w) for w in re.findall(r"Overfull \\hbox \(([\d.]+)pt too wide\)", log)]
    assert not [w for w in wide if w > 2.0], wide
    main, appendix = paper_pages((pdf.parent / "paper.aux").read_text())
    assert main <= 8 and appendix <= 8, (main, appendix)
    # the paper rule recorded the PDF's pages beside it (paper/manifest.py pages)
    pages = json.loads((pdf.parent / "pages.json").read_text())
    assert set(pages["labels"]) == {"mainend", "appstart", "paperend"}


def unquoted_macros(numbers: str, paper: str) -> list[str]:
    """The generated macros (numbers.tex) that neither the paper nor the README quotes. The README's are
    paper.numbers.readme.README_MACROS: its block is generated from the same functions, not through LaTeX."""
    from paper.numbers.readme import README_MACROS

    used = set(re.findall(r"\\([A-Za-z]+)", paper))
    defined = re.findall(r"\\newcommand\{\\([A-Za-z]+)\}", numbers)
    assert defined and set(README_MACROS) <= set(defined), set(README_MACROS) - set(defined)
    return sorted(set(defined) - used - set(README_MACROS))


def paper_pages(aux: str) -> tuple[int, int]:
    """(pages of main text, pages of appendix) from the paper's labels: mainend at the end of the
    conclusion, appstart after \\appendix, paperend at the end; the bibliography between counts for
    neither."""
    page = {
        k: int(v)
        for k, v in re.findall(r"\\newlabel\{(mainend|appstart|paperend)\}\{\{[^}]*\}\{(\d+)\}", aux)
    }
    return page["mainend"], page["paperend"] - page["appstart"] + 1


def test_every_generated_macro_is_quoted(tmp_path):
    """paper/make_numbers.py on the committed results defines no macro that neither paper.tex nor the README
    quotes (an unused macro is dead code to keep right), and the README's macros are among those defined.
    On a copy of the results: reading the superseded runs unpacks their archive beside them."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results", results, ignore=shutil.ignore_patterns("runs", "shards"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "paper.make_numbers",
            "--results",
            str(results / "nvidia-h200"),
            "--out",
            str(tmp_path / "generated"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    unused = unquoted_macros(
        (tmp_path / "generated" / "numbers.tex").read_text(), (ROOT / "paper" / "paper.tex").read_text()
    )
    assert not unused, f"generated but quoted nowhere: {unused}"


def test_unquoted_macros_and_page_counts_read_what_they_should():
    """unquoted_macros names a defined macro the paper does not quote, and not one it does; paper_pages
    counts the main text to its last page and the appendix from its first page to the last."""
    numbers = (
        "\\newcommand{\\Used}{1}\n\\newcommand{\\Unused}{2}\n\\newcommand{\\EThreeSingleLaunchGraphCi}{3}\n"
    )
    from paper.numbers.readme import README_MACROS

    numbers += "".join(f"\\newcommand{{\\{m}}}{{x}}\n" for m in README_MACROS)
    assert unquoted_macros(numbers, "text \\Used{} more") == ["Unused"]
    aux = "\\newlabel{mainend}{{13}{8}}\n\\newlabel{appstart}{{13}{11}}\n\\newlabel{paperend}{{D}{18}}\n"
    assert paper_pages(aux) == (8, 8)


def test_figures_refuse_small_print_and_many_panels(tmp_path):
    """paper.figures.common.save: a figure printed at the paper's text width with a font below 7 pt, or with
    more than 4 panels, is refused (naming it); one within both is saved."""
    import matplotlib.pyplot as plt

    from paper.figures import common

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
    smk = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    assert f'container: "docker://{base}"' in smk, "the pipeline's container must be the same image"
    cmd = re.search(r"^CMD\s+\[(.*)\]", docker, flags=re.M).group(1)
    assert [c.strip().strip('"') for c in cmd.split(",")] == ["snakemake", "--cores", "1"]
    readme = (ROOT / "README.md").read_text()
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
    # triton_kernels from that same wheel (fetch_peers.sh unpacks it), and Unsloth at the revision measured
    fetch = 'RUN bash experiments/fetch_peers.sh /opt/peers "$MOEGEMM_VLLM_SOURCE"'
    assert fetch in docker and "unzip" in docker
    assert docker.index("ENV MOEGEMM_VLLM_SOURCE=") < docker.index(fetch)  # the wheel it reads, set before
    assert re.search(r"^ENV MOEGEMM_TRITON_KERNELS_SOURCE=/opt/peers/tk$", docker, flags=re.M)
    from experiments.unsloth_moe import UNSLOTH_COMMIT, UNSLOTH_REPO

    assert f"github.com/{UNSLOTH_REPO} /opt/unsloth" in docker
    assert f"checkout --quiet {UNSLOTH_COMMIT}" in docker
    assert re.search(r"^ENV MOEGEMM_UNSLOTH_SOURCE=/opt/unsloth$", docker, flags=re.M)
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
    """The README's summary table and run times, and docs/results.md's headline block, are what
    paper/make_numbers.py makes of the committed results now."""
    from paper.numbers.readme import README_END, README_START, SUMMARY_END, SUMMARY_START, headline, summary
    from paper.numbers.runtime import RUNTIME_END, RUNTIME_START, runtime_block

    res = ROOT / "results" / "nvidia-h200"
    readme, full = (ROOT / "README.md").read_text(), (ROOT / "docs" / "results.md").read_text()
    fix = (
        "run python -m paper.make_numbers --results results/nvidia-h200 --out "
        "paper/build/nvidia-h200/generated --readme README.md"
    )
    for text, (a, b), want in (
        (readme, (SUMMARY_START, SUMMARY_END), summary(res)),
        (readme, (RUNTIME_START, RUNTIME_END), runtime_block(res)),
        (full, (README_START, README_END), headline(res)),
    ):
        block = text.split(a, 1)[1].split(b, 1)[0].strip()
        assert block == want.strip(), f"{a} differs from results/: {fix}"


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
    assert "5.0 minutes" in text and "Test GPU" in text and "3 of 16" in text and "router_gemm" in text
    assert "budget" not in text  # the breadth is fixed in the config; a long run is split, never cut
    (tmp_path / "benchmarks" / "tune.tsv").write_text("s\th:m:s\tmax_rss\n1000.0\t0:00:00\t1.0\n")
    text = runtime_block(tmp_path)  # 21 minutes in all; a re-measurement's, the tuners reused: 4.4
    assert "21.0 minutes" in text and "(tune)" in text and "**4.4 minutes**;" in text
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
    assert "timed it where it last ran (not all in one run: RUNS.md)" in text  # no output names its commit
    # every step but the tuners at one commit (a CSV's rows, verify.json's provenance): said so
    (tmp_path / "verify.json").write_text('{"provenance": {"gpu": "Test GPU", "git_commit": "abcdef0123"}}')
    for step in ("grouped_skew", "moe_layer"):
        (tmp_path / f"{step}.csv").write_text("git_commit,x\nabcdef0123,1\nabcdef0123,2\n")
    (tmp_path / "tune_decompose_k.csv").write_text("git_commit\n99999999\n")
    assert "timed it (every step but the tuners in one run at abcdef0, the tuners where they last ran: " in (
        runtime_block(tmp_path)
    )
    (tmp_path / "moe_layer.csv").write_text("git_commit,x\nabcdef0123,1\n1111111,2\n")  # rows of two runs
    assert "(not all in one run: RUNS.md)" in runtime_block(tmp_path)
    # rows that name no commit (empty, "unknown"), an empty file, a null commit: no run, never an error
    for bad in ("git_commit,x\n,1\n,2\n", "git_commit,x\nunknown,1\n", ""):
        for step in ("grouped_skew", "moe_layer"):
            (tmp_path / f"{step}.csv").write_text(bad)
        (tmp_path / "verify.json").write_text('{"provenance": {"gpu": "Test GPU", "git_commit": null}}')
        assert "(not all in one run: RUNS.md)" in runtime_block(tmp_path)


def test_headline_names_the_triton_each_result_used(tmp_path):
    """paper.numbers.common.versions_text reads torch and Triton from the CSV rows (synthetic ones here): one
    pair for all, or each pair with the experiments measured with it."""
    import pandas as pd

    from paper.numbers.common import EXPERIMENT_CSVS, versions_text

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
        "torch 2.11.0+cu130, Triton 3.6.0 for E1-E6; torch 2.11.0+cu130, Triton 3.7.1 for E2, E7-E10"
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
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "paper.figures.e7_grouped_skew",
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
    for macro in ("ESevenSkewAlpha", "ESevenPathSpeedup", "ReadTBs"):
        assert f"\\newcommand{{\\{macro}}}" in numbers, macro
    # Zipf 1.2 over uniform per unit of floor (the same floor here), ours the better of the two grids
    df = pd.DataFrame(rows)
    ours = df[df.contender.isin(["ours:contiguous", "ours:persistent"]) & df.proj.isin(["up", "down"])]
    best = ours.groupby(["model", "proj", "tokens", "load"]).graph_us.min().unstack("load")
    pen = (best["zipf1.2"] / best["uniform"]).dropna()
    t = pen.index.get_level_values("tokens")
    for phase, part in (("Decode", pen[t <= 256]), ("Prefill", pen[t >= 1024])):  # each phase apart
        assert len(part), phase
        gm = np.exp(np.log(part).mean())
        assert f"\\newcommand{{\\ESevenSkewPenaltyFloor{phase}}}{{{gm:.2f}}}" in numbers, phase
        assert f"\\newcommand{{\\ESevenSkewPenaltyFloor{phase}Max}}{{{part.max():.2f}}}" in numbers, phase
    assert "\\newcommand{\\ESevenPathT}" in numbers
    assert "ours, tile per program" in (tmp_path / "gen" / "table_e7.tex").read_text()


def test_tuner_feature_numbers_fall_back_to_the_newest_kept_run(tmp_path):
    """paper.numbers.e7_tuner.extra_rows (and tma_splits, the same helper) on synthetic tuner CSVs made here:
    from the current CSV when it timed the feature, else from the newest kept tuner table that did (kept
    tables in numeric order: 10 after 9); nothing where no CSV timed it."""
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
    assert n.items["ExtraWins"] == "1" and n.items["ExtraLo"] == "1.25" and n.items["ExtraHi"] == "1.250"
    csv(tmp_path / "tune_grouped.csv", True, 200.0)
    n = Numbers()
    extra_rows(n, tmp_path)
    assert n.items["ExtraWins"] == "0" and n.items["ExtraHi"] == "0.500"


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
    """figures/README.md has one row per figure the pipeline draws (workflow.plan), naming every CSV it reads
    (with a GPU's full set of results)."""
    from workflow.plan import plan

    entries = plan(["a GPU"], "nvidia-h200", ROOT).figure_inputs()
    index = (ROOT / "figures" / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|[^|]*\|(.*)\|$", index, flags=re.M)}
    assert entries and set(rows) == set(entries), (sorted(rows), sorted(entries))
    for name, inputs in entries.items():
        for csv in inputs:
            assert f"`{csv}.csv`" in rows[name], (name, csv)
        assert (ROOT / "paper" / "figures" / f"{name}.py").exists()


def test_related_work_cites_the_sources_it_builds_on():
    """The paper cites, from paper/references.bib, the sources it builds on and measures against (the seed's
    post and repository, the custom-op autotuning talk, split-K and Stream-K, decoupled look-back, the MoE
    papers behind capacity factors and the router's shape, the MoE kernels and libraries it measures or
    names); every key it cites is in the .bib, every .bib entry is cited, and there are at least 25."""
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
        "stream-k",
        "cutlass-splitk",
        "decoupled-lookback",
        "scattermoe",
        "sonicmoe",
        "triton-kernels",
        "vllm-fused-moe",
        "sglang",
        "tensorrt-llm",
        "flashinfer",
        "gshard",
        "switch",
        "deepseek-v3",
    }
    assert required <= cited, required - cited
    assert cited <= keys, cited - keys
    assert keys <= cited, keys - cited
    assert len(keys) >= 25, len(keys)
    assert "\\bibliography{references}" in tex


def test_abstract_is_at_most_200_words():
    tex = (ROOT / "paper" / "paper.tex").read_text()
    abstract = tex.split("\\begin{abstract}", 1)[1].split("\\end{abstract}", 1)[0]
    words = re.sub(r"\\[A-Za-z]+|[{}$\\]", " ", abstract).split()
    assert len(words) <= 200, len(words)


def test_e8_numbers_and_figure_on_a_synthetic_csv(tmp_path):
    """paper.numbers.e8 and paper/figures/e8_moe_layer on a moe_layer CSV (synthetic test data made here, not
    a measurement): ours against the best peer per phase, the torch._grouped_mm pipeline at decode and vLLM at
    prefill, the fusion's gain; the table; a figure that passes the print check; no CSV, no numbers."""
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
    for phase in ("Decode", "Prefill"):  # each phase apart: 2 models x 2 loads at T = 16, and at 4096
        assert n.items[f"EEight{phase}PeerCells"] == "4" and n.items[f"EEight{phase}SlowerPeer"] == "0"
        # vLLM (110 us) is the fastest peer in every cell: the best peer is vLLM's time
        assert n.items[f"EEight{phase}VsPeerMin"] == "1.10"
        assert n.items[f"EEight{phase}FastestGpu"] == "vLLM's fused\\_experts (4 of 4 cells)"
    assert "EEightDecodeFastestLaunch" not in n.items  # the GPU clock's alone
    # peers tied for the most cells are all named, never the first of a tie alone
    from paper.numbers.e8 import TK, VLLM, most_often

    assert most_often(pd.Series({VLLM: 3, TK: 1}), 4) == "vLLM's fused_experts (3 of 4 cells)"
    tie = most_often(pd.Series({VLLM: 2, TK: 2, "torch._grouped_mm pipeline": 1}), 5)
    assert tie == "triton_kernels or vLLM's fused_experts (2 of 5 cells each)"
    assert n.items["EEightHeldDecodeVsPeerGpu"] == "1.10x [1.10, 1.10] over 4 cells"
    # held-out decode: the pipeline at 130 us over ours at 100 in every cell
    assert n.items["EEightHeldDecodeVsTorchGpu"] == "1.30x [1.30, 1.30] over 4 cells"
    assert n.items["EEightHeldPrefillVsVllmGpu"] == "1.10x [1.10, 1.10] over 4 cells"
    assert n.items["EEightFusionGain"] == "1.20"
    assert "tab:e8" in (tmp_path / "table_e8.tex").read_text()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "paper.figures.e8_moe_layer",
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


def test_ffn_ceiling_numbers_on_a_synthetic_csv(tmp_path):
    """paper.numbers.e8.ffn_ceiling_probe (ours' time over dense:ffn's, its range and the cells) on a
    synthetic CSV made here; a wrong row left out; no CSV, no numbers."""
    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e8 import OURS, TORCH, ffn_ceiling_probe

    n = Numbers()
    ffn_ceiling_probe(n, tmp_path)
    assert not n.items
    base = {"model": "m", "tokens": 16384, "git_commit": "1234567890", "status": "ok"}
    ffn = []
    for model, (ours, pipe) in {"a": (110, 116), "b": (150, 200)}.items():
        for c, us in ((OURS, ours), (TORCH, pipe), ("dense:ffn", 100)):
            ffn.append(dict(base, model=model, load="uniform", contender=c, graph_us=float(us)))
    ffn.append(
        dict(base, model="c", load="uniform", contender="dense:ffn", graph_us=float("nan"), status="wrong")
    )
    pd.DataFrame(ffn).to_csv(tmp_path / "probe_ffn_ceiling.csv", index=False)
    ffn_ceiling_probe(n, tmp_path)
    assert n.items == {
        "EEightCeilCells": "2",
        "EEightCeilOursVsDenseLo": "1.10",
        "EEightCeilOursVsDenseHi": "1.50",
    }


_FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3 as device_pipeline.sh calls it: Snakemake's version, dry run and run of one target; the GPU's slug
if [ "$1" = "-c" ]; then echo test-gpu; exit 0; fi
[ "$1 $2" = "-m snakemake" ] || exit 3
target=${@: -1}
case " $* " in
  *" --version "*) echo 8.0 ;;
  *" -n "*)
    printf 'rule %s:\n    output: results/test-gpu/%s.csv\n' "$target" "$target"
    echo "    reason: forced" ;;
  *)
    echo "start $target gpu=${CUDA_VISIBLE_DEVICES-unset} $(date +%s.%N)" >> "$RUN_LOG"
    sleep 1
    echo "$target" > "results/test-gpu/$target.csv"
    echo "end $target $(date +%s.%N)" >> "$RUN_LOG" ;;
esac
"""
_FAKE_SMI = """#!/usr/bin/env bash
case "$*" in *index*) printf '0\\n1\\n' ;; *) echo "Test GPU, 1, 2, 3, 4, 5" ;; esac
"""


def _device_pipeline(tmp_path, *args, env=None):
    """experiments/device_pipeline.sh in a copy of its folder, with python3 and nvidia-smi stood in for: the
    run log's lines ({target: (gpu, start, end)}), its output and exit code."""
    root = tmp_path / "tree"
    (root / "experiments").mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "device_pipeline.sh", root / "experiments")
    (root / "src" / "moegemm" / "tuned").mkdir(parents=True)
    (root / "results" / "test-gpu").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", _FAKE_PYTHON), ("nvidia-smi", _FAKE_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "run.log"
    log.touch()
    run_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    run_env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RUN_LOG=str(log),
        OUT=str(tmp_path / "out"),
        STATE=str(tmp_path / "state"),
        DEADLINE="60",
        **(env or {}),
    )
    p = subprocess.run(
        ["bash", str(root / "experiments" / "device_pipeline.sh"), *args],
        cwd=root,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    runs: dict = {}
    for line in log.read_text().splitlines():
        word, target, *rest = line.split()
        if word == "start":
            runs[target] = [rest[0].removeprefix("gpu="), float(rest[1]), None]
        else:
            runs[target][2] = float(rest[0])
    return runs, p.stdout + p.stderr, p.returncode


def test_device_pipeline_runs_lanes_at_once_one_gpu_each(tmp_path):
    """`--` splits the targets into lanes: each lane runs its targets in order on its own GPU, the lanes at
    once; the call then saves every lane's results. Without `--`, one lane, the GPU left as it is; more
    lanes than GPUs is refused before any target runs."""
    runs, out, rc = _device_pipeline(tmp_path, "a:1", "b:1", "--", "c:1")
    assert rc == 0, out
    assert {t: r[0] for t, r in runs.items()} == {"a": "0", "b": "0", "c": "1"}, out
    assert runs["a"][2] <= runs["b"][1]  # in order within a lane
    assert runs["c"][1] < runs["a"][2] and runs["a"][1] < runs["c"][2]  # the lanes at once
    assert "[gpu1] === c rc=0" in out and "[gpu0] === b rc=0" in out
    saved = subprocess.run(
        ["tar", "tzf", str(tmp_path / "out" / "results.tgz")], capture_output=True, text=True
    )
    assert {f"results/test-gpu/{t}.csv" for t in "abc"} <= set(saved.stdout.split())
    # CUDA_VISIBLE_DEVICES names the GPUs the lanes take, in order
    runs, out, rc = _device_pipeline(tmp_path / "v", "a", "--", "c", env={"CUDA_VISIBLE_DEVICES": "5,3"})
    assert rc == 0 and {t: r[0] for t, r in runs.items()} == {"a": "5", "c": "3"}, out
    # one lane: as before, the GPU left to the caller
    runs, out, rc = _device_pipeline(tmp_path / "one", "a", "b")
    assert rc == 0 and {t: r[0] for t, r in runs.items()} == {"a": "unset", "b": "unset"}, out
    # three lanes, two GPUs; a target in two lanes; empty lanes are dropped
    runs, out, rc = _device_pipeline(tmp_path / "three", "a", "--", "b", "--", "c")
    assert rc == 2 and runs == {} and "3 lanes but 2 GPUs" in out, out
    runs, out, rc = _device_pipeline(tmp_path / "twice", "a:1", "--", "b", "a+")
    assert rc == 2 and runs == {} and "target a is in two lanes" in out, out
    runs, out, rc = _device_pipeline(tmp_path / "empty", "--", "a", "--", "--", "c", "--")
    assert rc == 0 and {t: r[0] for t, r in runs.items()} == {"a": "0", "c": "1"}, out
