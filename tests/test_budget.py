"""experiments/budget.py: the GPU steps' times under the current config, from the committed run's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from experiments import budget
from experiments.common import load_config
from paper.numbers.runtime import run_times

ROOT = Path(__file__).resolve().parent.parent


def baseline_config(cfg: dict, step: str) -> dict:
    """The current config with the knobs set back to those ``step``'s committed time was measured under."""
    b, c = budget.step_baseline(step), copy.deepcopy(cfg)
    d, r = c["decompose_k"], c["decompose_k"]["router"]
    d["compile_shapes"] = [[16, 16, 32768]] * b["compile_shapes"]
    d["compile_modes"] = list(b["compile_modes"])
    d["codegen_shapes"] = [[16, 16, 256]] * b["codegen_shapes"]
    d["grid_mn"] = [16] * b["grid_mn"]
    d["grid_k"] = [8192] * b["grid_k"]
    d["fusion_grid_k"] = [8192] * b["fusion_grid_k"]
    d["fusion_grid_mn"] = [16] * b["fusion_grid_mn"]
    d["split_sweep"] = [2] * b["split_sweep"]
    d["seed_grid_dtypes"] = ["bfloat16", "float32"][: b["seed_grid_dtypes"]]
    d["grid_compiled_k"] = [8192] * b["grid_compiled_k"]
    d["grid_compiled_mn"] = [16] * b["grid_compiled_mn"]
    r.update(
        tokens=list(b["router_tokens"]),
        tune_tokens=[1] * b["router_tune_tokens"],
        compiled_tokens=list(b["router_compiled_tokens"]),
        seed_max_tokens=b["seed_max_tokens"],
        epilogues=list(b["router_epilogues"]),
        compiled_epilogues=list(b["router_compiled_epilogues"]),
    )
    if b.get("router_relu_max_tokens") is None:
        r.pop("relu_max_tokens", None)
    else:
        r["relu_max_tokens"] = b["router_relu_max_tokens"]
    c["grouped"]["tune_tokens"] = list(b["grouped_tune_tokens"])
    return c


def test_the_baseline_knobs_give_the_committed_times_back():
    cfg = load_config(ROOT / "experiments" / "config.yaml")
    step_s = {s: 100.0 for s in budget.baseline_work()}
    step_s["verify"] = 50.0
    for step in (
        "compile_modes",
        "inductor_codegen",
        "epilogue_fusion",
        "split_sweep",
        "decompose_k_grid",
        "tune",
        "tune_seed",
        "router_gemm",
        "tune_grouped",
    ):
        got = budget.scaled_step_times(step_s, baseline_config(cfg, step))
        assert got[step] == pytest.approx(100.0), step
        assert got["verify"] == 50.0  # no work model: as measured


def test_work_follows_the_knobs():
    cfg = load_config(ROOT / "experiments" / "config.yaml")
    w = budget.work(cfg)
    more = copy.deepcopy(cfg)
    more["decompose_k"]["router"]["relu_max_tokens"] = 16384
    more["moe_layer"]["run"]["loads"] = ["uniform", "zipf1.2"]
    more["grouped"]["heldout_tokens"] = cfg["grouped"]["heldout_tokens"] + [1024]
    w2 = budget.work(more)
    assert w2["router_gemm"] > w["router_gemm"] and w2["moe_layer"] > w["moe_layer"]
    assert w2["grouped_skew"] > w["grouped_skew"]
    from experiments.e8_moe_layer import run_selection

    run = run_selection(cfg["moe_layer"])
    models = sum(
        v["split"] in run["splits"] and (run["models"] is None or m in run["models"])
        for m, v in cfg["grouped"]["models"].items()
    )
    zipf_t = sum(t not in run["uniform_only_tokens"] for t in run["tokens"])
    assert len(budget.moe_layer_cells(more)) == len(budget.moe_layer_cells(cfg)) + zipf_t * models


@pytest.mark.outputs  # (the committed step times against the config: a config change fails it until they are
# measured again, so the pipeline's verify step, which runs before them, leaves it to CI)
def test_steps_measured_under_this_config_are_predicted_as_measured():
    """The tuners and E1-E9 were last measured under the current config (the budget's step_baseline holds
    their knobs), but for the Decompose-K grid's and the breadth E7-E9 now fix in advance (every held-out
    model in E7 and E8, E7 at four decode T under both loads, E9 on four models at two T): their
    predictions are longer than their committed times, in proportion to their work; the rest are their
    committed times, unscaled. Every step of the committed run has an estimate."""
    cfg = load_config(ROOT / "experiments" / "config.yaml")
    times = run_times(ROOT / "results" / "nvidia-h200")
    measured = dict(zip(times.step, times.seconds))
    step_s = budget.scaled_step_times(measured, cfg)
    assert set(step_s) == set(measured)
    from experiments.pipeline import STEP_ORDER

    # every step with a work model (verify, floors and tune_unsloth have none): the steps that the seed's
    # whole grid (28 shapes, after the committed run's 16) runs are predicted longer, in proportion to their
    # shapes, and so are E7-E9, in proportion to their cells; the others as measured
    grid = ("tune", "tune_seed", "decompose_k_grid")
    breadth = ("grouped_skew", "moe_layer", "moe_train")
    # E10 awaits its first GPU run: no benchmark file, no estimate yet
    assert [s for s in STEP_ORDER if s not in measured] == ["fp8_grouped"]
    for step in [s for s in STEP_ORDER if s in measured and s not in ("verify", "floors", "tune_unsloth")]:
        if step in grid + breadth:
            assert step_s[step] > measured[step] * 1.5, step
        else:
            assert step_s[step] == pytest.approx(measured[step]), step
    work = budget.work(cfg)
    for step in breadth:
        ran = budget.step_baseline(step)[f"{step}_work"]
        assert step_s[step] == pytest.approx(measured[step] * work[step] / ran), step
    # every held-out model of the zoo, in E7 and in E8
    heldout = {m for m, v in cfg["grouped"]["models"].items() if v["split"] == "heldout"}
    assert set(cfg["grouped"]["heldout_models"]) == heldout == set(cfg["moe_layer"]["run"]["models"])


