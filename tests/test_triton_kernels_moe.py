"""experiments/triton_kernels_moe.py: OpenAI's triton_kernels as an E7/E8 contender, loaded at run time.

On the CPU: the loader (on stand-in trees), the routing logits and indices, the gate/up interleave and, with
MOEGEMM_TRITON_KERNELS_SOURCE set, under Triton's interpreter: its own ``swiglu_fn`` with the adapter's alpha
and bias against float64, and its routing kernels on the adapter's ids against torch (routing() itself hands
its top-k kernel a Tensor wrapper the interpreter cannot copy, so that kernel is launched on plain tensors).
matmul_ogs cannot run under the interpreter (it asks the CUDA device for its capability and SM count), so
its numbers are checked on a GPU (``-m gpu``, with the source set)."""

from __future__ import annotations

import math
import os
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, HAS_CUDA
from experiments import triton_kernels_moe as tkm

SOURCE = os.environ.get(tkm.ENV)
needs_source = pytest.mark.skipif(not SOURCE, reason=f"needs {tkm.ENV} (triton_kernels' source)")

STAND_IN = {
    "__init__.py": "",
    "matmul_ogs.py": textwrap.dedent("""
        class FnSpecs:
            def __init__(self, name, fn, arg_names):
                self.name, self.fn, self.arg_names = name, fn, arg_names


        class FusedActivation:
            def __init__(self, specs, args, reduction_n):
                self.specs, self.args, self.reduction_n = specs, args, reduction_n


        def matmul_ogs(*args, **kwargs):
            raise NotImplementedError
    """),
    "swiglu.py": "def swiglu_fn(x, alpha, limit):\n    return x\n",
    "routing.py": "def routing(logits, k, sm_first=False, expt_indx=None):\n    return None, None, None\n",
}


