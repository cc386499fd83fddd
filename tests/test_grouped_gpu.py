"""Grouped GEMM on real MoE shapes, natively on a CUDA GPU (``pytest -m gpu``; skipped without one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_close_to_ref

from experiments.harness.moe_loads import sample_topk
from moegemm.grouped import (
    GroupedConfig,
    grouped_mm,
    grouped_mm_masked,
    heuristic_config,
    permute,
    route,
    sorted_weights,
    unpermute,
)

pytestmark = pytest.mark.gpu

# (name, E, top_k, K, N): gate/up and down projections
MODELS = [
    ("deepseek-v3-up", 256, 8, 7168, 4096),
    ("deepseek-v3-down", 256, 8, 2048, 7168),
    ("mixtral-up", 8, 2, 4096, 14336),
    ("qwen3-30b-a3b-up", 128, 8, 2048, 1536),
]
# DeepSeek-V3's expert weights take 15 GB (gate/up) and 7.5 GB (down) in bf16: its cases run one at a time
# across pytest's workers (gpu_memory), so that several of them never share an 80 GB card with the rest
HEAVY = {"deepseek-v3-up", "deepseek-v3-down"}


def _ref(xs, w_nk, offsets, scale=None):
    off = offsets.tolist()
    out = torch.empty(xs.shape[0], w_nk.shape[1], dtype=torch.float64, device="cuda")
    for e in range(w_nk.shape[0]):
        if off[e + 1] > off[e]:
            out[off[e] : off[e + 1]] = xs[off[e] : off[e + 1]].double() @ w_nk[e].double().T
    if scale is not None:
        out *= scale.double()[:, None]
    return out


def _captured(call):
    """(a CUDA graph of one ``call()``, its output): warmed up once and captured on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        call()
        with torch.cuda.graph(graph, stream=s):
            y = call()
    torch.cuda.current_stream().wait_stream(s)
    return graph, y


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (16, 128, 8), (4096, 256, 8), (16384, 8, 2), (16384, 160, 6)])
@pytest.mark.parametrize("skew", ["uniform", "zipf1.2", "hot0.9"])
def test_routing_kernels_match_the_stable_sort_on_the_gpu(t, e, k, skew):
    """route's kernels against torch's stable sort at real sizes, element for element, and the same plan
    again from a CUDA graph replayed on new ids."""
    from moegemm.grouped.routing import _route_torch

    fields = ("sorted_token_ids", "sorted_slot", "slot_rows", "group_sizes", "group_offsets")
    ids = sample_topk(t, e, k, skew, seed=t + e)
    plan = route(ids, e)
    want = _route_torch(ids.reshape(-1).to(torch.int64), e, k)
    for name, b in zip(fields, want):
        assert torch.equal(getattr(plan, name), b), name
    live = ids.clone()
    graph, captured = _captured(lambda: route(live, e))
    for i in range(3):
        live.copy_(sample_topk(t, e, k, skew, seed=1000 + i))
        graph.replay()
        want = _route_torch(live.reshape(-1).to(torch.int64), e, k)
        for name, b in zip(fields, want):
            assert torch.equal(getattr(captured, name), b), (name, i)


@pytest.mark.parametrize(
    "t,e,k,h", [(1, 256, 8, 7168), (8, 128, 8, 2048), (32, 8, 2, 6144), (1, 16, 1, 5120), (16, 128, 8, 2048)]
)
def test_route_and_permute_matches_its_three_steps_on_the_gpu(t, e, k, h):
    """route_and_permute (one launch up to 64 slots, three at 128) against route, permute and sorted_weights
    at real decode sizes, element for element (outputs poisoned first: the graph's own buffers, written on
    each replay), and again from a CUDA graph replayed on new ids, rows and weights."""
    from moegemm.grouped import route_and_permute

    fields = ("sorted_token_ids", "sorted_slot", "slot_rows", "group_sizes", "group_offsets")
    g = torch.Generator(device="cuda").manual_seed(t + e + h)
    ids = sample_topk(t, e, k, "uniform", seed=t + e)
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    wts = torch.rand(t, k, device="cuda", generator=g)
    graph, (plan, xs, ws) = _captured(lambda: route_and_permute(x, ids, wts, e))
    for i in range(3):
        ids.copy_(sample_topk(t, e, k, "zipf1.2", seed=100 + i))
        x.normal_(generator=g)
        wts.uniform_(generator=g)
        for v in (xs, ws):
            v.fill_(float("nan"))
        for v in (getattr(plan, f) for f in fields):
            v.fill_(-1)
        graph.replay()
        want = route(ids, e)
        for name in fields:
            assert torch.equal(getattr(plan, name), getattr(want, name)), (name, i)
        assert torch.equal(xs, permute(x, want)) and torch.equal(ws, sorted_weights(wts, want)), i


