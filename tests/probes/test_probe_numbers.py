"""probes/writeup.py on synthetic probe CSVs made here (no measured data): each probe's numbers and tables,
and none before its CSV exists."""

from __future__ import annotations


def _probe_numbers(tmp_path, numbers, csv_name: str, times: dict, failed: tuple) -> dict:
    """A probe's numbers (``numbers(n, results)``) from a synthetic probe CSV: one ok row per (cell,
    contender) of ``times`` ({(model, proj, T, load): {contender: us}}) and a failed row for ``failed``
    ((model, proj, T, load, contender)), all at one made-up commit; checked to give no numbers before the CSV
    exists."""
    import pandas as pd

    from experiments.report import Numbers

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


def test_middle_tiles_numbers_on_a_synthetic_csv(tmp_path):
    """probes.writeup.middle_tiles_probe on a probe CSV (synthetic test data made here): per cell the
    tuned config's time over each new config's, the best per cell, how many cells a new one beat by more than
    3%, and each family's geomean (a failed row left out); no CSV, no numbers."""
    from probes.writeup import middle_tiles_probe

    times = {
        ("m", "up", 256, "uniform"): {"tuned": 100, "k256-s2": 200, "k128-s4": 125, "n256-k64-s4": 96},
        ("m", "up", 256, "zipf1.2"): {"tuned": 100, "k256-s2": 125, "k128-s4": 100, "n256-k64-s4": 200},
    }
    got = _probe_numbers(
        tmp_path,
        middle_tiles_probe,
        "probe_middle_tiles.csv",
        times,
        ("m", "up", 256, "uniform", "w8-k128-s3"),
    )
    assert got["MidCells"] == "2" and got["MidConfigs"] == "3" and got["MidBeat"] == "1"
    assert got["MidBestLo"] == "1.00" and got["MidBestHi"] == "1.04"
    assert got["MidKLong"] == "0.63" and got["MidFourStage"] == "0.89" and got["MidWide"] == "0.72"
    assert "MidEightWarps" not in got and "MidKLongNarrow" not in got


def test_gluon_probe_numbers_on_a_synthetic_csv(tmp_path):
    """probes.writeup.gluon_probe on a probe CSV (synthetic test data made here): per cell the
    faster of our grids against the fastest Gluon config (a failed Gluon row left out), how often the Gluon
    kernel beat ours by more than 3% and was fastest ping-pong, and both against torch._grouped_mm; no CSV,
    no numbers."""
    from probes.writeup import gluon_probe

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
    assert got["GluCells"] == "2" and got["GluConfigs"] == "2" and got["GluCommit"] == "abcdef0"
    assert got["GluVsOursLo"] == "0.80" and got["GluVsOursHi"] == "1.25" and got["GluVsOurs"] == "1.00"
    assert got["GluBeat"] == "1" and got["GluPingBest"] == "1"
    assert got["GluBigTokens"] == "4096" and got["GluBigVsOurs"] == "1.25"
    assert got["GluVsTorch"] == "1.22" and got["GluOursVsTorch"] == "1.22"


def test_stream_k_numbers_on_a_synthetic_csv(tmp_path):
    """probes.writeup.stream_k_probe on a probe CSV (synthetic test data made here): whole against
    dealt for each tile shape and cell (a failed row left out), the tuned config against the fastest
    dealt shape per cell; no CSV, no numbers."""
    from probes.writeup import stream_k_probe

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
    assert got["StreamKCells"] == "2" and got["StreamKPairs"] == "4" and got["StreamKWins"] == "1"
    assert got["StreamKVsWholeLo"] == "0.50" and got["StreamKVsWholeHi"] == "1.10"
    assert got["StreamKVsTunedLo"] == "0.80" and got["StreamKVsTunedHi"] == "0.90"