@pytest.fixture
def fresh(monkeypatch):
    """A clean slate of imported triton_kernels modules and sys.path for a test that loads a tree."""
    for name in [m for m in sys.modules if m == "triton_kernels" or m.startswith("triton_kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv(tkm.ENV, raising=False)


def _tree(root, files):
    pkg = root / "triton_kernels"
    pkg.mkdir(parents=True)
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_no_source_is_none(fresh):
    assert tkm.load() is None


def test_load_names_the_tree_by_revision_and_hash(fresh, tmp_path):
    pkg = _tree(tmp_path / "a", STAND_IN)
    (tmp_path / "a" / "REVISION").write_text("v3.7.1 abcdef0\nmore\n")
    tk = tkm.load(tmp_path / "a")
    assert tk.origin == f"triton_kernels v3.7.1 abcdef0 sha256:{tkm.tree_digest(pkg)}"
    assert tkm.package_dir(pkg) == pkg  # the package folder itself is taken too
    (pkg / "swiglu.py").write_text("def swiglu_fn(x, alpha, limit):\n    return -x\n")
    assert tkm.tree_digest(pkg) not in tk.origin  # the hash follows the content


def test_load_refuses_bad_sources(fresh, tmp_path):
    with pytest.raises(FileNotFoundError, match=tkm.ENV):
        tkm.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no triton_kernels package"):
        tkm.load(tmp_path / "empty")
    files = {k: v for k, v in STAND_IN.items() if k != "routing.py"}
    _tree(tmp_path / "later", files)
    with pytest.raises(ValueError, match="routing"):
        tkm.load(tmp_path / "later")


def test_load_refuses_a_second_tree(fresh, tmp_path):
    _tree(tmp_path / "a", STAND_IN)
    _tree(tmp_path / "b", STAND_IN)
    tkm.load(tmp_path / "a")
    with pytest.raises(ValueError, match="already imported"):
        tkm.load(tmp_path / "b")


@pytest.mark.parametrize("seed", range(3))
def test_routing_logits_give_the_weights_back_through_a_top_k_softmax(seed):
    g = torch.Generator().manual_seed(seed)
    t, e, k = 5, 9, 3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    logits = tkm.routing_logits(ids, w, e)
    assert logits.dtype == torch.float32
    top = torch.topk(logits, k, dim=1)
    assert (torch.sort(top.indices, 1).values == torch.sort(ids, 1).values).all()
    back = torch.softmax(torch.gather(logits, 1, ids), -1)
    torch.testing.assert_close(back, w, atol=1e-6, rtol=1e-6)
    assert torch.isinf(logits).sum() == t * (e - k)
    with pytest.raises(ValueError, match="topk_weights"):
        tkm.routing_logits(ids, w[:, :2], e)
    with pytest.raises(ValueError, match="num_experts"):
        tkm.routing_logits(ids, w, 0)


def test_interleave_gate_up_alternates_rows():
    w = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    got = tkm.interleave_gate_up(w)
    for e in range(2):
        for i in range(3):
            assert torch.equal(got[e, 2 * i], w[e, i]) and torch.equal(got[e, 2 * i + 1], w[e, 3 + i])
    with pytest.raises(ValueError, match="w_gu"):
        tkm.interleave_gate_up(w[:, :5])
    b = tkm.silu_bias(2, 6, "cpu")
    assert b.tolist() == [[0.0, -1.0] * 3] * 2


def test_routing_indices_are_int32_rows():
    ids = torch.tensor([[31, 15, 40], [16, 0, 7]]).t()  # [3, 2], not contiguous
    got = tkm.routing_indices(ids)
    assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got.long(), ids)
    with pytest.raises(ValueError, match="topk_ids"):
        tkm.routing_indices(ids.reshape(-1))
    with pytest.raises(TypeError, match="topk_ids"):
        tkm.routing_indices(ids.float())


def _its_routing(tk, logits, ids):
    """Its routing() for the given ids: on a GPU the adapter's own call; under the interpreter (which cannot
    copy the Tensor wrapper routing() hands its top-k kernel) that kernel is launched here on plain tensors,
    as routing() launches it, and the rest is its routing_from_bitmatrix."""
    if HAS_CUDA:
        return tkm.route(tk, ids, logits)
    from triton_kernels.tensor import Bitmatrix
    from triton_kernels.topk_details._topk_forward import _topk_forward

    t, e = logits.shape
    k = ids.shape[1]
    idx = tkm.routing_indices(ids)
    e_pad = triton.cdiv(e, 32) * 32
    vals = torch.full((t, k), float("nan"), dtype=logits.dtype, device=logits.device)
    words = torch.empty(e_pad // 32, triton.cdiv(t, 32) * 32, dtype=torch.uint32, device=logits.device)
    bits = words.transpose(0, 1)[:t]
    s_blocks = triton.cdiv(e, 128)
    zeros = torch.empty(s_blocks * 128, dtype=torch.int32, device=logits.device)
    _topk_forward[(max(triton.cdiv(t, 32), s_blocks),)](
        logits,
        logits.stride(0),
        vals,
        idx,
        vals.stride(0),
        True,
        bits,
        bits.stride(0),
        bits.stride(1),
        t,
        e,
        zeros,
        128,
        s_blocks,
        APPLY_SOFTMAX=True,
        BLOCK_M=32,
        BLOCK_N=32,
        N_EXPTS_PAD=e_pad,
        N_EXPTS_ACT=k,
    )
    bitmatrix = Bitmatrix(bits, shape=[t, e_pad], shape_max=[t, None], scratchpad=zeros)
    return tk.routing.routing_from_bitmatrix(bitmatrix, vals, idx, e, k)


@needs_source
@pytest.mark.parametrize("t,e,k", [(5, 8, 2), (45, 32, 4), (70, 40, 2)])
def test_its_routing_of_the_given_ids_matches_a_reference(fresh, t, e, k):
    """Its routing kernels fed the adapter's ids (more than 16 experts, more than one block of 32 tokens)
    against torch: the histogram, the expert-sorted order (gather) and its inverse (scatter), the gammas in
    that order, and the tile maps matmul_ogs reads for each block size."""
    tk = tkm.load(SOURCE)
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    wts = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEVICE)
    rd, gather, scatter = _its_routing(tk, tkm.routing_logits(ids, wts, e), ids)
    flat = ids.reshape(-1)
    hist = torch.bincount(flat, minlength=e)
    assert torch.equal(rd.expt_hist.long(), hist)
    order = tkm.slot_order(gather)
    assert torch.equal(torch.sort(order).values, torch.arange(t * k, device=DEVICE))
    assert torch.equal(flat[order], torch.sort(flat).values)  # expert-sorted
    assert torch.equal(scatter.src_indx.long()[order], torch.arange(t * k, device=DEVICE))
    assert torch.equal(gather.dst_indx.long(), scatter.src_indx.long())
    torch.testing.assert_close(rd.gate_scal.float(), wts.reshape(-1)[order].float(), atol=1e-6, rtol=1e-5)
    assert (rd.n_expts_tot, rd.n_expts_act) == (e, k)
    data = rd.expt_data
    starts = torch.cat([hist.new_zeros(1), hist.cumsum(0)])
    assert torch.equal(data.token_offs_raw.long(), starts)
    for block, tile_map in data.block_pid_map.items():
        tiles = (hist + block - 1) // block
        offs = torch.cat([tiles.new_zeros(1), tiles.cumsum(0)])
        assert torch.equal(data.token_offs_pad[block].long(), offs), block
        want = torch.full_like(tile_map, -1)
        for x in range(e):  # (tile of the expert << 16) + expert, in expert order; -1 after the last
            blocks = torch.arange(int(tiles[x]), device=DEVICE, dtype=torch.int32)
            want[int(offs[x]) : int(offs[x + 1])] = (blocks << 16) + x
        assert torch.equal(tile_map, want), block


@triton.jit
def _apply(fn, x_ptr, b_ptr, out_ptr, alpha, limit, M: tl.constexpr, N2: tl.constexpr):
    rows = tl.arange(0, M)
    cols = tl.arange(0, N2)
    x = tl.load(x_ptr + rows[:, None] * N2 + cols[None, :]) + tl.load(b_ptr + cols)[None, :]
    y = fn(x, alpha, limit)
    half = tl.arange(0, N2 // 2)
    tl.store(out_ptr + rows[:, None] * (N2 // 2) + half[None, :], y)


@needs_source
def test_its_swiglu_with_the_adapters_bias_is_silu_times_up(fresh):
    """Its own swiglu_fn (read from the source), fed the interleaved product plus the adapter's bias at
    alpha 1 and no clamp, against SiLU(gate) * up in float64."""
    tk = tkm.load(SOURCE)
    act = tkm.silu_activation(tk)
    g = torch.Generator().manual_seed(0)
    m, i = 8, 16
    gate, up = torch.randn(m, i, generator=g) * 3, torch.randn(m, i, generator=g) * 3
    x = torch.stack([gate, up], -1).reshape(m, 2 * i).to(DEVICE)  # interleaved, as the product comes out
    b = tkm.silu_bias(1, 2 * i, DEVICE)[0]
    out = torch.full((m, i), float("nan"), device=DEVICE)
    alpha, limit = act.fn_args if hasattr(act, "fn_args") else act.args
    _apply[(1,)](tk.swiglu.swiglu_fn, x, b, out, alpha, limit, M=m, N2=2 * i)
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=1e-5)


def _ref_ffn(x, ids, wts, w_gu, w_dn):
    i = w_gu.shape[1] // 2
    out = torch.zeros(x.shape[0], w_dn.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w_gu[e].double() @ x[t].double()
            out[t] += float(wts[t, j]) * (w_dn[e].double() @ (torch.nn.functional.silu(gu[:i]) * gu[i:]))
    return out


@pytest.mark.gpu
@needs_source
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 16, 4), (300, 32, 4)])
def test_gpu_layer_and_projections_match_float64(fresh, t, e, k):
    """The layer (routing, gather + fused SwiGLU, scatter + gammas + top-k sum) and both projections in bf16
    on a GPU, outputs poisoned between calls, against float64."""
    tk = tkm.load(SOURCE)
    g = torch.Generator(device="cuda").manual_seed(t)
    h, i = 256, 128
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, device="cuda", generator=g), -1)
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    w_gu = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / math.sqrt(h)).to(torch.bfloat16)
    w_dn = (torch.randn(e, h, i, device="cuda", generator=g) / math.sqrt(i)).to(torch.bfloat16)
    call = tkm.layer(tk, x, ids, wts, e)(w_gu, w_dn)
    call().fill_(float("nan"))
    got = call().double()
    ref = _ref_ffn(x, ids, wts, w_gu, w_dn)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
    slots_in = torch.randn(t * k, h, device="cuda").to(torch.bfloat16)
    for gather_rows, a, w in ((True, x, w_gu), (False, slots_in, w_dn.transpose(1, 2).contiguous())):
        bind, order = tkm.projection(tk, a, ids, e, gather_rows)
        c = bind(w)
        c().fill_(float("nan"))
        y = c().double()
        experts = ids.reshape(-1)[order]
        rows = a[order // k] if gather_rows else a[order]
        ref = torch.einsum("rk,rnk->rn", rows.double(), w[experts].double())
        assert not y.isnan().any()
        torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)