def test_the_runs_refuse_models_outside_their_selection_by_name():
    """E7's held-out selection takes only held-out zoo models, E8's only zoo models: anything else is
    refused with a ValueError naming the config key."""
    cfg = load_config(ROOT / "experiments" / "config.yaml")
    tune = next(m for m, v in cfg["grouped"]["models"].items() if v["split"] == "tune")
    bad = copy.deepcopy(cfg)
    bad["grouped"]["heldout_models"] = [tune]
    with pytest.raises(ValueError, match=rf"grouped.heldout_models: not held-out zoo models: \['{tune}'\]"):
        budget.e7_cells(bad)
    bad = copy.deepcopy(cfg)
    bad["moe_layer"]["run"]["models"] = ["no-such-model"]
    with pytest.raises(ValueError, match="moe_layer.run.models: not zoo models"):
        budget.moe_layer_cells(bad)


def test_peer_selections_of_e8_and_e9_stay_inside_their_runs():
    """E9's Unsloth models and E8's compiled models are models of their runs: by default every one, else
    those named; a name outside the run is refused with a ValueError naming the config key."""
    from experiments.e8_moe_layer import compiled_here
    from experiments.e8_moe_layer import run_selection as e8_run
    from experiments.e9_moe_train import run_selection as e9_run
    from experiments.e9_moe_train import train_cells, unsloth_joins

    cfg = load_config(ROOT / "experiments" / "config.yaml")
    e9 = e9_run(cfg["moe_train"])
    assert [m for m in e9["models"] if unsloth_joins(e9, m)] == e9["unsloth_models"]
    assert all(unsloth_joins({**e9, "unsloth_models": None}, m) for m in e9["models"])
    e8 = e8_run(cfg["moe_layer"])
    t = e8["compiled_tokens"][0]
    assert [m for m in e8["models"] if compiled_here(e8, m, t)] == e8["compiled_models"]
    assert not any(compiled_here(e8, m, 1) for m in e8["models"]) or 1 in e8["compiled_tokens"]
    bad = copy.deepcopy(cfg)
    bad["moe_train"]["run"]["unsloth_models"] = ["mixtral-8x22b"]  # a zoo model outside E9's run
    with pytest.raises(
        ValueError, match=r"moe_train.run.unsloth_models: not E9's models: \['mixtral-8x22b'\]"
    ):
        train_cells(bad["grouped"], bad["moe_train"], 141 << 30)
    bad = copy.deepcopy(cfg)
    bad["moe_layer"]["run"]["compiled_models"] = ["deepseek-v3"]
    with pytest.raises(ValueError, match=r"moe_layer.run.compiled_models: not E8's models"):
        budget.moe_layer_cells(bad)


def test_the_call_plan_keeps_pipeline_order_and_each_call_within_its_deadline():
    """experiments.schedule.call_plan packs the one-GPU run's steps, in order, into device calls of at most
    the deadline; a step longer than the deadline gets a call of its own; the order puts the grouped tuner's
    CPU step before the experiments that read its table."""
    from experiments.schedule import call_order, call_plan

    plan = call_plan({"a": 300, "b": 200, "c": 100, "d": 700, "e": 50}, 550, ["a", "b", "c", "d", "e", "f"])
    assert plan == [[("a", 300), ("b", 200)], [("c", 100)], [("d", 700)], [("e", 50), ("f", 0.0)]]
    assert [s for call in plan for s, _ in call] == ["a", "b", "c", "d", "e", "f"]
    order = call_order()
    assert order.index("tune_grouped") < order.index("distill_grouped") < order.index("grouped_skew")
    assert order[0] == "verify" and order[-1] == "fp8_grouped"
    again = call_order(remeasure=True)
    assert again == [s for s in order if s not in budget.TUNERS + ("distill_grouped",)]
    # with a per-step overhead a call ends sooner: a + b + 2 x 30 > 550
    assert call_plan({"a": 300, "b": 200}, 550, ["a", "b"], 30.0) == [[("a", 300)], [("b", 200)]]


def test_a_superseded_runs_step_times_replace_the_committed_ones(tmp_path):
    """experiments.schedule --times-from RUN: the step times a superseded run (results/<gpu>/runs/<run>/
    benchmarks) recorded, one call's or several calls' sum, as run_times reads them; a run without benchmark
    files is refused, naming the option."""
    from experiments.schedule import superseded_times

    bench = tmp_path / "runs" / "r1" / "benchmarks"
    bench.mkdir(parents=True)
    (bench / "verify.tsv").write_text("s\th:m:s\n300.5\t0:05:00\n")
    (bench / "moe_layer.tsv").write_text("s\th:m:s\n60.0\t0:01:00\n")
    (bench / "moe_layer.calls").write_text("seconds\trc\n200\t124\n70\t0\n")
    assert superseded_times(tmp_path, "r1") == {"verify": 300.5, "moe_layer": 270.0}
    with pytest.raises(SystemExit, match="--times-from"):
        superseded_times(tmp_path, "r2")
