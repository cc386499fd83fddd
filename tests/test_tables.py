"""Which tuned table serves a GPU (moegemm.tuned.serving): its own, else the nearest card's of its
architecture, else none, and then the first call of a shape times a shortlist; on the CPU, with GPUs
simulated by their traits."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moegemm import autotune, tuned
from moegemm._runtime import GpuTraits, register_traits
from moegemm.decompose_k import DecomposeKConfig, first_call
from moegemm.decompose_k import configs as dk_configs
from moegemm.epilogue import Epilogue
from moegemm.grouped import config as gconfig

HOPPER = GpuTraits(capability=(9, 0), sm_count=132, smem_per_block=232448, memory_gib=79.2)
AMPERE = GpuTraits(capability=(8, 0), sm_count=108, smem_per_block=166912, memory_gib=79.2)


@pytest.fixture
def unseen(monkeypatch):
    """Two GPUs whose names no table holds: a Hopper card and an Ampere card; no table hidden."""
    monkeypatch.delenv("MOEGEMM_HIDE_TABLES", raising=False)
    register_traits("test-unseen-hopper", HOPPER)
    register_traits("test-unseen-ampere", AMPERE)
    return "test-unseen-hopper", "test-unseen-ampere"


def test_every_packaged_table_names_its_hardware():
    """Each slug with a table of any family has its traits in hardware.json, Hopper's among them."""
    hw = tuned.hardware()
    for family in tuned.FAMILIES:
        assert tuned.packaged(family), family
        for slug in tuned.packaged(family):
            assert slug in hw, (family, slug)
    assert all(t.sm_count > 0 and t.smem_per_block > 0 for t in hw.values())
    assert hw["nvidia-h200"].capability == (9, 0)


def test_a_card_is_served_by_its_own_table_else_the_nearest_of_its_architecture(unseen, monkeypatch):
    hopper, ampere = unseen
    for family in tuned.FAMILIES:
        own = tuned.packaged(family)
        for slug in own:
            assert tuned.serving(family, slug) == slug
        # an unseen Hopper card: a Hopper table (the one whose SM count, shared memory and memory are
        # nearest); an unseen Ampere card: none
        got = tuned.serving(family, hopper)
        assert got in own and tuned.hardware()[got].capability == (9, 0)
        want = min(own, key=lambda s: (tuned.distance(HOPPER, tuned.hardware()[s]), s))
        assert got == want
        assert tuned.serving(family, ampere) is None
        assert tuned.serving(family, "a-name-never-met") is None  # no traits: no guess
    # hidden tables serve no card, their own included
    monkeypatch.setenv("MOEGEMM_HIDE_TABLES", "all")
    assert tuned.serving("grouped", "nvidia-h200") is None and tuned.serving("grouped", hopper) is None
    monkeypatch.setenv("MOEGEMM_HIDE_TABLES", " nvidia-h200 ,other")
    assert tuned.hidden() == {"nvidia-h200", "other"}
    assert tuned.serving("grouped", "nvidia-h200") != "nvidia-h200"
    assert tuned.describe("nvidia-h200").keys() == set(tuned.FAMILIES)


def test_nearest_table_prefers_the_closer_card():
    """Distance: across architectures none; else SM count first, shared memory, then memory."""
    near = dataclasses.replace(HOPPER, memory_gib=94.0)
    far = dataclasses.replace(HOPPER, memory_gib=141.0)
    fewer_sms = dataclasses.replace(HOPPER, sm_count=114, memory_gib=80.0)
    assert tuned.distance(HOPPER, AMPERE) is None
    assert tuned.distance(HOPPER, near) < tuned.distance(HOPPER, far) < tuned.distance(HOPPER, fewer_sms)
    assert tuned.distance(HOPPER, HOPPER) == (0.0, 0.0, 0.0)


