"""Grouped GEMM: routing, contiguous and masked kernels, baselines, against float64 (interpreter on CPU)."""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TOL, case_params

from conftest import HAS_CUDA
from moegemm import tuned
from moegemm.grouped import (
    GroupedConfig,
    grouped_mm,
    grouped_mm_masked,
    permute,
    route,
    sorted_weights,
    unpermute,
)
from moegemm.grouped import config as gconfig
from moegemm.grouped.baselines import capacity, dense_reference, padded_bmm, per_expert_loop, torch_grouped_mm

SENTINEL = 12345.0


def _ref(xs, w_kn, offsets, epilogue="none", scale=None):
    off = offsets.tolist()
    out = torch.zeros(xs.shape[0], w_kn.shape[2], dtype=torch.float64)
    for e in range(w_kn.shape[0]):
        out[off[e] : off[e + 1]] = xs[off[e] : off[e + 1]].double().cpu() @ w_kn[e].double().cpu()
    if epilogue == "relu":
        out = torch.relu(out)
    elif epilogue == "sigmoid":
        out = torch.sigmoid(out)
    if scale is not None:
        out = out * scale.double().cpu()[:, None]
    return out


def _sizes(rng: random.Random, e: int, kind: str) -> list[int]:
    if kind == "one-holds-all":
        sizes = [0] * e
        sizes[rng.randrange(e)] = rng.randint(1, 90)
        return sizes
    return [rng.choice([0, 0, 1, rng.randint(1, 40)]) for _ in range(e)]


def _cases(n, seed):
    rng = random.Random(seed)
    for i in range(n):
        e = rng.randint(1, 16)
        yield pytest.param(
            e,
            _sizes(rng, e, rng.choice(["random", "random", "one-holds-all"])),
            rng.choice([16, 40, 64, 97]),
            rng.choice([8, 33, 64, 130]),
            rng.choice(["kn", "nk"]),
            rng.choice(["none", "relu", "sigmoid"]),
            rng.choice([True, False]),
            rng.choice([torch.bfloat16, torch.float16, torch.float32]),
            rng.choice([True, False]),
            rng.choice([(16, 16, 32), (32, 64, 16), (16, 32, 64)])
            + (rng.choice([1, 2, 3, 8]),)
            + (rng.choice([False, True]),),
            id=f"g{i}-E{e}",
        )


@pytest.mark.parametrize("e,sizes,k,n,layout,epilogue,scale,dtype,persistent,blocks", list(_cases(40, 7)))
def test_grouped_mm_random(
    e, sizes, k, n, layout, epilogue, scale, dtype, persistent, blocks, device, monkeypatch
):
    bm, bn, bk, gm, tma = blocks  # gm: row tiles of an expert walked together (partial bands included)
    monkeypatch.setattr(gconfig, "GROUP_M", gm)
    cfg = GroupedConfig(block_m=bm, block_n=bn, block_k=bk, persistent=persistent, tma=tma)
    _check_grouped(e, sizes, k, n, layout, epilogue, scale, dtype, cfg, device)


@pytest.fixture
def launched(monkeypatch):
    """The kernels grouped_mm launches, in order (each launch still runs): through Triton, or on a GPU
    through a call's plan (launch.GroupedPlan)."""
    from moegemm.grouped import contiguous, launch

    kernels = []
    real, real_run = contiguous.launch, launch.GroupedPlan.run

    def run(plan, *a):
        kernels.append(plan.kernel)
        return real_run(plan, *a)

    monkeypatch.setattr(contiguous, "launch", lambda kernel, *a: (kernels.append(kernel), real(kernel, *a)))
    monkeypatch.setattr(launch.GroupedPlan, "run", run)
    return kernels


def _check_grouped(e, sizes, k, n, layout, epilogue, scale, dtype, cfg, device):
    g = torch.Generator().manual_seed(sum(sizes) * 131 + k * 7 + n)
    m = sum(sizes)
    offsets = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0).tolist()), dtype=torch.int32)
    xs = torch.randn(m, k, generator=g).to(dtype)
    w_kn = (torch.randn(e, k, n, generator=g) / k**0.5).to(dtype)
    w = w_kn if layout == "kn" else w_kn.transpose(1, 2).contiguous()
    rs = torch.rand(m, generator=g).to(dtype) if scale else None
    # Output with guard rows before and after, all at a sentinel: nothing may be written outside [M, N].
    buf = torch.full((m + 4, n + 3), SENTINEL, dtype=dtype, device=device)
    out = buf[2 : m + 2, 1 : n + 1]
    out.fill_(float("nan"))
    d = lambda t: t.to(device) if t is not None else None  # noqa: E731
    got = grouped_mm(
        d(xs), d(w), d(offsets), w_layout=layout, epilogue=epilogue, row_scale=d(rs), config=cfg, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    ref = _ref(xs, w_kn, offsets, epilogue, rs)
    rtol, atol = TOL[dtype]
    assert not torch.isnan(got.cpu().double()).any()
    torch.testing.assert_close(got.cpu().double(), ref, rtol=rtol, atol=atol * (k**0.5) + rtol)
    guard = buf.cpu().clone()
    guard[2 : m + 2, 1 : n + 1] = SENTINEL
    assert (guard == SENTINEL).all(), "wrote outside the output"


def test_route_permute_unpermute_roundtrip(device):
    torch.manual_seed(1)
    t, k, e = 37, 4, 9
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(device)
    plan = route(ids, e)
    sizes = torch.bincount(ids.flatten().cpu(), minlength=e)
    assert plan.group_sizes.cpu().tolist() == sizes.tolist()
    assert plan.group_offsets.cpu().tolist() == [0] + sizes.cumsum(0).tolist()
    # grouped by expert, and stable (token order kept within an expert)
    flat = ids.flatten().cpu()
    experts_in_order = flat[plan.sorted_slot.cpu().long()]
    assert (experts_in_order[1:] >= experts_in_order[:-1]).all()
    for ex in range(e):
        toks = plan.sorted_token_ids.cpu()[experts_in_order == ex]
        assert (toks[1:] > toks[:-1]).all()
    x = torch.randn(t, 24, device=device)
    xs = permute(x, plan)
    assert torch.equal(xs.cpu(), x.cpu()[plan.sorted_token_ids.cpu().long()])
    wts = torch.rand(t, k, device=device)
    y = unpermute(xs, plan, wts)  # identity "GEMM": y = x * sum_j w[t, j]
    torch.testing.assert_close(y.cpu(), x.cpu() * wts.cpu().sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
    # the fused-gating path: row_scale in sorted order, then unpermute without weights
    y2 = unpermute(xs * sorted_weights(wts, plan)[:, None], plan, None)
    torch.testing.assert_close(y2.cpu(), y.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "t,k,e",
    [
        (1, 1, 1),
        (3, 2, 5),
        (5, 4, 60),
        (3, 2, 300),
        (16, 8, 128),
        (17, 8, 128),
        (300, 6, 160),
        (90, 3, 300),
        (700, 2, 8),
    ],
)
@pytest.mark.parametrize("load", ["uniform", "skewed"])
def test_routing_kernels_give_the_stable_sort_plan(t, k, e, load, device):
    """The routing kernels (one program up to 128 slots, its blocks sized to the slots and experts; else
    count, scan and place over chunks of 128, with experts in steps of 128) against a stable sort by expert
    id, element for element, for every integer id dtype; an id out of range clears the check's flag and still
    leaves a permutation."""
    from moegemm.grouped.routing import _route_torch
    from moegemm.grouped.routing_kernels import plan_arrays

    g = torch.Generator().manual_seed(t * 31 + e)
    if load == "uniform":
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    else:  # most copies on the last expert and its neighbours (a long run within every chunk)
        ids = (e - 1 - torch.randint(0, min(e, 3), (t, k), generator=g)).clamp_min(0)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if dtype == torch.uint8 and e > 255:
            continue
        flat = ids.reshape(-1).to(dtype).to(device)
        *got, ok = plan_arrays(flat, e, k)
        want = _route_torch(flat.to(torch.int64), e, k)
        for name, a, b in zip(
            ("sorted_token_ids", "sorted_slot", "slot_rows", "group_sizes", "group_offsets"), got, want
        ):
            assert a.dtype == torch.int32 and torch.equal(a, b), (name, dtype)
        assert bool(ok)
    bad = ids.reshape(-1).clone()
    bad[-1] = e  # past the last expert
    *got, ok = plan_arrays(bad.to(device), e, k)
    assert not bool(ok)
    assert torch.equal(torch.sort(got[1].long().cpu()).values, torch.arange(bad.numel()))  # a permutation
    assert int(got[4][-1]) == bad.numel()


@pytest.mark.parametrize(
    "t,k,e", [(1, 1, 1), (1, 8, 256), (5, 4, 60), (16, 4, 60), (16, 8, 128), (17, 8, 128), (70, 6, 40)]
)
@pytest.mark.parametrize("h", [1, 100, 700])
def test_route_and_permute_matches_its_three_steps(t, k, e, h, device, monkeypatch):
    """route_and_permute against route, permute and sorted_weights, element for element: the gathering plan
    (up to 64 slots one launch, its column blocks short of H, one or several programs; past them the count,
    the scan and the placement with its gathers, over several chunks and column blocks); x in every float
    dtype, with rows further apart than H (a slice) and with a column stride (a transposed view, which takes
    the three steps); gating weights in fp32 and bf16. Each path's launches counted; bad arguments refused
    by name."""
    from moegemm.grouped import route_and_permute
    from moegemm.grouped import routing_kernels as rk

    calls = []
    for name in ("plan_and_gather", "plan_arrays"):
        real = getattr(rk, name)
        monkeypatch.setattr(
            "moegemm.grouped.routing." + name,
            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw),
        )
    g = torch.Generator().manual_seed(t * 13 + e + h)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    for dtype, wdtype in (
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.float32),
    ):
        wide = torch.randn(t, h + 3, generator=g).to(dtype).to(device)
        wts = torch.rand(t, k, generator=g).to(wdtype).to(device)
        for x in (
            wide[:, :h],
            wide[:, :h].contiguous(),
            torch.randn(h, t, generator=g).to(dtype).to(device).T,
        ):
            fused = x.stride(1) == 1
            calls.clear()
            plan, xs, ws = route_and_permute(x, ids, wts, e)
            assert calls == (["plan_and_gather"] if fused else ["plan_arrays"] if t * k > 0 else [])
            want = route(ids, e)
            for name in ("sorted_token_ids", "sorted_slot", "slot_rows", "group_sizes", "group_offsets"):
                assert torch.equal(getattr(plan, name), getattr(want, name)), name
            assert (plan.num_tokens, plan.top_k) == (t, k)
            assert xs.dtype == dtype and torch.equal(xs, permute(x, want))
            assert ws.dtype == wdtype and torch.equal(ws, sorted_weights(wts, want))
    x = torch.randn(t, h).to(device)
    wts = torch.rand(t, k).to(device)
    with pytest.raises(ValueError, match="x: has"):
        route_and_permute(x[:-1] if t > 1 else torch.randn(2, h).to(device), ids, wts, e)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        route_and_permute(x, ids, wts[:, :0], e)
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        route_and_permute(x[0], ids, wts, e)
    if device == "cpu":  # on a GPU, a device-side assertion
        with pytest.raises(ValueError, match="topk_ids: expert ids must be in"):
            route_and_permute(x, ids + e, wts, e)


