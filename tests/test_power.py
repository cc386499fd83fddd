"""harness.power (the NVML sampler behind probes/probe_power.py), on the CPU: NVML and the GPU clock
are faked here; on a GPU machine the probe itself reads the real ones. The probe's cell loop is tested in
probes/tests/test_probes.py."""

from __future__ import annotations

import time

import pytest

from experiments.harness import power
from experiments.harness.power import Sample, Sampler, summary


def test_summary_takes_medians_after_the_settling_time_and_counts_the_limit_reasons():
    """Samples before ``since`` are left out (the clock before the load settled); the power comes from those
    at or after ``power_since``; each reason's share counts the kept samples with its bit set."""
    cap, thermal, brake = power.REASON_SW_POWER_CAP, 0x20, power.REASON_HW_POWER_BRAKE
    s = [Sample(0.0, 1980, 3201, 100.0, 0), Sample(0.1, 1980, 3201, 120.0, 0)]  # before the load settled
    s += [
        Sample(0.3 + 0.1 * i, mhz, 3201, w, r)
        for i, (mhz, w, r) in enumerate(
            [
                (1500, 690.0, cap),
                (1400, 700.0, cap),
                (1600, 650.0, 0),
                (1300, 705.0, cap | thermal),
                (1700, 640.0, brake),
            ]
        )
    ]
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
