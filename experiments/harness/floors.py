"""Physical floors: datasheet peaks, and the two ceilings plus the tiny-kernel time measured in the run."""

from __future__ import annotations

import functools

import torch

# Datasheet peaks per card, by slug (NVIDIA's H100 and H200 datasheets: HBM bandwidth in TB/s, dense bf16
# and plain fp32 in TFLOP/s; the SXM parts share the tensor rates, the PCIe and NVL parts run lower clocks).
DATASHEET = {
    "nvidia-h100-80gb-hbm3": {"hbm_tb_s": 3.35, "bf16_tflops": 989.0, "fp32_tflops": 67.0},
    "nvidia-h100-pcie": {"hbm_tb_s": 2.0, "bf16_tflops": 756.0, "fp32_tflops": 51.0},
    "nvidia-h100-nvl": {"hbm_tb_s": 3.9, "bf16_tflops": 835.0, "fp32_tflops": 60.0},
    "nvidia-h200": {"hbm_tb_s": 4.8, "bf16_tflops": 989.0, "fp32_tflops": 67.0},
    "nvidia-h200-nvl": {"hbm_tb_s": 4.8, "bf16_tflops": 835.0, "fp32_tflops": 60.0},
}

# Dense bf16/fp16 tensor-core FLOPs per clock per multiprocessor on Hopper (NVIDIA H100 Tensor Core GPU
# Architecture whitepaper: 1024 dense FP16 FMA per clock per tensor core, four per SM). The datasheet's
# 989 TFLOP/s over 132 SMs at that rate is a clock of about 1830 MHz.
HOPPER_BF16_FLOP_PER_CLOCK_PER_SM = 4096


# What the Triton interpreter's runs (tests on the CPU) count as their GPU's peaks
INTERPRETER_STAND_IN = "nvidia-h100-80gb-hbm3"


def datasheet(slug: str) -> dict:
    """The peaks the floors count for the GPU named ``slug``: its datasheet's (``source`` 'datasheet'), or,
    for a card this table does not know, the ceilings measured now on GPU 0 (:func:`measure`: copy
    bandwidth, bf16 matmul rate; fp32 at a sixteenth of bf16, Hopper's ratio; ``source`` 'measured'),
    never another card's; under the interpreter (slug 'cpu-interpreter'), the H100's as a stand-in. Without a
    GPU, an unknown card is a ValueError naming it."""
    if slug in DATASHEET:
        return {**DATASHEET[slug], "source": "datasheet"}
    if slug == "cpu-interpreter":  # no GPU: the H100's, as the heuristics stand in for Hopper's 132 SMs
        return {**DATASHEET[INTERPRETER_STAND_IN], "source": f"stand-in ({INTERPRETER_STAND_IN})"}
    return dict(_measured_peaks(slug))


@functools.lru_cache(maxsize=None)
def _measured_peaks(slug: str) -> tuple:
    if not torch.cuda.is_available():
        raise ValueError(f"gpu: no datasheet peaks for {slug!r} and no GPU to measure them on")
    m = measure()
    tflops = m["bf16_matmul_tflops"]
    return tuple(
        {
            "hbm_tb_s": m["copy_tb_s"],
            "bf16_tflops": tflops,
            "fp32_tflops": tflops / 16,
            "source": "measured",
        }.items()
    )


def gemm_bytes(m: int, n: int, k: int, elt: int) -> int:
    """Fewest bytes one GEMM must move: each input read once, the output written once."""
    return (m * k + k * n + m * n) * elt


def gemm_floor_us(m, n, k, elt, slug: str, tiny_kernel_us: float, fp32: bool = False) -> float:
    d = datasheet(slug)
    t_mem = gemm_bytes(m, n, k, elt) / (d["hbm_tb_s"] * 1e12) * 1e6
    t_flop = 2 * m * n * k / ((d["fp32_tflops"] if fp32 else d["bf16_tflops"]) * 1e12) * 1e6
    return max(t_mem, t_flop) + tiny_kernel_us


def measure() -> dict:
    """Tiny-kernel graph time, copy bandwidth (read + write), streaming-read bandwidth and bf16 matmul rate,
    measured now on GPU 0."""
    from .timing import GraphTimer

    x = torch.ones(1, device="cuda")
    tiny = GraphTimer([lambda: x.add_(1)], calls_per_graph=200)
    tiny_us = sorted(tiny.sample(20))[10]

    n = 1 << 30  # 1 GiB each way, as fp32 words (a byte-wise copy does not reach the bandwidth)
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    copy = GraphTimer([lambda: dst.copy_(src)], calls_per_graph=5)
    copy_us = sorted(copy.sample(10))[5]
    copy_tb_s = 2 * n / (copy_us * 1e-6) / 1e12

    # Streaming read: a sum over 4 GiB, what a weight-streaming (decode) kernel at best can do on this GPU.
    big = torch.rand(1 << 30, device="cuda")
    read = GraphTimer([lambda: big.sum()], calls_per_graph=5)
    read_us = sorted(read.sample(10))[5]
    read_tb_s = big.numel() * big.element_size() / (read_us * 1e-6) / 1e12

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = GraphTimer([lambda: a @ b], calls_per_graph=5)
    mm_us = sorted(mm.sample(10))[5]
    return {
        "tiny_kernel_graph_us": tiny_us,
        "copy_tb_s": copy_tb_s,
        "read_tb_s": read_tb_s,
        "bf16_matmul_tflops": 2 * 8192**3 / (mm_us * 1e-6) / 1e12,
    }
