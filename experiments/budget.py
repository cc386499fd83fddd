"""The GPU steps' wall times under the current config, estimated from the committed run's.

The committed benchmark files time each step under the config it ran with (``BASELINE``: the knobs each
estimate reads, as they were). A step's estimate is its committed time scaled by its work under the current
config over its work under ``BASELINE``; a step's work is its cells, each weighted by what dominates its cost:
- E1: each (shape, mode), a max-autotune mode 4x a plain one (its autotuning);
- E2, E3: each shape; E4: each (shape, split);
- E5: each (shape, suite), and the compiled contenders' (shape, suite) 8x (a max-autotune compile each);
- tune (Decompose-K): each shape and dtype; tune_seed: each shape and dtype it searches (the seed's own
  search);
- E6: each (epilogue, T), and 4x more where the compiled contenders run (two compiles of tens of seconds);
- tune_grouped: each (model, projection, T, load);
- E7: each cell times its contenders (the per-contender check, compile and timing dominate: its committed run
  spent about 80% of its time outside the timed loops), times the rounds' share;
- E8: the same, per cell;
- E9: each cell, and each model's compiles (moe_train_work);
- E10: each cell times its contenders, and vLLM's config search adds its candidates once per (model,
  projection, T) (fp8_grouped_work).
verify and floors have no knob here and keep their committed times: a test selection's wall time does not
scale with its share of the tests (the workers' start-up and the heaviest tests dominate). An estimate, not a
measurement: the run on the GPU confirms it (the benchmark files it writes become the next baseline).

A step with no committed benchmark file yet may have a run's own record instead (``HARNESS_RECORDS``: the
per-contender wall times that experiments.harness.runner.measure writes, ``setup_s``, ``capture_s``,
``timed_s``); :func:`harness_estimates` prices the step from it, each model's first cell less a later one
being what the model's compiles and autotuning cost once.
"""

from __future__ import annotations

from pathlib import Path

# The knobs of the config the committed step times were measured under.
BASELINE = {
    "compile_shapes": 2,
    "compile_modes": ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
    "codegen_shapes": 4,
    "grid_mn": 4,
    "grid_k": 7,
    "fusion_grid_k": 4,
    "fusion_grid_mn": 4,
    "split_sweep": 13,
    "suites": 4,
    "grid_compiled_suites": 1,
    "grid_compiled_k": 4,
    "grid_compiled_mn": 4,
    "router_tokens": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384],
    "router_tune_tokens": 11,
    "router_compiled_tokens": [1, 4, 16, 64, 256, 1024, 4096],
    "seed_max_tokens": 256,
    "router_epilogues": ["none", "sigmoid"],
    "router_compiled_epilogues": ["none", "sigmoid"],
    "tune_models": 3,
    "grouped_tune_tokens": [1, 8, 64, 256, 1024, 4096],
    "tune_loads": 2,
    # tune_seed: the dtypes it searched on the grid (bf16 alone, before it searched fp32 as well)
    "seed_grid_dtypes": 1,
    # E7 and E8: their work in contender-cells, under the committed run's code and config (grouped_skew_work
    # and moe_layer_work of that config, with the contender lists of that code), and its rounds
    "grouped_skew_work": 990.0,
    "moe_layer_work": 372.0,
    "grouped_rounds": 3,
    # E9: its work (moe_train_work) under the config of its first committed run
    "moe_train_work": 18.0,
    # E10: none yet (no committed run has timed it): its estimate stays unscaled until one has, and this
    # holds the fp8_grouped_work of that run's config
    "fp8_grouped_work": None,
}
# The committed steps' knobs where they differ from BASELINE: {step: those knobs} (the tuners' run and the
# run of verify, floors and E1-E9 behind the committed step times, results/<gpu>/RUNS.md)
STEP_BASELINE = {
    "compile_modes": {
        "compile_shapes": 1,
        "compile_modes": ["default", "max-autotune", "max-autotune-no-cudagraphs"],
    },
    "inductor_codegen": {"codegen_shapes": 2},
    "epilogue_fusion": {"fusion_grid_k": 1, "fusion_grid_mn": 2},
    "split_sweep": {"fusion_grid_k": 1, "fusion_grid_mn": 2, "split_sweep": 8},
    "tune": {"grid_k": 4, "router_tune_tokens": 7},
    "tune_seed": {"grid_k": 4, "router_tokens": [1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 16384]},
    "decompose_k_grid": {"grid_k": 4, "grid_compiled_k": 1, "grid_compiled_mn": 2},
    "router_gemm": {
        "router_tokens": [1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 16384],
        "router_compiled_tokens": [4096],
        "router_epilogues": ["none", "relu", "sigmoid"],
        "router_relu_max_tokens": 256,
        "router_compiled_epilogues": ["sigmoid"],
    },
    "grouped_skew": {"grouped_skew_work": 660.0},
    "moe_layer": {"moe_layer_work": 149.0},
    # E9 under the current selection (two models, one T, both loads)
    "moe_train": {"moe_train_work": 12.0},
}


