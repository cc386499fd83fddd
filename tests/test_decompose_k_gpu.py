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
    w = (
        (torch.randn(256, 7168, device="cuda", generator=g) / 8).to(dtype).t()
    )  # nn.Linear weight, transposed view
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


def test_single_launch_takes_the_cooperative_form_where_the_grid_fits():
    """The skinny shapes' grids fit on the GPU at once: the plan launches the parallel reduction (coop);
    a grid too large for that takes the last-arriver form. Both are right."""
    from moegemm.decompose_k import plan

    a = torch.randn(16, 8192, device="cuda").to(torch.bfloat16)
    b = torch.randn(8192, 16, device="cuda").to(torch.bfloat16)
    cfg = DecomposeKConfig(split_k=64, block_m=16, block_n=16, block_k=128)
    p = plan(a, b, kernel="single_launch", config=cfg, epilogue="relu")
    assert p.coop and p._bound is not None
    fast = matmul(a, b, kernel="single_launch", config=cfg, epilogue="relu")
    from moegemm.decompose_k import single_launch
    from moegemm.decompose_k.configs import Prepared
    from moegemm.epilogue import Epilogue

    out = torch.full_like(fast, float("nan"))
    ws = single_launch.alloc_workspace(16, 16, cfg, a.device)
    cnt = single_launch.counters(a.device, 1)
    prep = Prepared(a=a, b=b, out=out, bias=None, epilogue=Epilogue.RELU, allow_tf32=False)
    single_launch._single_launch_kernel[single_launch.grid(16, 16, cfg)](
        **single_launch.kernel_args(prep, cfg, ws, cnt, False),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    assert_close_to_ref(out, _ref(a, b, "relu"), 8192, "last arriver")
    assert_close_to_ref(fast, _ref(a, b, "relu"), 8192, "coop")
    big = plan(
        torch.randn(4096, 8192, device="cuda").to(torch.bfloat16),
        b,
        kernel="single_launch",
        config=DecomposeKConfig(split_k=64, block_m=16, block_n=16, block_k=128),
    )
    assert not big.coop  # 256 tiles x 64 splits: more programs than the GPU holds at once


def test_plans_sharing_a_workspace_stay_right_interleaved_and_in_graphs():
    """Plans of one class (cooperative form, the same S and tile) at several token counts share one workspace
    and its counters on a stream. Run interleaved, eagerly and as CUDA graphs replayed between the eager
    calls, each stays right and bitwise equal to an eager call on the same inputs; a larger plan made after
    the captures grows the class's buffers, and the graphs, which keep the old ones, stay right."""
    from moegemm.decompose_k import plan

    k, n = 7168, 256
    cfg = DecomposeKConfig(split_k=16, block_m=16, block_n=32, block_k=128)
    w = (torch.randn(n, k, device="cuda") / 8).to(torch.bfloat16).t()
    ts = [64, 33, 16, 5, 1]  # the largest first: every later plan fits the class's first buffer
    xs = {t: torch.randn(t, k, device="cuda").to(torch.bfloat16) for t in ts + [80]}
    outs = {t: torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for t in ts}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graphs = {}
    with torch.cuda.stream(s):
        for t in ts:
            matmul(xs[t], w, kernel="single_launch", config=cfg, epilogue="relu", out=outs[t])
        plans = {
            t: plan(xs[t], w, kernel="single_launch", config=cfg, epilogue="relu", out=outs[t]) for t in ts
        }
        assert all(p.coop for p in plans.values())
        stream = s.cuda_stream
        assert len({p._per_stream[stream][0].data_ptr() for p in plans.values()}) == 1
        for t in (33, 1):
            graphs[t] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[t], stream=s):
                matmul(xs[t], w, kernel="single_launch", config=cfg, epilogue="relu", out=outs[t])
        grown = matmul(xs[80], w, kernel="single_launch", config=cfg, epilogue="relu")  # 40 tiles: 32 fit
        larger = plan(xs[80], w, kernel="single_launch", config=cfg, epilogue="relu")
        assert larger.coop
        assert larger._per_stream[stream][1].numel() >= 2 * plans[64]._per_stream[stream][1].numel()
        for r in range(4):
            for t in ts:
                xs[t].copy_(torch.randn(t, k, device="cuda"))
                outs[t].fill_(float("nan"))
                if t in graphs:
                    graphs[t].replay()
                else:
                    matmul(xs[t], w, kernel="single_launch", config=cfg, epilogue="relu", out=outs[t])
                got = outs[t].clone()
                eager = matmul(xs[t], w, kernel="single_launch", config=cfg, epilogue="relu")
                s.synchronize()
                assert_close_to_ref(got, _ref(xs[t], w, "relu"), k, f"T={t} round {r}")
                assert torch.equal(got.view(torch.int16), eager.view(torch.int16)), f"T={t} round {r}"
    torch.cuda.current_stream().wait_stream(s)
    assert_close_to_ref(grown, _ref(xs[80], w, "relu"), k, "T=80")


@pytest.mark.parametrize("mn,k", [(16, 8192), (64, 32768), (48, 20480)])
def test_default_is_bitwise_deterministic_over_100_repeats(mn, k):
    a = torch.randn(mn, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, mn, device="cuda").to(torch.bfloat16)
    first = matmul(a, b, epilogue="relu")
    assert_close_to_ref(first, _ref(a, b, "relu"), k, "first")
    for _ in range(100):
        assert torch.equal(matmul(a, b, epilogue="relu").view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("t", [1, 16, 256, 4096])
def test_default_under_cuda_graph_replay_with_new_inputs(t):
    """kernel="auto" (whatever it dispatches to) captured once, replayed 20 times on new inputs."""
    x = torch.randn(t, 7168, device="cuda").to(torch.bfloat16)
    w = (torch.randn(256, 7168, device="cuda") / 8).to(torch.bfloat16).t()
    bias = torch.randn(256, device="cuda").to(torch.bfloat16)
    out = torch.empty(t, 256, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            matmul(x, w, epilogue="sigmoid", bias=bias, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            matmul(x, w, epilogue="sigmoid", bias=bias, out=out)
    torch.cuda.current_stream().wait_stream(s)
    for i in range(20):
        x.copy_(torch.randn(t, 7168, device="cuda"))
        w.copy_(torch.randn(7168, 256, device="cuda") / 8)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(out, _ref(x, w, "sigmoid", bias), 7168, f"T={t} replay {i}")


def test_torch_compile_fullgraph_traces_matmul():
    def f(a, b, bias):
        return matmul(a, b, epilogue="sigmoid", bias=bias) * 2.0

    a = torch.randn(16, 7168, device="cuda").to(torch.bfloat16)
    b = torch.randn(7168, 256, device="cuda").to(torch.bfloat16)
    bias = torch.randn(256, device="cuda").to(torch.bfloat16)
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    got = cf(a, b, bias)
    assert_close_to_ref(got, 2.0 * _ref(a, b, "sigmoid", bias), 7168, "compiled")
    assert torch.equal(got.view(torch.int16), f(a, b, bias).view(torch.int16))


def test_auto_routes_large_outputs_to_cublas_and_applies_the_epilogue():
    from moegemm.decompose_k import plan

    x = torch.randn(16384, 7168, device="cuda").to(torch.bfloat16)
    w = (torch.randn(7168, 256, device="cuda") / 8).to(torch.bfloat16)
    p = plan(x, w, epilogue="relu")
    assert p.backend == "cublas"
    got = matmul(x, w, epilogue="relu")
    assert (got >= 0).all()
    assert_close_to_ref(got, _ref(x, w, "relu"), 7168, "cublas relu")