def test_routing_kernels_refuse_counts_past_32_bit_offsets():
    """More per-chunk counts than 32-bit offsets reach: a ValueError naming the argument, before any launch
    (meta tensors: nothing is allocated)."""
    from moegemm.grouped.routing_kernels import plan_arrays

    with pytest.raises(ValueError, match="topk_ids: .*32-bit offsets"):
        plan_arrays(torch.empty(2**30, dtype=torch.int32, device="meta"), 128, 8)


@pytest.mark.parametrize("t,k,e,n", [(1, 1, 1, 1), (5, 2, 4, 1500), (19, 8, 8, 40), (0, 2, 4, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_unpermute_gathers_each_tokens_rows_in_float32(device, t, k, e, n, dtype, strided):
    """The un-permute (a gather kernel where Triton runs, torch ops otherwise) against float64, with and
    without gating weights, on a row-strided or column-strided y_sorted; both paths agree with each other."""
    from moegemm.grouped import routing

    torch.manual_seed(t * 31 + n)
    ids = (
        torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.empty(0, k, dtype=torch.int64)
    )
    plan = route(ids.to(device), e)
    big = torch.randn(t * k, 2 * n + 3, device=device).to(dtype)
    y = big[:, 1 : n + 1] if strided else big[:, :n].contiguous()
    if strided:
        y = y.t().contiguous().t()  # column-major: stride(1) != 1
    wts = torch.rand(t, k, device=device)
    slot_of_row = plan.sorted_slot.cpu().long()
    rows = torch.empty(t * k, n, dtype=torch.float64)
    rows[slot_of_row] = y.cpu().double()
    rows = rows.view(t, k, n)
    for w in (wts, None):
        ref = (rows * (w.cpu().double()[..., None] if w is not None else 1)).sum(1)
        got = unpermute(y, plan, w)
        assert got.dtype == dtype and got.shape == (t, n)
        assert not torch.isnan(got.cpu().double()).any()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.cpu().double(), ref, rtol=tol, atol=tol)
        slots = y.index_select(0, plan.slot_rows).view(t, k, n).float()
        torch_path = ((slots * w.float()[..., None]) if w is not None else slots).sum(1).to(dtype)
        torch.testing.assert_close(got.cpu().double(), torch_path.cpu().double(), rtol=tol, atol=tol)
    assert routing.triton_here(y) == (device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1")


def test_moe_expert_path_end_to_end(device):
    """route -> permute -> grouped_mm with fused gating -> unpermute equals the dense float64 MoE sum."""
    torch.manual_seed(2)
    t, k, e, hidden, n = 21, 2, 6, 48, 40
    logits = torch.randn(t, e)
    wts, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    x = torch.randn(t, hidden)
    w = torch.randn(e, n, hidden) / hidden**0.5  # nn.Linear layout [E, N, K]
    plan = route(ids.to(device), e)
    xs = permute(x.to(device), plan)
    ys = grouped_mm(
        xs,
        w.to(device),
        plan.group_offsets,
        w_layout="nk",
        row_scale=sorted_weights(wts.to(device), plan),
        config=GroupedConfig(16, 16, 16),
    )
    y = unpermute(ys, plan, None).cpu().double()
    ref = torch.zeros(t, n, dtype=torch.float64)
    for ti in range(t):
        for j in range(k):
            ref[ti] += wts[ti, j].double() * (x[ti].double() @ w[ids[ti, j]].double().T)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tiles,layout,dtype",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        tiles={
            "grid": (GroupedConfig(16, 16, 16), 8),
            "persistent": (GroupedConfig(16, 16, 16, persistent=True), 2),
            "rowwise": (GroupedConfig(16, 16, 16), 1),
            "default": (None, 8),
            "prefill-tiles": (GroupedConfig(64, 16, 16, tma=True, flatten=True, tail_m=32), 8),
        },
        layout=["kn", "nk"],
        dtype={str(d): d for d in (torch.bfloat16, torch.float32)},
    ),
)
def test_masked_layout_ignores_rows_past_masked_m(tiles, layout, dtype, device, monkeypatch):
    """tiles: (config, gm). prefill-tiles: a tuned prefill config (TMA, tail tiles) given to the masked
    layout, whose row tiles shrink to m_max (20 rows: 32) below the config's tail_m; its TMA settings are not
    used. gm: the row tiles walked together (rowwise: one)."""
    cfg, gm = tiles
    monkeypatch.setattr(gconfig, "GROUP_M", gm)
    torch.manual_seed(3)
    e, m_max, k, n = 5, 20, 40, 24
    x = torch.randn(e, m_max, k).to(dtype)
    w_kn = (torch.randn(e, k, n) / k**0.5).to(dtype)
    w = w_kn if layout == "kn" else w_kn.transpose(1, 2).contiguous()
    masked = torch.tensor([0, 20, 7, 1, 16], dtype=torch.int32)
    # Poison the rows past masked_m in x too: they must not be read.
    for ex, mm in enumerate(masked.tolist()):
        x[ex, mm:] = float("nan")
    _check_masked_relu(x, w, w_kn, masked, layout, cfg, device)


def _check_masked_relu(x, w, w_kn, masked, layout, cfg, device) -> None:
    """grouped_mm_masked with ReLU into an output poisoned with SENTINEL, twice: its rows below masked_m
    against float64, and the rows past it zeros (the default) or, with leave_tail_unwritten, as they were."""
    e, m_max, k = x.shape
    n = w_kn.shape[2]
    rtol, atol = TOL[x.dtype]
    for unwritten in (False, True):
        out = torch.full((e, m_max, n), SENTINEL, dtype=x.dtype)
        got = grouped_mm_masked(
            x.to(device),
            w.to(device),
            masked.to(device),
            w_layout=layout,
            epilogue="relu",
            out=out.to(device),
            config=cfg,
            leave_tail_unwritten=unwritten,
        ).cpu()
        for ex, mm in enumerate(masked.tolist()):
            ref = torch.relu(x[ex, :mm].double() @ w_kn[ex].double())
            torch.testing.assert_close(got[ex, :mm].double(), ref, rtol=rtol, atol=atol * k**0.5 + rtol)
            tail = (got[ex, mm:] == SENTINEL) if unwritten else (got[ex, mm:] == 0)
            assert tail.all(), f"expert {ex}: rows past masked_m {'written' if unwritten else 'not zeros'}"


@pytest.mark.parametrize("persistent", [False, True])
def test_masked_m_values_are_clamped(persistent, device):
    """masked_m below 0 reads as 0 and above m_max as m_max (no row outside x is touched)."""
    torch.manual_seed(5)
    e, m_max, k, n = 3, 18, 32, 40
    x = torch.randn(e, m_max, k).to(device)
    w = (torch.randn(e, k, n) / k**0.5).to(device)
    cfg = GroupedConfig(16, 16, 16, persistent=persistent)
    out = torch.full((e, m_max, n), SENTINEL).to(device)
    masked = torch.tensor([-3, 25, 5], dtype=torch.int32).to(device)
    got = grouped_mm_masked(x, w, masked, w_layout="kn", out=out, config=cfg)
    assert (got[0] == 0).all()  # no rows: every row past masked_m, zeros
    ref = x[1].double() @ w[1].double()
    torch.testing.assert_close(got[1].double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[2, :5].double(), x[2, :5].double() @ w[2].double(), rtol=1e-5, atol=1e-4)
    assert (got[2, 5:] == 0).all()


def test_baselines(device):
    torch.manual_seed(4)
    t, k, e, hidden, n = 16, 2, 4, 32, 16
    ids = torch.tensor([[0, 1]] * 10 + [[2, 3]] * 6).to(device)
    plan = route(ids, e)
    xs = permute(torch.randn(t, hidden).to(device), plan)
    w = torch.randn(e, hidden, n).to(device)
    ref = _ref(xs.cpu(), w.cpu(), plan.group_offsets.cpu())
    for baseline in (per_expert_loop, torch_grouped_mm):
        got = baseline(xs, w, plan.group_offsets, "kn")
        torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dense_reference(xs, w, "kn").cpu(), (xs @ w[0]).cpu())
    y, dropped = padded_bmm(xs, w, plan, 1.0, "kn")
    c = capacity(t * k, e, 1.0)  # 8 rows per expert: experts 0 and 1 hold 10 each -> 2 + 2 dropped
    assert c == 8 and int(dropped) == 4
    off = plan.group_offsets.tolist()
    kept = torch.cat([torch.arange(off[ex], min(off[ex + 1], off[ex] + c)) for ex in range(e)])
    torch.testing.assert_close(y.cpu().double()[kept], ref[kept], rtol=1e-5, atol=1e-4)
    dropped_rows = torch.tensor(sorted(set(range(t * k)) - set(kept.tolist())))
    assert (y.cpu()[dropped_rows] == 0).all()
    y2, d2 = padded_bmm(xs, w, plan, 2.0, "kn")
    assert int(d2) == 0
    torch.testing.assert_close(y2.cpu().double(), ref, rtol=1e-5, atol=1e-4)


def _ok(device):
    xs = torch.randn(10, 16).to(device)
    w = torch.randn(3, 8, 16).to(device)  # [E, N, K], the default layout
    off = torch.tensor([0, 4, 4, 10], dtype=torch.int32).to(device)
    return xs, w, off


