"""Decompose-K kernels against a float64 reference (interpreter on CPU, natively on a GPU)."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from helpers import (
    DTYPES,
    LAYOUTS,
    assert_close_to_ref,
    assert_compiled_grads_match,
    case_params,
    make,
    poisoned,
)

from conftest import HAS_CUDA
from moegemm.decompose_k import KERNELS, DecomposeKConfig, decompose_k, heuristic_config, matmul
from moegemm.decompose_k.reference import decompose_k_relu, reference_mm

EPILOGUES = ("none", "relu", "sigmoid")


def _case(m, n, k, dtype, device, seed, la="contiguous", lb="contiguous", bias=False):
    gen = torch.Generator().manual_seed(seed)
    a = make((m, k), dtype, la, gen, device)
    b = make((k, n), dtype, lb, gen, device)
    bias_t = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return a, b, bias_t


@pytest.mark.parametrize(
    "bias,epilogue,dtype,kernel",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        bias={"nobias": False, "bias": True},
        epilogue=EPILOGUES,
        dtype={str(d): d for d in DTYPES},
        kernel=KERNELS,
    ),
)
def test_every_kernel_epilogue_dtype(bias, epilogue, dtype, kernel, device, poison_partials):
    m, n, k, s = 33, 47, 1031, 6  # ragged tiles, prime K, S not dividing K
    a, b, bias_t = _case(
        m, n, k, dtype, device, seed=zlib.crc32(f"{kernel}{dtype}{epilogue}{bias}".encode()), bias=bias
    )
    out = poisoned((m, n), dtype, device)
    got = matmul(
        a,
        b,
        kernel=kernel,
        split_k=s,
        epilogue=epilogue,
        bias=bias_t,
        out=out,
        config=DecomposeKConfig(split_k=s, block_m=16, block_n=32, block_k=64),
    )
    assert got.data_ptr() == out.data_ptr()
    assert_close_to_ref(got, reference_mm(a, b, epilogue, bias_t), k, f"{kernel}/{dtype}/{epilogue}")


def _random_cases(n_cases: int, seed: int):
    rng = random.Random(seed)
    for i in range(n_cases):
        m = rng.choice([1, 2, rng.randint(1, 70)])
        n = rng.choice([1, rng.randint(1, 70)])
        k = rng.choice([rng.randint(1, 64), rng.randint(65, 3000), 2039, 1024])  # 2039 is prime
        s = rng.randint(1, min(k, 40))
        yield pytest.param(
            m,
            n,
            k,
            s,
            rng.choice(KERNELS),
            rng.choice(DTYPES),
            rng.choice(EPILOGUES),
            rng.choice(LAYOUTS),
            rng.choice(LAYOUTS),
            rng.choice([True, False]),
            rng.choice([16, 32, 64]),
            rng.choice([16, 32]),
            rng.choice([16, 32, 64, 128]),
            id=f"c{i}-{m}x{n}x{k}-s{s}",
        )


@pytest.mark.parametrize(
    "m,n,k,s,kernel,dtype,epilogue,la,lb,bias,bm,bn,bk", list(_random_cases(48, seed=20261130))
)
def test_random_shapes_layouts(
    m, n, k, s, kernel, dtype, epilogue, la, lb, bias, bm, bn, bk, device, poison_partials
):
    a, b, bias_t = _case(m, n, k, dtype, device, seed=m * 1_000_003 + n * 1009 + k, la=la, lb=lb, bias=bias)
    out_layout = "transposed" if (m + n) % 3 == 0 else "contiguous"  # the generic strided store too
    out = poisoned((m, n), dtype, device, out_layout)
    cfg = DecomposeKConfig(split_k=s, block_m=bm, block_n=bn, block_k=bk, xblock=32, rblock=8)
    got = matmul(a, b, kernel=kernel, epilogue=epilogue, bias=bias_t, config=cfg, out=out)
    assert_close_to_ref(got, reference_mm(a, b, epilogue, bias_t), k, f"{kernel} {la}/{lb}->{out_layout}")


@pytest.mark.parametrize("kernel", KERNELS + ("auto",))
def test_default_allocation_and_auto(kernel, device):
    a, b, _ = _case(5, 70, 777, torch.float32, device, seed=7)
    got = matmul(a, b, kernel=kernel)
    assert got.shape == (5, 70) and got.dtype == torch.float32 and got.is_contiguous()
    assert_close_to_ref(got, reference_mm(a, b), 777, kernel)


def test_split_override_and_empty_splits(device, poison_partials):
    # K=5 with S=4: ceil(5/4)=2 per split, so split 3 starts at 6 > K and holds nothing.
    a, b, _ = _case(3, 4, 5, torch.float32, device, seed=11)
    for kernel in KERNELS:
        got = matmul(a, b, kernel=kernel, split_k=4, out=poisoned((3, 4), torch.float32, device))
        assert_close_to_ref(got, reference_mm(a, b), 5, kernel)
    # split_k = K: one element of K per split.
    got = matmul(a, b, kernel="flat", split_k=5)
    assert_close_to_ref(got, reference_mm(a, b), 5, "S=K")


def test_tf32_is_opt_in(device):
    a, b, _ = _case(16, 16, 4096, torch.float32, device, seed=5)
    ref = reference_mm(a, b)
    ieee = matmul(a, b, kernel="two_stage", split_k=8)
    assert ((ieee.double().cpu() - ref).norm() / ref.norm()).item() < 1e-6
    tf32 = matmul(a, b, kernel="two_stage", split_k=8, allow_tf32=True)
    assert ((tf32.double().cpu() - ref).norm() / ref.norm()).item() < 3e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_deterministic_across_runs(kernel, device):
    a, b, bias = _case(40, 24, 3001, torch.bfloat16, device, seed=3, bias=True)
    cfg = DecomposeKConfig(split_k=13, block_m=16, block_n=16, block_k=64)
    first = matmul(a, b, kernel=kernel, config=cfg, epilogue="relu", bias=bias)
    for _ in range(3):
        again = matmul(a, b, kernel=kernel, config=cfg, epilogue="relu", bias=bias)
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))


def test_single_launch_resets_counters(device):
    """After a launch every counter is back at zero, so the next launch (or a graph replay) is right."""
    from moegemm.decompose_k import workspace

    a, b, _ = _case(48, 48, 512, torch.float32, device, seed=9)
    for s in (1, 3, 8):
        got = matmul(a, b, kernel="single_launch", split_k=s, config=DecomposeKConfig(split_k=s))
        assert_close_to_ref(got, reference_mm(a, b), 512, f"S={s}")
    for buf in workspace._COUNTERS.values():
        assert int(buf.abs().sum()) == 0


def test_zero_size(device):
    for m, n in ((0, 5), (5, 0), (0, 0)):
        a = torch.randn(m, 32).to(device)
        b = torch.randn(32, n).to(device)
        for kernel in KERNELS:
            assert matmul(a, b, kernel=kernel).shape == (m, n)
    # K = 0: the empty sum, then the epilogue.
    a, b = torch.randn(3, 0).to(device), torch.randn(0, 4).to(device)
    bias = torch.randn(4).to(device)
    got = matmul(a, b, epilogue="sigmoid", bias=bias)
    torch.testing.assert_close(got.cpu(), torch.sigmoid(bias.cpu()).expand(3, 4))


def test_relu_propagates_nan(device):
    a, b, _ = _case(16, 16, 64, torch.float32, device, seed=2)
    a[3, 7] = float("nan")
    got = matmul(a, b, kernel="single_launch", split_k=2, epilogue="relu").cpu()
    assert torch.isnan(got[3]).all() and not torch.isnan(got[:3]).any()


def test_heuristic_config_is_valid():
    for m in (1, 16, 64, 256, 4096):
        for k in (16, 100, 7168, 32768):
            for dt in DTYPES:
                cfg = heuristic_config(m, 256, k, dt, 132)
                assert 1 <= cfg.split_k <= k and cfg.split_k & (cfg.split_k - 1) == 0
    assert heuristic_config(16, 16, 8192, torch.bfloat16, 132).split_k == 64


# --- the seed's reference formulation --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_decompose_k(dtype, device):
    a, b, _ = _case(16, 24, 1024, dtype, device, seed=4)
    assert_close_to_ref(decompose_k(a, b, 8), reference_mm(a, b), 1024, "reference")
    assert_close_to_ref(decompose_k_relu(a, b, 16), reference_mm(a, b, "relu"), 1024, "reference relu")


def test_reference_rejects_indivisible_k(device):
    a, b = torch.randn(4, 100).to(device), torch.randn(100, 4).to(device)
    with pytest.raises(ValueError, match="not divisible"):
        decompose_k(a, b, 3)
    with pytest.raises(ValueError, match="inner dimensions"):
        decompose_k(a, torch.randn(99, 4).to(device), 4)


# --- bad input ---------------------------------------------------------------------------------------


def _ok(device, dtype=torch.float32):
    return torch.randn(8, 64, dtype=dtype).to(device), torch.randn(64, 16, dtype=dtype).to(device)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a, b: dict(a=a[0], b=b), ValueError, "a: expected a 2-D"),
        (lambda a, b: dict(a=a, b=b[None]), ValueError, "b: expected a 2-D"),
        (lambda a, b: dict(a=a, b=b[:32]), ValueError, "b: inner dimensions differ"),
        (lambda a, b: dict(a=a, b=b.half()), TypeError, "b: dtype"),
        (lambda a, b: dict(a=a.double(), b=b.double()), TypeError, "a: unsupported dtype float64"),
        (lambda a, b: dict(a=a.int(), b=b.int()), TypeError, "a: unsupported dtype int32"),
        (lambda a, b: dict(a=a.tolist(), b=b), TypeError, "a: expected a torch.Tensor"),
        (lambda a, b: dict(a=a, b=b, split_k=0), ValueError, "split_k: expected 1 <= split_k"),
        (lambda a, b: dict(a=a, b=b, split_k=65), ValueError, "split_k: expected 1 <= split_k"),
        (lambda a, b: dict(a=a, b=b, split_k=2.0), TypeError, "split_k: expected an int"),
        (
            lambda a, b: dict(a=a, b=b, bias=torch.zeros(15, device=a.device)),
            ValueError,
            "bias: expected shape",
        ),
        (lambda a, b: dict(a=a, b=b, bias=torch.zeros(16, device=a.device).half()), TypeError, "bias: dtype"),
        (lambda a, b: dict(a=a, b=b, bias=[0.0] * 16), TypeError, "bias: expected a torch.Tensor"),
        (lambda a, b: dict(a=a, b=b, kernel="magic"), ValueError, "kernel: unknown kernel 'magic'"),
        (lambda a, b: dict(a=a, b=b, epilogue="gelu"), ValueError, "epilogue: unknown epilogue 'gelu'"),
        (
            lambda a, b: dict(a=a, b=b, out=torch.empty(8, 15, device=a.device)),
            ValueError,
            "out: expected shape",
        ),
        (
            lambda a, b: dict(a=a, b=b, out=torch.empty(8, 16, device=a.device).half()),
            TypeError,
            "out: dtype",
        ),
        (lambda a, b: dict(a=a, b=b, config={"block_m": 16}), ValueError, "config: missing key 'split_k'"),
        (
            lambda a, b: dict(a=a, b=b, config={"split_k": 2, "blockm": 16}),
            ValueError,
            "config: unknown keys",
        ),
        (lambda a, b: dict(a=a, b=b, config={"split_k": 2, "block_m": 24}), ValueError, "config.block_m"),
        (lambda a, b: dict(a=a, b=b, config={"split_k": 2, "block_k": 8}), ValueError, "config.block_k"),
        (lambda a, b: dict(a=a, b=b, config=DecomposeKConfig(split_k=65)), ValueError, "config.split_k"),
        (lambda a, b: dict(a=a, b=b, config=3), TypeError, "config: expected DecomposeKConfig"),
    ],
)
def test_bad_input(mutate, exc, match, device):
    a, b = _ok(device)
    with pytest.raises(exc, match=match):
        matmul(**mutate(a, b))


def test_bad_device(device):
    a, b = _ok(device)
    meta = torch.empty(64, 16, device="meta")
    with pytest.raises(ValueError, match="b: on meta"):
        matmul(a, meta)
    if device == "cpu":
        import subprocess
        import sys

        # Without the interpreter a CPU tensor is refused with a clear message.
        code = (
            "import torch; from moegemm.decompose_k import matmul\n"
            "try:\n matmul(torch.randn(4, 8), torch.randn(8, 4))\n"
            "except ValueError as e: print('ERR', e)"
        )
        env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert "ERR a: CPU tensor given" in res.stdout, res.stdout + res.stderr


def test_packaged_tuned_table_is_valid_and_used():
    """The H200 table parses into valid configs; `auto` uses it (fp16 and epilogues fall back to the bf16,
    no-epilogue entry); a shape it lacks falls back to the heuristic."""
    from moegemm.decompose_k import configs
    from moegemm.epilogue import Epilogue

    table = configs._tuned_table("nvidia-h200")
    assert len(table) >= 28
    for (_dt, _m, _n, k, _epi), (best, per_kernel, times, act) in table.items():
        assert (best == "cublas" or best in per_kernel) and set(per_kernel) <= set(KERNELS)
        for cfg in per_kernel.values():
            assert 1 <= cfg.split_k <= k
        assert times[best] == min(times.values()) and act > 0
    best, per_kernel, _, _ = table[("bfloat16", 16, 16, 8192, "none")]
    got = configs._choose("nvidia-h200", torch.bfloat16, 16, 16, 8192, Epilogue.NONE, "auto", 132)
    assert best != "cublas" and got == (best, per_kernel[best], "tuned")
    assert configs._choose("nvidia-h200", torch.float16, 16, 16, 8192, Epilogue.RELU, "auto", 132) == got
    explicit = configs._choose("nvidia-h200", torch.bfloat16, 16, 16, 8192, Epilogue.NONE, "two_stage", 132)
    if "two_stage" in per_kernel:
        assert explicit == ("two_stage", per_kernel["two_stage"], "tuned")
    else:  # a kernel the table has no entry for gets the heuristic config
        assert explicit[0] == "two_stage" and explicit[2] == "heuristic"
    miss = configs._choose("nvidia-h200", torch.bfloat16, 17, 16, 8192, Epilogue.NONE, "auto", 132)
    assert miss[0] == configs.HEURISTIC_KERNEL and miss[2] == "heuristic"
    big = configs._choose("nvidia-h200", torch.bfloat16, 16384, 256, 7168, Epilogue.NONE, "auto", 132)
    assert big == ("cublas", None, "heuristic")
    assert configs._tuned_table("no-such-gpu") == {}


def test_auto_charges_cublas_the_separate_activation(monkeypatch):
    """The table is tuned without an epilogue; with one, cuBLAS needs an activation launch of its own, so
    `auto` takes our fastest kernel where it beats cuBLAS plus that charge, and cuBLAS elsewhere; with no
    epilogue the tuned best stands."""
    from moegemm.decompose_k import configs
    from moegemm.epilogue import Epilogue

    cfg = DecomposeKConfig(split_k=8, block_m=64, block_n=32)

    def entry(ours_us):
        return (
            "cublas",
            {"single_launch": cfg, "flat": cfg},
            {"cublas": 8.0, "single_launch": ours_us, "flat": 9.5},
            0.9,
        )

    table = {
        ("bfloat16", 256, 256, 7168, "none"): entry(8.5),
        ("bfloat16", 512, 256, 7168, "none"): entry(9.1),
    }
    monkeypatch.setattr(configs, "_tuned_table", lambda slug: table)
    configs._choose.cache_clear()
    try:
        pick = lambda m, epi: configs._choose("gpu", torch.bfloat16, m, 256, 7168, epi, "auto", 132)[0]  # noqa: E731
        assert pick(256, Epilogue.NONE) == "cublas"
        assert pick(256, Epilogue.SIGMOID) == "single_launch" and pick(256, Epilogue.RELU) == "single_launch"
        assert pick(512, Epilogue.SIGMOID) == "cublas"  # 9.1 > 8.0 + 0.9
        assert (
            configs._choose("gpu", torch.bfloat16, 256, 256, 7168, Epilogue.SIGMOID, "cublas", 132)[0]
            == "cublas"
        )
    finally:
        configs._choose.cache_clear()


def test_auto_charges_a_two_launch_kernel_its_second_launch(monkeypatch):
    """`auto` takes the backend of least tuned time plus one tiny kernel's time per launch it adds (a
    two-launch kernel's second launch; cuBLAS's separate activation where there is an epilogue), the table's
    best on a tie: the single launch over a two-launch kernel that won by less than that charge, the
    two-launch kernel where it won by more, cuBLAS over a two-launch kernel that beat it by less; an
    explicit kernel is taken as asked. Every packaged H200 entry follows the same rule."""
    from moegemm.decompose_k import configs
    from moegemm.epilogue import Epilogue

    cfg = DecomposeKConfig(split_k=8, block_m=64, block_n=32)

    def entry(cublas, flat, single, two_stage=30.0):
        times = {"cublas": cublas, "flat": flat, "two_stage": two_stage, "single_launch": single}
        return (min(times, key=times.get), {k: cfg for k in times if k != "cublas"}, times, 1.0)

    table = {
        ("float32", 48, 48, 8192, "none"): entry(20.0, 8.2, 8.8),  # flat by < 1.0: the single launch
        ("float32", 64, 64, 8192, "none"): entry(20.0, 8.2, 9.5),  # flat by more than its launch
        ("float32", 16, 16, 8192, "none"): entry(8.5, 8.2, 20.0),  # flat + 1.0 > cuBLAS
        ("float32", 32, 32, 8192, "none"): entry(9.0, 9.5, 10.4),  # cuBLAS best; with an epilogue too
        ("float32", 80, 80, 8192, "none"): entry(9.0, 9.5, 9.6),  # with an epilogue: the single launch
    }
    monkeypatch.setattr(configs, "_tuned_table", lambda slug: table)
    configs._choose.cache_clear()
    try:
        pick = lambda m, epi=Epilogue.NONE, kernel="auto": configs._choose(  # noqa: E731
            "gpu", torch.float32, m, m, 8192, epi, kernel, 132
        )[0]
        assert pick(48) == "single_launch" and pick(48, kernel="flat") == "flat"
        assert pick(64) == "flat"
        assert pick(16) == "cublas"
        assert pick(32) == "cublas" and pick(32, Epilogue.RELU) == "cublas"  # 10.0 < 10.4 < 10.5
        assert pick(80) == "cublas" and pick(80, Epilogue.RELU) == "single_launch"  # 9.6 < 10.0
    finally:
        configs._choose.cache_clear()
    h200 = configs._tuned_table("nvidia-h200")
    assert any(best in configs.TWO_LAUNCH for best, *_ in h200.values()), "no two-launch winner to check"
    for (dt, m, n, k, _), (best, per_kernel, times, act) in h200.items():
        for epi in (Epilogue.NONE, Epilogue.RELU):
            cost = {
                b: t + act * ((b in configs.TWO_LAUNCH) + (b == "cublas" and epi is not Epilogue.NONE))
                for b, t in times.items()
                if b == "cublas" or b in per_kernel
            }
            want = min(cost, key=lambda b: (cost[b], b != best))
            got = configs._choose("nvidia-h200", getattr(torch, dt), m, n, k, epi, "auto", 132)[0]
            assert got == want, (dt, m, n, k, epi)
            if best in configs.TWO_LAUNCH and times["single_launch"] <= times[best] + act:
                assert got != best  # the five fp32 shapes where flat won by less than its launch


def test_packaged_decompose_k_table_rebuilds_from_its_csv(tmp_path, monkeypatch):
    """The committed table is what the tuner's table step makes of the committed tuning CSV (configs, best
    backend, each backend's time); where it was rebuilt on a CPU, its activation charge is the floors'
    tiny-kernel time of the same GPU."""
    import json

    from experiments import tune_decompose_k as tdk
    from experiments.common import ROOT

    res = ROOT / "results" / "nvidia-h200"
    committed = json.loads((ROOT / "src/moegemm/tuned/decompose_k/nvidia-h200.json").read_text())
    import csv

    with open(res / "tune_decompose_k.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    act = json.loads((res / "floors.json").read_text())["measured"]["tiny_kernel_graph_us"]
    got = tdk.table_entries(rows, act)
    strip = lambda es: [{k: v for k, v in e.items() if k != "activation_us"} for e in es]  # noqa: E731
    assert strip(got) == strip(committed["entries"])
    if "rebuilt_from" in committed:
        assert got == committed["entries"]


# --- plans, cuBLAS dispatch, the custom op ----------------------------------------------------------


def test_plan_is_cached_per_shape_stride_and_alignment(device):
    from moegemm.decompose_k import plans

    a, b, _ = _case(20, 24, 300, torch.float32, device, seed=21)
    p1 = plans.plan(a, b, epilogue="relu")
    assert plans.plan(a.clone(), b.clone(), epilogue="relu") is p1  # same shapes, strides, alignment
    assert plans.plan(a, b, epilogue="none") is not p1
    assert plans.plan(a.t().contiguous().t(), b, epilogue="relu") is not p1  # other strides
    base = torch.randn(20 * 300 + 1).to(device)
    shifted = base[1:].view(20, 300)  # 4 bytes past a 16-byte boundary
    assert plans.plan(shifted, b, epilogue="relu") is not p1
    assert p1.matches(a, b) and not p1.matches(shifted, b)
    for x in (a, shifted):
        got = matmul(x, b, epilogue="relu", out=poisoned((20, 24), torch.float32, device))
        assert_close_to_ref(got, reference_mm(x, b, "relu"), 300, "plan")
    # a plan run directly computes what matmul does
    assert torch.equal(p1.run(a, b), matmul(a, b, epilogue="relu"))


def test_bad_input_is_still_refused_after_a_plan_exists(device):
    a, b = _ok(device)
    matmul(a, b)
    with pytest.raises(TypeError, match="b: dtype"):
        matmul(a, b.half())
    with pytest.raises(ValueError, match="out: expected shape"):
        matmul(a, b, out=torch.empty(8, 15, device=a.device))


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cublas_backend_applies_the_epilogue(epilogue, bias, device):
    a, b, bias_t = _case(9, 33, 130, torch.float32, device, seed=31, bias=bias)
    out = poisoned((9, 33), torch.float32, device, "transposed")
    got = matmul(a, b, kernel="cublas", epilogue=epilogue, bias=bias_t, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close_to_ref(got, reference_mm(a, b, epilogue, bias_t), 130, f"cublas {epilogue}")


def test_heuristic_choice():
    from moegemm.decompose_k.configs import heuristic_choice

    assert heuristic_choice(16, 16, 8192) == "single_launch"
    assert heuristic_choice(256, 256, 7168) == "single_launch"
    assert heuristic_choice(512, 256, 7168) == "cublas"  # past DK_MAX_OUTPUT
    assert heuristic_choice(64, 64, 100) == "cublas"  # K too short to split


@pytest.mark.parametrize("with_out", [False, True])
def test_torch_compile_fullgraph_traces_the_custom_op(with_out, device):
    """fullgraph=True: no graph break; the op's fake gives the compiler the output, the real one our
    kernel."""
    torch._dynamo.reset()
    a, b, bias = _case(12, 20, 260, torch.float32, device, seed=41, bias=True)

    def f(a, b, bias, out):
        y = matmul(
            a,
            b,
            epilogue="relu",
            bias=bias,
            config={"split_k": 3, "block_m": 16, "block_n": 16, "block_k": 32},
            out=out,
        )
        return y * 2.0

    out = poisoned((12, 20), torch.float32, device) if with_out else None
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = cf(a, b, bias, out)
    assert_close_to_ref(got, 2.0 * reference_mm(a, b, "relu", bias), 260, "compiled")
    if with_out:
        assert_close_to_ref(out, reference_mm(a, b, "relu", bias), 260, "compiled out")
    explained = torch._dynamo.explain(f)(a, b, bias, None)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_custom_op_fake_and_schema(device):
    """The custom op's schema and fake implementation (torch's opcheck), on the device the kernels run on."""
    from moegemm.decompose_k import api

    torch.library.opcheck(
        api.dk_matmul,
        (
            torch.randn(5, 40).to(device),
            torch.randn(40, 6).to(device),
            None,
            "two_stage",
            4,
            "relu",
            None,
            False,
        ),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_fast_launch_arguments_follow_the_kernel_signature(device):
    """The plan's direct launch (a BoundKernel) passes the kernel's arguments by position: kernel_args must
    name every argument of the kernel, and the six it passes anew on every call (the pointers) lead."""
    from moegemm.decompose_k import plans, single_launch
    from moegemm.decompose_k.configs import Prepared
    from moegemm.epilogue import Epilogue

    a, b, _ = _case(8, 24, 256, torch.float32, device, seed=51)
    out = torch.empty(8, 24).to(device)
    p = Prepared(a=a, b=b, out=out, bias=None, epilogue=Epilogue.RELU, allow_tf32=False)
    cfg = DecomposeKConfig(split_k=4, block_m=16, block_n=16, block_k=32)
    for coop in (True, False):
        args = single_launch.kernel_args(p, cfg, None, None, coop)
        names = single_launch._single_launch_kernel.arg_names
        assert list(args) == list(names) or sorted(args) == sorted(names)
        assert names[:7] == ["a_ptr", "b_ptr", "p_ptr", "c_ptr", "bias_ptr", "counter_ptr", "M"]
        assert plans._DYNAMIC == 6
        assert args["COOP"] is coop and args["SLICE"] * cfg.split_k >= cfg.block_m * cfg.block_n


def test_plan_refuses_bad_input_by_name_and_runs_empty_shapes(device):
    from moegemm.decompose_k import plan

    with pytest.raises(TypeError, match="a: expected a torch.Tensor"):
        plan([[1.0]], torch.randn(1, 1).to(device))
    a, b = torch.randn(0, 32).to(device), torch.randn(32, 5).to(device)
    got = plan(a, b).run(a, b)
    assert got.shape == (0, 5)


def test_legacy_config_fields_read_at_their_constant_value():
    """group_m and reduce_warps are constants now; older tables and CSVs that hold them at those values still
    read, other values are refused by name."""
    from moegemm.decompose_k.configs import GROUP_M, REDUCE_WARPS

    cfg = DecomposeKConfig.coerce({"split_k": 4, "group_m": GROUP_M, "reduce_warps": REDUCE_WARPS})
    assert cfg == DecomposeKConfig(split_k=4)
    for bad in ({"group_m": 4}, {"reduce_warps": 8}):
        with pytest.raises(ValueError, match=f"config.{next(iter(bad))}: no longer a config field"):
            DecomposeKConfig.coerce({"split_k": 4, **bad})


def test_occupancy_model_rounds_registers_per_warp():
    """The occupancy model both kernel families share: registers are allocated per warp in units of 256, so
    255 registers per thread take 8192 per warp (two 4-warp programs fit in 64K, not more); shared memory
    counts 1 KiB reserved per program; threads and the resident-block limit cap the rest."""
    from moegemm._triton_common import programs_per_sm

    smem = 228 * 1024
    assert programs_per_sm(0, 255, 4, smem_per_sm=smem) == 2  # 8192 x 4 = 32K per program
    assert programs_per_sm(0, 256, 4, smem_per_sm=smem) == 2
    assert programs_per_sm(0, 250, 4, smem_per_sm=smem) == 2  # 8000 per warp rounds up to 8192
    assert programs_per_sm(0, 249, 4, smem_per_sm=smem) == 2
    assert programs_per_sm(0, 63, 4, smem_per_sm=smem) == 8  # 2016 -> 2048 per warp: 8 programs by registers
    assert programs_per_sm(0, 33, 1, smem_per_sm=smem) == 32  # 1056 -> 1280 per warp: 51 by registers
    assert programs_per_sm(0, 8, 16, smem_per_sm=smem) == 4  # threads: 2048 / 512
    assert programs_per_sm(smem // 2 - 1024, 32, 4, smem_per_sm=smem) == 2
    assert programs_per_sm(smem // 2, 32, 4, smem_per_sm=smem) == 1  # 1 KiB reserved each
    assert programs_per_sm(smem, 32, 4, smem_per_sm=smem) == 0


def test_bound_kernel_launches_through_either_launcher_convention():
    """BoundKernel passes the leading arguments anew and keeps the rest (constexprs included, in the kernel's
    order): straight through a compiled launcher of the known convention, or through the compiled kernel's
    own ``compiled[grid](...)`` where the launcher's convention is another (a Triton this code does not
    know). Faked compiled kernels: nothing is compiled or launched."""
    import triton
    import triton.language as tl

    from moegemm._triton_common import BoundKernel

    @triton.jit
    def kern(x_ptr, y_ptr, n, stride, BLOCK: tl.constexpr, FLAG: tl.constexpr = 3):
        pass

    calls = []

    class Known:
        function, packed_metadata = "fn", "meta"

        def run(
            self,
            gridX,
            gridY,
            gridZ,
            stream,
            function,
            kernel_metadata,
            launch_metadata,
            launch_enter_hook,
            launch_exit_hook,
            *args,
        ):
            calls.append(("direct", (gridX, gridY, gridZ), stream, function, kernel_metadata, args))

    class Older:  # the launcher of Triton versions that take everything after the function as *args
        function, packed_metadata = "fn", "meta"

        def run(self, gridX, gridY, gridZ, stream, function, *args):
            calls.append(("direct", (gridX, gridY, gridZ), stream, function, args[0], args[4:]))

    class Other:
        function, packed_metadata = "fn", "meta"

        def run(self, grid, stream, *args):  # a launcher of another convention
            raise AssertionError("must not be called")

        def __getitem__(self, grid):
            return lambda *args, stream=None: calls.append(("own", grid, stream, args))

    for compiled in (Known(), Older(), Other()):
        bound = BoundKernel(kern, (5,), ("x0", "y0", 7, 16), dict(BLOCK=32), 2, compiled=compiled)
        bound(99, "x1", "y1")
        bound.on_grid((2, 3), 98, ("x2", "y2"))
    assert calls == [
        ("direct", (5, 1, 1), 99, "fn", "meta", ("x1", "y1", 7, 16, 32, 3)),
        ("direct", (2, 3, 1), 98, "fn", "meta", ("x2", "y2", 7, 16, 32, 3)),
    ] * 2 + [
        ("own", (5, 1, 1), 99, ("x1", "y1", 7, 16, 32, 3)),
        ("own", (2, 3, 1), 98, ("x2", "y2", 7, 16, 32, 3)),
    ]
    with pytest.raises(ValueError, match="slots"):
        BoundKernel(kern, (1,), ("x0",), dict(BLOCK=32), 2, compiled=Known())


# ----------------------------------------------------------------------------------------------------------
# Gradients (the router trains through matmul: the custom op's registered autograd)
# ----------------------------------------------------------------------------------------------------------


def _grads(a, b, bias, dy, f):
    """The gradients of a, b and bias of sum(f(a, b, bias) * dy)."""
    leaves = [t.detach().clone().requires_grad_() for t in (a, b, bias)]
    f(*leaves).backward(dy.to(leaves[0].dtype))
    return [t.grad for t in leaves]


def _ref(epilogue):
    act = {"none": lambda z: z, "relu": torch.relu, "sigmoid": torch.sigmoid}[epilogue]
    return lambda a, b, bias: act(a @ b + bias)


def _max_rel(got, want) -> float:
    assert got.shape == want.shape and not torch.isnan(got).any()
    return ((got.double().cpu() - want.cpu()).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("kernel", ["auto", *KERNELS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gradients_match_float64(kernel, dtype, epilogue, device, poison_partials):
    """dA, dB and dbias of every kernel and epilogue on fresh random data (a transposed weight, as the router
    holds it), the Triton kernels as the forward (split_k set) so that the gradient does not depend on which
    backend ran:

    - the backward's own arithmetic: against float64 from our forward's output (the epilogue's derivative
      reads it), within that dtype's rounding;
    - the whole: against float64 autograd of the float64 forward, no further from it than the same
      computation in eager PyTorch at that dtype, twice over (six times for bf16 under Triton's interpreter,
      whose truncating casts double the output's rounding, which the sigmoid's 1 - c magnifies), or that
      dtype's rounding."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kernel}{dtype}{epilogue}".encode()))
    a = make((7, 200), dtype, "contiguous", gen, device)
    w = make((24, 200), dtype, "contiguous", gen, device)  # the router's [N, K] weight, used as w.t()
    bias = torch.randn(24, generator=gen).to(dtype).to(device)
    dy = torch.randn(7, 24, generator=gen).to(device)
    split = None if kernel in ("auto", "cublas") else 3
    outs = []

    def ours(a, w, bias):
        outs.append(matmul(a, w.t(), kernel=kernel, split_k=split, epilogue=epilogue, bias=bias))
        return outs[-1]

    got = _grads(a, w, bias, dy, ours)
    floor = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    # the backward given our forward's output c
    c, d = outs[0].detach().double(), dy.double()
    dz = {"none": d, "relu": d * (c > 0), "sigmoid": d * c * (1 - c)}[epilogue]
    given = (dz @ w.double(), dz.t() @ a.double(), dz.sum(0))
    for name, g, r in zip(("a", "w", "bias"), got, given):
        assert g.dtype == dtype, name
        assert _max_rel(g, r) <= floor, (name, "given our output", _max_rel(g, r))
    # the whole, against float64 throughout and against eager PyTorch at this dtype
    want = _grads(a.double(), w.double(), bias.double(), d, lambda a, w, b: _ref(epilogue)(a, w.t(), b))
    eager = _grads(a, w, bias, dy, lambda a, w, b: _ref(epilogue)(a, w.t(), b))
    times = 6 if dtype is torch.bfloat16 and not torch.cuda.is_available() else 2
    for name, g, r, e in zip(("a", "w", "bias"), got, want, eager):
        assert _max_rel(g, r) <= max(times * _max_rel(e, r), floor), (name, _max_rel(g, r), _max_rel(e, r))


