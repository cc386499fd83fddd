"""paper/numbers: the bootstrap interval of headline ratios, the phase split and the parity rule (common.py),
and the reproducibility table's command cell (repro.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from paper.numbers.common import (
    cell_ratios,
    ci_text,
    is_parity,
    paired_rounds,
    phase_headline,
    phase_of,
    ratio_ci,
    round_times,
)


def test_ratio_ci_point_is_the_geomean_of_median_ratios_and_the_interval_holds_it():
    rng = np.random.default_rng(1)
    ours = [rng.uniform(90, 110, 3) for _ in range(20)]
    theirs = [o * 1.5 * rng.uniform(0.97, 1.03, 3) for o in ours]
    point, lo, hi = ratio_ci(theirs, ours)
    want = math.exp(np.mean([math.log(np.median(a) / np.median(b)) for a, b in zip(theirs, ours)]))
    assert point == pytest.approx(want)
    assert lo < point < hi and 1.4 < lo and hi < 1.6
    assert ratio_ci(theirs, ours) == (point, lo, hi)  # fixed seed


def test_ratio_ci_widens_with_noisier_rounds_and_reads_parity_when_it_spans_one():
    rng = np.random.default_rng(2)
    ours = [np.full(3, 100.0) for _ in range(10)]
    tight = [np.full(3, 101.0) for _ in range(10)]
    noisy = [100.0 * rng.uniform(0.8, 1.25, 3) for _ in range(10)]
    _, lo_t, hi_t = ratio_ci(tight, ours)
    p, lo_n, hi_n = ratio_ci(noisy, ours)
    assert hi_t - lo_t < 1e-9 and lo_t > 1.0 and not is_parity(lo_t, hi_t)
    assert hi_n - lo_n > 0.02 and is_parity(lo_n, hi_n)
    assert ci_text(p, lo_n, hi_n).startswith("parity (")
    assert ci_text(1.2345, 1.1, 1.3) == "1.23x [1.10, 1.30]"
    # a bound that rounds to 1.00 shows whether it holds 1.0
    assert ci_text(1.07, 1.0031, 1.11) == "1.07x [1.003, 1.11]"
    assert ci_text(0.95, 0.9, 0.9996) == "0.95x [0.90, 0.999]"
    assert ci_text(1.05, 1.0004, 1.1) == "1.05x [1.001, 1.10]"
    assert ci_text(1.02, 0.999, 1.04).startswith("parity (1.02x [0.999, 1.04]")
    assert ci_text(float("nan"), 0, 0) == "--"
    # an interval over few cells names how many: it is then little more than their range
    assert ci_text(1.2345, 1.1, 1.3, cells=2) == "1.23x [1.10, 1.30] over 2 cells"
    assert ci_text(1.02, 0.99, 1.04, cells=1) == "parity (1.02x [0.99, 1.04] over 1 cell)"
    assert ci_text(1.2345, 1.1, 1.3, cells=5) == ci_text(1.2345, 1.1, 1.3) == "1.23x [1.10, 1.30]"
    from paper.numbers.common import ratio_ci_text

    two = [np.array([2.0, 2.1, 1.9]), np.array([3.0, 3.2])]
    ones = [np.array([1.0, 1.0]), np.array([1.0])]
    assert ratio_ci_text(two, ones) == ci_text(*ratio_ci(two, ones), cells=2)
    assert ratio_ci_text(two, ones).endswith(" over 2 cells")


def test_ratio_ci_takes_cells_of_one_round_and_leaves_out_empty_or_bad_ones():
    theirs = [np.array([200.0]), np.array([300.0]), np.array([]), np.array([np.nan, 50.0])]
    ours = [np.array([100.0]), np.array([100.0]), np.array([100.0]), np.array([50.0])]
    point, lo, hi = ratio_ci(theirs, ours)
    assert point == pytest.approx((2.0 * 3.0 * 1.0) ** (1 / 3))
    assert 1.0 - 1e-9 <= lo <= point <= hi <= 3.0 + 1e-9
    assert all(math.isnan(v) for v in ratio_ci([np.array([])], [np.array([1.0])]))
    with pytest.raises(ValueError):
        ratio_ci([np.array([1.0])], [])


def test_phase_of_splits_decode_and_prefill_and_leaves_the_middle_out():
    assert phase_of([1, 256, 512, 1024, 16384]).tolist() == ["decode", "decode", "", "prefill", "prefill"]


def _csv(rounds: bool) -> pd.DataFrame:
    """A synthetic E8-style CSV: theirs 2x ours at decode, equal at prefill, with or without per-round
    times."""
    rows = []
    rng = np.random.default_rng(3)
    for model in ("a", "b", "c"):
        for t in (1, 64, 4096, 16384):
            for c, f in (("ours", 1.0), ("peer", 2.0 if t <= 256 else 1.0)):
                r = 100.0 * f * rng.uniform(0.95, 1.05, 3)
                med = float(np.median(r))
                row = {
                    "model": model,
                    "tokens": t,
                    "load": "uniform",
                    "contender": c,
                    "status": "ok",
                    "graph_us": med,
                    "launch_us": med + 20,
                    "cpu_us": 10.0 * f,
                }
                if rounds:
                    row["graph_round_us"] = ";".join(f"{v:.3f}" for v in r)
                    row["launch_round_us"] = ";".join(f"{v + 20:.3f}" for v in r)
                rows.append(row)
    rows.append(
        {
            "model": "a",
            "tokens": 1,
            "load": "zipf",
            "contender": "peer",
            "status": "error",
            "graph_us": float("nan"),
            "launch_us": float("nan"),
        }
    )
    return pd.DataFrame(rows)


@pytest.mark.parametrize("rounds", [True, False])
def test_phase_headline_on_a_synthetic_csv_with_and_without_rounds(rounds, tmp_path):
    path = tmp_path / "moe_layer.csv"
    _csv(rounds).to_csv(path, index=False)
    df = pd.read_csv(path)
    keys = ["model", "tokens", "load"]
    ta, _, cells = paired_rounds(df, keys, "peer", "ours")
    assert len(cells) == 12 and all(len(a) == (3 if rounds else 1) for a in ta)
    dec, pre = phase_headline(df, keys, "peer", "ours")
    assert dec["phase"] == "decode" and dec["graph_cells"] == 6 and dec["launch_cells"] == 6
    assert 1.8 < dec["graph"][1] <= dec["graph"][0] <= dec["graph"][2] < 2.2
    assert not is_parity(*dec["graph"][1:])
    assert is_parity(*pre["graph"][1:]) and is_parity(*pre["launch"][1:])
    assert dec["launch"][0] < dec["graph"][0]  # the launch clock adds the same overhead to both
    assert dec["host_theirs_us"] == 20.0 and dec["host_ours_us"] == 10.0


def test_round_times_reads_the_round_column_else_the_median():
    assert round_times(pd.Series({"graph_us": 5.0, "graph_round_us": "4;6;nan"})).tolist() == [4.0, 6.0]
    assert round_times(pd.Series({"graph_us": 5.0, "graph_round_us": float("nan")})).tolist() == [5.0]
    assert round_times(pd.Series({"graph_us": float("nan")})).size == 0


def test_a_headline_point_takes_each_cells_time_as_its_row_states_it():
    """Rows with rounds: the point is the geomean of the rows' own times (what the tables show), not of their
    median rounds; the interval still resamples the rounds. Plain arrays (no row): their median rounds."""
    theirs = [round_times(pd.Series({"graph_us": 12.0, "graph_round_us": "10;11;15"}))]
    ours = [round_times(pd.Series({"graph_us": 8.0, "graph_round_us": "9;10;10"}))]
    assert cell_ratios(theirs, ours) == [pytest.approx(1.5)]
    assert ratio_ci(theirs, ours)[0] == pytest.approx(1.5)
    assert cell_ratios([np.array([10.0, 11.0, 15.0])], [np.array([9.0, 10.0, 10.0])]) == [pytest.approx(1.1)]
    # a selection of the rounds keeps the row's time; arithmetic and reductions give plain values
    r = theirs[0]
    assert r[r > 10.5].time == 12.0 and type(r * 2) is np.ndarray and type(np.median(r)) is not type(r)
    # a row without its own time (a CSV cell left empty): its median round
    bare = [round_times(pd.Series({"graph_us": float("nan"), "graph_round_us": "10;11;15"}))]
    assert cell_ratios(bare, ours) == [pytest.approx(11.0 / 8.0)]


def test_e8_phase_rows_take_the_fastest_peer_per_cell_and_clock():
    from paper.numbers.e8 import BEST, OURS, TORCH, VLLM, phase_rows

    rows = []
    for model in ("a", "b"):
        for t in (1, 16, 4096):
            vllm_us = 120.0 if t <= 256 else 300.0
            for c, g, la in ((OURS, 100.0, 150.0), (TORCH, 200.0, 210.0), (VLLM, vllm_us, 130.0)):
                rows.append(
                    {
                        "model": model,
                        "tokens": t,
                        "load": "uniform",
                        "contender": c,
                        "status": "ok",
                        "graph_us": g,
                        "launch_us": la,
                        "graph_round_us": f"{g};{g};{g}",
                        "launch_round_us": f"{la};{la};{la}",
                    }
                )
    out = {(r["theirs"], r["phase"]): r for r in phase_rows(pd.DataFrame(rows))}
    assert out[(BEST, "decode")]["graph"][0] == pytest.approx(1.2)  # vLLM, the faster peer at decode
    assert out[(BEST, "prefill")]["graph"][0] == pytest.approx(2.0)  # torch's pipeline at prefill
    assert out[(BEST, "decode")]["launch"][0] == pytest.approx(130 / 150)  # vLLM on the launch clock
    assert out[(VLLM, "prefill")]["graph"][0] == pytest.approx(3.0)
    assert out[(BEST, "decode")]["graph_cells"] == 4 and out[(BEST, "prefill")]["graph_cells"] == 2


def test_e7_phase_numbers_compare_each_peer_with_ours_on_its_own_work():
    """A peer whose timed call gathers its rows (its timing_scope says so) is compared with ours and its
    gather timed, projection by projection: vLLM's kernel on both, triton_kernels on gate/up only (its down
    projection is timed without its scatter, so against ours on rows already permuted)."""
    from paper.numbers.common import Numbers
    from paper.numbers.e7 import e7_phase_numbers

    gathers = "gather fused in the GEMM (rows read by id)"
    rows = []
    for proj in ("up", "down"):
        for t in (8, 4096):
            for c, g, scope in (
                ("ours:auto", 100.0, "GEMM on rows already permuted"),
                ("ours:auto+gather", 110.0, "our gather kernel + GEMM"),
                ("torch._grouped_mm", 150.0, "GEMM on rows already permuted"),
                ("vllm:fused_moe", 110.0, gathers),
                # the same work as ours on each projection: parity, if each is matched right
                (
                    "tk:matmul_ogs",
                    110.0 if proj == "up" else 100.0,
                    gathers if proj == "up" else "no scatter",
                ),
            ):
                rows.append(
                    {
                        "model": "m",
                        "proj": proj,
                        "tokens": t,
                        "load": "uniform",
                        "contender": c,
                        "timing_scope": scope,
                        "status": "ok",
                        "graph_us": g,
                        "launch_us": g + 5,
                        "graph_round_us": f"{g};{g * 1.01}",
                        "launch_round_us": f"{g + 5};{g + 6}",
                    }
                )
    n = Numbers()
    out = e7_phase_numbers(n, pd.DataFrame(rows), prefix="Test")
    assert {(r["theirs"], r["ours"]) for r in out} == {
        ("torch._grouped_mm", "ours:auto"),
        ("vllm:fused_moe", "ours:matched"),
        ("tk:matmul_ogs", "ours:matched"),
    }
    assert n.items["TestDecodeVsTorchGpu"].startswith("1.50x")
    assert n.items["TestPrefillVsVllmGpu"].startswith("parity (1.00x")
    # triton_kernels' down against ours with the gather would read 100/110: 0.95x over both projections
    assert n.items["TestPrefillVsTkGpu"].startswith("parity (1.00x"), n.items["TestPrefillVsTkGpu"]
    assert n.items["TestDecodeVsTkGpu"].startswith("parity (1.00x"), n.items["TestDecodeVsTkGpu"]
    # macros only for the peers asked for; the rows for every peer measured
    n = Numbers()
    assert len(e7_phase_numbers(n, pd.DataFrame(rows), prefix="Test", tags=("Torch",))) == len(out)
    assert sorted(n.items) == [
        "TestDecodeVsTorchGpu",
        "TestDecodeVsTorchLaunch",
        "TestPrefillVsTorchGpu",
        "TestPrefillVsTorchLaunch",
    ]


def test_runner_records_each_rounds_median_for_the_intervals(monkeypatch):
    """runner.measure writes <clock>_round_us: one median per round, in round order (launch samples faked:
    round r's samples are r + 1 and r + 3, so its median is r + 2); round_times reads them back."""
    import torch

    from experiments.harness import runner

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = iter(range(1000))

    def fake_launch(fn, rep_ms, warmup_ms):
        fn()
        r = next(calls)
        return [r + 1.0, r + 3.0]

    monkeypatch.setattr(runner, "launch_samples", fake_launch)
    c = runner.Contender(
        "A", lambda inp: lambda: torch.zeros(1), graph=False, check=lambda out: (True, 0.0, "")
    )
    (row,) = runner.measure([c], [()], torch.zeros(1), 1, runner.Settings(rounds=3))
    assert row["launch_round_us"] == "2.0000;3.0000;4.0000"
    assert round_times(pd.Series(row), "launch").tolist() == [2.0, 3.0, 4.0]
    assert row["graph_round_us"] == ""  # no graph clock for this contender


def test_repro_commands_break_at_spaces_to_keep_the_table_in_the_text_width():
    """The reproducibility table's command cell: a short command is one typewriter cell; a long one is a
    stack of lines of at most the width, broken at spaces, its words kept whole and in order."""
    from paper.numbers.repro import command_cell

    assert command_cell("experiments.e7_grouped_skew") == r"\texttt{experiments.e7\_grouped\_skew}"
    cmd = "probes.probe_backward --pieces dswiglu --steps --configs separate 128x256x64/w8s3e4 auto"
    cell = command_cell(cmd, width=38)
    assert cell.startswith(r"\shortstack[l]{") and cell.endswith("}")
    lines = [
        ln.removeprefix(r"\texttt{").removesuffix("}")
        for ln in cell[len(r"\shortstack[l]{") : -1].split(r"\\")
    ]
    assert len(lines) == 3 and all(len(ln.replace("\\_", "_")) <= 38 for ln in lines)
    assert " ".join(ln.replace("\\_", "_") for ln in lines) == cmd


def _fp8_csv(path) -> None:
    """A synthetic E10 CSV: two held-out models and DeepSeek-V3, each GEMM and the layer, a decode and a
    prefill T under two loads; vLLM 1.5x ours everywhere, DeepGEMM 0.8x at prefill, our bf16 path 2x at
    prefill; DeepGEMM's masked GEMM 1.25x our masked one at decode; a peer that could not run."""
    rng = np.random.default_rng(3)
    rows = []
    for model, split in (("m1", "heldout"), ("m2", "heldout"), ("deepseek-v3", "tune")):
        for proj in ("up", "down", "ffn"):
            for t in (64, 4096):
                for load in ("uniform", "zipf1.2"):
                    if proj == "ffn":
                        who = {
                            "ours:moe_ffn-fp8": 1.0,
                            "vllm:fused_experts-fp8": 1.5,
                            "ours:moe_ffn-bf16": 2.0,
                        }
                    else:
                        who = {
                            "ours:fp8": 1.0,
                            "vllm:fused_moe-fp8": 1.5,
                            "deepgemm:contiguous": 0.8 if t >= 1024 else 1.1,
                            "ours:bf16": 2.0 if t >= 1024 else 1.2,
                        }
                        if t <= 256:
                            who |= {"ours:fp8-masked": 1.0, "deepgemm:masked": 1.25}
                    for c, f in who.items():
                        r = 100.0 * f * rng.uniform(0.97, 1.03, 3)
                        rows.append(
                            {"model": model, "split": split, "proj": proj, "tokens": t, "load": load,
                             "contender": c, "status": "ok", "graph_us": float(np.median(r)),
                             "launch_us": float(np.median(r)) + 10,
                             "graph_round_us": ";".join(f"{v:.3f}" for v in r),
                             "launch_round_us": ";".join(f"{v + 10:.3f}" for v in r), "note": ""}
                        )  # fmt: skip
                    if proj != "ffn":
                        rows.append(
                            {"model": model, "split": split, "proj": proj, "tokens": t, "load": load,
                             "contender": "tk:matmul_ogs-fp8", "status": "not runnable",
                             "note": "no MOEGEMM_TRITON_KERNELS_SOURCE"}
                        )  # fmt: skip
    pd.DataFrame(rows).to_csv(path, index=False)


def test_e10_numbers_per_part_phase_split_and_peer(tmp_path):
    """E10's numbers from a synthetic CSV: each peer's time over ours per part (GEMM, layer, masked GEMM),
    phase and clock, held-out models and DeepSeek-V3 apart; the peer that could not run named with why;
    our cells counted; the table written. No CSV: no numbers."""
    from paper.numbers.common import Numbers
    from paper.numbers.e10 import e10

    n = Numbers()
    e10(n, tmp_path, tmp_path)
    assert n.items == {}
    _fp8_csv(tmp_path / "fp8_grouped.csv")
    e10(n, tmp_path, tmp_path)
    it = n.items
    # per model and load: each GEMM at decode (contiguous and masked) and prefill, the layer at both T
    assert it["ETenOursCells"] == str(3 * 2 * (2 * (2 + 1) + 2)) == it["ETenOursPassed"]
    assert it["ETenUnrunnable"] == "tk:matmul\\_ogs-fp8: no MOEGEMM\\_TRITON\\_KERNELS\\_SOURCE"

    def point(name: str) -> float:
        return float(it[name].removeprefix("parity (").split("x")[0])

    assert point("ETenHeldGemmPrefillVsVllmGpu") == pytest.approx(1.5, rel=0.03)
    assert point("ETenHeldGemmPrefillVsDeepgemmContiguousGpu") == pytest.approx(0.8, rel=0.03)
    assert point("ETenHeldGemmPrefillVsBfGpu") == pytest.approx(2.0, rel=0.03)
    assert point("ETenDsvLayerDecodeVsVllmGpu") == pytest.approx(1.5, rel=0.03)
    assert "over 2 cells" in it["ETenDsvLayerDecodeVsVllmGpu"]  # one model, two loads: its cells named
    assert point("ETenHeldMaskedDecodeVsDeepgemmMaskedGpu") == pytest.approx(1.25, rel=0.03)
    assert "ETenHeldMaskedPrefillVsDeepgemmMaskedGpu" not in it  # the masked layout is decode's
    assert not any("VsTk" in k for k in it)  # no row of a peer that did not run
    assert point("ETenHeldGemmDecodeVsVllmLaunch") < point("ETenHeldGemmDecodeVsVllmGpu")
    tex = (tmp_path / "table_e10.tex").read_text()
    assert "DeepSeek-V3" in tex and "held-out models" in tex and "DeepGEMM masked" in tex
