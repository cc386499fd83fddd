"""workflow/plan.py, what the pipeline runs on a machine: without a GPU the write-up's results are the
committed GPU's, those whose CSV exists; with GPUs every experiment, the grouped ones sharded over several;
the figures drawn and what each reads; what Snakemake says at start. Checked on folders made here."""

from __future__ import annotations

import re
from pathlib import Path

from workflow import plan as wp

ROOT = Path(__file__).resolve().parent.parent


def _results(root: Path, gpu: str, names) -> None:
    (root / "results" / gpu).mkdir(parents=True)
    for n in names:
        (root / "results" / gpu / f"{n}.csv").write_text("x\n")


def test_without_a_gpu_the_write_up_is_what_is_committed(tmp_path):
    _results(tmp_path, "nvidia-h200", ["compile_modes", "decompose_k_grid", "epilogue_fusion"])
    p = wp.plan([], "nvidia-h200", tmp_path)
    assert (p.here, p.res, p.shards, p.sharded) == ("cpu-interpreter", "nvidia-h200", 1, ())
    assert p.writeup == ("compile_modes", "epilogue_fusion", "decompose_k_grid")  # in E1..E9 order
    # a figure is drawn where its results are there; hero without grouped_skew draws the grid alone
    assert p.figures() == [
        "e1_compile_modes",
        "e3_epilogue_fusion",
        "e5_decompose_k_grid",
        "hero",
        "diagram_reduction",
        "diagram_grouped",
    ]
    assert p.figure_data("nvidia-h200", "hero") == ["results/nvidia-h200/decompose_k_grid.csv"]
    assert p.figure_data("g", "e3_epilogue_fusion") == [
        "results/g/epilogue_fusion.csv",
        "results/reference/seed-h100/original_triton/epilogue_relu_bf16.csv",
    ]
    assert p.figure_data("g", "diagram_grouped") == []
    said = p.banner(tex=True)
    assert len(said) == 1 and "no CUDA GPU here" in said[0] and "committed results/nvidia-h200/" in said[0]
    assert "latexmk not found" in p.banner(tex=False)[1]


def test_with_gpus_every_experiment_runs_and_the_grouped_ones_shard(tmp_path):
    one = wp.plan(["NVIDIA H100 80GB HBM3"], "nvidia-h200", tmp_path)  # nothing committed for it: measured
    assert (one.here, one.res, one.shards, one.sharded) == ("nvidia-h100-80gb-hbm3",) * 2 + (1, ())
    assert one.writeup == tuple(wp.EXPERIMENTS)
    assert set(one.figures()) == set(wp.FIGURE_INPUTS)
    assert one.figure_data("r", "hero") == ["results/r/decompose_k_grid.csv", "results/r/grouped_skew.csv"]
    assert "1 GPU(s) found (NVIDIA H100 80GB HBM3)" in one.banner(tex=True)[0]
    four = wp.plan(["NVIDIA H200"] * 4, "nvidia-h200", tmp_path)
    assert (four.shards, four.sharded) == (4, wp.GROUPED_EXPERIMENTS)
    assert set(wp.GROUPED_EXPERIMENTS) | set(wp.SEED_EXPERIMENTS) <= set(wp.EXPERIMENTS)


def test_every_experiment_and_figure_has_its_module():
    for module in wp.EXPERIMENTS.values():
        assert (ROOT / "experiments" / f"{module}.py").is_file(), module
    for fig in wp.FIGURE_INPUTS:
        assert (ROOT / "paper" / "figures" / f"{fig}.py").is_file(), fig
    for refs in wp.FIGURE_REFERENCES.values():
        assert all((ROOT / r).is_file() for r in refs), refs


def test_verify_tests_the_library_and_the_tests(tmp_path):
    for f in ("src/pkg/b.py", "src/pkg/a.py", "tests/test_x.py", "experiments/e.py", "src/pkg/data.json"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    assert wp.source_files(tmp_path) == ["src/pkg/a.py", "src/pkg/b.py", "tests/test_x.py"]


def test_every_rule_has_a_log():
    """Every rule of workflow/rules/ but the target `all` writes a log (logs/...), where its output goes."""
    seen = []
    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        text = smk.read_text()
        starts = [(m.start(), m.group(1)) for m in re.finditer(r"^\s*rule (\w+):", text, flags=re.M)]
        for (at, name), (end, _) in zip(starts, [*starts[1:], (len(text), "")]):
            body = text[at:end]
            assert re.search(r"^\s+log:\n\s+f?\"logs/", body, flags=re.M), f"{smk.name}: {name}: no log"
            seen.append(name)
    assert {"verify", "measure", "merge_shards", "figure", "publish_paper"} <= set(seen), seen
    assert "rule all:" in (ROOT / "Snakefile").read_text()