def test_gradients_only_where_asked_and_under_torch_compile(device):
    """Only the inputs that require grad get one; a compiled step (fullgraph) gives the eager gradients;
    ``out`` with a recorded gradient is refused by name; with no gradient recorded, the call makes none."""
    torch._dynamo.reset()
    a, b, bias = _case(6, 16, 300, torch.float32, device, seed=5, bias=True)
    w = b.t().contiguous().requires_grad_()
    x = a.clone().requires_grad_()
    matmul(x, w.t(), epilogue="relu", bias=bias, split_k=4).sum().backward()
    assert x.grad is not None and w.grad is not None and bias.grad is None

    def step(x, w, bias):
        return matmul(x, w.t(), epilogue="sigmoid", bias=bias, split_k=4).square().sum()

    assert_compiled_grads_match(step, (a, w, bias), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="out"):
        matmul(x, w.t(), out=torch.empty(6, 16, device=device))
    with torch.no_grad():
        assert not matmul(x, w.t(), split_k=4).requires_grad
    assert not matmul(a, b, split_k=4).requires_grad


def test_cublas_path_keeps_fp32_products_ieee_unless_asked(monkeypatch, device):
    """allow_tf32 holds on the cuBLAS path whatever the process-wide setting (set through the new API, the
    legacy flag or set_float32_matmul_precision): cuBLAS runs inside fp32_matmul_precision, which sets the
    precision to the call's choice and puts the setting back exactly as it was; 16-bit calls leave it
    alone."""
    from moegemm.decompose_k import precision

    m = torch.backends.cuda.matmul
    before = m.fp32_precision
    try:
        for setting in ("tf32", "ieee", "none"):
            for via in ("api", "medium"):
                if via == "medium":
                    torch.set_float32_matmul_precision("medium" if setting == "tf32" else "highest")
                else:
                    m.fp32_precision = setting
                was = m.fp32_precision
                generic = torch.get_float32_matmul_precision() if via == "medium" else None
                for asked in (False, True):
                    with precision.fp32_matmul_precision(asked):
                        assert m.fp32_precision in (("tf32",) if asked else ("ieee", "none"))
                        if m.fp32_precision == "none":
                            assert torch.get_float32_matmul_precision() == "highest"
                    assert m.fp32_precision == was
                    if generic is not None:  # still readable as set: no mix of the two APIs left
                        assert torch.get_float32_matmul_precision() == generic
        seen = []
        real = torch.mm
        monkeypatch.setattr(torch, "mm", lambda *a, **k: seen.append(m.fp32_precision) or real(*a, **k))
        m.fp32_precision = "tf32"
        a, b = torch.randn(4, 64, device=device), torch.randn(64, 8, device=device)
        matmul(a, b, kernel="cublas")
        matmul(a, b, kernel="cublas", allow_tf32=True)
        matmul(a.bfloat16(), b.bfloat16(), kernel="cublas")
        assert seen == ["ieee", "tf32", "tf32"] and m.fp32_precision == "tf32"
    finally:
        m.fp32_precision = before


