"""paper/numbers/probes.py on synthetic probe CSVs made here (no measured data): each probe's numbers, and
none before its CSV exists."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.probe  # the probes' own tests (the pipeline runs no probe)


def _probe_numbers(tmp_path, numbers, csv_name: str, times: dict, failed: tuple) -> dict:
    """A probe's numbers (``numbers(n, results)``) from a synthetic probe CSV: one ok row per (cell,
    contender) of ``times`` ({(model, proj, T, load): {contender: us}}) and a failed row for ``failed``
    ((model, proj, T, load, contender)), all at one made-up commit; checked to give no numbers before the CSV
    exists."""
    import pandas as pd

    from paper.numbers.latex import Numbers

    rows = [
        {
            "model": m,
            "proj": p,
            "tokens": t,
            "load": ld,
            "contender": c,
            "status": "ok",
            "graph_us": float(us),
        }
        for (m, p, t, ld), cs in times.items()
        for c, us in cs.items()
    ]
    rows.append(
        dict(
            zip(("model", "proj", "tokens", "load", "contender"), failed),
            status="wrong",
            graph_us=float("nan"),
        )
    )
    for r in rows:
        r["git_commit"] = "abcdef0123"
    n = Numbers()
    numbers(n, tmp_path)
    assert not n.items
    pd.DataFrame(rows).to_csv(tmp_path / csv_name, index=False)
    numbers(n, tmp_path)
    return n.items


def test_gluon_probe_numbers_on_a_synthetic_csv(tmp_path):
    """paper.numbers.probes.gluon_probe on a probe CSV (synthetic test data made here): per cell the faster of
    our grids against the fastest Gluon config (a failed Gluon row left out): geomean, lowest and highest of
    the Gluon kernel's speed over ours; no CSV, no numbers."""
    from paper.numbers.probes import gluon_probe

    times = {
        ("m", "up", 1024, "uniform"): {
            "ours:contiguous": 100,
            "ours:persistent": 110,
            "gluon-ws:n256-s4": 125,
            "gluon-ws:pingpong-n128-s6": 200,
            "torch._grouped_mm": 150,
        },
        ("m", "up", 4096, "uniform"): {
            "ours:contiguous": 120,
            "ours:persistent": 100,
            "gluon-ws:n256-s4": 125,
            "gluon-ws:pingpong-n128-s6": 80,
            "torch._grouped_mm": 100,
        },
    }
    got = _probe_numbers(
        tmp_path,
        gluon_probe,
        "probe_gluon_prefill.csv",
        times,
        ("m", "up", 4096, "uniform", "gluon-ws:n128-s6"),
    )
    assert got == {"GluCells": "2", "GluVsOurs": "1.00", "GluVsOursLo": "0.80", "GluVsOursHi": "1.25"}


def test_stream_k_numbers_on_a_synthetic_csv(tmp_path):
    """paper.numbers.probes.stream_k_probe on a probe CSV (synthetic test data made here): whole against dealt
    for each tile shape and cell (a failed row left out): the pairs, how many dealing won, the geomean; no
    CSV, no numbers."""
    from paper.numbers.probes import stream_k_probe

    times = {
        ("m", "up", 1024, "uniform"): {
            "tuned": 90,
            "stream-k:a": 100,
            "whole:a": 80,
            "stream-k:b": 120,
            "whole:b": 132,
        },
        ("m", "up", 1024, "zipf1.2"): {
            "tuned": 100,
            "stream-k:a": 125,
            "whole:a": 100,
            "stream-k:b": 200,
            "whole:b": 100,
        },
    }
    got = _probe_numbers(
        tmp_path, stream_k_probe, "probe_stream_k.csv", times, ("m", "up", 4096, "uniform", "stream-k:a")
    )
    # whole over dealt: 0.8 and 1.1 in the first cell, 0.8 and 0.5 in the second
    assert got == {
        "StreamKWins": "1",
        "StreamKPairs": "4",
        "StreamKVsWhole": f"{(0.8 * 1.1 * 0.8 * 0.5) ** 0.25:.2f}",
    }