# Values (not shapes or types) that a GPU call checks on the device, with no host sync: a failed check there
# is a device-side assertion, which ends the process's CUDA context, so on a GPU these run in subprocesses.
DEVICE_CHECKED = ("not monotone", "end at M_total=10", "start at 0")


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (
            lambda xs, w, off: dict(x_sorted=xs[0], w=w, group_offsets=off),
            ValueError,
            "x_sorted: expected a 2-D",
        ),
        (lambda xs, w, off: dict(x_sorted=xs, w=w[0], group_offsets=off), ValueError, "w: expected a 3-D"),
        (lambda xs, w, off: dict(x_sorted=xs, w=w.half(), group_offsets=off), TypeError, "w: dtype"),
        (
            lambda xs, w, off: dict(x_sorted=xs.double(), w=w.double(), group_offsets=off),
            TypeError,
            "x_sorted: unsupported",
        ),
        (lambda xs, w, off: dict(x_sorted=xs, w=w[:, :, :8], group_offsets=off), ValueError, "w: K=8"),
        (lambda xs, w, off: dict(x_sorted=xs, w=w, group_offsets=off, w_layout="kn"), ValueError, "w: K=8"),
        (lambda xs, w, off: dict(x_sorted=xs, w=w, group_offsets=off, w_layout="kk"), ValueError, "w_layout"),
        (
            lambda xs, w, off: dict(x_sorted=xs, w=w, group_offsets=off[:3]),
            ValueError,
            "group_offsets: expected length",
        ),
        (
            lambda xs, w, off: dict(x_sorted=xs, w=w, group_offsets=off.float()),
            TypeError,
            "group_offsets: expected int32",
        ),
        (
            lambda xs, w, off: dict(
                x_sorted=xs, w=w, group_offsets=torch.tensor([0, 6, 4, 10], device=off.device)
            ),
            ValueError,
            "not monotone",
        ),
        (
            lambda xs, w, off: dict(
                x_sorted=xs, w=w, group_offsets=torch.tensor([0, 4, 4, 9], device=off.device)
            ),
            ValueError,
            "end at M_total=10",
        ),
        (
            lambda xs, w, off: dict(
                x_sorted=xs, w=w, group_offsets=torch.tensor([1, 4, 4, 10], device=off.device)
            ),
            ValueError,
            "start at 0",
        ),
        (
            lambda xs, w, off: dict(
                x_sorted=xs, w=w, group_offsets=off, row_scale=torch.ones(9, device=off.device)
            ),
            ValueError,
            "row_scale: expected shape",
        ),
        (
            lambda xs, w, off: dict(x_sorted=xs, w=w, group_offsets=off, epilogue="gelu"),
            ValueError,
            "epilogue",
        ),
        (
            lambda xs, w, off: dict(x_sorted=xs, w=torch.empty(3, 8, 16, device="meta"), group_offsets=off),
            ValueError,
            "w: on meta",
        ),
    ],
)
def test_grouped_mm_bad_input(mutate, exc, match, device):
    if device != "cpu" and match in DEVICE_CHECKED:
        pytest.skip(
            "a value checked on the GPU by a device-side assertion: test_grouped_gpu.py's subprocess test"
        )
    with pytest.raises(exc, match=match):
        grouped_mm(**mutate(*_ok(device)))


def test_routing_and_masked_bad_input(device):
    ids = torch.tensor([[0, 1], [2, 3]]).to(device)
    if device == "cpu":  # on a GPU, a device-side assertion (test_grouped_gpu.py's subprocess test)
        with pytest.raises(ValueError, match="expert ids must be in \\[0, 3\\)"):
            route(ids, 3)
        with pytest.raises(ValueError, match="expert ids"):
            route(torch.tensor([[0, -1]]).to(device), 4)
    with pytest.raises(ValueError, match="top_k=3 exceeds num_experts=2"):
        route(torch.zeros(2, 3, dtype=torch.int64).to(device), 2)
    with pytest.raises(TypeError, match="topk_ids: expected an integer"):
        route(ids.float(), 4)
    with pytest.raises(ValueError, match="topk_ids: expected a 2-D"):
        route(ids[0], 4)
    plan = route(ids, 4)
    with pytest.raises(ValueError, match="x: has 3 rows"):
        permute(torch.randn(3, 8).to(device), plan)
    with pytest.raises(ValueError, match="y_sorted: has 3 rows"):
        unpermute(torch.randn(3, 8).to(device), plan, None)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        unpermute(torch.randn(4, 8).to(device), plan, torch.ones(2, 3).to(device))
    x = torch.randn(2, 4, 8).to(device)
    w = torch.randn(2, 8, 8).to(device)
    with pytest.raises(ValueError, match="masked_m: expected an int tensor of shape"):
        grouped_mm_masked(x, w, torch.tensor([1], dtype=torch.int32).to(device))
    with pytest.raises(TypeError, match="masked_m: expected int32"):
        grouped_mm_masked(x, w, torch.tensor([1.0, 2.0]).to(device))
    with pytest.raises(ValueError, match="w: has 3 experts but x has 2"):
        grouped_mm_masked(x, torch.randn(3, 8, 8).to(device), torch.tensor([1, 2]).to(device))


def test_default_path_for_an_unseen_shape(monkeypatch, tmp_path):
    """A shape the tuned table lacks: the distilled shortlist of its regime (rows per expert <= 1, <= 16,
    <= 64, more), first config 'default'; once a call has timed it, the kept config is 'autotuned' for every
    later call of that (dtype, E, K, N, layout, rows bucket), this process's or (through the disk cache,
    written atomically) a later one's; a cache written by other versions is ignored. On the CPU (and under
    the interpreter) nothing is timed."""
    import json

    import moegemm.grouped.config as api
    from moegemm import autotune

    short = [(GroupedConfig(16, 64, 16 << i), GroupedConfig(16, 32, 16 << i)) for i in range(4)]
    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: tuple(short))
    monkeypatch.setattr(api, "gpu_slug", lambda x: "test-gpu")
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    x = lambda rows: torch.empty(rows, 64, dtype=torch.bfloat16)  # noqa: E731
    for rows, regime in ((8, 0), (16 * 8, 1), (17 * 8, 2), (64 * 8, 2), (65 * 8, 3)):
        assert api.choose_config(x(rows), 8, 32, "nk") == (short[regime][0], "default"), rows
        assert api.shortlist(rows, 8, 32, "test-gpu") == short[regime]
    assert not autotune.can_time(x(8))
    key = api.autotune_key(100 * 8, 64, torch.bfloat16, 8, 32, "nk", "test-gpu")
    # the shape's key, and the table whose shortlist was timed (none serves "test-gpu": the generic one)
    assert key == ("bfloat16", 8, 64, 32, "nk", 128, "generic")
    kept = GroupedConfig(128, 128, 64, num_warps=8, tma=True)
    autotune.remember("test-gpu", key, dataclasses.asdict(kept), {"0": 1.0})
    assert api.choose_config(x(100 * 8), 8, 32, "nk") == (kept, "autotuned")
    assert api.choose_config(x(90 * 8), 8, 32, "nk") == (kept, "autotuned")  # the same rows bucket
    assert api.choose_config(x(100 * 8), 8, 32, "kn")[1] == "default"  # another layout: not timed yet
    # a later process: the disk cache
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    assert api.choose_config(x(100 * 8), 8, 32, "nk") == (kept, "autotuned")
    path = autotune.cache_file("test-gpu")
    data = json.loads(path.read_text())
    assert [tuple(e["key"]) for e in data["entries"]] == [key]
    data["entries"][0]["versions"]["triton"] = "0.0"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    assert api.choose_config(x(100 * 8), 8, 32, "nk")[1] == "default"
    path.write_text("not json")  # a broken cache file is ignored too
    monkeypatch.setattr(autotune, "_LOADED", set())
    assert api.choose_config(x(100 * 8), 8, 32, "nk")[1] == "default"
    monkeypatch.setenv("MOEGEMM_AUTOTUNE", "0")
    assert not autotune.enabled()


def _fake_cuda(monkeypatch) -> list[tuple]:
    """torch.cuda's device, stream, event and sync calls as the autotuner makes them, faked on the CPU;
    returns the list the device and stream contexts entered are recorded in (kind, value, thread)."""
    import contextlib
    import threading

    entered: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)

    class Stream(str):  # a name that answers the query a pool thread makes to bind the device's context
        def query(self):
            return True

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream("the caller's stream"))

    @contextlib.contextmanager
    def device(d):
        entered.append(("device", d, threading.get_ident()))
        yield

    @contextlib.contextmanager
    def stream(st):
        entered.append(("stream", st, threading.get_ident()))
        yield

    class Event:  # each timing of a config reads as 1 ms
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return entered