def step_baseline(step: str) -> dict:
    """The knobs ``step``'s committed time was measured under."""
    return {**BASELINE, **STEP_BASELINE.get(step, {})}


# E7's and E8's share of time in the timed rounds (measured: about 83 of 433 s and 100 of 778 s)
TIMED_SHARE = 0.2
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")


def _compile_work(shapes: int, modes: list[str]) -> float:
    return shapes * sum(4.0 if m in AUTOTUNE_MODES else 1.0 for m in modes)


def _router_work(tokens, compiled, epilogues, relu_max: int | None = None, compiled_epi=None) -> float:
    compiled_epi = [e for e in epilogues if e != "relu"] if compiled_epi is None else compiled_epi
    out = 0.0
    for epi in epilogues:
        for t in tokens:
            if epi == "relu" and relu_max is not None and t > relu_max:
                continue
            out += 1.0 + (4.0 if t in compiled and epi in compiled_epi else 0.0)
    return out


def _tune_grouped_work(models: int, tokens, loads: int) -> float:
    return models * 2 * sum(1 if t == 1 else loads for t in tokens)


def e7_cells(cfg: dict) -> list[tuple[str, str, int, str]]:
    """E7's cells under ``cfg`` (experiments.e7_grouped_skew.e7_cells)."""
    from experiments.e7_grouped_skew import e7_cells as cells

    return cells(cfg)


def grouped_skew_work(cfg: dict) -> float:
    """E7's contender-cells under ``cfg`` with this code's contender lists: a tune-split cell runs ours (auto
    and the two grids), ours with the gather, torch._grouped_mm, vLLM's kernel, triton_kernels, the per-expert
    loop, the memory ceiling (its launch-shape search once per (model, projection, T)), the capacity factors,
    the dense yardstick at the uniform load and the masked kernels at decode; a held-out cell ours:auto,
    ours:default, ours with the gather, torch._grouped_mm, vLLM's and triton_kernels'; a path cell two."""
    g = cfg["grouped"]
    work = 0.0
    for model, proj, t, load in e7_cells(cfg):
        if proj.startswith("path"):
            work += 2
        elif g["models"][model]["split"] == "heldout":
            work += 6
        else:
            work += (
                9 + len(g["capacity_factors"]) + (load == "uniform") + (2 if t in g["decode_tokens"] else 0)
            )
    return work


def moe_layer_cells(cfg: dict) -> list[tuple[str, int, str]]:
    """E8's cells under ``cfg`` (experiments.e8_moe_layer.layer_cells)."""
    from experiments.e8_moe_layer import layer_cells

    return layer_cells(cfg["grouped"], cfg["moe_layer"])


def moe_layer_work(cfg: dict) -> float:
    """E8's contender-cells under ``cfg``: moe_ffn, it without its gathering gate/up and without its decode
    graphs, the unfused composition, our transformers backend, transformers' grouped_mm, the
    torch._grouped_mm pipeline, vLLM's fused_experts, triton_kernels, the per-expert loop, and the two
    compiled backends at the compiled token counts."""
    from experiments.e8_moe_layer import compiled_here, run_selection

    run = run_selection(cfg["moe_layer"])
    host = 0.5 if cfg["moe_layer"].get("host_calls") else 0.0  # the host-cost calls: half a contender's setup
    return sum(
        (10 + 2 * compiled_here(run, m, t)) * (1 + host * (t >= 1024)) for m, t, _ in moe_layer_cells(cfg)
    )