def test_power_numbers_on_a_synthetic_csv(tmp_path):
    """paper.numbers.probes.power_probe on a probe CSV (synthetic test data made here): the cap and the hold,
    at prefill ours' and torch._grouped_mm's median clock, the held ratio against ours, and E7's burst ratio
    from grouped_skew.csv in the same cells; a failed row left out; no CSV, no numbers."""
    import pandas as pd

    from paper.numbers.e7 import e7_frame
    from paper.numbers.latex import Numbers
    from paper.numbers.probes import power_probe

    base = {
        "status": "ok",
        "max_sm_mhz": 1980,
        "power_limit_w": 700.0,
        "hold_s": 1.5,
        "gpu": "NVIDIA H200",
        "sm_count": 132,
        "load": "uniform",
        "proj": "up",
        "model": "m",
    }
    cells = {
        64: {
            "ours": (100, 1980, 600.0, 0.0),
            "torch._grouped_mm": (150, 1980, 610.0, 0.0),
            "vllm:fused_moe": (100, 1980, 620.0, 0.5),
        },
        1024: {
            "ours": (400, 1400, 690.0, 1.0),
            "torch._grouped_mm": (440, 1600, 695.0, 1.0),
            "vllm:fused_moe": (500, 1500, 690.0, 1.0),
        },
        4096: {
            "ours": (1000, 1500, 692.0, 1.0),
            "torch._grouped_mm": (900, 1500, 691.0, 1.0),
            "vllm:fused_moe": (1100, 1600, 694.0, 1.0),
        },
    }
    rows = [
        {
            **base,
            "tokens": t,
            "contender": c,
            "graph_us": float(us),
            "sm_mhz": mhz,
            "power_w": w,
            "power_capped": cap,
        }
        for t, cs in cells.items()
        for c, (us, mhz, w, cap) in cs.items()
    ]
    rows.append(
        {
            **base,
            "tokens": 4096,
            "contender": "ours",
            "status": "wrong",
            "graph_us": 1.0,
            "sm_mhz": 1.0,
            "power_w": 1.0,
            "power_capped": 0.0,
        }
    )
    n = Numbers()
    power_probe(n, tmp_path)
    assert not n.items
    pd.DataFrame(rows).to_csv(tmp_path / "probe_power.csv", index=False)
    power_probe(n, tmp_path)
    assert n.items == {
        "PowLimitW": "700",
        "PowHoldS": "1.5",
        "PowPrefillCells": "2",
        "PowPrefillOursMHz": "1450",
        "PowPrefillTorchMHz": "1550",
        "PowPrefillVsTorch": f"{(1.1 * 0.9) ** 0.5:.2f}",  # no E7 CSV yet: no burst ratio
    }
    e7 = [
        {
            "model": "m",
            "proj": "up",
            "tokens": t,
            "load": "uniform",
            "status": "ok",
            "contender": c,
            "graph_us": us,
            "pct_floor_graph": 50.0,
            "floor_us": 10.0,
        }
        for t, cs in {
            1024: {"ours:contiguous": 200.0, "ours:persistent": 180.0, "torch._grouped_mm": 360.0},
            4096: {"ours:contiguous": 500.0, "ours:persistent": 600.0, "torch._grouped_mm": 500.0},
        }.items()
        for c, us in cs.items()
    ]
    pd.DataFrame(e7).to_csv(tmp_path / "grouped_skew.csv", index=False)
    n = Numbers()
    power_probe(n, tmp_path, e7_frame(tmp_path))
    assert n.items["PowPrefillBurstTorch"] == f"{2.0**0.5:.2f}"  # 360 / 180 and 500 / 500