def test_first_call_compiles_the_shortlist_side_by_side(monkeypatch):
    """The first call of an unseen shape launches every candidate kernel once from a pool of threads, all
    at once, each on the caller's device and stream and off the caller's thread (so the compiles overlap
    and nothing races the caller's queue); configs that differ only in their launch are launched once
    there; a candidate whose launch raises only off the caller's thread is still timed and can be kept;
    with MOEGEMM_COMPILE_THREADS=1 nothing is launched from a thread; a value that is not a positive
    integer raises, naming the variable."""
    import threading

    from moegemm import autotune
    from moegemm._runtime import compile_threads

    caller = threading.get_ident()
    entered = _fake_cuda(monkeypatch)
    launched: list[tuple] = []
    barrier = threading.Barrier(3, timeout=10)
    broken: list[str] = []

    def launch(c):
        launched.append((c, threading.get_ident()))
        if threading.get_ident() != caller:
            try:
                barrier.wait()  # the three kernels' first launches at once, or this breaks
            except threading.BrokenBarrierError:
                broken.append(c)
            if c == "b":
                raise RuntimeError("off the caller's thread only")

    monkeypatch.setenv("MOEGEMM_COMPILE_THREADS", "3")
    # "a2" differs from "a" in its launch only (kernel_of): not launched from the pool
    assert autotune.compile_side_by_side(launch, ["a", "b", "a2", "c"], kernel_of=lambda c: c[0]) == 3
    assert broken == [] and sorted(c for c, _ in launched) == ["a", "b", "c"]
    assert all(tid != caller for _, tid in launched)
    assert {(kind, what) for kind, what, _ in entered} == {("device", 3), ("stream", "the caller's stream")}
    assert len(entered) == 6 and all(tid != caller for *_, tid in entered)

    launched.clear()
    barrier.reset()
    best, times = autotune.fastest(
        launch, ["a", "b", "a2", "c"], parallel_compile=True, kernel_of=lambda c: c[0]
    )
    assert broken == [] and best in ("a", "b", "a2", "c") and sorted(times) == ["0", "1", "2", "3"]
    first = [c for c, tid in launched if tid == caller][:4]
    assert first == ["a", "b", "a2", "c"]  # then every config's own first launch, on the caller's thread

    launched.clear()
    monkeypatch.setenv("MOEGEMM_COMPILE_THREADS", "1")
    assert autotune.compile_side_by_side(launch, ["a", "b", "c"]) == 0 and launched == []
    for bad in ("many", "0", "-3"):
        monkeypatch.setenv("MOEGEMM_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="MOEGEMM_COMPILE_THREADS"):
            compile_threads(2)


def test_default_path_computes_the_product_on_an_unseen_shape(device, monkeypatch):
    """grouped_mm with no config on a shape no tuned entry covers runs the shortlist's first config (the
    interpreter does not time) and is right: merged tails and the mixed order, or plain pointer tiles."""
    import moegemm.grouped.config as api

    for first in (
        GroupedConfig(32, 16, 32, tma=True, tail_m=16, merge_tail=True, mix=2),
        GroupedConfig(16, 16, 32),
    ):
        monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
        monkeypatch.setattr(
            api, "_default_table", lambda slug, f=first: ((f, GroupedConfig(64, 64, 64)),) * 4
        )
        assert api.choose(76, 64, torch.bfloat16, "any", 4, 24, "nk") == (first, "default")
        for sizes in ([3, 0, 1, 2], [40, 0, 3, 33]):
            _check_grouped(len(sizes), sizes, 64, 24, "nk", "relu", True, torch.bfloat16, None, device)


@pytest.mark.parametrize("slug", tuned.packaged("grouped_default"))
def test_committed_default_table_is_the_distillation_of_the_committed_tuner_csv(slug, tmp_path):
    """Each card's committed shortlists (src/moegemm/tuned/grouped_default/<gpu>.json) are what
    experiments/distill_grouped.py makes of its committed tuner CSV, from the tune-set models alone: the
    held-out models' names appear nowhere in its input; the leave-one-model-out CSV is committed too."""
    import json

    import pandas as pd

    from experiments import distill_grouped
    from experiments.common import load_config

    ROOT = Path(__file__).resolve().parent.parent
    res = ROOT / "results" / slug
    out, loo = tmp_path / "t.json", tmp_path / "loo.csv"
    distill_grouped.main(["--csv", str(res / "tune_grouped.csv"), "--out", str(out), "--loo", str(loo)])
    committed = json.loads((ROOT / f"src/moegemm/tuned/grouped_default/{slug}.json").read_text())
    assert json.loads(out.read_text())["entries"] == committed["entries"]
    g = load_config()["grouped"]
    held = {m for m, v in g["models"].items() if v["split"] == "heldout"}
    assert held and not held & set(pd.read_csv(res / "tune_grouped.csv")["model"])
    assert set(committed["provenance"]["tune_models"]) == {
        m for m, v in g["models"].items() if v["split"] == "tune"
    }
    pd.testing.assert_frame_equal(pd.read_csv(loo), pd.read_csv(res / "distill_grouped.csv"))


def test_distilled_shortlist_is_greedy_over_cells():
    """The shortlist: first the config of the least geometric-mean slowdown, then the one that most lowers
    the slowdown of the fastest-of-the-shortlist; a config not timed in a cell counts as its slowest."""
    from experiments.distill_grouped import shortlist, slowdown

    times = {
        "c1": {"a": 10.0, "b": 12.0, "c": 20.0},
        "c2": {"a": 20.0, "b": 12.0, "c": 10.0},
        "c3": {"a": 10.0, "b": 11.0},
    }
    cells = ["c1", "c2", "c3"]
    assert shortlist(cells, times, 1) == ["b"]
    assert shortlist(cells, times, 2) == ["b", "a"]  # a: best in c1 and c3
    assert slowdown(cells, times, ["c"]) == pytest.approx(
        (2.0 * 1.0 * 1.1) ** (1 / 3)
    )  # c3: its slowest (11)
    assert slowdown(cells, times, ["a", "b", "c"]) == 1.0


def test_config_lookup_exact_nearest_generic(monkeypatch):
    import moegemm.grouped.config as api

    a, b = GroupedConfig(16, 64, 256), GroupedConfig(128, 128, 64, num_warps=8)
    table = {("bfloat16", 8, 64, 32, "nk", 1): a, ("bfloat16", 8, 64, 32, "nk", 128): b}
    monkeypatch.setattr(api, "_tuned_table", lambda slug: table)
    monkeypatch.setattr(api, "gpu_slug", lambda x: "test-gpu")
    x = lambda rows: torch.empty(rows, 64, dtype=torch.bfloat16)  # noqa: E731
    assert api.choose_config(x(8), 8, 32, "nk") == (a, "tuned")  # 1 row per expert
    assert api.choose_config(x(8 * 100), 8, 32, "nk") == (b, "tuned")  # bucket 128
    assert api.choose_config(x(8 * 3), 8, 32, "nk") == (a, "tuned-nearest")  # bucket 4: nearer to 1
    assert api.choose_config(x(8 * 40), 8, 32, "kn") == (b, "tuned-nearest")  # bucket 64, other layout
    assert api.choose_config(x(1), 8, 32, "nk") == (a, "tuned-nearest")  # bucket 1/8: nearest is 1
    # below a row per expert the bucket is a fraction: 1 and 8 tokens of a 256-expert top-8 model apart
    assert [api.rows_bucket(r, 256) for r in (8, 64, 256, 257, 512, 513)] == [1 / 32, 1 / 4, 1, 2, 2, 4]
    assert [api.rows_bucket(r, 128) for r in (0, 9, 127)] == [1 / 128, 1 / 8, 1]
    c = GroupedConfig(32, 32, 32)
    table[("bfloat16", 256, 64, 32, "nk", 1 / 32)] = c
    assert api.choose_config(x(8), 256, 32, "nk") == (c, "tuned")
    assert api.choose_config(x(64), 256, 32, "nk") == (c, "tuned-nearest")  # 1/4: the only entry of E=256
    cfg, src = api.choose_config(x(8), 8, 48, "nk")  # no entry for this N, no table serves this GPU
    assert src == "generic" and cfg == api.heuristic_config(8, 8, 48)
    with pytest.raises(TypeError):
        GroupedConfig(group_m=8)  # a constant (config.GROUP_M), not a field
    # removed options: read from old tables and CSVs at their no-op values, refused otherwise
    assert GroupedConfig.from_dict(
        {"block_m": 32, "split_k": 1, "stream_k": False, "tma_store": 0, "extra_m": 0, "group_m": 8}
    ) == GroupedConfig(block_m=32)
    renamed = GroupedConfig.from_dict({"tma": True, "warp_specialize": True})  # flatten's former name
    assert renamed == GroupedConfig(tma=True, flatten=True)
    for bad in (dict(split_k=2), dict(stream_k=True), dict(tma_store=1), dict(extra_m=16), dict(group_m=4)):
        with pytest.raises(ValueError, match=f"config.{next(iter(bad))}: no longer an option"):
            GroupedConfig.from_dict({"block_m": 64, "tma": True, **bad})
    with pytest.raises(TypeError):
        GroupedConfig(split_k=2)


def test_untuned_configs_are_fitted_to_the_dtypes_shared_memory():
    """The distilled shortlists and the heuristic are written for 16-bit operands; in fp32 a config whose
    pipeline takes more shared memory than one program may have is given fewer stages, then a shallower K
    step, until it fits (fp32 128 x 256 x 64 in three stages, 294912 bytes, did not launch on the H200's
    232448). 16-bit configs that fit, tuned entries (measured in their own dtype) and the interpreter (no
    limit) keep theirs; every default and heuristic choice fits."""
    import moegemm.grouped.config as api

    h200 = 232448
    big = GroupedConfig(128, 256, 64, num_warps=8, num_stages=3)
    assert api.shared_bytes(big, 4) == 294912
    assert api.fitted(big, torch.float32, h200) == dataclasses.replace(big, num_stages=2)
    assert api.fitted(big, torch.bfloat16, h200) == big and api.fitted(big, torch.float32, None) == big
    deep = GroupedConfig(16, 64, 256, num_stages=4)  # two stages still too many on a 64 KB GPU
    assert api.fitted(deep, torch.float32, 65536) == GroupedConfig(16, 64, 64, num_stages=2)
    for limit in (h200, 101376, 65536):
        for rows, e, n in ((2, 16, 704), (64, 16, 704), (512, 16, 704), (4096, 16, 704), (8192, 8, 32)):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                size = torch.empty((), dtype=dtype).element_size()
                for slug in ("nvidia-h200", "no-such-gpu"):
                    cfg, src = api.choose(rows, 1000, dtype, slug, e, n, "nk", limit)
                    assert src in ("default", "generic") and api.shared_bytes(cfg, size) <= limit, cfg
                    short = api.fitted_shortlist(rows, e, n, slug, dtype, limit)
                    assert cfg == short[0] and len(set(short)) == len(short)
                    assert all(api.shared_bytes(c, size) <= limit for c in short)
                    if dtype != torch.float32 and limit == h200:  # what the shortlists were written for
                        assert short == list(dict.fromkeys(api.shortlist(rows, e, n, slug)))
    (dtype_s, e, k, n, layout, bucket), entry = next(
        item for item in api._tuned_table("nvidia-h200").items() if item[0][-1] >= 1
    )
    rows = int(bucket * e)
    cfg, src = api.choose(rows, k, getattr(torch, dtype_s), "nvidia-h200", e, n, layout, 1024)
    assert (cfg, src) == (entry, "tuned")


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("persistent,group_m", [(False, 8), (True, 2)])
def test_masked_tma_path(layout, persistent, group_m, monkeypatch, device):
    """The masked layout's TMA kernel (taken: 16-bit, aligned rows, K a multiple of BLOCK_K): an empty
    expert, a full one, one row, counts that are not multiples of the tile; rows past masked_m are NaN in x
    and must not reach a stored row, and are not written. (That they are not read at all rests on the
    in-kernel descriptor ending at masked_m[e]: a row past it could only reach a row that is not stored.)"""
    import moegemm.grouped.masked as api

    monkeypatch.setattr(gconfig, "GROUP_M", group_m)
    launches = []
    real = api._grouped_mm_masked_tma_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(api, "_grouped_mm_masked_tma_kernel", Spy())
    torch.manual_seed(13)
    e, m_max, k, n = 5, 40, 64, 40
    x = torch.randn(e, m_max, k).to(torch.bfloat16)
    w_kn = (torch.randn(e, k, n) / k**0.5).to(torch.bfloat16)
    w = w_kn if layout == "kn" else w_kn.transpose(1, 2).contiguous()
    masked = torch.tensor([0, 40, 7, 1, 33], dtype=torch.int32)
    for ex, mm in enumerate(masked.tolist()):
        x[ex, mm:] = float("nan")
    cfg = GroupedConfig(16, 16, 32, persistent=persistent, tma=True, tail_m=0)
    _check_masked_relu(x, w, w_kn, masked, layout, cfg, device)
    assert len(launches) == 2, "expected the TMA kernel"
    # fp32, or a K tail with "kn": the pointer kernel, same tiles
    launches.clear()
    grouped_mm_masked(
        x.float().to(device), w.float().to(device), masked.to(device), w_layout=layout, config=cfg
    )
    assert not launches


def test_masked_default_config_from_a_tuned_table_with_tail_tiles(monkeypatch, device):
    """The tuned table's choice for the masked layout (here a middle-regime config, 64-row tiles with 32-row
    tails) shrinks its row tiles to m_max; that must not trip over the tail setting the masked kernel does
    not use."""
    tuned = GroupedConfig(64, 32, 16, tma=True, tail_m=32)
    monkeypatch.setattr(gconfig, "choose", lambda *a, **k: (tuned, "tuned"))
    torch.manual_seed(11)
    e, m_max, k, n = 4, 12, 32, 40
    x, w = torch.randn(e, m_max, k), torch.randn(e, n, k) / k**0.5
    masked = torch.tensor([12, 0, 5, 9], dtype=torch.int32)
    out = torch.full((e, m_max, n), SENTINEL)
    got = grouped_mm_masked(
        x.to(device), w.to(device), masked.to(device), w_layout="nk", out=out.to(device)
    ).cpu()
    for ex, mm in enumerate(masked.tolist()):
        torch.testing.assert_close(
            got[ex, :mm].double(), x[ex, :mm].double() @ w[ex].double().T, rtol=1e-5, atol=1e-4
        )
        assert (got[ex, mm:] == 0).all()


@pytest.mark.parametrize("layout,k,n", [("nk", 40, 24), ("nk", 64, 48), ("kn", 64, 40), ("kn", 96, 8)])
@pytest.mark.parametrize(
    "persistent,ws,tail,merge",
    [
        (False, False, 0, False),
        (True, False, 0, False),
        (True, True, 0, False),
        (False, False, 16, False),
        (True, True, 16, False),
        (False, False, 16, True),
        (True, True, 16, True),
        (True, False, 16, True),
    ],
)
def test_tma_path_matches_reference(layout, k, n, persistent, ws, tail, merge, device, monkeypatch):
    """The TMA kernel (taken here: 16-bit, aligned rows) on experts whose row tiles overrun into the next
    expert, N and (nk) K tails that the boxes read past, an empty expert and one holding many rows. With
    tail tiles (32-row tiles, 16-row tails): experts of 5 and 1 rows are tails only, 37 rows are a full tile
    and a tail of 5, 70 two and a tail of 6, 18 rows a full tile (more than the tail holds), 56 two full
    tiles (the second of 24 rows). Merged, the tails of 5 and 6 rows ride with the row tile before them
    (the last expert's past M_total, where the box reads zeros). The NaN-poisoned output shows any row or
    column left unwritten."""
    from moegemm.grouped import launch

    monkeypatch.setattr(gconfig, "GROUP_M", 2)
    g = torch.Generator().manual_seed(k * 31 + n)
    sizes = [5, 0, 37, 1, 18, 56, 70]
    e, m = len(sizes), sum(sizes)
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    xs = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w_kn = (torch.randn(e, k, n, generator=g) / k**0.5).to(torch.bfloat16)
    w = w_kn if layout == "kn" else w_kn.transpose(1, 2).contiguous()
    rs = torch.rand(m, generator=g).to(torch.bfloat16)
    cfg = GroupedConfig(
        block_m=32 if tail else 16,
        block_n=16,
        block_k=32,
        persistent=persistent,
        tma=True,
        flatten=ws,
        tail_m=tail,
        merge_tail=merge,
    )
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
    descs = launch.tma_descriptors(xs, w, layout, e, n, k, cfg)
    assert descs is not None, "expected the TMA path"
    assert (descs[2] is not descs[0]) == bool(tail), "expected a tail descriptor exactly with tail tiles"
    got = grouped_mm(
        xs.to(device),
        w.to(device),
        offsets.to(device),
        w_layout=layout,
        epilogue="relu",
        row_scale=rs.to(device),
        config=cfg,
        out=out,
    )
    ref = _ref(xs, w_kn, offsets, "relu", rs)
    rtol, atol = TOL[torch.bfloat16]
    assert not torch.isnan(got.cpu().double()).any()
    torch.testing.assert_close(got.cpu().double(), ref, rtol=rtol, atol=atol * k**0.5 + rtol)


def test_tma_path_declines_unsuitable_inputs():
    from moegemm.grouped import launch as api

    cfg = GroupedConfig(block_m=16, block_n=16, block_k=32, tma=True)
    x = torch.randn(8, 64).to(torch.bfloat16)
    w = torch.randn(3, 64, 32).to(torch.bfloat16)
    assert api.tma_descriptors(x, w, "kn", 3, 32, 64, cfg) is not None
    assert api.tma_descriptors(x.float(), w.float(), "kn", 3, 32, 64, cfg) is None  # fp32
    assert api.tma_descriptors(x[:, :40], w[:, :40], "kn", 3, 32, 40, cfg) is None  # kn with a K tail
    x97 = torch.randn(8, 97).to(torch.bfloat16)
    assert api.tma_descriptors(x97, torch.randn(3, 8, 97).to(torch.bfloat16), "nk", 3, 8, 97, cfg) is None
    assert (
        api.tma_descriptors(x, w.transpose(1, 2).contiguous().transpose(1, 2), "kn", 3, 32, 64, cfg) is None
    )
    with pytest.raises(ValueError, match="flatten"):
        GroupedConfig(flatten=True)
    for bad in (8, 24, 64, 128):
        with pytest.raises(
            ValueError, match=r"config.tail_m: expected 0 or a power of two in \[16, block_m\)"
        ):
            GroupedConfig(block_m=64, tma=True, tail_m=bad)
    with pytest.raises(ValueError, match="config.tail_m: tail tiles are a TMA-kernel feature"):
        GroupedConfig(block_m=64, tail_m=32)
    with pytest.raises(
        ValueError, match="config.merge_tail: merges tail tiles into row tiles; needs tail_m > 0"
    ):
        GroupedConfig(tma=True, merge_tail=True)


def test_persistent_programs_per_sm():
    """The persistent grid's programs per SM from a compiled kernel's shared memory and registers (numbers
    of the kind Triton 3.6 reports for sm_90): a 128x256 tile in four stages fits once, a 64x128 tile in four
    stages twice, never more than two, never fewer than one."""
    from moegemm.grouped.launch import fit_per_sm

    smem = 228 * 1024
    assert fit_per_sm(196640, 168, 8, smem) == 1
    assert fit_per_sm(98336, 128, 4, smem) == 2
    assert fit_per_sm(36888, 64, 4, smem) == 2  # would fit more; capped
    assert fit_per_sm(60000, 255, 8, smem) == 1  # registers: 255 x 256 threads
    assert fit_per_sm(300000, 32, 4, smem) == 1


def test_persistent_grid_size(monkeypatch):
    """launch sizes a persistent grid by per_sm (capped by the work), a plain grid by the work."""
    from moegemm.grouped import launch as api

    seen = []

    class K:
        def __getitem__(self, grid):
            seen.append(grid[0])
            return lambda *a, **k: None

    monkeypatch.setattr(api, "device_sm_count", lambda x: 132)
    monkeypatch.setattr(api, "per_sm", lambda *a: 1)
    x = torch.zeros(4, 8)
    api.launch(K(), 1000, GroupedConfig(persistent=True), x, (), {})
    api.launch(K(), 100, GroupedConfig(persistent=True), x, (), {})
    api.launch(K(), 1000, GroupedConfig(persistent=False), x, (), {})
    assert seen == [132, 100, 1000]


def _count_stores(interp, out: torch.Tensor, run) -> tuple[np.ndarray, list[int]]:
    """Run ``run()`` under the interpreter with its masked stores counted per element of ``out``: (writes per
    element, the lowest element each program stores into ``out``, in the order the programs ran)."""
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    writes = np.zeros(out.numel(), dtype=np.int64)
    lowest: dict = {}  # program -> lowest element it stored (dicts keep the programs' order)
    real = interp.InterpreterBuilder.create_masked_store

    def counting(self, ptrs, value, mask, *rest):  # rest: the cache policy (and eviction, Triton >= 3.7)
        addr = ptrs.data[mask.data.astype(bool) & np.ones_like(ptrs.data, dtype=bool)]
        addr = addr[(addr >= lo) & (addr < hi)]
        np.add.at(writes, (addr - lo) // out.element_size(), 1)
        if len(addr):
            pid, first = tuple(self.grid_idx), int((addr.min() - lo) // out.element_size())
            lowest[pid] = min(lowest.get(pid, first), first)
        return real(self, ptrs, value, mask, *rest)

    interp.InterpreterBuilder.create_masked_store = counting
    try:
        run()
    finally:
        interp.InterpreterBuilder.create_masked_store = real
    return writes, list(lowest.values())


@pytest.mark.parametrize(
    "tail,merge,persistent",
    [(0, False, False), (16, False, True), (16, True, False), (16, True, True), (0, False, True)],
)
def test_tma_kernel_writes_every_output_element_once(tail, merge, persistent):
    """Under the interpreter, every store of the TMA kernel is counted per output element: each element of y
    is written exactly once, whatever path its tile takes (whole tiles, partial ones, tail tiles of their
    own, tails merged into the row tile before them). A tile
    computing rows that another tile also stores would still give right values; this catches it. Experts
    of 70 and 101 rows hold several 32-row tiles before their last (merged or not)."""
    interp = pytest.importorskip("triton.runtime.interpreter")
    from moegemm._runtime import INTERPRET
    from moegemm.grouped import launch as api

    if not INTERPRET or not hasattr(getattr(interp, "InterpreterBuilder", None), "create_masked_store"):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1) and its store hook")
    g = torch.Generator().manual_seed(3)
    sizes = [70, 5, 0, 40, 101, 33]
    e, k, n = len(sizes), 64, 48
    m = sum(sizes)
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    xs = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(e, n, k, generator=g) / 8).to(torch.bfloat16)
    cfg = GroupedConfig(
        block_m=32, block_n=16, block_k=32, persistent=persistent, tma=True, tail_m=tail, merge_tail=merge
    )
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert api.tma_descriptors(xs, w, "nk", e, n, k, cfg) is not None
    writes, _ = _count_stores(
        interp, out, lambda: grouped_mm(xs, w, offsets, w_layout="nk", config=cfg, out=out)
    )
    assert writes.min() == 1 and writes.max() == 1, np.unique(writes, return_counts=True)
    ref = _ref(xs, w.transpose(1, 2), offsets, "none", None)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * k**0.5)