def _router_plan_configs():
    """(T, config) of the router's single-launch plans at T = 1..256 under the packaged H200 table."""
    from moegemm.decompose_k.configs import _choose
    from moegemm.epilogue import Epilogue

    out = []
    for t in range(1, 257):
        backend, cfg, _ = _choose("nvidia-h200", torch.bfloat16, t, 256, 7168, Epilogue.SIGMOID, "auto", 132)
        if backend == "single_launch":
            out.append((t, cfg))
    return out


@pytest.mark.parametrize("order", ["rising", "falling"])
@pytest.mark.parametrize("coop", [False, True], ids=["last-arriver", "cooperative"])
def test_plans_share_their_workspace_within_the_safe_class(coop, order, monkeypatch):
    """The router's plans at every T from 1 to 256 hold one workspace per class (any plan in the last-arriver
    form; the same S and tile size in the cooperative one), grown by doubling, instead of one each: the
    buffers alive at once sum to less than twice each class's largest. A plan keeps the buffer it was given
    when a larger one replaces it, and plans that may not share never do, whichever plans come first."""
    from moegemm.decompose_k import workspace

    monkeypatch.setattr(workspace, "_PARTIALS", {})
    monkeypatch.setattr(workspace, "_COOP", {})
    monkeypatch.setattr(workspace, "_COUNTERS", {})
    cpu = torch.device("cpu")
    plans = _router_plan_configs()
    assert len(plans) > 200
    if order == "falling":
        plans.reverse()
    held, own_bytes = [], 0
    for t, cfg in plans:
        ws, cnt = workspace.plan_state(t, 256, cfg, cpu, 7, coop)
        need = workspace.workspace_numel(t, 256, cfg)
        assert ws.numel() >= need and cnt.numel() >= workspace.grid(t, 256, cfg)[0]
        assert (ws.dtype, cnt.dtype) == ((torch.int64, torch.int64) if coop else (torch.float32, torch.int32))
        own_bytes += need * ws.element_size()
        held.append((cfg, ws, cnt))
        again = workspace.plan_state(t, 256, cfg, cpu, 7, coop)  # the same plan's state again: no growth
        assert again[0] is ws and again[1] is cnt
    # The distinct buffers the plans hold, against each class's largest.
    distinct = {ws.data_ptr(): ws for _, ws, _ in held}
    total = sum(ws.numel() * ws.element_size() for ws in distinct.values())
    classes = {}
    for cfg, ws, cnt in held:
        key = (cfg.split_k, cfg.block_m * cfg.block_n) if coop else "any"
        classes.setdefault(key, set()).add((ws.data_ptr(), ws.numel() * ws.element_size(), cnt.data_ptr()))
    bound = sum(2 * max(b for _, b, _ in members) for members in classes.values())
    assert total < bound, (total, bound)
    assert total * 4 < own_bytes, (total, own_bytes)  # one buffer per plan held several times more
    if coop:
        # Classes never share a workspace or counters, and a workspace goes with one set of counters.
        served: dict = {}
        for cfg, ws, cnt in held:
            served.setdefault(("ws", ws.data_ptr()), set()).add((cfg.split_k, cfg.block_m * cfg.block_n))
            served.setdefault(("cnt", cnt.data_ptr()), set()).add((cfg.split_k, cfg.block_m * cfg.block_n))
            served.setdefault(("pair", ws.data_ptr()), set()).add(cnt.data_ptr())
        assert all(len(v) == 1 for v in served.values()), served
        assert len(classes) > 1
        # A plan keeps its pair while a larger plan of its class grows the class's pair.
        (t0, cfg0) = plans[0]
        first = workspace.plan_state(t0, 256, cfg0, cpu, 8, True)
        bigger = workspace.plan_state(t0 * 64, 256, cfg0, cpu, 8, True)
        assert bigger[1].numel() >= 2 * first[1].numel() and first[0].data_ptr() != bigger[0].data_ptr()
        assert workspace.plan_state(t0, 256, cfg0, cpu, 8, True)[0] is bigger[0]
    # Another stream gets buffers of its own.
    t, cfg = plans[-1]
    assert workspace.plan_state(t, 256, cfg, cpu, 9, coop)[0].data_ptr() not in distinct


