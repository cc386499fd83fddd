"""Inconsistent offsets, expert ids and counts with the checks switched off (``validate=False``): every public
op either raises or returns, and no kernel reads or writes outside its tensors. Each case runs in a child
process (a heap overrun shows as a signal at exit, not at the bad call); on a GPU under compute-sanitizer's
memcheck where it is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import HAS_CUDA, ROOT

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from moegemm.grouped import (
        grouped_mm, grouped_mm_masked, grouped_mm_swiglu, moe_ffn, permute, route, route_and_permute,
        sorted_weights, unpermute,
    )

    dev = sys.argv[1]
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.bfloat16, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).to(dev).requires_grad_(grad)

    def i32(*v):
        return torch.tensor(v, dtype=torch.int32, device=dev)

    E, K, N = 4, 32, 16
    BAD_OFFSETS = {
        "past the rows": i32(0, 3, 3, 7, 12),
        "falling": i32(0, 8, 2, 6, 10),
        "negative and huge": i32(-5, 3, 2**30, 2, 10),
        "all past": i32(100, 200, 300, 400, 500),
    }
    BAD_IDS = {"past E": [[7, 1], [0, 2], [3, 9]], "negative": [[-1, 0], [2, -7], [1, 3]]}

    def case(name, fn):
        try:
            out = fn()
            if isinstance(out, torch.Tensor):
                out = [out]
            for t in out:
                t.float().sum().item()  # every output readable
            print("returned", name, flush=True)
        except (ValueError, TypeError, RuntimeError) as ex:
            print("raised", name, type(ex).__name__, str(ex)[:80], flush=True)

    for label, off in BAD_OFFSETS.items():
        x, w, rs = r(10, K), r(E, N, K), r(10, dtype=torch.float32)
        case(f"grouped_mm {label}", lambda: grouped_mm(x, w, off, row_scale=rs, validate=False))
        case(f"grouped_mm_swiglu {label}", lambda: grouped_mm_swiglu(x, r(E, 2 * N, K), off, validate=False))

        def train(off=off):
            xg, wg = r(10, K, grad=True), r(E, N, K, grad=True)
            y = grouped_mm(xg, wg, off, validate=False)
            y.float().square().sum().backward()
            return [y, xg.grad, wg.grad]

        case(f"grouped_mm backward {label}", train)

    for label, ids in BAD_IDS.items():
        ids = torch.tensor(ids, device=dev)
        x, wts = r(3, K), torch.rand(3, 2, generator=g).to(dev)
        wgu, wd = r(E, 2 * N, K), r(E, K, N)
        case(f"moe_ffn {label}", lambda: moe_ffn(x, ids, wts, wgu, wd, validate=False))

        def layer_train(ids=ids):
            xg, wg, dg = r(3, K, grad=True), r(E, 2 * N, K, grad=True), r(E, K, N, grad=True)
            y = moe_ffn(xg, ids, wts, wg, dg, validate=False)
            y.float().square().sum().backward()
            return [y, xg.grad, wg.grad, dg.grad]

        case(f"moe_ffn backward {label}", layer_train)

        def steps(ids=ids):
            plan = route(ids, E, validate=False)
            ys = grouped_mm(permute(x, plan), r(E, N, K), plan.group_offsets, validate=False)
            return unpermute(ys, plan, wts), sorted_weights(wts, plan)

        case(f"route, permute, grouped_mm, unpermute {label}", steps)
        case(f"route_and_permute {label}", lambda: route_and_permute(x, ids, wts, E, validate=False)[1:])

    xm, wm = r(E, 6, K), r(E, N, K)
    for label, mm in {"negative": i32(-3, 2, 0, 1), "past m_max": i32(9, 2**30, 6, 0)}.items():
        case(f"grouped_mm_masked {label}", lambda: grouped_mm_masked(xm, wm, mm))
        unwritten = lambda: grouped_mm_masked(xm, wm, mm, leave_tail_unwritten=True)  # noqa: E731
        case(f"grouped_mm_masked unwritten {label}", unwritten)
    print("done", flush=True)
    """
)


def _run(tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "bad_input.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(script), "cuda" if HAS_CUDA else "cpu"]
    if not HAS_CUDA:
        env["TRITON_INTERPRET"] = "1"
    elif shutil.which("compute-sanitizer"):
        # memory accesses are the question here, not CUDA API return codes (which the calls check themselves)
        cmd = [
            "compute-sanitizer",
            "--tool",
            "memcheck",
            "--report-api-errors",
            "no",
            "--error-exitcode",
            "97",
            *cmd,
        ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, check=False)


@pytest.mark.long
def test_every_public_op_stays_inside_its_tensors_with_checks_off(tmp_path):
    """Every case ends in a clean exception or a returned, readable result; the child exits 0 (no signal, no
    heap corruption at exit; on a GPU no memcheck error); each case reports."""
    res = _run(tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"exit {res.returncode}\n{out[-4000:]}"
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("returned", "raised"))]
    assert len(lines) == 4 * 3 + 2 * 4 + 2 * 2, out[-4000:]
    # the child's own lines (the sanitizer adds its own, each starting with "=========")
    own = [ln for ln in res.stdout.splitlines() if not ln.startswith("=========")]
    assert own and own[-1] == "done", out[-4000:]
    if "ERROR SUMMARY" in out:
        assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]


def test_a_tensor_on_another_device_names_what_is_accepted():
    """A meta tensor (or any device but CUDA and the CPU) is refused naming the argument, the device, and
    what is accepted: CUDA tensors, and CPU tensors under the interpreter."""
    import torch

    from moegemm.decompose_k import matmul
    from moegemm.grouped import grouped_mm

    a, b = torch.empty(4, 64, device="meta"), torch.empty(64, 8, device="meta")
    with pytest.raises(
        ValueError, match=r"a: unsupported device meta; expected a CUDA tensor, or a CPU tensor"
    ):
        matmul(a, b)
    x, w = torch.empty(6, 32, device="meta"), torch.empty(2, 16, 32, device="meta")
    off = torch.tensor([0, 3, 6], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"unsupported device meta; .*TRITON_INTERPRET=1"):
        grouped_mm(x, w, off)