def test_committed_grouped_table_serves_every_tuned_cell_exactly():
    """The committed H200 table (written by tune_grouped) and the library's lookup agree on the key: every
    (model, projection, T) that config.yaml has the tuner tune finds its own entry ("tuned", not the
    nearest), T=1 and T=8 of the many-expert models included (buckets below one row per expert)."""
    import moegemm.grouped.config as api
    from experiments.common import load_config

    g = load_config()["grouped"]
    table = api._tuned_table("nvidia-h200")
    assert table, "no committed grouped table for nvidia-h200"
    for model, m in g["models"].items():
        if m["split"] != "tune":
            continue
        for proj in ("up", "down"):
            k, n = m[proj]
            for t in g["tune_tokens"]:
                cfg, source = api.choose(
                    t * m["top_k"], k, torch.bfloat16, "nvidia-h200", m["experts"], n, "nk"
                )
                assert source == "tuned", (model, proj, t, api.rows_bucket(t * m["top_k"], m["experts"]))
                assert (
                    cfg
                    == table[
                        ("bfloat16", m["experts"], k, n, "nk", api.rows_bucket(t * m["top_k"], m["experts"]))
                    ]
                )


@pytest.mark.parametrize(
    "persistent,ws,tail,merge",
    [
        (False, False, 0, False),
        (True, False, 16, False),
        (True, True, 0, False),
        (False, False, 16, True),
        (True, True, 16, True),
    ],
)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_mixed_tile_order_matches_reference(
    persistent, ws, tail, merge, layout, launched, device, monkeypatch
):
    """Mixed tile order (config.mix = 2 row tiles): two heavy experts (130 and 200 rows: several 32-row
    tiles) dealt out among light ones of 0, 1, 5, 17, 33 (one row tile, or one and a tail) and 40 rows
    (two tiles, or one with its tail merged: heavy or light by the tiles it has), with ReLU, row scale,
    an N tail and a NaN-poisoned output, on both grids, the flattened loop and tails (separate and
    merged)."""
    from moegemm.grouped.kernels import _grouped_mm_tma_kernel

    monkeypatch.setattr(gconfig, "GROUP_M", 2)
    sizes = [5, 130, 0, 1, 33, 17, 200, 40]
    cfg = GroupedConfig(
        block_m=32,
        block_n=16,
        block_k=32,
        persistent=persistent,
        tma=True,
        flatten=ws,
        tail_m=tail,
        merge_tail=merge,
        mix=2,
    )
    _check_grouped(len(sizes), sizes, 64, 40, layout, "relu", True, torch.bfloat16, cfg, device)
    assert launched == [_grouped_mm_tma_kernel]