def fp8_grouped_work(cfg: dict) -> float:
    """E10's contender-cells under ``cfg`` with this code's contender lists: a projection's cell runs ours
    (FP8, bf16), vLLM's kernel, torch._scaled_grouped_mm, triton_kernels and DeepGEMM's contiguous GEMM, and
    at decode both masked GEMMs; an FFN cell three layers; vLLM's config search (fp8.vllm_search) tries its
    own config and a light search's, about five candidates, once per (model, projection, T)."""
    from experiments.e10_fp8 import fp8_cells, phase

    f = cfg["fp8"]
    cells = fp8_cells(cfg)
    work = sum(3 if p == "ffn" else 6 + 2 * (phase(t) == "decode") for _, p, t, _ in cells)
    return work + 5.0 * f.get("vllm_search", True) * len({(m, p, t) for m, p, t, _ in cells})


def moe_train_work(cfg: dict, total_bytes: int = 141 << 30) -> float:
    """E9's work under ``cfg``: each cell times its contenders in both phases, and each model's compiled
    contenders compile anew (about four cells' time: two backends, two phases)."""
    from experiments.e9_moe_train import train_cells

    cells = train_cells(cfg["grouped"], cfg["moe_train"], total_bytes)
    return len(cells) + 4.0 * len({m for m, _, _ in cells})


# Steps with no benchmark file yet, and the run whose rows time them (results/<gpu>/<file>)
HARNESS_RECORDS = {"moe_train": "moe_train.csv"}  # its rows' setup, capture and timed wall times


def harness_estimates(results, cfg: dict, total_bytes: int = 141 << 30) -> dict[str, tuple[float, str]]:
    """{step: (estimated seconds, the record it comes from)} for the steps of HARNESS_RECORDS whose record is
    committed: E9 from the wall times of a run's rows, per (model, T, load) cell the sum over its contenders
    and phases; a model's first cell costs its compiles once (first cell less the mean of its later cells),
    every cell the mean later one; under ``cfg``'s selection (e9_moe_train.train_cells). Unsloth's own tuning
    (its rows' first ``setup_s`` of a model, where a run tuned inside E9) is the tune_unsloth step's, once
    per model that Unsloth joins (that model's own where the record has it, else their mean), and not E9's."""
    import pandas as pd

    from experiments.e9_moe_train import run_selection, train_cells, unsloth_joins

    out = {}
    path = Path(results) / HARNESS_RECORDS["moe_train"]
    if not path.exists():
        return out
    df = pd.read_csv(path)
    cols = [c for c in ("setup_s", "capture_s", "timed_s") if c in df]
    wall = df.assign(wall=df[cols].fillna(0).sum(axis=1))
    peer = wall.contender.str.startswith("unsloth")
    per = wall[~peer].groupby(["model", "tokens", "load"], sort=False).wall.sum()
    tunes = {m: float(v) for m, v in wall[peer].groupby("model", sort=False).setup_s.max().dropna().items()}
    firsts, laters = [], []
    for model in dict.fromkeys(m for m, _, _ in per.index):
        measured = per[per.index.get_level_values(0) == model]
        firsts.append(float(measured.iloc[0]))
        laters += [float(v) for v in measured.iloc[1:]]
    if not laters:
        return out
    cell_s = sum(laters) / len(laters)
    model_s = sum(firsts) / len(firsts) - cell_s
    mean_tune = sum(tunes.values()) / len(tunes) if tunes else 0.0
    cells = train_cells(cfg["grouped"], cfg["moe_train"], total_bytes)
    models = list(dict.fromkeys(m for m, _, _ in cells))
    run = run_selection(cfg["moe_train"])
    tune_s = sum(tunes.get(m, mean_tune) for m in models if unsloth_joins(run, m))
    out["moe_train"] = (len(models) * model_s + len(cells) * cell_s, path.name)
    out["tune_unsloth"] = (tune_s, path.name)
    return out


# The steps whose outputs a re-measurement reuses: the tuned tables the library ships (tune, tune_grouped)
# and the configs the peers' own searches chose (tune_seed, tune_unsloth), each committed with its CSV. They
# run where a GPU has none yet, and, forced, where a kernel, their code or the toolchain changed (the
# Snakefile's keep_tuned keeps a re-measurement's newer verify from running them again).
TUNERS = ("tune", "tune_seed", "tune_grouped", "tune_unsloth")