@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("skew", ["uniform", "zipf1.2", "hot0.9"])
@pytest.mark.parametrize(
    "name,e,k,hidden,n",
    [pytest.param(*m, marks=[pytest.mark.gpu_memory] if m[0] in HEAVY else []) for m in MODELS],
    ids=[m[0] for m in MODELS],
)
def test_contiguous_real_shapes(name, e, k, hidden, n, t, skew):
    g = torch.Generator(device="cuda").manual_seed(t * 7 + e)
    ids = sample_topk(t, e, k, skew, seed=t * 7 + e)
    wts = torch.rand(t, k, device="cuda", generator=g)
    plan = route(ids, e)
    x = torch.randn(t, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    # drawn in bf16 directly: an fp32 draw of DeepSeek-V3's 256 experts would need 30 GB on the side
    w = torch.randn(e, n, hidden, device="cuda", generator=g, dtype=torch.bfloat16).div_(hidden**0.5)
    xs = permute(x, plan)
    rs = sorted_weights(wts, plan).to(torch.bfloat16)
    heur = heuristic_config(xs.shape[0], e, n)
    # the heuristic config on both grids, with TMA loads (and warp specialization), and config=None: the
    # tuned table's choice on this GPU
    tma = dataclasses.replace(heur, tma=True, num_stages=3)
    tails = (
        [
            dataclasses.replace(tma, tail_m=32),
            dataclasses.replace(tma, tail_m=heur.block_m // 2, persistent=True, flatten=True),
            dataclasses.replace(tma, tail_m=32, merge_tail=True, persistent=True, flatten=True),
        ]
        if heur.block_m > 32
        else [  # an expert's last few rows as smaller tiles, or with the tile before them
            # decode: a hot expert's rows in one 64-row tile, the others' as 16-row tiles
            GroupedConfig(64, 128, 128, num_stages=4, tma=True, tail_m=16),
            GroupedConfig(64, 64, 256, num_stages=3, tma=True, tail_m=16, persistent=True),
        ]
    )
    # the mixed tile order (heavy experts' tiles among the light ones'): plain grid with tails merged, and the
    # flattened loop
    mixed = [
        dataclasses.replace(tails[-1], persistent=False, flatten=False, mix=2),
        dataclasses.replace(tma, persistent=True, flatten=True, mix=2),
    ]
    for cfg in (
        heur,
        dataclasses.replace(heur, persistent=True),
        tma,
        dataclasses.replace(tma, persistent=True, flatten=True),
        *tails,
        *mixed,
        None,
    ):
        out = torch.full((xs.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = grouped_mm(xs, w, plan.group_offsets, w_layout="nk", row_scale=rs, config=cfg, out=out)
        assert_close_to_ref(y, _ref(xs, w, plan.group_offsets, rs), hidden, f"{name} T={t} {skew}")
    yt = unpermute(y, plan, None)
    assert yt.shape == (t, n) and not torch.isnan(yt).any()


@pytest.mark.parametrize(
    "config",
    [
        None,
        GroupedConfig(16, 128, 128, num_stages=4, persistent=True, tma=True),
        GroupedConfig(64, 128, 64, num_stages=4, tma=True),
    ],
    ids=["default", "tma-decode", "tma-64"],
)
def test_masked_cuda_graph_replay_with_changing_masked_m(config):
    """Captured once, replayed with new masked_m and x (the output poisoned before each replay: the rows past
    masked_m come back as zeros): pointer loads (the default here: no tuned entry for
    16 experts) and TMA loads through the in-kernel descriptors (their scratch memory comes from the
    graph's pool at capture)."""
    torch.manual_seed(0)
    e, m_max, hidden, n = 16, 64, 2048, 1536
    x = torch.randn(e, m_max, hidden, device="cuda").to(torch.bfloat16)
    w = (torch.randn(e, n, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    masked = torch.zeros(e, dtype=torch.int32, device="cuda")
    out = torch.zeros(e, m_max, n, dtype=torch.bfloat16, device="cuda")
    graph, _ = _captured(lambda: grouped_mm_masked(x, w, masked, w_layout="nk", out=out, config=config))
    for i in range(4):
        masked.copy_(torch.randint(0, m_max + 1, (e,), device="cuda", dtype=torch.int32))
        x.copy_(torch.randn(e, m_max, hidden, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for ex, mm in enumerate(masked.tolist()):
            ref = x[ex, :mm].double() @ w[ex].double().T
            assert_close_to_ref(out[ex, :mm], ref, hidden, f"replay {i} expert {ex}")
            assert (out[ex, mm:] == 0).all(), f"replay {i}: rows past masked_m not zeros"


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize(
    "tma,ws,persistent,tail,merge",
    [
        (False, False, False, 0, False),
        (True, False, False, 0, False),
        (True, True, True, 0, False),
        (True, False, True, 16, False),
        (True, True, True, 16, False),
        (True, False, False, 16, True),
    ],
)
def test_both_weight_layouts_and_load_paths(layout, tma, ws, persistent, tail, merge):
    """w as [E, K, N] and [E, N, K], pointer and TMA loads, Zipf load, fused gating; K = 4100 has rows that
    are not 16-byte aligned, so there a TMA config must fall back to the pointer kernel and stay right."""
    for hidden in (4096, 4100):
        e, top_k, t, n = 8, 2, 96, 1536
        g = torch.Generator(device="cuda").manual_seed(hidden + 3)
        plan = route(sample_topk(t, e, top_k, "zipf1.2", seed=hidden), e)
        xs = permute(torch.randn(t, hidden, device="cuda", generator=g).to(torch.bfloat16), plan)
        w_nk = (torch.randn(e, n, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
        w = w_nk if layout == "nk" else w_nk.transpose(1, 2).contiguous()
        rs = torch.rand(xs.shape[0], device="cuda", generator=g).to(torch.bfloat16)
        cfg = dataclasses.replace(
            heuristic_config(xs.shape[0], e, n),
            tma=tma,
            flatten=ws,
            persistent=persistent,
            num_stages=3,
            tail_m=tail,
            merge_tail=merge,
        )
        out = torch.full((xs.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = grouped_mm(xs, w, plan.group_offsets, w_layout=layout, row_scale=rs, config=cfg, out=out)
        assert_close_to_ref(y, _ref(xs, w_nk, plan.group_offsets, rs), hidden, f"{layout} K={hidden} {cfg}")


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("bm,bn,warps", [(128, 128, 8), (64, 128, 4)])
def test_tma_cuda_graph_replay_with_new_routing(layout, bm, bn, warps):
    """The TMA kernel on the persistent grid inside a CUDA graph, replayed with a new routing each time (new
    offsets in the same buffer): the tile count and each tile's expert are worked out in-kernel on every
    replay. A few waves of tiles on the H200's SMs."""
    torch.manual_seed(11)
    e, top_k, t, hidden, n = 8, 2, 512, 4096, 1536
    plan = route(sample_topk(t, e, top_k, "zipf1.2", seed=11), e)
    offsets = plan.group_offsets.clone()
    xs = torch.randn(t * top_k, hidden, device="cuda").to(torch.bfloat16)
    w_nk = (torch.randn(e, n, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    w = w_nk if layout == "nk" else w_nk.transpose(1, 2).contiguous()
    cfg = GroupedConfig(bm, bn, 64, num_warps=warps, num_stages=4, persistent=True, tma=True)
    rs = torch.rand(xs.shape[0], device="cuda").to(torch.bfloat16)
    out = torch.empty(xs.shape[0], n, dtype=torch.bfloat16, device="cuda")
    grouped_mm(xs, w, offsets, w_layout=layout, row_scale=rs, epilogue="relu", config=cfg, out=out)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_mm(
            xs,
            w,
            offsets,
            w_layout=layout,
            row_scale=rs,
            epilogue="relu",
            config=cfg,
            out=out,
            validate=False,
        )
    for i, load in enumerate(["uniform", "hot0.9", "zipf1.5", "uniform"]):
        offsets.copy_(route(sample_topk(t, e, top_k, load, seed=100 + i), e).group_offsets)
        xs.copy_(torch.randn(xs.shape, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(
            out, torch.relu(_ref(xs, w_nk, offsets)) * rs.double()[:, None], hidden, f"replay {i} {load}"
        )


@pytest.mark.parametrize("t", [16, 2048])
def test_unseen_shape_autotunes_once_then_captures(t, tmp_path, monkeypatch):
    """A shape no tuned entry covers (20 experts, hidden 2880, N 1000): the first call times the distilled
    shortlist and keeps the fastest (in memory and in the cache file); the next call, captured in a CUDA
    graph, neither times nor syncs, and every replay with new routing and activations is right. A shape
    first met inside a capture takes the shortlist's first config and stays right on replay."""
    import moegemm.grouped.config as api
    from moegemm import autotune

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    e, top_k, hidden, n = 20, 4, 2880, 1000
    g = torch.Generator(device="cuda").manual_seed(t)
    w = (torch.randn(e, n, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
    plan = route(sample_topk(t, e, top_k, "zipf1.2", seed=t), e)
    offsets = plan.group_offsets.clone()
    xs = torch.randn(t * top_k, hidden, device="cuda", generator=g).to(torch.bfloat16)
    assert api.choose_config(xs, e, n, "nk")[1] in api.TIMED_SOURCES
    y = grouped_mm(xs, w, offsets, w_layout="nk", validate=False)
    assert_close_to_ref(y, _ref(xs, w, offsets), hidden, "first call")
    cfg, source = api.choose_config(xs, e, n, "nk")
    assert source == "autotuned" and cfg in api.shortlist(xs.shape[0], e, n, api.gpu_slug(xs))
    assert autotune.cache_file(api.gpu_slug(xs)).exists()
    for label, w_now in (("kept", w), ("first met in the capture", w.transpose(1, 2).contiguous())):
        layout = "nk" if w_now is w else "kn"
        out = torch.empty(xs.shape[0], n, dtype=torch.bfloat16, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            # warm-up (compiles outside the capture): the kept config, or, with timing off, the first of the
            # shortlist, leaving the shape unseen
            monkeypatch.setenv("MOEGEMM_AUTOTUNE", "1" if w_now is w else "0")
            grouped_mm(xs, w_now, offsets, w_layout=layout, out=out, validate=False)
            monkeypatch.setenv("MOEGEMM_AUTOTUNE", "1")
            with torch.cuda.graph(graph, stream=s):
                grouped_mm(xs, w_now, offsets, w_layout=layout, out=out, validate=False)
        torch.cuda.current_stream().wait_stream(s)
        if w_now is not w:
            # nothing timed or kept in the capture
            assert api.choose_config(xs, e, n, "kn")[1] in api.TIMED_SOURCES
        for i, load in enumerate(["uniform", "hot0.9", "zipf1.5"]):
            offsets.copy_(route(sample_topk(t, e, top_k, load, seed=50 + i), e).group_offsets)
            xs.copy_(torch.randn(xs.shape, device="cuda"))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert_close_to_ref(out, _ref(xs, w, offsets), hidden, f"{label}: replay {i} {load}")


@pytest.mark.parametrize("t", [2, 16, 128, 1024])  # 0.5, 4, 32 and 256 rows per expert: each regime
@pytest.mark.parametrize("swiglu", [False, True], ids=["mm", "swiglu"])
def test_fp32_untimed_choice_fits_shared_memory(t, swiglu, tmp_path, monkeypatch):
    """fp32 on an unseen shape with timing off, as inside a capture: the regime's distilled first config,
    written for 16-bit operands, fitted to what one program may take of shared memory in fp32 (unfitted,
    several of them ask for more and do not launch). It launches, eagerly and captured, and is right."""
    import moegemm.grouped.config as api
    from moegemm import autotune
    from moegemm._runtime import device_smem_per_block
    from moegemm.grouped import contiguous, grouped_mm_swiglu

    monkeypatch.setenv("MOEGEMM_AUTOTUNE", "0")
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))  # no choice kept from an earlier run
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(contiguous, "_PLANS", {})
    e, top_k, hidden, n = 16, 4, 1000, 704
    g = torch.Generator(device="cuda").manual_seed(t + swiglu)
    plan = route(sample_topk(t, e, top_k, "zipf1.2", seed=t), e)
    xs = torch.randn(t * top_k, hidden, device="cuda", generator=g)
    w = torch.randn(e, n, hidden, device="cuda", generator=g) / hidden**0.5
    cfg, source = api.choose_config(xs, e, n, "nk")
    assert source in api.TIMED_SOURCES and api.shared_bytes(cfg, 4) <= device_smem_per_block(xs)
    gu = _ref(xs, w, plan.group_offsets)
    ref = torch.nn.functional.silu(gu[:, : n // 2]) * gu[:, n // 2 :] if swiglu else gu
    fn = grouped_mm_swiglu if swiglu else grouped_mm
    out = torch.full(ref.shape, float("nan"), device="cuda")
    fn(xs, w, plan.group_offsets, w_layout="nk", out=out, validate=False)
    assert_close_to_ref(out, ref, hidden, f"fp32 T={t} eager")
    out.fill_(float("nan"))
    graph, _ = _captured(lambda: fn(xs, w, plan.group_offsets, w_layout="nk", out=out, validate=False))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_ref(out, ref, hidden, f"fp32 T={t} captured")


@pytest.mark.parametrize("threads", ["1", "8"])
def test_unseen_shape_first_call_on_a_side_stream(threads, tmp_path, monkeypatch):
    """The first call of an unseen shape made on a side stream, its inputs written on that stream just
    before it: every launch of the shortlist's kernels, from the pool of threads (with 8) or not (with 1),
    goes to the caller's stream and device, the result is right, and the timed choice is kept."""
    import threading

    import moegemm.grouped.config as api
    from moegemm import autotune
    from moegemm.grouped import contiguous

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MOEGEMM_COMPILE_THREADS", threads)
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(contiguous, "_PLANS", {})  # no plan kept from a call of the same key before
    seen: list[tuple] = []
    real_launch = contiguous.launch

    def recording_launch(*args, **kwargs):
        seen.append((torch.cuda.current_stream(), torch.cuda.current_device(), threading.get_ident()))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(contiguous, "launch", recording_launch)
    e, top_k, t, hidden, n = 24, 4, 512, 2112, 1040
    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(e, n, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
    offsets = route(sample_topk(t, e, top_k, "zipf1.2", seed=7), e).group_offsets
    src = torch.randn(t * top_k, hidden, device="cuda", generator=g).to(torch.bfloat16)
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xs = torch.full_like(src, float("nan"))
        for _ in range(4):
            big = big @ big.T / 8192  # keeps the side stream busy while the first call is issued
        xs.copy_(src)
        y = grouped_mm(xs, w, offsets, w_layout="nk", validate=False)
    s.synchronize()
    assert_close_to_ref(y, _ref(src, w, offsets), hidden, f"first call on a side stream, {threads} threads")
    assert api.choose_config(xs, e, n, "nk")[1] == "autotuned"
    caller = threading.get_ident()
    assert seen and all(st == s and dev == torch.cuda.current_device() for st, dev, _ in seen)
    # with 8, the pool's threads made launches (how many threads: as many as were idle when the jobs came,
    # one where the kernels were compiled before, by this process or another's disk cache); with 1, none
    pooled = {tid for *_, tid in seen if tid != caller}
    assert pooled if threads == "8" else not pooled


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["other-architecture", "hopper"])
def test_a_gpu_no_table_names(capability, tmp_path, monkeypatch):
    """This GPU under a name no table holds. Of another architecture (traits say sm_80; the kernels still
    run here): no table serves it, so the first call of a shape times the generic shortlist, keeps the
    fastest, and is right; Decompose-K's first call times its shortlist too. Of this architecture: the
    nearest packaged card's tables serve it, so a tuned shape is 'tuned' and an unseen one times the
    distilled shortlist."""
    import moegemm.grouped.config as api
    from moegemm import autotune, tuned
    from moegemm._runtime import device_traits, register_traits
    from moegemm.decompose_k import configs as dk_configs
    from moegemm.decompose_k import first_call, matmul
    from moegemm.decompose_k import plans as dk_plans
    from moegemm.grouped import contiguous

    slug = f"test-unnamed-sm{capability[0]}{capability[1]}"
    register_traits(
        slug, dataclasses.replace(device_traits(torch.cuda.current_device()), capability=capability)
    )
    for mod in (api, contiguous, dk_configs, first_call):
        monkeypatch.setattr(mod, "gpu_slug", lambda t: slug)
    monkeypatch.delenv("MOEGEMM_HIDE_TABLES", raising=False)
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(contiguous, "_PLANS", {})
    monkeypatch.setattr(dk_plans, "_PLANS", {})
    other = capability != (9, 0)
    assert (tuned.serving("grouped", slug) is None) == other
    e, top_k, t, hidden, n = 24, 4, 1024, 2112, 1040
    g = torch.Generator(device="cuda").manual_seed(17)
    w = (torch.randn(e, n, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
    offsets = route(sample_topk(t, e, top_k, "zipf1.2", seed=17), e).group_offsets
    xs = torch.randn(t * top_k, hidden, device="cuda", generator=g).to(torch.bfloat16)
    assert api.choose_config(xs, e, n, "nk")[1] == ("generic" if other else "default")
    out = torch.full((xs.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_mm(xs, w, offsets, w_layout="nk", out=out, validate=False)
    assert_close_to_ref(out, _ref(xs, w, offsets), hidden, f"first call on {slug}")
    cfg, source = api.choose_config(xs, e, n, "nk")
    assert source == "autotuned" and cfg in api.fitted_shortlist(
        xs.shape[0], e, n, slug, xs.dtype, api.device_smem_per_block(xs)
    )
    assert autotune.cache_file(slug).exists()
    # Decompose-K: the router's shape at one token count
    a = torch.randn(48, 7168, device="cuda", generator=g).to(torch.bfloat16)
    b = (torch.randn(7168, 256, device="cuda", generator=g) / 7168**0.5).to(torch.bfloat16)
    ref = torch.sigmoid(a.double() @ b.double())
    got = matmul(a, b, epilogue="sigmoid")
    assert_close_to_ref(got, ref, 7168, f"Decompose-K first call on {slug}")
    p = dk_plans.plan(a, b, epilogue="sigmoid")
    if other:
        assert p.source == "autotuned on this call" or p.source == "autotuned", p.source
        kept = (p.backend, p.config)
        monkeypatch.setattr(dk_plans, "_PLANS", {})
        again = dk_plans.plan(a, b, epilogue="sigmoid")
        assert again.source == "autotuned" and (again.backend, again.config) == kept
    else:
        assert p.source in ("tuned", "heuristic")


def test_default_expert_path_captures_and_compiles():
    """route -> permute -> grouped_mm -> unpermute with every default argument (validation on the device, no
    host sync): one CUDA graph, right on replays with new routing and activations; and the same function
    under torch.compile(fullgraph=True) (Inductor), right too."""
    torch.manual_seed(3)
    e, top_k, t, hidden, n = 64, 8, 64, 2048, 1536
    w = (torch.randn(e, n, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)]).to(torch.int32)
    wts = torch.rand(t, top_k, device="cuda")
    x = torch.randn(t, hidden, device="cuda").to(torch.bfloat16)

    def layer(x, ids, wts):
        plan = route(ids, e)
        ys = grouped_mm(
            permute(x, plan),
            w,
            plan.group_offsets,
            w_layout="nk",
            row_scale=sorted_weights(wts, plan).to(torch.bfloat16),
        )
        return unpermute(ys, plan, None)

    def ref(x, ids, wts):
        out = torch.zeros(t, n, dtype=torch.float64, device="cuda")
        for j in range(top_k):
            out += wts[:, j : j + 1].double() * torch.einsum(
                "tk,tnk->tn", x.double(), w[ids[:, j].long()].double()
            )
        return out

    layer(x, ids, wts)  # warm-up: compiles, and times the shortlist where the shape is not in the table
    torch.cuda.synchronize()
    graph, y = _captured(lambda: layer(x, ids, wts))
    for i in range(3):
        ids.copy_(torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)]))
        x.copy_(torch.randn(t, hidden, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(y, ref(x, ids, wts), hidden, f"replay {i}")
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x, ids, wts)
    assert_close_to_ref(got, ref(x, ids, wts), hidden, "compiled")


@pytest.mark.parametrize("t", [16, 512])
def test_moe_ffn_real_dimensions_and_graph_capture(t):
    """moe_ffn at Qwen3-30B-A3B's dimensions (128 experts, top-8, H=2048, I=768; gate and up fused, the
    nn.Linear layout) against a float64 reference, and captured with its default arguments in one CUDA
    graph, right on replay with new routing. At 32 rows per expert the first call chooses among the gate/up
    forms (fused, unfused, gathering x's rows itself) by timing them, and the capture takes that choice."""
    from moegemm import autotune
    from moegemm._runtime import gpu_slug
    from moegemm.grouped import ffn, moe_ffn
    from moegemm.grouped.config import autotune_key

    torch.manual_seed(t)
    e, top_k, h, i = 128, 8, 2048, 768
    w_gu = (torch.randn(e, 2 * i, h, device="cuda") / h**0.5).to(torch.bfloat16)
    w_dn = (torch.randn(e, h, i, device="cuda") / i**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, top_k, device="cuda"), -1)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)

    def ref():
        out = torch.zeros(t, h, dtype=torch.float64, device="cuda")
        for j in range(top_k):
            gu = torch.einsum("th,tnh->tn", x.double(), w_gu[ids[:, j]].double())
            act = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
            out += wts[:, j : j + 1].double() * torch.einsum("ti,thi->th", act, w_dn[ids[:, j]].double())
        return out

    assert_close_to_ref(moe_ffn(x, ids, wts, w_gu, w_dn), ref(), h, f"T={t}")
    if t * top_k > ffn.FUSE_ABOVE_ROWS_PER_EXPERT * e:  # the first call timed the gate/up forms, kept one
        key = autotune_key(t * top_k, h, torch.bfloat16, e, 2 * i, "nk+ffn-gate-up", gpu_slug(x))
        assert autotune.lookup(gpu_slug(x), key)["form"] in ffn.FORMS
    graph, y = _captured(lambda: moe_ffn(x, ids, wts, w_gu, w_dn))
    for r in range(2):
        ids.copy_(torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)]))
        x.copy_(torch.randn(t, h, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(y, ref(), h, f"T={t} replay {r}")


@pytest.mark.parametrize(
    "name,e,top_k,hidden,i,t",
    [
        ("qwen3-30b-a3b", 128, 8, 2048, 768, 256),
        ("gpt-oss-20b", 32, 4, 2880, 2880, 1024),
        ("mixtral-8x7b", 8, 2, 4096, 14336, 64),
    ],
)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_grouped_mm_swiglu_real_shapes(name, e, top_k, hidden, i, t, layout):
    """The fused gate/up with SwiGLU at real MoE sizes (gate and up fused, [E, 2I, H] or [E, H, 2I]), on the
    default path (the table's or the shortlist's tiles, halved) and on a pointer-load config, against
    float64 per expert, with the gating weights as row scale; the output NaN-poisoned."""
    from moegemm.grouped import grouped_mm_swiglu

    g = torch.Generator(device="cuda").manual_seed(i + t)
    plan = route(sample_topk(t, e, top_k, "zipf1.2", seed=i), e)
    xs = permute(torch.randn(t, hidden, device="cuda", generator=g).to(torch.bfloat16), plan)
    w_nk = (torch.randn(e, 2 * i, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
    w = w_nk if layout == "nk" else w_nk.transpose(1, 2).contiguous()
    rs = torch.rand(xs.shape[0], device="cuda", generator=g)
    gu = _ref(xs, w_nk, plan.group_offsets)
    ref = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:] * rs.double()[:, None]
    for cfg in (None, GroupedConfig(64, 128, 64, num_stages=3)):
        out = torch.full((xs.shape[0], i), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = grouped_mm_swiglu(xs, w, plan.group_offsets, w_layout=layout, row_scale=rs, config=cfg, out=out)
        assert_close_to_ref(y, ref, hidden, f"{name} {layout} T={t} {cfg}")


_BAD_SETUP = """
import torch
from moegemm.grouped import grouped_mm, moe_ffn, route
g = torch.Generator(device="cuda").manual_seed(3)
x = torch.randn(12, 64, device="cuda", generator=g).to(torch.bfloat16)
ids = torch.randint(0, 8, (12, 2), device="cuda", generator=g)
wts = torch.rand(12, 2, device="cuda", generator=g)
gu = torch.randn(8, 96, 64, device="cuda", generator=g).to(torch.bfloat16)
dn = torch.randn(8, 64, 48, device="cuda", generator=g).to(torch.bfloat16)
xs = torch.randn(10, 64, device="cuda", generator=g).to(torch.bfloat16)
off = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")
"""


@pytest.mark.parametrize(
    "call,bad",
    [
        ("moe_ffn(x, ids, wts, gu, dn)", False),
        ("grouped_mm(xs, gu[:3], off([0, 4, 4, 10]), w_layout='nk')", False),
        ("moe_ffn(x, ids + 8, wts, gu, dn)", True),
        # the training path (autograd on): the same check, before any gradient is computed
        ("moe_ffn(x.requires_grad_(), ids, wts, gu, dn).float().sum().backward()", False),
        ("moe_ffn(x.requires_grad_(), ids + 8, wts, gu, dn).float().sum().backward()", True),
        ("route(ids - 9, 8)", True),
        (
            (
                "route(torch.randint(0, 8, (100, 2), device='cuda')"
                ".index_fill_(0, torch.tensor([70], device='cuda'), 8), 8)"
            ),
            True,
        ),
        ("grouped_mm(xs, gu[:3], off([0, 6, 4, 10]), w_layout='nk')", True),
        ("grouped_mm(xs, gu[:3], off([0, 4, 4, 9]), w_layout='nk')", True),
        ("grouped_mm(xs, gu[:3], off([1, 4, 4, 10]), w_layout='nk')", True),
    ],
)
def test_bad_values_fail_on_the_device(call, bad):
    """Expert ids out of range and offsets that do not run from 0 to M_total non-decreasing, checked on the
    GPU with no host sync: the call returns, and the next sync fails with a device-side assertion (which
    ends the CUDA context, hence a process of its own); the same calls on good values run clean."""
    import os
    import subprocess
    import sys

    code = _BAD_SETUP + f"y = {call}\ntorch.cuda.synchronize()\nprint('synced')\n"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=300
    )
    if bad:
        assert res.returncode != 0 and "device-side assert" in res.stderr, res.stderr[-2000:]
        assert "synced" not in res.stdout
    else:
        assert res.returncode == 0 and "synced" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("tma,persistent", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_repeat_calls_take_the_plan_and_stay_right(layout, tma, persistent, swiglu, monkeypatch):
    """A repeat call of a (shape, strides, dtype, alignment) goes straight to the compiled kernel of the
    first one (launch.GroupedPlan): right on new activations, routing, gating weights and outputs; a call
    whose activations sit at another 16-byte alignment (rows of K = 1028: a pointer-kernel view) or whose
    offsets are int64 gets a plan of its own; the plans hold no tensor of the calls they were made from."""
    import gc
    import weakref

    import moegemm.grouped.contiguous as api
    from moegemm.grouped import grouped_mm_swiglu

    monkeypatch.setattr(api, "_PLANS", {})
    e, top_k, t, n = 8, 2, 80, 768
    for hidden in (1024, 1028):
        g = torch.Generator(device="cuda").manual_seed(hidden + 7)
        w_nk = (torch.randn(e, n, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
        w = w_nk if layout == "nk" else w_nk.transpose(1, 2).contiguous()
        cfg = GroupedConfig(64, 128, 64, num_warps=4, num_stages=3, tma=tma, persistent=persistent)
        before = len(api._PLANS)
        for i in range(4):
            plan = route(sample_topk(t, e, top_k, ("uniform", "zipf1.2", "hot0.9", "zipf1.5")[i], seed=i), e)
            buf = torch.randn(t * top_k + 1, hidden, device="cuda", generator=g).to(torch.bfloat16)
            xs = buf[1:] if i == 3 else buf[:-1]  # the last call's rows start 2 * hidden bytes in
            offsets = plan.group_offsets.to(torch.int64) if i == 2 else plan.group_offsets
            rs = torch.rand(xs.shape[0], device="cuda", generator=g).to(torch.bfloat16)
            width = n // 2 if swiglu else n
            out = torch.full((xs.shape[0], width), float("nan"), dtype=torch.bfloat16, device="cuda")
            if swiglu:
                y = grouped_mm_swiglu(xs, w, offsets, w_layout=layout, row_scale=rs, config=cfg, out=out)
                gu = _ref(xs, w_nk, plan.group_offsets)
                ref = torch.nn.functional.silu(gu[:, :width]) * gu[:, width:] * rs.double()[:, None]
            else:
                y = grouped_mm(xs, w, offsets, w_layout=layout, row_scale=rs, config=cfg, out=out)
                ref = _ref(xs, w_nk, plan.group_offsets, rs)
            assert y is out
            assert_close_to_ref(y, ref, hidden, f"K={hidden} call {i}")
        aligned = hidden * 2 % 16 == 0
        # the first call's plan served call 1; int64 offsets (call 2) made their own, and so did the view one
        # row in (call 3) where that row moved the base off its 16-byte alignment
        assert len(api._PLANS) - before == (2 if aligned else 3), list(api._PLANS)
        ref_w = weakref.ref(w)
        del w, w_nk, xs, buf, y, out, rs, offsets, plan
        gc.collect()
        assert ref_w() is None, "a plan keeps the weights alive"


def test_graph_timer_counts_the_gpu_time_of_a_call_not_the_hosts():
    """runner.graph_timer on the GPU: a call that spends 4 ms in Python around a tiny kernel gets all of
    calls_per_graph calls per graph (min_graph_us counts GPU time), and its held replays time the kernels,
    not the host."""
    import time

    from experiments.harness.runner import Settings, graph_timer

    x = torch.zeros(1024, device="cuda")

    def call():
        time.sleep(0.004)
        return x.add_(1)

    timer = graph_timer([call], Settings(calls_per_graph=10, min_graph_us=3000))
    assert timer.n == 10
    before = x[0].item()
    us = timer.sample(3)
    assert x[0].item() == before + 30 and max(us) < 500.0


def test_moe_ffn_decode_replays_one_graph_per_signature(monkeypatch):
    """A decode step of a signature seen before replays the layer's graph: each call equal, bit for bit, to
    the eager layer on the same inputs (new tokens, new routing, weights changed in place), the caller's
    output its own (not the graph's buffer), one graph per signature, the least recently used dropped past
    MAX_GRAPHS; a prefill step, a signature seen once, and MOEGEMM_LAYER_GRAPHS=0 run eagerly."""
    from moegemm.grouped import layer_graphs, moe_ffn

    layer_graphs.clear()
    torch.manual_seed(5)
    e, top_k, h, i = 64, 8, 256, 128
    w_gu = (torch.randn(e, 2 * i, h, device="cuda") / h**0.5).to(torch.bfloat16)
    w_dn = (torch.randn(e, h, i, device="cuda") / i**0.5).to(torch.bfloat16)

    def inputs(t):
        ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, top_k, device="cuda"), -1)
        return torch.randn(t, h, device="cuda").to(torch.bfloat16), ids, wts

    def eager(*a):
        monkeypatch.setenv(layer_graphs.ENV, "0")
        try:
            return moe_ffn(*a)
        finally:
            monkeypatch.delenv(layer_graphs.ENV)

    outs = []
    for step in range(4):
        x, ids, wts = inputs(4)
        if step == 3:
            w_dn.mul_(0.5)  # new values in the weights: the graph reads them where they live
        got = moe_ffn(x, ids, wts, w_gu, w_dn)
        assert torch.equal(got, eager(x, ids, wts, w_gu, w_dn)), f"step {step}"
        outs.append(got)
        assert len(layer_graphs._GRAPHS) == (0 if step == 0 else 1)
    assert len({o.data_ptr() for o in outs}) == 4  # each call's output its own
    x, ids, wts = inputs(512 // top_k + 1)  # past GRAPH_ROWS: eager, no graph
    for _ in range(2):
        moe_ffn(x, ids, wts, w_gu, w_dn)
    assert len(layer_graphs._GRAPHS) == 1
    monkeypatch.setattr(layer_graphs, "MAX_GRAPHS", 2)
    for t in (1, 2, 3):
        x, ids, wts = inputs(t)
        for _ in range(3):
            assert torch.equal(moe_ffn(x, ids, wts, w_gu, w_dn), eager(x, ids, wts, w_gu, w_dn))
    assert len(layer_graphs._GRAPHS) == 2
    # captured under inference_mode, replayed outside it: its static inputs are ordinary tensors
    layer_graphs.clear()
    x, ids, wts = inputs(2)
    with torch.inference_mode():
        for _ in range(2):
            moe_ffn(x, ids, wts, w_gu, w_dn)
    assert len(layer_graphs._GRAPHS) == 1
    with torch.no_grad():
        assert torch.equal(moe_ffn(x, ids, wts, w_gu, w_dn), eager(x, ids, wts, w_gu, w_dn))
    layer_graphs.clear()