@pytest.mark.parametrize(
    "mix,tail,merge,group_m",
    [(2, 0, False, 2), (3, 16, True, 8), (0, 0, False, 2), (0, 16, True, 2), (2, 16, False, 1)],
)
def test_tiles_run_in_the_order_schedule_writes_out(mix, tail, merge, group_m, monkeypatch):
    """Under the interpreter (programs run one after another in program order, one tile each on the plain
    grid), the lowest output element each program stores is the first element of the tile that
    moegemm.grouped.schedule.tile_order puts at that number: expert order with bands of group_m row tiles
    walked column by column, tails of their own and merged, and the mixed
    order, where a hot expert's tiles spread over the launch in proportion. Each element is still written
    exactly once (a wrong mapping would skip some tiles and repeat others)."""
    from moegemm.grouped.schedule import tile_order

    interp = pytest.importorskip("triton.runtime.interpreter")
    from moegemm._runtime import INTERPRET
    from moegemm.grouped import launch as api

    if not INTERPRET or not hasattr(getattr(interp, "InterpreterBuilder", None), "create_masked_store"):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1) and its store hook")
    monkeypatch.setattr(gconfig, "GROUP_M", group_m)
    g = torch.Generator().manual_seed(11)
    sizes = [3, 300, 20, 0, 9, 150, 31, 2, 40]
    e, k, n, bm = len(sizes), 32, 40, 32
    m = sum(sizes)
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    xs = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(e, n, k, generator=g) / 8).to(torch.bfloat16)
    cfg = GroupedConfig(block_m=bm, block_n=16, block_k=32, tma=True, tail_m=tail, merge_tail=merge, mix=mix)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert api.tma_descriptors(xs, w, "nk", e, n, k, cfg) is not None
    writes, first = _count_stores(
        interp, out, lambda: grouped_mm(xs, w, offsets, w_layout="nk", config=cfg, out=out)
    )
    assert writes.min() == 1 and writes.max() == 1, np.unique(writes, return_counts=True)
    order = tile_order(sizes, n, cfg)
    assert first == [t.row0 * n + t.col0 for t in order]
    experts = [t.expert for t in order]
    assert (experts == sorted(experts)) == (not mix), "a hot expert's tiles spread only in the mixed order"
    assert sum(t.rows * min(16, n - t.col0) for t in order) == m * n
    ref = _ref(xs, w.transpose(1, 2), offsets, "none", None)
    rtol, atol = TOL[torch.bfloat16]
    assert torch.allclose(out.double(), ref, rtol=rtol, atol=atol)


def test_mix_config_errors():
    for bad in (1, -2, True, 2.0):
        with pytest.raises(
            ValueError, match="config.mix: expected 0 .expert order. or a number of row tiles >= 2"
        ):
            GroupedConfig(tma=True, mix=bad)
    with pytest.raises(ValueError, match="config.mix: the mixed tile order is the TMA kernel's"):
        GroupedConfig(mix=2)


def test_schedule_rows_computed_and_wave_model():
    """schedule.tile_order's rows kept and computed per tile (128-row tiles, 32-row tails merged: an expert of
    20 rows is a tail tile of its own, 140 one row tile holding its 12-row tail, 161 two whole row tiles as
    its last 33 rows are more than a tail), and the wave model on hand-countable launches: one wave bound
    by its bytes, then by its FLOPs, and two waves where the weights read in the first are not read again."""
    from moegemm.grouped.schedule import tile_order, wave_model_us

    cfg = GroupedConfig(block_m=128, block_n=64, tma=True, tail_m=32, merge_tail=True)
    order = tile_order([20, 0, 140, 161], 64, cfg)
    assert [(t.expert, t.rows, t.computed) for t in order] == [
        (0, 20, 32),
        (2, 140, 160),
        (3, 128, 128),
        (3, 33, 128),
    ]
    sep = dataclasses.replace(cfg, merge_tail=False)
    assert [(t.rows, t.computed) for t in tile_order([140], 64, sep)] == [(128, 128), (12, 32)]
    one = GroupedConfig(block_m=16, block_n=16)
    tiles = tile_order([16], 16, one)  # one tile: weights 16x16, rows 16x16, output 16x16, 2*16*16*16 FLOPs
    assert wave_model_us(tiles, 16, 16, one, 1, 3 * 512 / 1e-6, 1e30) == pytest.approx(1.0)
    assert wave_model_us(tiles, 16, 16, one, 1, 1e30, 8192 / 1e-6) == pytest.approx(1.0)
    two = tile_order([32], 16, one)  # two row tiles sharing the weights: 3 then 2 blocks of 512 bytes
    assert wave_model_us(two, 16, 16, one, 1, 512 / 1e-6, 1e30) == pytest.approx(5.0)
    assert wave_model_us(two, 16, 16, one, 2, 512 / 1e-6, 1e30) == pytest.approx(5.0)


@pytest.mark.parametrize("with_out", [False, True])
def test_torch_compile_fullgraph_traces_the_expert_path(with_out, device):
    """route -> permute -> grouped_mm (gating fused) -> unpermute under torch.compile(fullgraph=True), all
    with their default arguments (validation included): no graph break, the grouped GEMM as the custom op
    moegemm::grouped_mm, the result right against float64."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    e, t, top_k, k, n = 6, 9, 2, 64, 40
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(device)
    wts = torch.rand(t, top_k, generator=g).to(device)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(e, n, k, generator=g) / 8).to(torch.bfloat16).to(device)
    cfg = GroupedConfig(16, 16, 32)

    def layer(x, w, ids, wts, out):
        plan = route(ids, e)
        xs = permute(x, plan)
        ys = grouped_mm(
            xs, w, plan.group_offsets, w_layout="nk", row_scale=sorted_weights(wts, plan), config=cfg, out=out
        )
        return unpermute(ys, plan, None)

    out = torch.full((t * top_k, n), float("nan"), dtype=torch.bfloat16, device=device) if with_out else None
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, w, ids, wts, out)
    ref = torch.zeros(t, n, dtype=torch.float64)
    for tok in range(t):
        for j in range(top_k):
            ref[tok] += float(wts[tok, j]) * (x[tok].double().cpu() @ w[int(ids[tok, j])].double().cpu().T)
    torch.testing.assert_close(got.double().cpu(), ref, rtol=3e-2, atol=3e-2)
    if with_out:
        assert not torch.isnan(out.float()).any()
    explained = torch._dynamo.explain(layer)(x, w, ids, wts, None)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_torch_compile_traces_the_masked_layout(device):
    """grouped_mm_masked under torch.compile(fullgraph=True): the custom op writes the rows below masked_m
    and leaves those past it as the given output held them."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    e, m_max, k, n = 3, 8, 32, 24
    x = torch.randn(e, m_max, k, generator=g).to(device)
    w = torch.randn(e, k, n, generator=g).to(device)
    masked = torch.tensor([3, 0, 8], dtype=torch.int32).to(device)
    out = torch.full((e, m_max, n), SENTINEL).to(device)
    f = torch.compile(
        lambda x, w, m, out: (
            grouped_mm_masked(x, w, m, w_layout="kn", out=out, config=GroupedConfig(16, 16, 16)) * 1.0
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    got = f(x, w, masked, out)
    for ex, mm in enumerate(masked.tolist()):
        torch.testing.assert_close(
            got[ex, :mm].double().cpu(),
            x[ex, :mm].double().cpu() @ w[ex].double().cpu(),
            rtol=1e-3,
            atol=1e-3,
        )
        assert (out[ex, mm:] == 0).all() and (got[ex, mm:] == 0).all()


def test_grouped_custom_ops_fake_and_schema(device):
    """torch's opcheck of the GEMMs' custom ops and the one-launch routing's (schema, fake implementation),
    and a config's round trip through the ops' int list."""
    from moegemm.grouped import contiguous, masked, routing
    from moegemm.grouped.call import GroupedCall, MaskedCall
    from moegemm.grouped.config import config_list, config_of

    cfg = GroupedConfig(32, 16, 32, persistent=True, tma=True, tail_m=16, merge_tail=True, mix=2)
    assert config_of(config_list(cfg)) == cfg and config_of(None) is None
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(10, 32, generator=g).to(device)
    w = torch.randn(3, 32, 16, generator=g).to(device)
    off = torch.tensor([0, 4, 4, 10], dtype=torch.int32).to(device)
    out = torch.empty(10, 16).to(device)
    call = GroupedCall("kn", "relu", config=GroupedConfig(16, 16, 16))
    assert GroupedCall.from_op(call.op_args()) == call
    torch.library.opcheck(
        contiguous.grouped_mm_op,
        (xs, w, off, out, None, *call.op_args()),
        test_utils=("test_schema", "test_faketensor"),
    )
    xm = torch.randn(3, 4, 32, generator=g).to(device)
    torch.library.opcheck(
        masked.grouped_mm_masked_op,
        (
            xm,
            w,
            torch.tensor([1, 0, 4]).to(device),
            torch.empty(3, 4, 16).to(device),
            *MaskedCall("kn", config=GroupedConfig(16, 16, 16)).op_args(),
        ),
        test_utils=("test_schema", "test_faketensor"),
    )
    ids = torch.tensor([2, 0, 2, 1, 0, 2], dtype=torch.int32).to(device)  # 3 tokens, top_k 2
    torch.library.opcheck(
        routing.route_gather_op,
        (ids, xs[:3], torch.rand(6, generator=g).to(device), 3, 2, False),
        test_utils=("test_schema", "test_faketensor"),
    )


def _ffn_ref(x, ids, wts, w_gu_nk, w_down_nk):
    """float64 reference of the expert FFN, token by token."""
    i = w_gu_nk.shape[1] // 2
    out = torch.zeros(x.shape[0], w_down_nk.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = x[t].double() @ w_gu_nk[e].double().T
            act = torch.nn.functional.silu(gu[:i]) * gu[i:]
            out[t] += float(wts[t, j]) * (act @ w_down_nk[e].double().T)
    return out


@pytest.mark.parametrize(
    "dtype,layout,t",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        dtype=[torch.bfloat16, torch.float32],
        layout=["nk", "kn"],
        t=[11, 61, 97],  # 3, 17, 28 rows per expert: unfused, fused gate/up, routing in one launch (up to
        # 64 slots) and in three
    ),
)
def test_moe_ffn_matches_float64(dtype, layout, t, device, monkeypatch):
    """moe_ffn: routing, fused gate/up (gate first), SiLU(gate) * up, down with the gating weights, combine;
    against a float64 token-by-token reference on fresh random data, both weight layouts; experts left
    empty by the routing included; bad shapes refused by name."""
    import moegemm.grouped.config as api
    from moegemm.grouped import contiguous, ffn, moe_ffn

    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)
    g = torch.Generator().manual_seed(8)
    e, top_k, h, i = 7, 2, 64, 24
    ids = torch.stack([torch.randperm(e - 2, generator=g)[:top_k] for _ in range(t)])  # experts 5, 6 empty
    fused = []
    real_run = contiguous.run
    monkeypatch.setattr(
        contiguous, "run", lambda call, *a, **k: (call.swiglu and fused.append(1)) or real_run(call, *a, **k)
    )
    wts = torch.rand(t, top_k, generator=g)
    x = torch.randn(t, h, generator=g).to(dtype)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / 8).to(dtype)
    w_dn = (torch.randn(e, h, i, generator=g) / 5).to(dtype)
    ref = _ffn_ref(x, ids, wts, w_gu, w_dn)
    a, b = (
        (w_gu, w_dn)
        if layout == "nk"
        else (w_gu.transpose(1, 2).contiguous(), w_dn.transpose(1, 2).contiguous())
    )
    d = lambda v: v.to(device)  # noqa: E731
    got = moe_ffn(d(x), d(ids), d(wts), d(a), d(b), w_layout=layout)
    assert got.shape == (t, h) and got.dtype == dtype
    tol = 4e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double().cpu(), ref, rtol=tol, atol=tol)
    assert bool(fused) == (t * top_k > ffn.FUSE_ABOVE_ROWS_PER_EXPERT * e)
    with pytest.raises(ValueError, match="w_down: expected shape"):
        moe_ffn(d(x), d(ids), d(wts), d(a), d(b[:, :-1]), w_layout=layout)
    with pytest.raises(ValueError, match="w_gate_up: hidden size"):
        moe_ffn(d(x[:, :-1]), d(ids), d(wts), d(a), d(b), w_layout=layout)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        moe_ffn(d(x), d(ids), d(wts[:, :1]), d(a), d(b), w_layout=layout)
    if device == "cpu":  # on a GPU, a device-side assertion (test_grouped_gpu.py's subprocess test)
        with pytest.raises(ValueError, match="topk_ids: expert ids must be in"):
            moe_ffn(d(x), d(ids + e), d(wts), d(a), d(b), w_layout=layout)