def test_prefill_counter_numbers_on_synthetic_csvs(tmp_path):
    """paper.numbers.probes.prefill_counters on the counters probe's two CSVs (synthetic test data made here):
    the longest kernel of each call is read (a setup kernel left out), executed tensor math is divided by
    the cell's FLOPs, DeepSeek-V3's L2 throughput and the merged tails' gain in the timing come out; without
    the CSVs, nothing."""
    import pandas as pd

    from paper.numbers.latex import Numbers
    from paper.numbers.probes import prefill_counters

    n = Numbers()
    prefill_counters(n, tmp_path)
    assert not n.items
    cell = {"model": "deepseek-v3", "proj": "up", "tokens": 4096, "load": "uniform"}
    vals = {
        "tuned": (4000e3, 70, 1.26e12, 97, 41e9, 77, 15.7e9),
        "tails:merged": (3600e3, 66, 1.13e12, 95, 31e9, 85, 15.7e9),
        "even": (3500e3, 58, 1.0e12, 95, 30e9, 87, 15.6e9),
        "dense:cublas": (2400e3, 95, 1.03e12, 50, 14e9, 20, 2e9),
        "torch._grouped_mm": (6700e3, 45, 1.5e12, 93, 54e9, 82, 26e9),
    }
    names = [
        "gpu__time_duration.sum",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
        "sm__ops_path_tensor_src_bf16_dst_fp32.sum",
        "lts__throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__t_bytes.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__bytes_read.sum",
    ]
    rows = [
        {**cell, "contender": c, "kernel_id": 0, "kernel": "k", "metric": m, "value": x}
        for c, v in vals.items()
        for m, x in zip(names, v)
    ]
    # torch's setup kernel: shorter, with counters that must not be read
    rows += [
        {
            **cell,
            "contender": "torch._grouped_mm",
            "kernel_id": 1,
            "kernel": "setup",
            "metric": m,
            "value": 1.0,
        }
        for m in names
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "probe_prefill_counters.csv", index=False)
    timing = [
        {
            **cell,
            "contender": c,
            "status": "ok",
            "flops": 1.0e12,
            "graph_us": us,
            "clock_samples": 10,
            "sm_mhz_min": 855.0,
            "sm_mhz_max": 1980.0,
            "power_w_max": 701.0,
            "clock_event_reasons": r,
        }
        for c, us, r in (("tuned", 4824.0, "0x4"), ("tails:merged", 4335.0, "0x4"), ("even", 4244.0, "0x4"))
    ]
    timing.append(
        {
            **timing[0],
            "model": "qwen3-30b-a3b",
            "contender": "tuned",
            "sm_mhz_min": 1500.0,
            "sm_mhz_max": 1990.0,
            "power_w_max": 600.0,
            "clock_event_reasons": "0x1",
        }
    )
    pd.DataFrame(timing).to_csv(tmp_path / "probe_prefill_timing.csv", index=False)
    prefill_counters(n, tmp_path)
    assert n.items == {
        "CtrCells": "1",
        "CtrTunedOpsLo": "1.26",
        "CtrTunedOpsHi": "1.26",
        "CtrDsLtwoPct": "97",
        "CtrDsMergedGain": f"{4824 / 4335:.2f}",
    }


def test_heldout_ceilings_numbers_on_a_synthetic_csv(tmp_path):
    """paper.numbers.probes.heldout_ceilings_probe (synthetic test data made here): at the smaller T ours and
    torch._grouped_mm as % of the memory ceiling's speed (geomeans); a wrong row left out."""
    from paper.numbers.probes import heldout_ceilings_probe

    times = {
        ("a", "up", 256, "uniform"): {
            "ours:auto": 100,
            "torch._grouped_mm": 150,
            "dense-reference": 900,
            "ceiling:stream": 95,
        },
        ("b", "down", 256, "uniform"): {
            "ours:auto": 120,
            "torch._grouped_mm": 200,
            "dense-reference": 900,
            "ceiling:stream": 96,
        },
        ("a", "up", 4096, "uniform"): {
            "ours:auto": 110,
            "torch._grouped_mm": 120,
            "dense-reference": 100,
            "ceiling:stream": 500,
        },
        ("b", "down", 4096, "uniform"): {
            "ours:auto": 300,
            "torch._grouped_mm": 400,
            "dense-reference": 200,
            "ceiling:stream": 100,
        },
    }
    got = _probe_numbers(
        tmp_path,
        heldout_ceilings_probe,
        "probe_heldout_ceilings.csv",
        times,
        ("a", "up", 256, "uniform", "ours:auto"),
    )
    # ours: 95/100 and 96/120 of the ceiling's speed; torch: 95/150 and 96/200
    assert got == {
        "CeilHeldDecodeTokens": "256",
        "CeilHeldDecodeOursPct": f"{100 * (0.95 * 0.8) ** 0.5:.0f}",
        "CeilHeldDecodeTorchPct": f"{100 * (95 / 150 * 0.48) ** 0.5:.0f}",
    }


