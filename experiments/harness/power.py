"""The GPU's SM clock, power draw and clock-limit reasons while a kernel runs, read from NVML (the driver's
``libnvidia-ml.so.1``, through ctypes: no Python package needed) by a thread sampling every few ms.

Why: an H200 runs under a 700 W power cap, and under load its SM clock moves (855-1980 MHz within one
run on ours). A kernel that keeps both the HBM and the tensor cores busy draws more power than one that
keeps one of them busy, so it may run at a lower clock: the floor (datasheet peaks) and the practical
ceiling (streaming alone, dense GEMM alone) do not see that. ``Sampler`` records what the GPU reports.

    with Sampler() as s:
        ...  # replay a CUDA graph for a second or two
    summary(s.samples, since=0.3)  # medians over the samples after the first 0.3 s
"""

from __future__ import annotations

import ctypes
import dataclasses
import statistics
import threading
import time

CLOCK_SM, CLOCK_MEM = 1, 2  # nvmlClockType_t: NVML_CLOCK_SM, NVML_CLOCK_MEM
# nvmlClocksEventReasons bits (nvml.h): why the clocks are below their maximum
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_THERMAL = 0x20 | 0x40  # software and hardware thermal slowdown
REASON_HW_POWER_BRAKE = 0x80


@dataclasses.dataclass
class Sample:
    t: float  # seconds since the sampler started
    sm_mhz: int
    mem_mhz: int
    power_w: float
    reasons: int


class NvmlError(RuntimeError):
    pass


class Nvml:
    """The few NVML calls we need, on the device CUDA calls ``cuda:0`` (matched by UUID where torch gives
    one)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise NvmlError(
                f"NVML: libnvidia-ml.so.1 could not be loaded (no NVIDIA driver here?): {e}"
            ) from e
        self._ok(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        uuid = _cuda_uuid()
        handle = ctypes.byref(self.handle)
        if uuid is not None and self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), handle) == 0:
            return
        self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(0, handle), "nvmlDeviceGetHandleByIndex_v2")

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise NvmlError(f"NVML: {what} returned {rc}")

    def _uint(self, fn: str, *args) -> int:
        v = ctypes.c_uint()
        self._ok(getattr(self.lib, fn)(self.handle, *args, ctypes.byref(v)), fn)
        return v.value

    def clock_mhz(self, which: int = CLOCK_SM) -> int:
        return self._uint("nvmlDeviceGetClockInfo", which)

    def max_clock_mhz(self, which: int = CLOCK_SM) -> int:
        return self._uint("nvmlDeviceGetMaxClockInfo", which)

    def power_w(self) -> float:
        return self._uint("nvmlDeviceGetPowerUsage") / 1000.0

    def power_limit_w(self) -> float:
        return self._uint("nvmlDeviceGetEnforcedPowerLimit") / 1000.0

    def reasons(self) -> int:
        v = ctypes.c_ulonglong()
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if hasattr(self.lib, fn):
                self._ok(getattr(self.lib, fn)(self.handle, ctypes.byref(v)), fn)
                return v.value
        return 0


def _cuda_uuid() -> str | None:
    """cuda:0's UUID in NVML's spelling ("GPU-..."), where this torch reports one."""
    try:
        import torch

        u = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    except Exception:
        return None
    if u is None:
        return None
    s = str(u)
    return s if s.startswith("GPU-") else f"GPU-{s}"


class Sampler:
    """A thread reading the SM and memory clocks, power and clock-limit reasons every ``period_s`` seconds
    between ``__enter__`` and ``__exit__``; ``samples`` holds them."""

    def __init__(self, period_s: float = 0.005, nvml: Nvml | None = None):
        self.period_s = period_s
        self.nvml = nvml or Nvml()
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.is_set():
            n = self.nvml
            self.samples.append(
                Sample(
                    time.perf_counter() - t0,
                    n.clock_mhz(CLOCK_SM),
                    n.clock_mhz(CLOCK_MEM),
                    n.power_w(),
                    n.reasons(),
                )
            )
            self._stop.wait(self.period_s)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def summary(samples: list[Sample], since: float, power_since: float | None = None) -> dict:
    """Medians (and the 20th/80th percentiles of the SM clock) over the samples taken ``since`` seconds
    after the sampler started or later; the power over those from ``power_since`` (default ``since``: NVML's
    power reading is itself averaged over up to a second on recent GPUs, so a later start keeps what ran
    before out of it); the fraction of those samples whose clocks were held down by the software power
    cap, by thermal slowdown, or by the hardware (slowdown or power brake)."""
    kept = [s for s in samples if s.t >= since]
    if not kept:
        raise ValueError(
            f"summary: no samples at or after {since} s (of {len(samples)}); hold the load longer"
        )
    later = [s for s in samples if s.t >= (since if power_since is None else power_since)] or kept
    sm = sorted(s.sm_mhz for s in kept)
    q = statistics.quantiles(sm, n=5, method="inclusive") if len(sm) > 1 else [sm[0]] * 4

    def share(bits: int) -> float:
        return sum(1 for s in kept if s.reasons & bits) / len(kept)

    return {
        "sm_mhz": statistics.median(sm),
        "sm_mhz_p20": q[0],
        "sm_mhz_p80": q[3],
        "mem_mhz": statistics.median(s.mem_mhz for s in kept),
        "power_w": statistics.median(s.power_w for s in later),
        "power_capped": share(REASON_SW_POWER_CAP),
        "thermal": share(REASON_THERMAL),
        "hw_slowdown": share(REASON_HW_SLOWDOWN | REASON_HW_POWER_BRAKE),
        "samples": len(kept),
    }