@pytest.mark.parametrize("t", [6, 40])  # 12 slots: routing and gathers in one launch; 80: in three
def test_moe_ffn_traces_under_torch_compile(t, device, monkeypatch):
    """moe_ffn under torch.compile(fullgraph=True): one graph, no break, right against float64."""
    import moegemm.grouped.config as api
    from moegemm.grouped import moe_ffn

    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(9)
    e, top_k, h, i = 4, 2, 32, 16
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)])
    wts = torch.rand(t, top_k, generator=g)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / 6).to(torch.bfloat16)
    w_dn = (torch.randn(e, h, i, generator=g) / 4).to(torch.bfloat16)
    args = [v.to(device) for v in (x, ids, wts, w_gu, w_dn)]
    got = torch.compile(moe_ffn, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got.double().cpu(), _ffn_ref(x, ids, wts, w_gu, w_dn), rtol=4e-2, atol=4e-2)
    explained = torch._dynamo.explain(moe_ffn)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    # the traced layer runs the eager layer's kernels and choices: routing, the row gathers, gate/up with
    # SiLU * up (fused or not, chosen at run time as in eager), down and the un-permute as custom ops, not as
    # torch ops for Inductor to re-derive
    code = str(explained.graphs[0].graph)
    for op in ("moegemm.route_gather", "moegemm.gate_up_act", "moegemm.grouped_mm", "moegemm.combine"):
        assert op in code, op
    assert "moegemm.route.default" not in code and "moegemm.gather_rows" not in code


@pytest.mark.parametrize(
    "dtype,cfg,layout",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        dtype=[torch.bfloat16, torch.float32],
        cfg={
            str(c): c
            for c in (
                GroupedConfig(16, 32, 32),
                GroupedConfig(32, 32, 32, persistent=True),
                GroupedConfig(32, 32, 32, tma=True),
                GroupedConfig(32, 64, 32, tma=True, persistent=True, flatten=True),
                GroupedConfig(32, 32, 32, tma=True, mix=2, tail_m=16, merge_tail=True),
            )
        },
        layout=["nk", "kn"],
    ),
)
def test_grouped_mm_swiglu_matches_float64(dtype, cfg, layout, device, launched, monkeypatch):
    """The fused gate/up with SwiGLU: silu(x G_e) * (x U_e) * row_scale on experts of 0, 1, 5, 40 and 70 rows
    (several row tiles), I = 24 (a column tail in every tile shape), NaN-poisoned output; pointer and TMA
    kernels (16-bit takes TMA where asked), both grids, the flattened loop, the mixed order (tails of the
    given config are not used; the persistent one walks two row tiles together). Against float64."""
    from moegemm.grouped import grouped_mm_swiglu
    from moegemm.grouped.kernels import _grouped_mm_kernel, _grouped_mm_swiglu_tma_kernel

    if cfg.persistent and not cfg.tma:
        monkeypatch.setattr(gconfig, "GROUP_M", 2)
    g = torch.Generator().manual_seed(12)
    sizes = [5, 0, 40, 1, 70]
    e, m, k, i = len(sizes), sum(sizes), 64, 24
    off = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    xs = torch.randn(m, k, generator=g).to(dtype)
    w_nk = (torch.randn(e, 2 * i, k, generator=g) / 6).to(dtype)
    w = w_nk if layout == "nk" else w_nk.transpose(1, 2).contiguous()
    rs = torch.rand(m, generator=g)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=device)
    d = lambda v: v.to(device)  # noqa: E731
    got = grouped_mm_swiglu(d(xs), d(w), d(off), w_layout=layout, row_scale=d(rs), config=cfg, out=out)
    assert got is out
    ref = torch.empty(m, i, dtype=torch.float64)
    for ex in range(e):
        a, b = off[ex].item(), off[ex + 1].item()
        gu = xs[a:b].double() @ w_nk[ex].double().T
        ref[a:b] = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:] * rs[a:b].double()[:, None]
    assert not torch.isnan(got.double()).any()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double().cpu(), ref, rtol=tol, atol=tol)
    tma = cfg.tma and dtype == torch.bfloat16
    assert launched == [_grouped_mm_swiglu_tma_kernel if tma else _grouped_mm_kernel]