def test_grouped_choice_on_unseen_cards(unseen):
    """An unseen Hopper card takes the nearest Hopper table's tuned entry and distilled shortlist; an
    unseen Ampere card takes the generic shortlist, several configs to time (source 'generic'), pointer
    loads only, each fitted to its shared memory."""
    hopper, ampere = unseen
    table_slug = tuned.serving("grouped", hopper)
    table = gconfig._tuned_table(table_slug)
    (dt, e, k, n, lay, bucket), cfg = next(iter(table.items()))
    rows = int(max(1, bucket * e))
    assert gconfig.rows_bucket(rows, e) == bucket
    dtype = getattr(torch, dt)
    assert gconfig.choose(rows, k, dtype, hopper, e, n, lay, HOPPER.smem_per_block) == (cfg, "tuned")
    unseen_shape = gconfig.choose(4096, 1000, dtype, hopper, 24, 704, "nk", HOPPER.smem_per_block)
    assert unseen_shape[1] == "default"
    assert unseen_shape[0] == gconfig.fitted_shortlist(4096, 24, 704, hopper, dtype, HOPPER.smem_per_block)[0]
    for rows, e in ((2, 16), (64, 16), (512, 16), (4096, 16), (8192, 8)):
        for dtype in (torch.bfloat16, torch.float32):
            cfg, src = gconfig.choose(rows, 1000, dtype, ampere, e, 704, "nk", AMPERE.smem_per_block)
            short = gconfig.fitted_shortlist(rows, e, 704, ampere, dtype, AMPERE.smem_per_block)
            assert src == "generic" and cfg == short[0] and len(short) >= 3
            assert all(not c.tma for c in short)
            assert all(gconfig.shared_bytes(c, dtype.itemsize) <= AMPERE.smem_per_block for c in short)
            assert short[0] == gconfig.fitted(
                gconfig.heuristic_config(rows, e, 704), dtype, AMPERE.smem_per_block
            )


def test_decompose_k_on_unseen_cards(unseen):
    """Decompose-K: an unseen Hopper card takes the nearest Hopper table's entries ('tuned'); a card no
    table serves gets 'generic', which the plan's first call replaces by the fastest of a shortlist: the
    heuristic's choice first, cuBLAS, then splits and K steps around the heuristic's, each valid."""
    hopper, _ = unseen
    slug = tuned.serving("decompose_k", hopper)
    (dt, m, n, k, epi), (best, per_kernel, _, _) = next(iter(dk_configs._tuned_table(slug).items()))
    got = dk_configs._choose(slug, getattr(torch, dt), m, n, k, Epilogue[epi.upper()], "auto", 132)
    assert got[2] == "tuned"
    for m, n, k in ((16, 16, 8192), (1, 256, 7168), (64, 64, 32768), (512, 256, 7168), (32, 32, 100)):
        src = dk_configs._choose(None, torch.bfloat16, m, n, k, Epilogue.NONE, "auto", 132)
        assert src[2] == "generic"
        short = first_call.shortlist(m, n, k, torch.bfloat16, 132)
        assert short[0] == (src[0], src[1]) and ("cublas", None) in short
        assert len(short) == len(set(short)) >= 2
        for name, cfg in short:
            assert name == "cublas" or (isinstance(cfg, DecomposeKConfig) and 1 <= cfg.split_k <= k)