@pytest.mark.parametrize("coop", [False, True], ids=["last-arriver", "cooperative"])
def test_a_plan_first_run_inside_a_graph_capture_gets_buffers_of_its_own(coop, monkeypatch):
    """What a capture allocates is filled only at replay: a plan whose state is made inside a capture shares
    nothing, and leaves nothing for the plans after it."""
    from moegemm.decompose_k import workspace

    monkeypatch.setattr(workspace, "_PARTIALS", {})
    monkeypatch.setattr(workspace, "_COOP", {})
    cpu = torch.device("cpu")
    by_cfg: dict = {}
    for t, cfg in _router_plan_configs():
        by_cfg.setdefault(cfg, []).append(t)
    cfg, ts = next((c, ts) for c, ts in by_cfg.items() if len(ts) > 1)  # two plans of one class
    t, t2 = max(ts), min(ts)
    shared = workspace.plan_state(t, 256, cfg, cpu, 7, coop)
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)
    own = workspace.plan_state(t2, 256, cfg, cpu, 7, coop)
    assert own[0].data_ptr() != shared[0].data_ptr()
    assert own[0].numel() >= workspace.workspace_numel(t2, 256, cfg)
    if coop:
        assert own[1].data_ptr() != shared[1].data_ptr() and int(own[1].abs().sum()) == 0
    monkeypatch.setattr(workspace, "_capturing", lambda device: False)
    assert workspace.plan_state(t2, 256, cfg, cpu, 7, coop)[0] is shared[0]