def test_backward_probe_numbers_on_a_synthetic_csv(tmp_path, monkeypatch):
    """paper.numbers.probes.backward_probe on a probe CSV (synthetic test data made here): the library's
    backward tiles (set here) against torch._grouped_mm per piece (another config's rows and a failed row left
    out, a cell without torch's row dropped), geomean; the step kept and recomputed against the torch
    pipeline, lowest and highest over the cells; no CSV, no numbers."""
    import pandas as pd

    from moegemm.grouped import backward as bw
    from paper.numbers import probes as numbers
    from paper.numbers.latex import Numbers
    from paper.numbers.probes import backward_probe

    monkeypatch.setattr(
        bw, "DW_TMA_TILES", dict(BLOCK_M=32, BLOCK_K=128, BLOCK_N=128, GROUP_K=8, num_warps=4, num_stages=5)
    )
    monkeypatch.setattr(numbers, "DSWIGLU_FUSED", "64x64x64/w4s4")
    dw, ds, torch_ = "32x128x128/w4s5", "64x64x64/w4s4", "torch._grouped_mm"
    times = {  # (model, T) -> {(piece, config): us}
        ("a", 4096): {
            ("dswiglu", ds): 200,
            ("dswiglu", "128x64x64/w8s4"): 50,
            ("dswiglu", torch_): 100,
            ("dw_down", dw): 100,
            ("dw_down", torch_): 90,
            ("dw_gate_up", dw): 100,
            ("dw_gate_up", torch_): 120,
            ("step:fwd+bwd", "ours:moe_ffn"): 120,
            ("step:fwd+bwd", "ours:moe_ffn:save-gate-up"): 100,
            ("step:fwd+bwd", "torch._grouped_mm pipeline"): 110,
        },
        ("b", 4096): {
            ("dswiglu", ds): 400,
            ("dswiglu", torch_): 100,
            ("dw_down", dw): 100,
            ("dw_down", torch_): 90,
            ("dw_gate_up", dw): 100,
            ("step:fwd+bwd", "ours:moe_ffn"): 100,
            ("step:fwd+bwd", "ours:moe_ffn:save-gate-up"): 80,
            ("step:fwd+bwd", "torch._grouped_mm pipeline"): 160,
        },
    }
    rows = [
        dict(model=m, tokens=t, piece=p, config=c, status="ok", graph_us=float(us), git_commit="abcdef0123")
        for (m, t), cs in times.items()
        for (p, c), us in cs.items()
    ]
    rows.append(
        dict(model="b", tokens=4096, piece="dw_gate_up", config=torch_, status="error", graph_us=None)
    )
    n = Numbers()
    backward_probe(n, tmp_path)
    assert not n.items
    pd.DataFrame(rows).to_csv(tmp_path / "probe_backward.csv", index=False)
    backward_probe(n, tmp_path)
    assert n.items == {
        "BwdDswiglu": "0.35",  # sqrt(0.5 * 0.25)
        "BwdDwDown": "0.90",
        "BwdDwGateUp": "1.20",  # cell b has no torch row
        "BwdCells": "2",
        "BwdStepKeepLo": "1.10",
        "BwdStepKeepHi": "2.00",
        "BwdStepRecomputeLo": "0.92",
        "BwdStepRecomputeHi": "1.60",
    }


