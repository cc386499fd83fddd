"""E10 (experiments/e10_fp8.py): the FP8 grouped GEMM and layer against their peers. On the CPU, under
Triton's interpreter on small shapes: each contender that runs here against float64 on its own dequantised
operands (ours; vLLM's block-FP8 kernel from a synthetic fused_moe-like source of our own, and from vLLM's
source where MOEGEMM_VLLM_SOURCE names it), the checks' teeth, the peers that cannot run here as rows that
say why, the cells and their splits, the rows' columns, and the step's place in the pipeline. On a GPU
(``-m gpu``): the experiment itself on a tiny zoo."""

from __future__ import annotations

import copy
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, HAS_CUDA
from experiments import budget, deepgemm_peer, fp8_peers, fp8_refs, vllm_fp8
from experiments import vllm_moe as vm
from experiments.common import load_config
from experiments.e10_fp8 import annotate, fp8_cells, ordered, phase
from experiments.fp8_cells import BLOCK_NOTE, Unrunnable, block_rows
from tests.fp8_stand_ins import (
    SMALL,
    SYNTHETIC_FP8_UTILS,
    SYNTHETIC_MOE,
    small_cell,
    synthetic_vllm,
    vllm_checks,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEGEMM_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture
def no_peers(monkeypatch):
    for env in ("MOEGEMM_VLLM_SOURCE", "MOEGEMM_TRITON_KERNELS_SOURCE", deepgemm_peer.ENV):
        monkeypatch.delenv(env, raising=False)


# -- the cells, the rows, the pipeline -----------------------------------------------------------------------


def test_cells_are_deepseek_v3_and_the_heldout_models_in_both_phases_and_loads():
    cfg = load_config(ROOT / "experiments" / "config.yaml")
    f, zoo = cfg["fp8"], cfg["grouped"]["models"]
    cells = fp8_cells(cfg)
    models = list(dict.fromkeys(c[0] for c in cells))
    assert models == ["deepseek-v3", *f["heldout_models"]]
    assert set(f["heldout_models"]) <= set(cfg["grouped"]["heldout_models"])
    ds = zoo["deepseek-v3"]  # DeepSeek-V3's experts: gate/up [7168 -> 2 x 2048], down [2048 -> 7168]
    assert (ds["experts"], ds["top_k"], ds["up"], ds["down"]) == (256, 8, [7168, 4096], [2048, 7168])
    assert {zoo[m]["split"] for m in models} == {"tune", "heldout"} and zoo["deepseek-v3"]["split"] == "tune"
    assert all(zoo[m]["split"] == "heldout" for m in models[1:])
    assert {phase(t) for _, _, t, _ in cells} == {"decode", "prefill"}
    assert all((phase(t) == "decode") == (t <= 256) for _, _, t, _ in cells)
    assert {c[1] for c in cells} == {"up", "down", "ffn"} and {c[3] for c in cells} >= {"uniform", "zipf1.2"}
    assert len(cells) == len(set(cells)) == len(models) * len(f["projections"]) * 2 * len(f["loads"])
    # the held-out selection left out: every held-out model; a wrong name refused by its config key
    every = copy.deepcopy(cfg)
    del every["fp8"]["heldout_models"]
    assert {c[0] for c in fp8_cells(every)} == {"deepseek-v3"} | {
        m for m, v in zoo.items() if v["split"] == "heldout"
    }
    bad = copy.deepcopy(cfg)
    bad["fp8"]["heldout_models"] = ["deepseek-v3"]
    with pytest.raises(ValueError, match=r"fp8.heldout_models: not held-out zoo models"):
        fp8_cells(bad)
    bad["fp8"]["heldout_models"], bad["fp8"]["models"] = [], ["no-such-model"]
    with pytest.raises(ValueError, match="fp8.models: not zoo models"):
        fp8_cells(bad)


def test_the_schema_holds_the_phases_and_projections():
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    cfg = load_config(ROOT / "experiments" / "config.yaml")
    schema = yaml.safe_load((ROOT / "experiments" / "config.schema.yaml").read_text())
    for key, bad in (("decode_tokens", [512]), ("prefill_tokens", [256]), ("projections", ["gate"])):
        wrong = copy.deepcopy(cfg)
        wrong["fp8"][key] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_the_step_is_wired_into_the_pipeline_and_its_budget():
    """fp8_grouped -> experiments/e10_fp8.py, a grouped experiment (the grouped tables; one shard per GPU),
    measured on a GPU and in the pipeline's order last; its work in the budget follows its knobs, and stays
    unscaled until a committed run times it."""
    from experiments.pipeline import STEP_ORDER
    from workflow import plan as wp

    assert wp.EXPERIMENTS["fp8_grouped"] == "e10_fp8" and "fp8_grouped" in wp.GROUPED_EXPERIMENTS
    assert STEP_ORDER[-1] == "fp8_grouped"
    doc = (ROOT / "experiments" / "e10_fp8.py").read_text()
    assert "python -m experiments.e10_fp8 --out results/<slug>/fp8_grouped.csv" in doc
    assert "fp8_grouped" in wp.plan(["NVIDIA H200"], "nvidia-h200", ROOT).writeup
    assert "fp8_grouped" in wp.plan(["NVIDIA H200"] * 2, "nvidia-h200", ROOT).sharded
    cfg = load_config(ROOT / "experiments" / "config.yaml")
    w = budget.work(cfg)["fp8_grouped"]
    more = copy.deepcopy(cfg)
    more["fp8"]["decode_tokens"] = [16, 64]
    assert budget.work(more)["fp8_grouped"] > w > 0
    assert budget.scaled_step_times({"fp8_grouped": 300.0}, more) == {"fp8_grouped": 300.0}
    from experiments.schedule import call_order

    assert call_order()[-1] == call_order(remeasure=True)[-1] == "fp8_grouped"


def test_peers_that_cannot_run_here_are_rows_that_say_why(no_peers, cache):
    """With no peer's source named (and torch._scaled_grouped_mm refused by the CPU), each peer is one row
    per cell, status "not runnable", its reason kept; ours are measured. A vLLM source without fp8_utils.py
    is refused by name."""
    peers = fp8_peers.Peers.load(DEVICE)
    assert "MOEGEMM_TRITON_KERNELS_SOURCE" in peers.tk_why and deepgemm_peer.ENV in peers.dg_why
    if not HAS_CUDA:
        assert "torch._scaled_grouped_mm on cpu failed" in peers.torch_why
    if peers.vllm is None:
        assert peers.vllm_why
    cell, w, ref = small_cell("up")
    cs = fp8_peers.gemm_contenders(cell, w, fp8_peers.Peers(**{**vars(peers), "vllm": None}), "unused", ref)
    names = [c.name for c in cs]
    assert names[:3] == ["ours:fp8", "ours:fp8-masked", "ours:bf16"]
    assert set(names[3:]) >= {fp8_peers.VLLM, fp8_peers.TK, fp8_peers.DG_CONTIGUOUS, fp8_peers.DG_MASKED}
    for u in cs[3:]:
        if isinstance(u, Unrunnable):
            row = u.row()
            assert row["status"] == "not runnable" and row["note"].startswith("not runnable: "), row
    vk = vm.load(synthetic_vllm(cache / "nofp8", fp8_utils=False))
    assert vk.fp8_utils is None
    with pytest.raises(ValueError, match="fp8_utils.py"):
        vllm_fp8.load_quant(vk)


def test_rows_carry_the_cells_columns_and_a_peers_format_in_its_note():
    measured = [
        {"contender": "ours:fp8", "status": "ok", "note": "", "graph_us": 10.0, "quant": BLOCK_NOTE},
        {
            "contender": fp8_peers.TORCH,
            "status": "ok",
            "note": "",
            "graph_us": 20.0,
            "quant": fp8_peers.ROWWISE_NOTE,
        },
    ]
    cs = [
        type("C", (), {"name": "ours:fp8"})(),
        Unrunnable(fp8_peers.DG_CONTIGUOUS, "not runnable: no source"),
        type("C", (), {"name": fp8_peers.TORCH})(),
    ]
    rows = ordered(cs, measured)
    assert [r["contender"] for r in rows] == ["ours:fp8", fp8_peers.DG_CONTIGUOUS, fp8_peers.TORCH]
    cell = {
        "experiment": "E10",
        "model": "m",
        "split": "heldout",
        "proj": "down",
        "tokens": 64,
        "phase": "decode",
        "load": "zipf1.2",
        "flops": 2e6,
        "floor_us": 5.0,
    }
    annotate(rows, cell, {"gpu": "g", "git_commit": "c"})
    for r in rows:
        assert {k: r[k] for k in cell} == cell and r["gpu"] == "g" and r["timing_scope"]
    assert rows[0]["tflops_graph"] == 2e6 / 10.0 / 1e6 and rows[0]["pct_floor_graph"] == 50.0
    assert rows[0]["note"] == "" and rows[2]["note"].startswith("e4m3 with row-wise scales")
    assert rows[1]["status"] == "not runnable" and math.isnan(rows[1]["tflops_graph"])
    assert "quantised before timing" in rows[0]["timing_scope"]


# -- the contenders against float64 --------------------------------------------------------------------------


@pytest.mark.parametrize("proj", ["up", "down"])
def test_ours_compute_the_projection_on_their_operands(proj):
    """ours:fp8 (contiguous), ours:fp8-masked and ours:bf16, each through its own check against float64 (its
    dequantised operands; the bf16 rows'), poisoned first; a wrong result (one expert's rows from another's
    weights) and NaN fail the same check."""
    from experiments.fp8_cells import ours_bf16, ours_fp8, ours_fp8_masked

    cell, w, ref = small_cell(proj)
    xq, xscale = block_rows(cell)
    for c in (ours_fp8(cell, w, xq, xscale), ours_fp8_masked(cell, w, xq, xscale), ours_bf16(cell, w, ref)):
        ok, rel, why = c.check(c.bind((0,))())
        assert ok, (c.name, why)
    c = ours_fp8(cell, w, xq, xscale)
    out = c.bind((0,))().clone()
    lo, hi = cell.offsets[0], cell.offsets[1]
    wq, ws = w.q("block")
    other = fp8_refs.rows64("block", xq[lo:hi], xscale[lo:hi]) @ fp8_refs.weights64("block", wq, ws, 1).T
    out[lo:hi] = other.to(out.dtype)
    assert not c.check(out)[0]
    out[0, 0] = float("nan")
    assert c.check(out)[2] == "NaN in output"


# -- vLLM's block-FP8 path -----------------------------------------------------------------------------------


def test_vllm_flags_configs_and_candidates_for_block_fp8(cache):
    names = {"use_fp8_w8a8", "use_int8_w8a8", "HAS_BIAS", "SWAP_AB", "USE_TD", "top_k"}
    flags, why = vm.vllm_flags(names, torch.bfloat16, (9, 0), (16, 64))
    assert flags == {
        "use_fp8_w8a8": True,
        "SWAP_AB": True,
        "use_int8_w8a8": False,
        "HAS_BIAS": False,
        "USE_TD": False,
    }
    assert "SWAP_AB=1" in why and "sm_90" in why
    assert not vm.vllm_flags(names, torch.bfloat16, (9, 0), (64, 128))[0]["SWAP_AB"]
    assert not vm.vllm_flags(names, torch.bfloat16, (10, 0), (16, 64))[0]["SWAP_AB"]  # enable_swap_ab: sm_90
    for rows in (4, 40, 400):
        cs = vm.candidates(rows, block_k=128)
        assert cs and all(c["BLOCK_SIZE_K"] <= 128 for c in cs) and len({str(c) for c in cs}) == len(cs)
    vk = vm.load(synthetic_vllm(cache))
    vk.configs["E=4,N=64,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"] = {
        "8": dict(SMALL)
    }
    got = vm.own_choice(vk, "NVIDIA H200", 4, 64, 256, 128, 2, 10, vllm_fp8.DTYPE, vllm_fp8.BLOCK_SHAPE)
    assert got == (SMALL, "vllm-table(E=4,N=64,dtype=fp8_w8a8,block_shape=[128,128],M=8)")
    cfg, source = vm.own_choice(vk, "NVIDIA H100 80GB HBM3", 4, 64, 256, 128, 2, 10, "fp8_w8a8", [128, 128])
    assert source == "vllm-default" and cfg["BLOCK_SIZE_N"] == 128  # its default for block FP8


def test_vllm_reads_fp8_utils_from_a_tree_and_a_wheel(cache):
    vk = vm.load(synthetic_vllm(cache / "tree"))
    assert "_per_token_group_quant_fp8" in vk.fp8_utils
    whl = cache / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(vm.MODULE, SYNTHETIC_MOE)
        z.writestr(vm.FP8_UTILS, SYNTHETIC_FP8_UTILS)
    assert vm.load(whl).fp8_utils == SYNTHETIC_FP8_UTILS
    qk = vllm_fp8.load_quant(vk)
    text = next((cache / "cache").glob("vllm_fp8_utils_*.py")).read_text()
    assert "def _per_token_group_quant_fp8" in text and "import vllm" not in text
    x = torch.randn(5, 200).to(DEVICE)
    with pytest.raises(ValueError, match="multiple of 128"):
        vllm_fp8.group_quant(qk, x)


def test_vllm_block_fp8_on_a_synthetic_source(cache):
    """The contender's launcher, scales, row-id lists and the layer's glue, on a kernel and a quantiser of our
    own with vLLM's signatures, against float64."""
    vk = vm.load(synthetic_vllm(cache))
    vllm_checks(vk, vllm_fp8.load_quant(vk))


def test_vllm_search_keeps_the_fastest_right_config(cache, monkeypatch):
    """vLLM's config search (GPU clock faked here): its own block-FP8 choice (its default here) and our light
    search's, each checked against float64 and timed; the fastest right one is kept, and the own choice's
    source and time are recorded."""
    from experiments.harness.runner import Settings

    times = iter(range(100, 0, -1))

    class FakeTimer:
        def __init__(self, calls, n):
            self.n = n

        def sample(self, n):
            return [float(next(times))] * n

    monkeypatch.setattr("experiments.harness.timing.GraphTimer", FakeTimer)
    vk = vm.load(synthetic_vllm(cache))
    cell, w, _ = small_cell("up")
    peers = fp8_peers.Peers(vllm=(vk, vllm_fp8.load_quant(vk)))
    m = {"up": [256, 192], "down": [96, 256]}
    got = fp8_peers.vllm_search(cell, w, peers, Settings(calls_per_graph=2), "NVIDIA H200", m)
    assert isinstance(got, dict), got
    tried = vm.candidates(10 / 4, block_k=128)
    assert got["source"] == "search" and got["config"] == tried[-1] and got["tried"] == len(tried) + 1
    assert got["own"] == ("vllm-default", 100.0)


@pytest.mark.skipif(
    not os.environ.get("MOEGEMM_VLLM_SOURCE"), reason="needs MOEGEMM_VLLM_SOURCE (vLLM's source)"
)
def test_vllm_block_fp8_on_its_own_source(cache):
    """vLLM's fused_moe_kernel and _per_token_group_quant_fp8 themselves, as E10 runs them."""
    vk = vm.load(os.environ["MOEGEMM_VLLM_SOURCE"])
    vllm_checks(vk, vllm_fp8.load_quant(vk))


# -- DeepGEMM, torch._scaled_grouped_mm ----------------------------------------------------------------------


def test_deepgemm_layouts_and_why_it_cannot_load(tmp_path, monkeypatch):
    layout, dest, m_pad = deepgemm_peer.contiguous_layout([3, 0, 5], 4, "cpu")
    assert m_pad == 12 and layout.tolist() == [0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1]
    assert dest.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    masked_m, expert, pos = deepgemm_peer.masked_layout([3, 0, 5], 6, "cpu")
    assert masked_m.tolist() == [3, 0, 5] and expert.tolist() == [0, 0, 0, 2, 2, 2, 2, 2]
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="m_max"):
        deepgemm_peer.masked_layout([3, 7], 6, "cpu")
    monkeypatch.delenv(deepgemm_peer.ENV, raising=False)
    assert deepgemm_peer.load() == (None, f"no {deepgemm_peer.ENV} (a DeepGEMM checkout with its submodules)")
    src = tmp_path / "DeepGEMM"
    for f in ("setup.py", "csrc/python_api.cpp", "deep_gemm/__init__.py"):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("")
    dg, why = deepgemm_peer.load(src)
    assert dg is None and "third-party/cutlass/include/cute" in why and "--recursive" in why
    for d in deepgemm_peer.NEEDED[3:]:
        (src / d).mkdir(parents=True)
    dg, why = deepgemm_peer.load(src)
    if not HAS_CUDA:
        assert dg is None and "needs a CUDA GPU" in why
    inner = tmp_path / "repo" / "deepgemm"  # a folder inside another repository: not its commit
    shutil.copytree(src, inner)
    git = ["git", "-C", str(tmp_path / "repo"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    assert deepgemm_peer.revision(inner).startswith("sha256:")
    (src / "REVISION").write_text("abc123\n")
    assert deepgemm_peer.revision(src) == "abc123"


def test_torch_scaled_grouped_mm_is_probed_before_it_is_run(monkeypatch):
    why = fp8_peers.torch_scaled_unfit(DEVICE)
    if not HAS_CUDA:
        assert why.startswith("torch._scaled_grouped_mm on cpu failed: ")
    monkeypatch.delattr(torch, "_scaled_grouped_mm", raising=False)
    assert "has no torch._scaled_grouped_mm" in fp8_peers.torch_scaled_unfit(DEVICE)
    cell, w, _ = small_cell("down")
    u = fp8_peers.torch_scaled(cell, w, fp8_peers.Peers(torch_why="no op"))
    assert isinstance(u, Unrunnable) and u.row()["note"] == "not runnable: no op"


# -- on a GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_e10_runs_on_a_tiny_zoo(tmp_path):
    """The experiment end to end on a GPU, on a tiny zoo of its own: every row a contender's, ours right and
    timed on both clocks, every other either right and timed or a row that says why not."""
    import pandas as pd
    import yaml

    cfg = load_config(ROOT / "experiments" / "config.yaml")
    cfg["grouped"]["models"] = {
        "tiny": {"experts": 8, "top_k": 2, "up": [512, 512], "down": [256, 512], "split": "heldout"}
    }
    cfg["grouped"]["heldout_models"] = ["tiny"]
    cfg["fp8"].update(
        models=["tiny"],
        heldout_models=[],
        decode_tokens=[16],
        prefill_tokens=[1024],
        loads=["uniform"],
        vllm_search=False,
    )
    cfg["fp8"]["timing"] = {
        "rounds": 1,
        "launch_rep_ms": 2,
        "launch_warmup_ms": 1,
        "graph_replays": 2,
        "calls_per_graph": 4,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "fp8_grouped.csv"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    res = subprocess.run(
        [sys.executable, "-m", "experiments.e10_fp8", "--out", str(out), "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    df = pd.read_csv(out)
    assert set(df.proj) == {"up", "down", "ffn"} and set(df.phase) == {"decode", "prefill"}
    ours = df[df.contender.str.startswith("ours:")]
    assert (ours.status == "ok").all(), ours[["contender", "note"]]
    assert (ours.graph_us > 0).all() and (ours.launch_us > 0).all()
    assert set(df.status) <= {"ok", "not runnable", "error", "wrong"}
    assert df[df.status != "ok"].note.notna().all()


@pytest.mark.parametrize("proj", ["up", "down"])
def test_deepgemm_contenders_pass_its_layouts_and_are_checked(proj):
    """DeepGEMM's contiguous and masked contenders against a stand-in of its API (tests/fp8_stand_ins.py):
    the padded layout with -1 on its padding rows, the masked layout with m_max a multiple of 128, the
    activation scales made MN-major and TMA-aligned before the call, each result through its check."""
    from tests.fp8_stand_ins import DeepGemmStandIn

    cell, w, _ = small_cell(proj)
    xq, xscale = block_rows(cell)
    peers = fp8_peers.Peers(dg=deepgemm_peer.DeepGemm(DeepGemmStandIn(), "DeepGEMM stand-in"))
    for masked in (False, True):
        c = fp8_peers.deepgemm(cell, w, peers, xq, xscale, masked)
        ok, rel, why = c.check(c.bind((0,))())
        assert ok, (c.name, why)
        if masked:
            m_max = c.config["m_max"]
            assert m_max % deepgemm_peer.MASKED_M_ALIGN == 0 and m_max >= max(cell.sizes)
        else:
            assert c.config["m_pad"] % 128 == 0
