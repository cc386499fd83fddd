"""Gate/up reading x's rows by token id (moegemm.grouped.gather), the routing that writes no permuted copy
for it, and the layer's choice of its gate/up form (moegemm.grouped.ffn): against float64 on fresh random
data, in both weight layouts; the choice timed once and kept, the gathering form left out where it cannot
serve or is switched off."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from moegemm.grouped import GroupedConfig, moe_ffn, route, sorted_weights
from tests.helpers import assert_close_to_ref


def _act_ref(x, tok, w_gu_nk, offsets):
    """float64 silu(x[tok] G_e) * (x[tok] U_e) per expert's rows."""
    i = w_gu_nk.shape[1] // 2
    xs = x.double().cpu()[tok.long().cpu()]
    out = torch.zeros(xs.shape[0], i, dtype=torch.float64)
    off = offsets.tolist()
    for e in range(w_gu_nk.shape[0]):
        gu = xs[off[e] : off[e + 1]] @ w_gu_nk[e].double().cpu().T
        out[off[e] : off[e + 1]] = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    return out


def _cell(seed, t, e, top_k, h, i, dtype=torch.bfloat16, empty=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - empty, generator=g)[:top_k] for _ in range(t)])
    x = torch.randn(t, h, generator=g).to(dtype)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w_dn = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    wts = torch.rand(t, top_k, generator=g)
    return [v.to(DEVICE) for v in (x, ids, wts, w_gu, w_dn)]


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("h", [64, 80])
def test_gather_swiglu_against_float64(layout, h):
    """The gathering kernel on x's rows through the routing's token order, experts empty and small, K a
    multiple of BLOCK_K and not ("kn" only with one, where the weight descriptor allows it), against
    float64; a token id past x's rows reads a row of x, never past it."""
    from moegemm.grouped import gather

    x, ids, wts, w_gu, _ = _cell(3 + h, 13, 6, 2, h, 24)
    e, i = 6, 24
    plan = route(ids, e)
    w = w_gu if layout == "nk" else w_gu.transpose(1, 2).contiguous()
    cfg = GroupedConfig(16, 16, 32, num_stages=2, tma=True)
    if not gather.can_gather(x, w, layout, cfg):
        assert layout == "kn" and h % cfg.block_k
        return
    got = gather.gather_swiglu(x, plan.sorted_token_ids, w, plan.group_offsets, layout, cfg)
    assert got.shape == (26, i) and got.dtype == x.dtype
    assert_close_to_ref(got.cpu(), _act_ref(x, plan.sorted_token_ids, w_gu, plan.group_offsets), h)
    bad = plan.sorted_token_ids.clone()
    bad[0], bad[-1] = -5, 10**6
    out = gather.gather_swiglu(x, bad, w, plan.group_offsets, layout, cfg)
    clamped = bad.clamp(0, x.shape[0] - 1)
    assert torch.equal(out, gather.gather_swiglu(x, clamped, w, plan.group_offsets, layout, cfg))


def test_can_gather_only_what_the_kernel_serves():
    from moegemm.grouped import gather

    x, _, _, w_gu, _ = _cell(4, 8, 4, 2, 64, 16)
    tma = GroupedConfig(16, 16, 32, tma=True)
    assert gather.can_gather(x, w_gu, "nk", tma)
    assert not gather.can_gather(x, w_gu, "nk", GroupedConfig(16, 16, 32))  # pointer loads
    assert not gather.can_gather(x.float(), w_gu.float(), "nk", tma)  # fp32: no TMA
    assert not gather.can_gather(x.T.contiguous().T, w_gu, "nk", tma)  # columns not unit stride


def test_routing_with_no_copy_gives_the_plan_and_weights():
    """route_with_weights: the same plan and gating weights in row order as route and sorted_weights, in
    one launch (a few slots) and in three (past 64), with no permuted copy of x."""
    from moegemm.grouped import routing_kernels as rk
    from moegemm.grouped.routing import route_with_weights

    for t, k, e in ((5, 4, 60), (70, 6, 40)):
        x, ids, wts, _, _ = _cell(t, t, e, k, 48, 8, empty=0)
        plan, ws = route_with_weights(x, ids, wts, e, True)
        want = route(ids, e)
        for name in ("sorted_token_ids", "sorted_slot", "slot_rows", "group_sizes", "group_offsets"):
            assert torch.equal(getattr(plan, name), getattr(want, name)), name
        assert torch.equal(ws, sorted_weights(wts, want))
        *_, xs, _ = rk.plan_and_gather(ids.reshape(-1), e, k, x, wts.reshape(-1), copy_x=False)
        assert xs.shape == (t * k, 0)


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """An empty autotune cache, in memory and on disk, and one small config for every grouped shape."""
    import moegemm.grouped.config as api
    from moegemm import autotune

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32, tma=True),),) * 4)


@pytest.mark.parametrize("gather_on", [True, False])
def test_layer_times_its_gate_up_forms_once_and_gathers_where_faster(fresh_choices, monkeypatch, gather_on):
    """Above decode, the layer's first call of a shape times the fused, the unfused and (switched on) the
    gathering form, keeps the fastest, and every later call takes it: with the gathering form, the routing
    writes no permuted copy and gate/up reads x's rows itself. Each form is right against float64."""
    from moegemm import autotune
    from moegemm.grouped import ffn
    from moegemm.grouped import routing_kernels as rk
    from tests.test_grouped import _ffn_ref

    monkeypatch.setattr(ffn, "GATHER", gather_on)
    monkeypatch.setenv("MOEGEMM_LAYER_GRAPHS", "0")  # (on a GPU: every call eager, its routing seen)
    x, ids, wts, w_gu, w_dn = _cell(11, 40, 6, 2, 64, 24)
    ref = _ffn_ref(x.cpu(), ids.cpu(), wts.cpu(), w_gu.cpu(), w_dn.cpu())
    timed: list = []

    def fastest(launch, forms, **kw):  # (the GEMMs' own first calls time their configs: the first kept)
        for f in forms:
            launch(f)
        if isinstance(forms[0], str):
            timed.append(list(forms))
        return forms[-1 if isinstance(forms[0], str) else 0], {str(j): 1.0 for j in range(len(forms))}

    copies: list = []
    real = rk.plan_and_gather
    monkeypatch.setattr(
        rk, "plan_and_gather", lambda *a, **k: copies.append(k.get("copy_x", True)) or real(*a, **k)
    )
    monkeypatch.setattr("moegemm.grouped.routing.plan_and_gather", rk.plan_and_gather)
    monkeypatch.setattr(autotune, "can_time", lambda t: True)
    monkeypatch.setattr(autotune, "fastest", fastest)
    monkeypatch.setattr(ffn, "FUSE_ABOVE_ROWS_PER_EXPERT", 1)  # 80 rows over 6 experts: above decode
    got = moe_ffn(x, ids, wts, w_gu, w_dn)
    assert_close_to_ref(got.cpu(), ref, 64)
    want = ["fused", "unfused", "gather"] if gather_on else ["fused", "unfused"]
    assert timed == [want] and copies == [True]
    got = moe_ffn(x, ids, wts, w_gu, w_dn)  # the kept choice: no timing
    assert_close_to_ref(got.cpu(), ref, 64)
    assert timed == [want] and copies == [True, not gather_on]