def work(cfg: dict) -> dict[str, float]:
    """Each step's work under ``cfg`` (the units of the module docstring)."""
    d, r, g = cfg["decompose_k"], cfg["decompose_k"]["router"], cfg["grouped"]
    grid = len(d["grid_mn"]) * len(d["grid_k"])
    fusion = len(d.get("fusion_grid_mn", d["grid_mn"])) * len(d.get("fusion_grid_k", d["grid_k"]))
    compiled_k = len(d.get("grid_compiled_k", d["grid_k"]))
    compiled_mn = len(d.get("grid_compiled_mn", d["grid_mn"]))
    rounds = g.get("timing", {}).get("rounds", cfg["timing"]["rounds"])
    round_factor = 1 - TIMED_SHARE + TIMED_SHARE * rounds / BASELINE["grouped_rounds"]
    return {
        "compile_modes": _compile_work(len(d["compile_shapes"]), d["compile_modes"]),
        "inductor_codegen": len(d["codegen_shapes"]),
        "epilogue_fusion": fusion,
        "split_sweep": fusion * len(d["split_sweep"]),
        "decompose_k_grid": grid * len(d["suites"])
        + 8 * compiled_mn * compiled_k * len(d.get("grid_compiled_suites", d["suites"])),
        "tune": 2 * grid + len(r.get("tune_tokens", r["tokens"])),
        "tune_seed": len(d.get("seed_grid_dtypes", ["bfloat16"])) * grid
        + sum(t <= r["seed_max_tokens"] for t in r["tokens"]),
        "router_gemm": _router_work(
            r["tokens"],
            set(r.get("compiled_tokens", r["tokens"])),
            r["epilogues"],
            r.get("relu_max_tokens"),
            r.get("compiled_epilogues"),
        ),
        "tune_grouped": _tune_grouped_work(
            sum(v["split"] == "tune" for v in g["models"].values()),
            g["tune_tokens"],
            len(g.get("tune_loads", ["uniform"])),
        ),
        "grouped_skew": grouped_skew_work(cfg) * round_factor,
        "moe_layer": moe_layer_work(cfg) * round_factor,
        "moe_train": moe_train_work(cfg),
        "fp8_grouped": fp8_grouped_work(cfg) * round_factor if "fp8" in cfg else 0.0,
    }


def baseline_work() -> dict[str, float]:
    """Each step's work under the knobs its committed time was measured under (step_baseline)."""
    every = {step: _work_under(step_baseline(step)) for step in STEP_BASELINE}
    base = _work_under(BASELINE)
    return {step: every.get(step, base)[step] for step in base}


def _work_under(b: dict) -> dict[str, float]:
    grid, fusion = b["grid_mn"] * b["grid_k"], b["fusion_grid_mn"] * b["fusion_grid_k"]
    return {
        "compile_modes": _compile_work(b["compile_shapes"], b["compile_modes"]),
        "inductor_codegen": b["codegen_shapes"],
        "epilogue_fusion": fusion,
        "split_sweep": fusion * b["split_sweep"],
        "decompose_k_grid": grid * b["suites"]
        + 8 * b["grid_compiled_mn"] * b["grid_compiled_k"] * b["grid_compiled_suites"],
        "tune": 2 * grid + b["router_tune_tokens"],
        "tune_seed": b["seed_grid_dtypes"] * grid
        + sum(t <= b["seed_max_tokens"] for t in b["router_tokens"]),
        "router_gemm": _router_work(
            b["router_tokens"],
            set(b["router_compiled_tokens"]),
            b["router_epilogues"],
            b.get("router_relu_max_tokens"),
            b["router_compiled_epilogues"],
        ),
        "tune_grouped": _tune_grouped_work(b["tune_models"], b["grouped_tune_tokens"], b["tune_loads"]),
        "grouped_skew": b["grouped_skew_work"],
        "moe_layer": b["moe_layer_work"],
        "moe_train": b["moe_train_work"],
        "fp8_grouped": b["fp8_grouped_work"],
    }


def scaled_step_times(step_s: dict[str, float], cfg: dict) -> dict[str, float]:
    """The committed step times ``step_s`` ({step: seconds}) scaled to ``cfg`` (steps without a work model
    unchanged)."""
    new, base = work(cfg), baseline_work()
    return {s: sec * (new[s] / base[s] if s in new and base.get(s) else 1.0) for s, sec in step_s.items()}