def test_decompose_k_first_call_times_once_then_keeps(monkeypatch, tmp_path):
    """first_call.choice on a GPU no table serves: times the shortlist once (every candidate run), keeps the
    fastest in memory and on disk; a later call (this process or the next) takes it without timing; where
    the call cannot time, it returns None (the caller keeps the untimed choice and no plan)."""
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(first_call, "gpu_slug", lambda a: "test-unseen-ampere")
    monkeypatch.setattr(first_call, "device_sm_count", lambda a: 108)
    a = torch.empty(16, 8192, dtype=torch.bfloat16)
    ran: list = []

    def make_plan(name, cfg):
        return lambda: ran.append((name, cfg))

    monkeypatch.setattr(autotune, "can_time", lambda x: False)
    assert first_call.choice(a, 16, Epilogue.RELU, False, False, make_plan) is None and ran == []
    monkeypatch.setattr(autotune, "can_time", lambda x: True)
    short = first_call.shortlist(16, 16, 8192, torch.bfloat16, 108)
    pick = len(short) - 1

    def fastest(launch, plans, **kw):
        for p in plans:
            launch(p)
        return plans[pick], {str(i): 1.0 for i in range(len(plans))}

    monkeypatch.setattr(autotune, "fastest", fastest)
    got = first_call.choice(a, 16, Epilogue.RELU, False, False, make_plan)
    assert got == (*short[pick], "autotuned on this call") and ran == short
    ran.clear()
    assert first_call.choice(a, 16, Epilogue.RELU, False, False, make_plan) == (*short[pick], "autotuned")
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    assert first_call.choice(a, 16, Epilogue.RELU, False, False, make_plan) == (*short[pick], "autotuned")
    assert ran == []
    # another epilogue, bias or dtype is another key: timed afresh
    assert first_call.choice(a, 16, Epilogue.NONE, False, False, make_plan)[2] == "autotuned on this call"
    data = json.loads(autotune.cache_file("test-unseen-ampere").read_text())
    assert {e["key"][5] for e in data["entries"]} == {"relu", "none"}


def test_floors_take_each_cards_own_peaks():
    """The floors count the card's own datasheet (the H100's 3.35 TB/s, not the H200's 4.8); a card the
    datasheet table does not know is measured, never given another card's peaks (without a GPU: an error
    naming it)."""
    from experiments.harness.floors import datasheet, gemm_floor_us

    h100, h200 = datasheet("nvidia-h100-80gb-hbm3"), datasheet("nvidia-h200")
    assert (h100["hbm_tb_s"], h200["hbm_tb_s"]) == (3.35, 4.8) and h100["source"] == "datasheet"
    # a memory-bound floor is 4.8 / 3.35 longer on the H100
    ratio = gemm_floor_us(16, 256, 7168, 2, "nvidia-h100-80gb-hbm3", 0.0) / gemm_floor_us(
        16, 256, 7168, 2, "nvidia-h200", 0.0
    )
    assert ratio == pytest.approx(4.8 / 3.35)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no-such-card"):
            datasheet("no-such-card")


def test_the_bound_of_a_cancelling_sum():
    """correctness.check with the terms' magnitudes: an error within the bound of a sum of rounded terms
    passes however the sum cancels; twice the bound, a NaN, or a wrong element fails."""
    from experiments.harness.correctness import OPERAND_ROUNDINGS, UNIT_ROUNDOFF, check

    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(64, 32, generator=g, dtype=torch.float64),
        torch.randn(32, 48, generator=g, dtype=torch.float64),
    )
    ref = a @ b
    mag = a.abs() @ b.abs()
    bound = (OPERAND_ROUNDINGS * UNIT_ROUNDOFF[torch.bfloat16] + 32 * UNIT_ROUNDOFF[torch.float32]) * mag
    sign = torch.where(torch.rand(ref.shape, generator=g) < 0.5, -1.0, 1.0).double()
    assert check((ref + 0.5 * bound * sign).to(torch.bfloat16), ref, 32, magnitude=mag)[0]
    assert not check(
        (ref + (3 * bound + 0.05 * ref.abs()) * sign).to(torch.bfloat16), ref, 32, magnitude=mag
    )[0]
    nan = ref.clone()
    nan[3, 4] = float("nan")
    assert not check(nan.to(torch.bfloat16), ref, 32, magnitude=mag)[0]
    wrong = ref.clone()
    wrong[0, 0] += 10 * mag[0, 0]
    assert not check(wrong.to(torch.bfloat16), ref, 32, magnitude=mag)[0]
