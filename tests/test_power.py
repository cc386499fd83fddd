"""moegemm.bench.power (the NVML sampler behind experiments/probe_power.py) and the probe's cell loop, on the
CPU: NVML and the GPU clock are faked here; on a GPU machine the probe itself reads the real ones."""

from __future__ import annotations

import json
import math
import time

import pytest

from moegemm.bench import power
from moegemm.bench.power import Sample, Sampler, summary


def test_summary_takes_medians_after_the_settling_time_and_counts_the_limit_reasons():
    """Samples before ``since`` are left out (the clock before the load settled); the power comes from those
    at or after ``power_since``; each reason's share counts the kept samples with its bit set."""
    cap, thermal, brake = power.REASON_SW_POWER_CAP, 0x20, power.REASON_HW_POWER_BRAKE
    s = [Sample(0.0, 1980, 3201, 100.0, 0), Sample(0.1, 1980, 3201, 120.0, 0)]  # before the load settled
    s += [Sample(0.3 + 0.1 * i, mhz, 3201, w, r) for i, (mhz, w, r) in enumerate(
        [(1500, 690.0, cap), (1400, 700.0, cap), (1600, 650.0, 0), (1300, 705.0, cap | thermal), (1700, 640.0, brake)])]
    out = summary(s, since=0.3, power_since=0.5)
    assert out["samples"] == 5 and out["sm_mhz"] == 1500 and out["mem_mhz"] == 3201
    assert out["sm_mhz_p20"] <= 1400 <= out["sm_mhz"] <= 1600 <= out["sm_mhz_p80"]
    assert out["power_w"] == 650.0  # the median of the samples from 0.5 s: 650, 705, 640
    assert out["power_capped"] == pytest.approx(3 / 5) and out["thermal"] == pytest.approx(1 / 5)
    assert out["hw_slowdown"] == pytest.approx(1 / 5)
    assert summary(s, since=0.3)["power_w"] == 690.0  # power over the same samples as the clock by default
    with pytest.raises(ValueError, match="no samples at or after 9"):
        summary(s, since=9.0)


def test_sampler_reads_the_device_until_it_is_stopped():
    """The sampler's thread reads clock, memory clock, power and reasons from its NVML object repeatedly
    between enter and exit, with times increasing from zero, and stops reading at exit."""
    reads = []

    class FakeNvml:
        def clock_mhz(self, which=power.CLOCK_SM):
            reads.append(which)
            return 1755 if which == power.CLOCK_SM else 2619

        def power_w(self):
            return 512.5

        def reasons(self):
            return power.REASON_SW_POWER_CAP

    with Sampler(period_s=0.001, nvml=FakeNvml()) as s:
        time.sleep(0.05)
    n = len(s.samples)
    time.sleep(0.02)
    assert n >= 3 and len(s.samples) == n  # stopped at exit
    assert all(x.sm_mhz == 1755 and x.mem_mhz == 2619 and x.power_w == 512.5 for x in s.samples)
    assert [x.t for x in s.samples] == sorted(x.t for x in s.samples) and s.samples[0].t < 0.05
    assert summary(s.samples, 0.0)["power_capped"] == 1.0


def test_nvml_without_a_driver_says_so(monkeypatch):
    """Where libnvidia-ml cannot be loaded (this CPU machine, or any without the NVIDIA driver) Nvml raises
    NvmlError naming the library, not a bare OSError."""
    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(power.ctypes, "CDLL", no_lib)
    with pytest.raises(power.NvmlError, match="libnvidia-ml.so.1 could not be loaded"):
        power.Nvml()


def test_power_probe_checks_each_contender_then_holds_the_right_ones_in_rotated_rounds(monkeypatch):
    """probe_power.measure_cell: every contender's first call checked (against float64, or its own check);
    a wrong one and one that raises are recorded with their reason and not held; the right ones are held
    ROUNDS times, who goes first rotating from round to round (starting at the cell's turn), and each row
    keeps the medians of its holds, the fastest and slowest hold and the count."""
    import torch

    from experiments import probe_power as probe
    from moegemm.bench.runner import Contender

    torch.manual_seed(0)
    k = 16
    ref = torch.randn(8, 4, dtype=torch.float64)
    right = ref.to(torch.float32)

    def returning(t):
        return lambda inp: (lambda: t)

    def raising(inp):
        def call():
            raise RuntimeError("no kernel image")
        return call

    cs = [Contender("a", returning(right), config={"x": 1}), Contender("wrong", returning(right + 1.0)),
          Contender("b", returning(right.clone())), Contender("broken", raising),
          Contender("own", returning(torch.zeros(3)), check=lambda out: (True, math.nan, "own check"))]
    order = []

    class FakeTimer:
        def __init__(self, calls, n):
            self.n = n

    def fake_hold(timer, seconds, nvml):
        order.append(timer)
        i = len(order)  # the i-th hold of the cell: its time and clock
        return {"graph_us": 10.0 * i, "sm_mhz": 1000 + i, "power_w": 600.0}

    monkeypatch.setattr(probe, "graph_timer", lambda calls, settings: FakeTimer(calls, 4))
    monkeypatch.setattr(probe, "hold", fake_hold)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(probe, "ROUNDS", 3)
    rows = probe.measure_cell(cs, [(None, None)], ref, k, None, nvml=None, turn=1)
    by = {r["contender"]: r for r in rows}
    assert [r["contender"] for r in rows] == ["a", "wrong", "b", "broken", "own"]
    assert by["wrong"]["status"] == "wrong" and "graph_us" not in by["wrong"]
    assert by["broken"]["status"] != "ok" and "no kernel image" in by["broken"]["note"] and "graph_us" not in by["broken"]
    # the right ones: a, b, own; rounds start at b (turn 1), then own, then a
    assert len(order) == 9
    holds = {"b": [1, 6, 8], "own": [2, 4, 9], "a": [3, 5, 7]}  # positions of each contender's holds
    for c, pos in holds.items():
        assert by[c]["graph_us"] == 10.0 * sorted(pos)[1] and by[c]["sm_mhz"] == 1000 + sorted(pos)[1]
        assert by[c]["graph_us_min"] == 10.0 * pos[0] and by[c]["graph_us_max"] == 10.0 * pos[-1]
        assert by[c]["holds"] == 3 and by[c]["graph_calls"] == 4 and by[c]["status"] == "ok"
    assert json.loads(by["a"]["config"]) == {"x": 1} and by["own"]["note"] == "own check"