def test_separate_probe_numbers_on_synthetic_csvs(tmp_path):
    """The SwiGLU backward's form: the fused kernel's knobs as its time over theirs, and the separate form,
    the fused kernel and the GEMM alone as torch's plain GEMM time over theirs (geomean over the cells), the
    default step's time with the fused kernel over its time with the separate one; none before the CSVs."""
    import pandas as pd

    from paper.numbers.latex import Numbers
    from paper.numbers.probes import separate_probe

    fused = "128x256x64/w8s3e4"
    n = Numbers()
    separate_probe(n, tmp_path, fused)
    assert not n.items
    cells = (("a", 4096), ("b", 16384))
    knobs = {fused: (200, 400), fused + "f": (250, 400), fused + "g": (200, 500), fused + "fg": (400, 800)}
    pd.DataFrame(
        [
            dict(model=m, tokens=t, piece="dswiglu", config=c, status="ok", graph_us=us[j])
            for c, us in knobs.items()
            for j, (m, t) in enumerate(cells)
        ]
        + [dict(model="a", tokens=4096, piece="dswiglu", config=fused + "f", status="error", graph_us=None)]
    ).to_csv(tmp_path / "probe_dswiglu_flatten.csv", index=False)
    pieces = {
        ("dswiglu", "torch._grouped_mm"): (100, 400),
        ("dswiglu", "separate"): (125, 400),
        ("dswiglu", fused): (200, 800),
        ("dswiglu:gemm-only", "auto"): (50, 400),
        ("step:fwd+bwd", "ours:moe_ffn:save-gate-up:fused"): (11, 36),
        ("step:fwd+bwd", "ours:moe_ffn:save-gate-up"): (10, 40),
    }
    pd.DataFrame(
        [
            dict(model=m, tokens=t, piece=p, config=c, status="ok", graph_us=us[j])
            for (p, c), us in pieces.items()
            for j, (m, t) in enumerate(cells)
        ]
    ).to_csv(tmp_path / "probe_dswiglu_separate.csv", index=False)
    pd.DataFrame(
        [
            dict(model=m, tokens=t, form=f, grad="x", ok=ok, rel_err=err)
            for (m, t), f, ok, err in (
                (cells[0], "fused", True, 3e-3),
                (cells[1], "fused", True, 4e-3),
                (cells[0], "separate", True, 5e-3),
                (cells[1], "separate", False, 9e-3),
            )
        ]
        + [dict(model="a", tokens=4096, form="separate vs fused", grad="w_down", ok=None, rel_err=0.5)]
    ).to_csv(tmp_path / "probe_swiglu_accuracy.csv", index=False)
    separate_probe(n, tmp_path, fused)
    acc = {k: n.items.pop(k) for k in list(n.items) if k.startswith("BwdAcc")}
    assert acc == {
        "BwdAccFused": "4.0e-03",
        "BwdAccFusedOk": "2 of 2",
        "BwdAccSeparate": "9.0e-03",
        "BwdAccSeparateOk": "1 of 2",
    }
    got = {k: float(v) for k, v in n.items.items()}
    assert got["BwdFlatten"] == pytest.approx((0.8 * 1.0) ** 0.5, abs=0.01)
    assert got["BwdGuTma"] == pytest.approx((1.0 * 0.8) ** 0.5, abs=0.01)
    assert got["BwdFlattenGuTma"] == pytest.approx(0.5, abs=0.01)
    assert got["BwdSepPiece"] == pytest.approx((0.8 * 1.0) ** 0.5, abs=0.01)
    assert got["BwdSepFusedPiece"] == pytest.approx(0.5, abs=0.01)
    assert got["BwdSepGemmOnly"] == pytest.approx(2**0.5, abs=0.01)
    assert got["BwdSepStep"] == pytest.approx((1.1 * 0.9) ** 0.5, abs=0.01)
    assert (got["BwdSepStepLo"], got["BwdSepStepHi"], got["BwdSepCells"]) == (0.9, 1.1, 2)


def test_the_write_up_names_the_probes_configs_as_their_rows_do():
    """paper.numbers.probes reads the probes' CSVs, not their code: its config labels are the probe's own
    (probe_backward.label), its fused SwiGLU tiles dswiglu_fused.FUSED_TILES, and its whole-epilogue test
    picks out exactly the sweep's configs without an epilogue split."""
    from paper.numbers import probes as numbers
    from probes.dswiglu_fused import FUSED_TILES
    from probes.probe_backward import DSWIGLU_CONFIGS, DW_CONFIGS, label

    assert numbers.DSWIGLU_FUSED == label(FUSED_TILES)
    for cfg in [*DSWIGLU_CONFIGS, *DW_CONFIGS, FUSED_TILES]:
        assert numbers.config_label(cfg) == label(cfg)
    whole = {label(c) for c in DSWIGLU_CONFIGS if "EPI_SPLIT" not in c}
    assert {label(c) for c in DSWIGLU_CONFIGS if numbers.WHOLE_EPILOGUE.search(label(c))} == whole
    assert not any(numbers.WHOLE_EPILOGUE.search(c) for c in ("pointer", "torch._grouped_mm", "auto"))
