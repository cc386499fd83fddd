"""E9 (experiments/e9_moe_train.py) on the CPU under the interpreter: each contender's step computes the
layer's dX (and, in the forward phase, its output) against E9's float64 reference on a tiny zoo-like layer;
the float64 reference against torch's autograd; the Unsloth loader's set-up on a stand-in source tree."""

from __future__ import annotations

import sys

import pytest
import torch

from moegemm._runtime import INTERPRET


@pytest.fixture
def small_tiles(monkeypatch, tmp_path):
    from tests.moe_cells import one_small_config

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    one_small_config(monkeypatch)


def tiny_cell(device):
    import experiments.e8_moe_layer as e8

    e, top_k, t, h, i = 6, 2, 5, 32, 16
    w_gu, w_dn = (w.requires_grad_() for w in e8.ffn_weights(3, e, h, i, device=device))
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:top_k] for _ in range(t)]).to(device)  # 5 idle
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device).requires_grad_()
    wts = torch.softmax(torch.randn(t, top_k, generator=g), -1).to(device).requires_grad_()
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    return e, h, i, ids, x, wts, dy, w_gu, w_dn


def test_e9_reference_matches_autograd(device):
    """ref_step's closed-form float64 dX equals torch's float64 autograd of the layer."""
    import experiments.e8_moe_layer as e8
    import experiments.e9_moe_train as e9

    e, h, i, ids, x, wts, dy, w_gu, w_dn = tiny_cell(device)
    y, dx = e9.ref_step(x, ids, wts, w_gu, w_dn, dy)
    xd = x.detach().double().requires_grad_()
    want = e8.ref_ffn(xd, ids, wts.detach(), w_gu.detach(), w_dn.detach())
    want.backward(dy.double())
    torch.testing.assert_close(y, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, xd.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("phase", ["fwd+bwd", "fwd"])
def test_e9_contenders_compute_the_step(phase, device, small_tiles):
    """E9's contenders (ours in both save modes, the torch._grouped_mm pipeline, transformers' eager loop)
    each give dX (fwd+bwd) or the output (fwd) within the harness's tolerance of float64; each step leaves
    no weight gradient behind, and two steps give the same dX."""
    pytest.importorskip("transformers.integrations.moe")
    import experiments.e9_moe_train as e9
    from experiments.harness.correctness import check

    e, h, i, ids, x, wts, dy, w_gu, w_dn = tiny_cell(device)
    ref_y, ref_dx = e9.ref_step(x, ids, wts, w_gu, w_dn, dy)
    cs = e9.contenders(x, ids, wts, dy, e, phase, ref_y, h + i, compiled=False, uk=None, ref_dx=ref_dx)
    assert [c.name for c in cs] == [
        "ours:moe_ffn",
        "ours:moe_ffn:recompute",
        "torch._grouped_mm pipeline",
        "per-expert-loop",
    ]
    for c in cs:
        call = c.bind((w_gu, w_dn))
        assert c.bind((w_gu, w_dn)) is call  # one call per input set
        out = call()
        ok, rel, why = c.check(out)
        if not ok and INTERPRET and out.dtype == torch.bfloat16:
            # Triton's interpreter casts fp32 to bf16 by truncation (README): each of ours' bf16 stores
            # (the gate/up product, P, dGU) carries up to twice its GPU rounding error there, so the check's
            # budget doubles; on a GPU the harness's own check holds (E9 and -m gpu)
            if phase == "fwd":
                ok, rel, why = check(out, ref_y, h + i, scale=2.0)
            else:
                ok, rel, why = e9.full_check(c.bind, ref_dx, h + i, x, ids, wts, dy, scale=2.0)(out)
        assert ok, (c.name, why)
        assert c.fields["phase"] == phase
        if phase == "fwd+bwd":
            assert w_gu.grad is None and w_dn.grad is None and wts.grad is None
            assert torch.equal(call(), out)


def test_e9_check_catches_a_wrong_weight_gradient(device, small_tiles):
    """A step whose dX is right but one of whose other gradients is wrong (zero for w_gate_up, or missing for
    the gating weights) fails E9's check, naming the gradient; the right step passes."""
    import experiments.e9_moe_train as e9
    from moegemm.grouped import moe_ffn

    e, h, i, ids, x, wts, dy, w_gu, w_dn = tiny_cell(device)
    _, ref_dx = e9.ref_step(x, ids, wts, w_gu, w_dn, dy)

    class NoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return torch.zeros_like(g)

    variants = {
        "right": lambda a, b, w: moe_ffn(x, ids, w, a, b, validate=False),
        "w_gate_up zeroed": lambda a, b, w: moe_ffn(x, ids, w, NoGrad.apply(a), b, validate=False),
        "gating detached": lambda a, b, w: moe_ffn(x, ids, w.detach(), a, b, validate=False),
    }
    for name, fn in variants.items():

        def make(inp, fn=fn):
            return e9.Step(lambda: fn(inp[0], inp[1], wts), (x, wts, *inp), (), dy, "fwd+bwd", weights=inp)

        bind = e9.memo_bind(make)
        out = bind((w_gu, w_dn))()
        scale = 2.0 if INTERPRET else 1.0  # (the interpreter's truncating bf16 casts, as above)
        ok, rel, why = e9.full_check(bind, ref_dx, h + i, x, ids, wts, dy, scale=scale)(out)
        assert ok == (name == "right"), (name, why)
        if name == "w_gate_up zeroed":
            assert "dW_gu" in why, why
        if name == "gating detached":
            assert "gating weights" in why, why
    assert w_gu.grad is None and w_dn.grad is None and wts.grad is None


def test_e9_step_columns_and_fit():
    """fwd+bwd rows count three forwards' FLOPs and floor; the fit rule keeps a small layer's largest T and
    drops a layer whose weights and gradients alone pass 80% of the memory."""
    import math

    import experiments.e9_moe_train as e9

    rows = [
        {"flops": 10.0, "floor_us": 2.0, "graph_us": 6.0},
        {"flops": 10.0, "floor_us": 2.0, "graph_us": math.nan},
    ]
    e9.step_columns(rows)
    assert rows[0]["flops"] == 30.0 and rows[0]["floor_us"] == 6.0 and rows[0]["pct_floor_graph"] == 100.0
    assert math.isnan(rows[1]["tflops_graph"])
    small = {"experts": 128, "top_k": 8, "up": [2048, 1536], "down": [768, 2048]}
    huge = {"experts": 256, "top_k": 8, "up": [7168, 4096], "down": [2048, 7168]}
    gib = 1 << 30
    assert e9.fits(small, 32768, 141 * gib)
    assert not e9.fits(huge, 4096, 40 * gib)


def test_the_pipeline_runs_the_configured_selection_of_cells():
    """train_cells: the run's models (zoo order), T and loads where the step fits; without a run selection
    every zoo model; a model the zoo lacks is refused by name; the budget counts the selection's work."""
    import pytest

    import experiments.e9_moe_train as e9
    from experiments.budget import moe_train_work
    from experiments.common import load_config

    cfg = load_config()
    g, e9cfg = cfg["grouped"], cfg["moe_train"]
    gib = 1 << 30
    run = e9cfg["run"]
    cells = e9.train_cells(g, e9cfg, 141 * gib)
    assert [m for m in g["models"] if m in run["models"]] == list(dict.fromkeys(m for m, _, _ in cells))
    assert {(t, ld) for _, t, ld in cells} <= {(t, ld) for t in run["tokens"] for ld in run["loads"]}
    assert len(cells) == len(run["models"]) * len(run["tokens"]) * len(run["loads"])
    assert moe_train_work(cfg) == len(cells) + 4 * len(run["models"])
    everything = e9.train_cells(g, {k: v for k, v in e9cfg.items() if k != "run"}, 141 * gib)
    assert len(everything) > len(cells) and set(run["models"]) < {m for m, _, _ in everything}
    with pytest.raises(ValueError, match="moe_train.run.models"):
        e9.train_cells(g, {**e9cfg, "run": {"models": ["no-such-model"]}}, 141 * gib)


def test_unsloth_loader_imports_only_the_grouped_gemm_package(tmp_path, monkeypatch):
    """load(): no source -> None with the reason; a tree without the package -> None naming it; a stand-in
    tree with the interface and the tuner's module -> their functions, unsloth's own __init__ never run."""
    import experiments.unsloth_moe as um

    monkeypatch.delenv(um.ENV, raising=False)
    assert um.load()[0] is None and um.ENV in um.load()[1]
    assert um.load(str(tmp_path))[0] is None
    pkg = tmp_path / "unsloth" / "kernels" / "moe" / "grouped_gemm"
    pkg.mkdir(parents=True)
    (tmp_path / "unsloth" / "__init__.py").write_text("raise ImportError('the whole stack')\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "interface.py").write_text(
        "from unsloth import DEVICE_TYPE\ndef grouped_gemm(**kw):\n    return DEVICE_TYPE\n"
    )
    (pkg.parent / "autotune_cache.py").write_text(
        "def get_or_autotune_moe_kernels(**kw):\n    return 'tuned'\n"
    )
    (pkg / "kernels").mkdir()
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "tuning.py").write_text(
        "KernelConfigForward, KernelConfigBackward_dX, KernelConfigBackward_dW = dict, list, tuple\n"
    )
    monkeypatch.setenv("MOEGEMM_UNSLOTH_REVISION", "abc123")
    saved = {k: v for k, v in sys.modules.items() if k == "unsloth" or k.startswith("unsloth.")}
    try:
        for k in saved:
            del sys.modules[k]
        uk, why = um.load(str(pkg))
        assert uk is not None, why
        assert uk.grouped_gemm() == "cuda" and uk.tune() == "tuned"
        assert uk.config_types == (dict, list, tuple)
        assert uk.revision == "abc123"  # (tmp_path is no repository's top)
    finally:
        for k in [k for k in sys.modules if k == "unsloth" or k.startswith("unsloth.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_unsloth_layer_runs_unsloths_training_path():
    """unsloth_moe.moe_layer with a stand-in for Unsloth's interface that computes what its grouped GEMM
    computes (rows gathered by gather_indices // topk under permute_x, scattered back under permute_y):
    the layer against a float64 reference per token on fresh random data; Unsloth's tuner asked once per
    layer shape with the dimensions unsloth_zoo gives it, every GEMM called with autotune=False and the
    tuned configs of its own GEMM; the configs and the tuner's warnings recorded."""
    import dataclasses
    import logging

    import experiments.unsloth_moe as um

    @dataclasses.dataclass
    class Cfg:
        BLOCK_SIZE_M: int
        dtype: object = torch.float64

    tuned, calls = [], []

    def tune(**kw):
        tuned.append(kw)
        logging.getLogger("unsloth.kernels.moe.autotune_cache").warning("fell back to default configs")
        n = kw["intermediate_dim"]
        return Cfg(n), Cfg(n + 1), Cfg(n + 2)

    def gemm(X, W, m_sizes, gather_indices, topk, permute_x, permute_y, **kw):
        calls.append(kw)
        rows = X[gather_indices // topk] if permute_x else X
        out, start = torch.empty(rows.shape[0], W.shape[1], dtype=X.dtype), 0
        for e, end in enumerate(m_sizes.cumsum(0).tolist()):
            out[start:end] = rows[start:end] @ W[e].T
            start = end
        if permute_y:
            scattered = torch.empty_like(out)
            scattered[gather_indices] = out
            out = scattered
        return out

    uk = um.Unsloth(gemm, tune, (Cfg, Cfg, Cfg), "rev", "origin")
    g = torch.Generator().manual_seed(7)
    t, e, k, h, i = 9, 5, 2, 8, 6
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    w_gu = torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64)
    w_dn = torch.randn(e, h, i, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g, dtype=torch.float64), -1)
    record: dict = {}
    got = um.moe_layer(uk, x, ids, wts, w_gu, w_dn, record=record)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for r in range(t):
        for j in range(k):
            gu = w_gu[ids[r, j]] @ x[r]
            ref[r] += wts[r, j] * (w_dn[ids[r, j]] @ (torch.nn.functional.silu(gu[:i]) * gu[i:]))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    common = {"num_experts": e, "top_k": k, "dtype": torch.float64, "force_autotune": False}
    assert tuned == [
        {**common, "hidden_dim": h, "intermediate_dim": 2 * i},
        {**common, "hidden_dim": i, "intermediate_dim": h},
    ]
    assert [c["autotune"] for c in calls] == [False, False]
    assert [c["kernel_config_fwd"].BLOCK_SIZE_M for c in calls] == [2 * i, h]
    assert [c["kernel_config_bwd_dW"].BLOCK_SIZE_M for c in calls] == [2 * i + 2, h + 2]
    assert record["gate_up.dX"] == {"BLOCK_SIZE_M": 2 * i + 1, "dtype": "torch.float64"}
    assert "fell back" in record["tuner_warnings"]
    um.moe_layer(uk, x, ids, wts, w_gu, w_dn)
    assert len(tuned) == 2  # the layer shape's configs kept, as unsloth_zoo keeps them on its module

    # the configs of a tuner run (tune_unsloth's rows) put in place: the layer's first call tunes nothing,
    # and each GEMM runs its own row's configs, rebuilt from their plain data
    import json

    fresh = um.Unsloth(gemm, tune, (Cfg, Cfg, Cfg), "rev", "origin")
    rows = [
        {
            "model": "m",
            "gemm": gemm_name,
            "experts": str(e),
            "hidden": str(h),
            "intermediate": str(i),
            "top_k": str(k),
            "dtype": "float32",
            "status": "ok",
            **{n: json.dumps({"BLOCK_SIZE_M": base + j}) for j, n in enumerate(("fwd", "dX", "dW"))},
            "tuner_warnings": "",
        }
        for gemm_name, base in (("gate_up", 100), ("down", 200))
    ]
    rows.append({**rows[0], "gemm": "down", "experts": str(e + 1)})  # another shape, half of it: not used
    rows.append({**rows[0], "status": "error"})
    assert um.seed_configs(fresh, rows) == 1
    calls.clear()
    x32, ids32 = x.float(), ids
    before = len(tuned)
    um.moe_layer(fresh, x32, ids32, wts.float(), w_gu.float(), w_dn.float())
    assert len(tuned) == before
    assert [c["kernel_config_fwd"].BLOCK_SIZE_M for c in calls] == [100, 200]
    assert [c["kernel_config_bwd_dW"].BLOCK_SIZE_M for c in calls] == [102, 202]


def test_e9_numbers_and_figure_on_a_synthetic_csv(tmp_path):
    """paper.numbers.e9 and paper/figures/e9_moe_train on a moe_train CSV (synthetic test data made here, not
    a measurement): the held-out step against the best peer on both clocks with its interval, the backward
    against the best peer's, the memory against the torch pipeline, recompute over the default (save); the
    table; a figure; no CSV, no numbers."""
    import subprocess
    from pathlib import Path

    import pandas as pd

    from paper.numbers.common import Numbers
    from paper.numbers.e9 import e9

    n = Numbers()
    e9(n, tmp_path, tmp_path)
    assert n.items == {"ENineMeasured": "0"}  # no CSV: only the switch that leaves E9 out of the paper
    step = {
        "ours:moe_ffn": 100.0,
        "ours:moe_ffn:recompute": 110.0,
        "torch._grouped_mm pipeline": 150.0,
        "torch._grouped_mm pipeline:compiled": 140.0,
        "hf:grouped_mm:compiled": 160.0,
        "unsloth:grouped_gemm": 130.0,
        "per-expert-loop": 900.0,
    }
    fwd = {c: v / 3 for c, v in step.items()}
    fwd["ours:moe_ffn"] = 40.0  # ours: backward 60; best peer (unsloth) backward 130 - 43.3
    mem = {c: 2e9 for c in step}
    mem["torch._grouped_mm pipeline"] = 3e9
    rows = []
    for m, s in (("a", "tune"), ("b", "heldout"), ("c", "heldout")):
        for t in (4096, 16384):
            for ld in ("uniform", "zipf1.2"):
                for c in step:
                    for phase, us in (("fwd+bwd", step[c]), ("fwd", fwd[c])):
                        gus = float("nan") if c == "per-expert-loop" else us
                        rows.append(
                            {
                                "model": m,
                                "split": s,
                                "tokens": t,
                                "load": ld,
                                "contender": c,
                                "phase": phase,
                                "status": "ok",
                                "graph_us": gus,
                                "launch_us": us * 1.1,
                                "peak_mem_bytes": mem[c],
                                "gpu": "Test GPU",
                                "torch": "x",
                                "triton": "y",
                            }
                        )
    rows.append({**rows[0], "contender": "unsloth:grouped_gemm", "status": "error", "graph_us": float("nan")})
    pd.DataFrame(rows).to_csv(tmp_path / "moe_train.csv", index=False)
    n = Numbers()
    e9(n, tmp_path, tmp_path)
    assert n.items["ENineMeasured"] == "1"
    assert n.items["ENineHeldModels"] == "2" and n.items["ENineTokens"] == "4096, 16384"
    # the best peer is Unsloth's (130 us) in every held-out cell, on both clocks; one round each
    assert n.items["ENineHeldVsPeerGpu"] == "1.30x [1.30, 1.30]"
    assert n.items["ENineHeldVsPeerLaunch"] == "1.30x [1.30, 1.30]"
    assert n.items["ENineHeldVsPeerMin"] == "1.30"  # the lowest cell, with the headline's estimator
    assert n.items["ENineHeldBwdVsPeer"] == f"{(130 - 130 / 3) / 60:.2f}"
    assert n.items["ENineMemVsTorch"] == "1.50" and n.items["ENineRecomputeOverSave"] == "1.10"
    assert "tab:e9" in (tmp_path / "table_e9.tex").read_text()
    # Unsloth's step never captured (as on the H200): no GPU time; the best peer on that clock is then the
    # compiled pipeline's (140 us), on the launch clock still Unsloth's; the coverage clause names it
    no_graph = pd.DataFrame(rows)
    no_graph.loc[no_graph.contender == "unsloth:grouped_gemm", "graph_us"] = float("nan")
    (tmp_path / "ng").mkdir()
    no_graph.to_csv(tmp_path / "ng" / "moe_train.csv", index=False)
    n = Numbers()
    e9(n, tmp_path / "ng", tmp_path / "ng")
    assert n.items["ENineHeldVsPeerGpu"] == "1.40x [1.40, 1.40]"
    assert n.items["ENineHeldVsPeerLaunch"] == "1.30x [1.30, 1.30]"
    assert n.items["ENineHeldBwdVsPeer"] == f"{(140 - 140 / 3) / 60:.2f}"
    assert "Unsloth's kernels" in n.items["ENineCoverage"]
    assert "launch clock only (no CUDA graph captured its step)" in n.items["ENineCoverage"]
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "paper.figures.e9_moe_train",
            "--results",
            str(tmp_path),
            "--out",
            str(tmp_path / "e9"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "e9.pdf").exists()


def test_e9_is_priced_from_a_partial_runs_record(tmp_path):
    """experiments.budget.harness_estimates on a partial run's record (synthetic test data made here): per
    model, its first cell's contender wall times less a later cell's (the compiles, once) plus every cell's
    later-cell time, under the config's selection; Unsloth's tuning inside a cell priced as the tune_unsloth
    step's, once per model Unsloth joins, and not E9's; no record, no estimate."""
    import pandas as pd

    from experiments.budget import HARNESS_RECORDS, harness_estimates
    from experiments.common import load_config

    cfg = load_config()
    assert harness_estimates(tmp_path, cfg) == {}
    rows = []
    for load, setup in (("uniform", 100.0), ("zipf1.2", 4.0)):  # two contenders, two phases per cell
        for phase in ("fwd+bwd", "fwd"):
            for c in ("a", "b"):
                rows.append(
                    dict(
                        model="m",
                        tokens=16,
                        load=load,
                        phase=phase,
                        contender=c,
                        setup_s=setup / 4,
                        capture_s=0.5,
                        timed_s=0.5,
                    )
                )
    rows.append({**rows[0], "contender": "unsloth:grouped_gemm", "setup_s": 50.0})
    pd.DataFrame(rows).to_csv(tmp_path / HARNESS_RECORDS["moe_train"], index=False)
    priced = harness_estimates(tmp_path, cfg)
    est, record = priced["moe_train"]
    joins = len(cfg["moe_train"]["run"]["unsloth_models"])
    assert priced["tune_unsloth"] == (pytest.approx(50.0 * joins), HARNESS_RECORDS["moe_train"])
    cell_s, first_s = 4.0 + 4.0, 100.0 + 4.0  # per cell: setup + 4 x (capture + timed)
    models = len(cfg["moe_train"]["run"]["models"])
    cells = models * len(cfg["moe_train"]["run"]["tokens"]) * len(cfg["moe_train"]["run"]["loads"])
    assert record == HARNESS_RECORDS["moe_train"]
    assert est == pytest.approx(models * (first_s - cell_s) + cells * cell_s)


def test_unsloths_tuner_step_tunes_the_layer_shapes_e9_gives_unsloth():
    """experiments.tune_unsloth.layer_shapes: the models of E9's run that Unsloth joins, each once, in the
    zoo's order; every one of them, where the run names no Unsloth models."""
    import copy

    from experiments.common import load_config
    from experiments.tune_unsloth import layer_shapes

    cfg = load_config()
    run = cfg["moe_train"]["run"]
    assert layer_shapes(cfg, 141 << 30) == run["unsloth_models"]
    every = copy.deepcopy(cfg)
    del every["moe_train"]["run"]["unsloth_models"]
    assert layer_shapes(every, 141 << 30) == [m for m in cfg["grouped"]["models"] if m in run["models"]]


def test_unsloths_tuner_rows_are_what_e9_reads_back(tmp_path):
    """tune_unsloth.tuned_row written to a CSV and read back as E9 reads it (e9_moe_train.unsloth_tuned):
    both GEMMs of a layer shape in place under the key layer_configs looks up, each config rebuilt from its
    row's JSON; a failed search's row is skipped, so that shape tunes on its first call."""
    import dataclasses

    import pandas as pd

    import experiments.unsloth_moe as um
    from experiments.common import DTYPES, load_config
    from experiments.e9_moe_train import unsloth_tuned
    from experiments.tune_unsloth import DTYPE, tuned_row

    @dataclasses.dataclass
    class Cfg:
        BLOCK_SIZE_M: int
        flatten: bool = True

    cfg = load_config()
    g = cfg["grouped"]["models"]
    up = (Cfg(64), Cfg(128, False), Cfg(32))
    down = (Cfg(16), Cfg(256), Cfg(8, False))
    rows = [
        tuned_row("olmoe-1b-7b", "gate_up", g["olmoe-1b-7b"], up, "fell back"),
        tuned_row("olmoe-1b-7b", "down", g["olmoe-1b-7b"], down, ""),
        tuned_row("phi-3.5-moe", "gate_up", g["phi-3.5-moe"], None, "RuntimeError: out of resources"),
        tuned_row("phi-3.5-moe", "down", g["phi-3.5-moe"], down, ""),
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "tune_unsloth.csv", index=False)
    uk = um.Unsloth(None, None, (Cfg, Cfg, Cfg), "rev", "origin")
    where = unsloth_tuned(uk, tmp_path, "no-such-gpu")
    assert "1 layer shapes" in where
    m = g["olmoe-1b-7b"]
    key = (m["experts"], m["down"][1], m["down"][0], m["top_k"], DTYPES[DTYPE])
    assert set(uk.configs) == {key}
    got_up, got_down, warned = uk.configs[key]
    assert got_up == up and got_down == down and warned == "fell back"
    assert rows[0]["tuner_intermediate"] == 2 * m["down"][0] and rows[1]["tuner_hidden"] == m["down"][0]
    assert unsloth_tuned(um.Unsloth(None, None, (Cfg,) * 3, "r", "o"), tmp_path / "none", "no-such-gpu") == ""
