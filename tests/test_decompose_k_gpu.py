"""Decompose-K on the real shapes, natively on a CUDA GPU (``pytest -m gpu``; skipped without one)."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPES, assert_close_to_ref

from moegemm.decompose_k import KERNELS, DecomposeKConfig, decompose_k, matmul
from moegemm.decompose_k.reference import reference_mm

pytestmark = pytest.mark.gpu

GRID = [(mn, k) for mn in (16, 32, 48, 64) for k in range(8192, 32768 + 1, 4096)]
ROUTER_T = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _ref(a, b, epilogue="none", bias=None):
    return reference_mm(a, b, epilogue, bias, on_cpu=False)  # float64 on the GPU: the shapes are big


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mn,k", GRID, ids=[f"{mn}x{k}" for mn, k in GRID])
def test_grid_every_kernel(mn, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(mn * 100003 + k)
    a = torch.randn(mn, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(k, mn, device="cuda", generator=g).to(dtype)
    ref = _ref(a, b, "relu")
    for kernel in KERNELS + ("auto",):
        out = torch.full((mn, mn), float("nan"), dtype=dtype, device="cuda")
        got = matmul(a, b, kernel=kernel, epilogue="relu", out=out)
        assert_close_to_ref(got, ref, k, f"{kernel} {mn}x{k} {dtype}")
    if k % 64 == 0:
        assert_close_to_ref(torch.relu(decompose_k(a, b, 64)), ref, k, "reference decompose_k")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", ROUTER_T + [1024, 4096])
def test_router_every_kernel(t, dtype):
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 7168, device="cuda", generator=g).to(dtype)
    w = (torch.randn(256, 7168, device="cuda", generator=g) / 8).to(dtype).t()  # nn.Linear weight, transposed view
    bias = torch.randn(256, device="cuda", generator=g).to(dtype)
    ref = _ref(x, w, "sigmoid", bias)
    for kernel in KERNELS + ("auto",):
        got = matmul(x, w, kernel=kernel, epilogue="sigmoid", bias=bias)
        assert_close_to_ref(got, ref, 7168, f"router {kernel} T={t} {dtype}")


def test_single_launch_cuda_graph_replay():
    """Capture once, replay with new inputs copied in: every replay is right (counters reset) and
    bitwise equal to an eager launch of the same inputs (deterministic split-order reduction)."""
    torch.manual_seed(0)
    m, n, k = 32, 256, 7168
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    cfg = DecomposeKConfig(split_k=16, block_m=16, block_n=64, block_k=128)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture: compiles, allocates the counters
            matmul(a, b, kernel="single_launch", config=cfg, epilogue="relu", out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            matmul(a, b, kernel="single_launch", config=cfg, epilogue="relu", out=out)
    torch.cuda.current_stream().wait_stream(s)
    for i in range(5):
        a.copy_(torch.randn(m, k, device="cuda"))
        b.copy_(torch.randn(k, n, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(out, _ref(a, b, "relu"), k, f"replay {i}")
        eager = matmul(a, b, kernel="single_launch", config=cfg, epilogue="relu")
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16)), f"replay {i} not bitwise equal"


def test_single_launch_many_tiles_and_splits():
    """Heavy contention on the tickets: 64 tiles x 128 splits, repeated; no lost or early reduction."""
    a = torch.randn(512, 16384, device="cuda").to(torch.float16)
    b = torch.randn(16384, 128, device="cuda").to(torch.float16)
    ref = _ref(a, b)
    cfg = DecomposeKConfig(split_k=128, block_m=32, block_n=32, block_k=128)
    first = matmul(a, b, kernel="single_launch", config=cfg)
    assert_close_to_ref(first, ref, 16384, "contention")
    for _ in range(20):
        assert torch.equal(matmul(a, b, kernel="single_launch", config=cfg), first)