def test_power_numbers_on_a_synthetic_csv(tmp_path):
    """probes.writeup.power_probe on a probe CSV (synthetic test data made here): per regime each
    contender's median clock and power, the held ratios against ours (geomean, lowest, cells slower), the
    same in SM cycles, E7's burst ratios from grouped_skew.csv in the same cells, the clock the datasheet
    peak needs, and the table; a failed row left out; no CSV, no numbers."""
    import json

    import pandas as pd

    from experiments.report import Numbers
    from paper.numbers.e7 import e7_frame
    from probes.writeup import power_probe

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
    gen = tmp_path / "gen"
    n = Numbers()
    power_probe(n, tmp_path, gen)
    assert not n.items and not gen.exists()
    (tmp_path / "floors.json").write_text(json.dumps({"datasheet": {"bf16_tflops": 989.0, "hbm_tb_s": 4.8}}))
    pd.DataFrame(rows).to_csv(tmp_path / "probe_power.csv", index=False)
    power_probe(n, tmp_path, gen)
    it = n.items
    assert it["PowPeakMHz"] == "1829" and it["PowLimitW"] == "700" and it["PowHoldS"] == "1.5"
    assert it["PowHolds"] == "1"  # a CSV without the holds column: one hold each
    assert it["PowDecodeCells"] == "1" and it["PowPrefillCells"] == "2"
    assert (
        it["PowPrefillOursMHz"] == "1450"
        and it["PowPrefillTorchMHz"] == "1550"
        and it["PowPrefillOursW"] == "691"
    )
    assert it["PowPrefillVsTorch"] == f"{(1.1 * 0.9) ** 0.5:.2f}" and it["PowPrefillVsTorchMin"] == "0.90"
    assert it["PowPrefillVsTorchSlower"] == "1" and it["PowPrefillVsVllmSlower"] == "0"
    cyc = ((440 * 1600) / (400 * 1400) * (900 * 1500) / (1000 * 1500)) ** 0.5
    assert it["PowPrefillVsTorchCycles"] == f"{cyc:.2f}" and it["PowDecodeVsTorch"] == "1.50"
    assert it["PowDecodeGemmCappedPct"] == "17" and it["PowPrefillGemmCappedPct"] == "100"
    assert "PowPrefillBurstTorch" not in it  # no E7 CSV yet
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
    power_probe(n, tmp_path, gen, e7_frame(tmp_path))
    assert n.items["PowPrefillBurstTorch"] == f"{2.0**0.5:.2f}"  # 360 / 180 and 500 / 500
    assert "PowPrefillBurstVllm" not in n.items  # E7 without vLLM's kernel
    table = (gen / "table_power.tex").read_text()
    assert (
        "torch.\\_grouped\\_mm & 1550 & 693" in table
        and "decode & ours (tuned) & 1980 & 600 & 0\\% & 1.00" in table
    )


def test_prefill_counter_numbers_on_synthetic_csvs(tmp_path):
    """probes.writeup.prefill_counters on the counters probe's two CSVs (synthetic test data made here):
    the longest kernel of each call is read (a setup kernel left out), executed tensor math is divided by
    the cell's FLOPs, the table is written, the clock's lowest and highest SM clock, highest power and the
    named clock-event reasons (OR of the cells') come out; without the CSVs, nothing."""
    import pandas as pd

    from experiments.report import Numbers
    from probes.writeup import prefill_counters

    n = Numbers()
    prefill_counters(n, tmp_path, tmp_path)
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
    prefill_counters(n, tmp_path, tmp_path)
    assert n.items["CtrCells"] == "1" and n.items["CtrTunedOpsHi"] == "1.26"
    assert (
        n.items["CtrDsLtwoGB"] == "41"
        and n.items["CtrDsMergedLtwoGB"] == "31"
        and n.items["CtrDsMergedOps"] == "1.13"
    )
    assert n.items["CtrDsMergedGain"] == f"{4824 / 4335:.2f}" and n.items["CtrCublasTensorLo"] == "95"
    assert (
        n.items["ClockSmMin"] == "855"
        and n.items["ClockSmMax"] == "1990"
        and n.items["ClockPowerMax"] == "701"
    )
    assert n.items["ClockReasons"] == "GPU idle, software power cap"
    assert "deepseek-v3 up" in n.items["ClockSmMinCell"]
    tab = (tmp_path / "table_counters.tex").read_text()
    assert "6700" in tab and "1.50" in tab and tab.count("\\\\") == 6  # header + five kernels


def test_heldout_ceilings_numbers_on_a_synthetic_csv(tmp_path):
    """probes.writeup.heldout_ceilings_probe (synthetic test data made here): at the smaller T ours
    and torch._grouped_mm as % of the memory ceiling's speed and the ceiling's speed over torch's; at the
    larger T torch's and ours' times over the dense GEMM's, the least with its model; a wrong row left out."""
    from probes.writeup import heldout_ceilings_probe

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
    assert got["CeilHeldCells"] == "4" and got["CeilHeldCommit"] == "abcdef0"
    assert (got["CeilHeldDecodeTokens"], got["CeilHeldPrefillTokens"]) == ("256", "4096")
    assert (got["CeilHeldDecodeOursPctLo"], got["CeilHeldDecodeOursPctHi"]) == ("80", "95")
    assert got["CeilHeldDecodeRoomMin"] == "1.58" and got["CeilHeldDecodeRoomMax"] == "2.08"
    assert (
        got["CeilHeldPrefillTorchVsDenseMin"] == "1.20" and got["CeilHeldPrefillTorchVsDenseMinModel"] == "a"
    )
    assert (got["CeilHeldPrefillOursVsDenseLo"], got["CeilHeldPrefillOursVsDenseHi"]) == ("1.10", "1.50")