def test_grouped_mm_swiglu_edges_and_errors(device):
    """K = 0 gives zeros; M = 0 an empty output; an odd gate/up width is refused by name; the config of the
    unfused product maps to the fused kernel's (half the columns, no tails); under torch.compile it traces
    as the custom op; opcheck of the op."""
    from moegemm.grouped import grouped_mm_swiglu
    from moegemm.grouped.call import GroupedCall
    from moegemm.grouped.config import swiglu_config
    from moegemm.grouped.contiguous import grouped_mm_op

    d = lambda v: v.to(device)  # noqa: E731
    off = d(torch.tensor([0, 2, 3], dtype=torch.int32))
    y = grouped_mm_swiglu(
        d(torch.randn(3, 0)), d(torch.randn(2, 8, 0)), off, config=GroupedConfig(16, 16, 16)
    )
    assert y.shape == (3, 4) and (y == 0).all()
    y = grouped_mm_swiglu(d(torch.randn(0, 8)), d(torch.randn(2, 8, 8)), d(torch.tensor([0, 0, 0])))
    assert y.shape == (0, 4)
    with pytest.raises(ValueError, match="w_gate_up: expected an even gate/up width"):
        grouped_mm_swiglu(d(torch.randn(3, 8)), d(torch.randn(2, 7, 8)), off)
    assert swiglu_config(
        GroupedConfig(128, 256, 64, tma=True, tail_m=32, merge_tail=True, mix=2)
    ) == GroupedConfig(128, 128, 64, tma=True, mix=2)
    assert swiglu_config(GroupedConfig(16, 16, 16)).block_n == 16
    g = torch.Generator().manual_seed(13)
    xs, w = torch.randn(3, 16, generator=g), torch.randn(2, 16, 8, generator=g)
    torch._dynamo.reset()
    f = torch.compile(
        lambda xs, w, off: (
            grouped_mm_swiglu(xs, w, off, w_layout="kn", config=GroupedConfig(16, 16, 16)) + 0.0
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    got = f(d(xs), d(w), off)
    ref = torch.empty(3, 4, dtype=torch.float64)
    for r, ex in ((0, 0), (1, 0), (2, 1)):
        p = xs[r].double() @ w[ex].double()
        ref[r] = torch.nn.functional.silu(p[:4]) * p[4:]
    torch.testing.assert_close(got.double().cpu(), ref, rtol=1e-4, atol=1e-4)
    torch.library.opcheck(
        grouped_mm_op,
        (
            d(xs),
            d(w),
            off,
            d(torch.empty(3, 4)),
            None,
            *GroupedCall("kn", swiglu=True, config=GroupedConfig(16, 16, 16)).op_args(),
        ),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_device_side_checks(device):
    """The offsets check a GPU call makes without a host sync (moegemm.grouped.checks), run here under the
    interpreter: right offsets pass; offsets not starting at 0, not ending at M_total, or decreasing fail
    with the message naming the argument (E beyond one block included). The expert ids' check is the routing
    kernels' flag (test_routing_kernels_give_the_stable_sort_plan)."""
    from moegemm.grouped import checks

    d = lambda v: torch.tensor(v, dtype=torch.int32).to(device)  # noqa: E731
    checks.assert_offsets(d([0, 2, 2, 5]), 5)
    checks.assert_offsets(d(list(range(0, 2000, 1))), 1999)  # 1999 experts: two blocks of the kernel
    if device != "cpu":  # a failed check ends the CUDA context: test_grouped_gpu.py's subprocess test
        torch.cuda.synchronize()
        return
    for bad, m in (
        ([1, 2, 5], 5),
        ([0, 2, 4], 5),
        ([0, 3, 2, 5], 5),
        (list(range(1500)) + [1400, 1600], 1600),
    ):
        with pytest.raises(RuntimeError, match="group_offsets: must run from 0 to M_total"):
            checks.assert_offsets(d(bad), m)


@pytest.mark.parametrize("rows,i", [(1, 1), (7, 24), (3, 1500), (0, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_in_float32(device, rows, i, dtype):
    """SiLU(gate) * up of an unfused gate/up product, against float64 on fresh random data."""
    from moegemm.grouped.pointwise import silu_mul

    torch.manual_seed(rows + i)
    gu = (3 * torch.randn(rows, 2 * i)).to(dtype).to(device)
    got = silu_mul(gu)
    g, u = gu.cpu().double()[:, :i], gu.cpu().double()[:, i:]
    ref = torch.nn.functional.silu(g) * u
    assert got.shape == (rows, i) and got.dtype == dtype and not torch.isnan(got.cpu().double()).any()
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.cpu().double(), ref, rtol=tol, atol=tol)


def test_cached_launch_keys_are_at_least_as_fine_as_tritons_specialization():
    """The compiled launchers cached per call (moegemm._triton_common.launch, the grouped plans) are keyed
    on every property Triton specializes a kernel on, or finer: pointer alignment, ints equal to 1 or
    divisible by 16 and their width, bools apart from ints; a CPU call (or the interpreter) has no plan."""
    from moegemm._triton_common import _specialization
    from moegemm.grouped import contiguous as api
    from moegemm.grouped.call import GroupedCall

    base = torch.empty(64, dtype=torch.float32)
    assert _specialization(base) != _specialization(base[1:])  # 4 bytes in: off 16-byte alignment
    assert _specialization(base) == _specialization(base[4:])  # 16 bytes in: aligned
    assert _specialization(base) != _specialization(base.to(torch.bfloat16))
    keys = [_specialization(v) for v in (1, 2, 16, 17, 32, 2**31, -1, True, False, None)]
    assert len({keys[1], keys[3]}) == 1 and keys[1] != keys[0] and keys[2] != keys[1] and keys[2] == keys[4]
    assert keys[5] != keys[4] and keys[6] != keys[1] and len({keys[7], keys[8], keys[9], keys[0]}) == 4
    x, w = torch.randn(8, 16), torch.randn(2, 16, 8)
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert api._plan_key(GroupedCall("kn"), x, w, offsets, None, None) is None


@pytest.mark.parametrize("persistent", [False, True])
def test_masked_m_checked_on_request(persistent, device):
    """check_masked_m=True refuses a masked_m value outside [0, m_max] with a ValueError naming masked_m (the
    default clamps it, with no sync); values inside pass and give the product."""
    torch.manual_seed(15)
    e, m_max, k, n = 3, 18, 32, 24
    x = torch.randn(e, m_max, k).to(device)
    w = (torch.randn(e, n, k) / k**0.5).to(device)
    cfg = GroupedConfig(16, 16, 16, persistent=persistent)
    for bad in ([-1, 3, 5], [0, 19, 5]):
        with pytest.raises(ValueError, match=r"masked_m: values must lie in \[0, m_max=18\]"):
            grouped_mm_masked(
                x, w, torch.tensor(bad, dtype=torch.int32).to(device), config=cfg, check_masked_m=True
            )
    masked = torch.tensor([0, 18, 5], dtype=torch.int32).to(device)
    out = torch.full((e, m_max, n), SENTINEL).to(device)
    got = grouped_mm_masked(x, w, masked, config=cfg, out=out, check_masked_m=True)
    for ex, mm in enumerate(masked.tolist()):
        torch.testing.assert_close(
            got[ex, :mm].double(), x[ex, :mm].double() @ w[ex].double().T, rtol=1e-5, atol=1e-4
        )
        assert (got[ex, mm:] == 0).all()


def test_public_functions_default_to_the_nn_linear_layout(device, monkeypatch):
    """Every public function that takes expert weights reads them as nn.Linear's [E, N, K] when no w_layout
    is given: the default call equals the explicit w_layout="nk" call, and differs from the "kn" reading
    of the same (square) tensor."""
    import inspect

    from moegemm.grouped import baselines, choose_config, grouped_mm_swiglu, moe_ffn
    from moegemm.grouped.config import masked_config

    for fn in (
        grouped_mm,
        grouped_mm_masked,
        grouped_mm_swiglu,
        moe_ffn,
        choose_config,
        masked_config,
        baselines.per_expert_loop,
        baselines.padded_bmm,
        baselines.torch_grouped_mm,
        baselines.dense_reference,
    ):
        assert inspect.signature(fn).parameters["w_layout"].default == "nk", fn.__name__
    monkeypatch.setattr(gconfig, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(gconfig, "_default_table", lambda slug: ((GroupedConfig(16, 16, 16),),) * 4)
    g = torch.Generator().manual_seed(16)
    e, k = 3, 32
    d = lambda v: v.to(device)  # noqa: E731
    xs, w = d(torch.randn(10, k, generator=g)), d(torch.randn(e, k, k, generator=g) / 6)
    off = d(torch.tensor([0, 4, 4, 10], dtype=torch.int32))
    cfg = GroupedConfig(16, 16, 16)
    nk = grouped_mm(xs, w, off, w_layout="nk", config=cfg)
    assert torch.equal(grouped_mm(xs, w, off, config=cfg), nk)
    assert not torch.allclose(grouped_mm(xs, w, off, w_layout="kn", config=cfg), nk)
    rows = [(0, 4), (4, 4), (4, 10)]  # of each expert
    ref = torch.cat([xs[a:b].cpu().double() @ w[i].cpu().double().T for i, (a, b) in enumerate(rows)])
    torch.testing.assert_close(nk.cpu().double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(
        grouped_mm_swiglu(xs, w[:, :16], off, config=cfg),
        grouped_mm_swiglu(xs, w[:, :16], off, w_layout="nk", config=cfg),
    )
    xm, masked = d(torch.randn(e, 4, k, generator=g)), d(torch.tensor([4, 1, 0], dtype=torch.int32))
    out_a, out_b = d(torch.zeros(e, 4, k)), d(torch.zeros(e, 4, k))
    grouped_mm_masked(xm, w, masked, config=cfg, out=out_a)
    grouped_mm_masked(xm, w, masked, w_layout="nk", config=cfg, out=out_b)
    assert torch.equal(out_a, out_b)
    ids = d(torch.tensor([[0, 2], [1, 2], [2, 0]]))
    wts = d(torch.rand(3, 2, generator=g))
    w_gu, w_dn = d(torch.randn(e, 16, k, generator=g) / 6), d(torch.randn(e, k, 8, generator=g) / 3)
    default = moe_ffn(xs[:3], ids, wts, w_gu, w_dn)
    assert torch.equal(default, moe_ffn(xs[:3], ids, wts, w_gu, w_dn, w_layout="nk"))
    for name in ("per_expert_loop", "torch_grouped_mm"):
        fn = getattr(baselines, name)
        if name == "torch_grouped_mm" and not hasattr(torch, "_grouped_mm"):
            continue
        torch.testing.assert_close(fn(xs, w, off).cpu().double(), ref, rtol=1e-4, atol=1e-4)


_ENTRY_ERRORS = [  # (call on the arguments a, exception, message)
    (
        lambda a: a.moe_ffn(a.x.to(torch.int8), a.ids, a.wts, a.w_gu, a.w_dn),
        TypeError,
        "^x: unsupported dtype int8",
    ),
    (
        lambda a: a.moe_ffn(a.x.to("meta"), a.ids, a.wts, a.w_gu, a.w_dn),
        ValueError,
        "^x: unsupported device meta",
    ),
    (lambda a: a.moe_ffn(a.x, a.ids, a.wts, a.w_gu.half(), a.w_dn), TypeError, "^w_gate_up: dtype"),
    (lambda a: a.moe_ffn(a.x, a.ids, a.wts, a.w_gu, a.w_dn.half()), TypeError, "^w_down: dtype"),
    (lambda a: a.grouped_mm_swiglu(a.x, a.w_gu.half(), a.off), TypeError, "^w_gate_up: dtype"),
    (
        lambda a: a.grouped_mm_swiglu(a.x.to(torch.int8), a.w_gu, a.off),
        TypeError,
        "^x_sorted: unsupported dtype",
    ),
    (lambda a: a.grouped_mm_swiglu(a.x, a.w_gu[:, :, :8], a.off), ValueError, "^w_gate_up: K=8"),
    (lambda a: grouped_mm(a.x, a.w_gu, a.off, w_layout="nk "), ValueError, "^w_layout: expected"),
    (
        lambda a: grouped_mm_masked(a.x[None].to(torch.int8), a.w_gu[:1], a.m),
        TypeError,
        "^x: unsupported dtype",
    ),
    (lambda a: grouped_mm_masked(a.x[None], a.w_gu[:1].half(), a.m), TypeError, "^w: dtype"),
]


@pytest.mark.parametrize("call,exc,match", _ENTRY_ERRORS, ids=[m for _, _, m in _ENTRY_ERRORS])
def test_errors_name_the_callers_argument(call, exc, match, device):
    """Each public entry point checks its own arguments, so an error names the argument the caller passed
    (x, w_gate_up, w_down), not an internal one."""
    from types import SimpleNamespace

    from moegemm.grouped import grouped_mm_swiglu, moe_ffn

    e, h, i = 3, 16, 8
    a = SimpleNamespace(
        moe_ffn=moe_ffn,
        grouped_mm_swiglu=grouped_mm_swiglu,
        x=torch.randn(5, h).to(device),
        ids=torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]]).to(device),
        wts=torch.rand(5, 2).to(device),
        w_gu=torch.randn(e, 2 * i, h).to(device),
        w_dn=torch.randn(e, h, i).to(device),
        off=torch.tensor([0, 2, 2, 5], dtype=torch.int32).to(device),
        m=torch.tensor([5], dtype=torch.int32).to(device),
    )
    with pytest.raises(exc, match=match):
        call(a)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's side (a GPU's: tests/test_grouped_gpu.py)")
def test_layer_graphs_stay_out_of_the_way_off_the_gpu(monkeypatch, device):
    """Under the interpreter the decode graphs never apply: moe_ffn runs its eager forward on every call
    (the same output each time) and captures nothing."""
    from moegemm.grouped import layer_graphs, moe_ffn

    calls = []
    monkeypatch.setattr(layer_graphs, "_capture", lambda *a: calls.append("capture"))
    g = torch.Generator().manual_seed(2)
    e, top_k, h, i, t = 4, 2, 32, 16, 3
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(device)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    wts = torch.rand(t, top_k, generator=g).to(device)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / 6).to(torch.bfloat16).to(device)
    w_dn = (torch.randn(e, h, i, generator=g) / 4).to(torch.bfloat16).to(device)
    first = moe_ffn(x, ids, wts, w_gu, w_dn)
    for _ in range(2):
        assert torch.equal(moe_ffn(x, ids, wts, w_gu, w_dn), first)
    assert calls == [] and not layer_graphs._GRAPHS and not layer_graphs._SEEN
