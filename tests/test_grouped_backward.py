"""Gradients of grouped_mm, grouped_mm_swiglu and moe_ffn (moegemm.grouped.autograd) against float64
references: on the CPU under Triton's interpreter at small shapes, on a GPU (-m gpu) at real ones."""

from __future__ import annotations

import zlib

import pytest
import torch

from conftest import HAS_CUDA
from moegemm.grouped import autograd as ag
from moegemm.grouped import backward as bw
from moegemm.grouped import grouped_mm, grouped_mm_swiglu, moe_ffn
from tests.helpers import assert_compiled_grads_match, case_params
from tests.moe_cells import one_small_config

# The GPU tests at real shapes hold tens of GiB each (float64 references included): one at a time across
# pytest-xdist's workers, whatever its --dist mode (conftest.py), or several at once run the GPU out of
# memory.
BIG = pytest.mark.gpu_memory

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 6e-3}  # largest error / largest value


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch, tmp_path, request):
    """Interpreter-sized forward tiles for every shape, and no cache file at home. On a GPU the library's
    own configs; for the small shapes the first of each shortlist, untimed (MOEGEMM_AUTOTUNE=0, as under the
    interpreter and in a graph capture): those tests check the gradients' arithmetic on ragged shapes, and
    timing every shortlist config of each dtype and layout on a few dozen rows only compiled kernels that
    the real-shape tests (``gpu``, autotuned) compile again."""
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    if not torch.cuda.is_available():
        one_small_config(monkeypatch)
    elif request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("MOEGEMM_AUTOTUNE", "0")


@pytest.fixture
def poison(monkeypatch):
    """Every float tensor torch.empty makes starts as NaN, so an output element a kernel forgot shows up."""
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not torch.isnan(got).any() and not torch.isinf(got).any()
    return ((got.double().cpu() - want.cpu()).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def offsets_of(sizes, device) -> torch.Tensor:
    off = [0]
    for s in sizes:
        off.append(off[-1] + s)
    return torch.tensor(off, dtype=torch.int32, device=device)


def ref_mm(x, w, sizes, w_layout, row_scale, swiglu):
    out, r = [], 0
    for e, m in enumerate(sizes):
        we = w[e] if w_layout == "kn" else w[e].transpose(0, 1)
        y = x[r : r + m] @ we
        if swiglu:
            i = y.shape[1] // 2
            y = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
        out.append(y)
        r += m
    y = torch.cat(out)
    return y * row_scale[:, None] if row_scale is not None else y


def weight(e, k, n, w_layout, dtype, device, g, transposed=False):
    """[E, K, N] ("kn") or [E, N, K] ("nk"); ``transposed``: the same values as a transposed view of the
    other layout's contiguous tensor (strides not those of a contiguous weight)."""
    base = torch.randn(e, k, n, generator=g) * 0.3
    if w_layout == "nk":
        base = base.transpose(1, 2)
    w = base.contiguous() if not transposed else base.transpose(1, 2).contiguous().transpose(1, 2)
    return w.to(dtype).to(device).requires_grad_()


CASES = {  # rows per expert
    "ragged-empty": [5, 0, 12, 3],
    "one-takes-all": [0, 21, 0, 0],
}


@pytest.mark.parametrize(
    "case,swiglu,w_layout,dtype",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        case=list(CASES),
        swiglu={"mm": False, "swiglu": True},
        w_layout=["kn", "nk"],
        dtype=[torch.float32, torch.bfloat16, torch.float16],
    ),
)
def test_grouped_mm_grads_match_float64(case, swiglu, w_layout, dtype, device, poison):
    """Gradients for x, w and row_scale against float64 autograd on fresh random data: ragged experts with
    an empty one and one expert taking every row; K and N not multiples of the tiles; x a strided view.
    An expert with no rows gets a weight gradient of exact zeros."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{w_layout}{swiglu}{case}".encode()))
    sizes = CASES[case]
    m, k, n = sum(sizes), 24, 20
    xb = torch.randn(m, 2 * k, generator=g).to(dtype).to(device)
    x = xb[:, ::2].detach().requires_grad_()  # column stride 2
    w = weight(len(sizes), k, n, w_layout, dtype, device, g)
    rs = torch.rand(m, generator=g).to(device).requires_grad_()
    fn = grouped_mm_swiglu if swiglu else grouped_mm
    y = fn(x, w, offsets_of(sizes, device), w_layout=w_layout, row_scale=rs)
    dy = torch.randn(y.shape, generator=g).to(dtype).to(device)
    y.backward(dy)
    xd, wd, rd = (t.detach().double().cpu().requires_grad_() for t in (x, w, rs))
    yr = ref_mm(xd, wd, sizes, w_layout, rd, swiglu)
    yr.backward(dy.double().cpu())
    tol = TOL[dtype]
    assert rel_err(y.detach(), yr.detach()) < tol
    for name, got, want in (("x", x.grad, xd.grad), ("w", w.grad, wd.grad), ("row_scale", rs.grad, rd.grad)):
        assert rel_err(got, want.to(torch.float64)) < tol * (2 if name == "row_scale" else 1), name
    for e, s in enumerate(sizes):
        if s == 0:
            assert (w.grad[e] == 0).all()
    assert x.grad.dtype == dtype and w.grad.dtype == dtype and rs.grad.dtype == torch.float32


@pytest.mark.parametrize("w_layout", ["kn", "nk"])
def test_transposed_weight_views_get_their_gradient(w_layout, device):
    """A weight given as a transposed view (its strides not a contiguous tensor's) gets the same gradient
    as its contiguous copy, in its own shape."""
    g = torch.Generator().manual_seed(3)
    sizes = [7, 2, 0, 9]
    x = torch.randn(18, 16, generator=g).to(device).requires_grad_()
    w = weight(4, 16, 24, w_layout, torch.float32, device, g, transposed=True)
    assert not w.is_contiguous()
    wc = w.detach().contiguous().requires_grad_()
    off = offsets_of(sizes, device)
    dy = torch.randn(18, 12, generator=g).to(device)
    grouped_mm_swiglu(x, w, off, w_layout=w_layout).backward(dy)
    grouped_mm_swiglu(x.detach(), wc, off, w_layout=w_layout).backward(dy)
    assert w.grad.shape == w.shape
    torch.testing.assert_close(w.grad, wc.grad, rtol=0, atol=0)


def ref_ffn(x, ids, tw, wgu, wd, w_layout):
    y = torch.zeros_like(x)
    i = wd.shape[2] if w_layout == "nk" else wd.shape[1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = wgu[e] if w_layout == "kn" else wgu[e].transpose(0, 1)
            d = wd[e] if w_layout == "kn" else wd[e].transpose(0, 1)
            h = x[t] @ g
            y[t] = y[t] + tw[t, j] * ((torch.nn.functional.silu(h[:i]) * h[i:]) @ d)
    return y


def ffn_inputs(dtype, w_layout, device, seed, t=9, h=24, i=20, e=5, k=2, empty=(3,)):
    g = torch.Generator().manual_seed(seed)
    allowed = [x for x in range(e) if x not in empty]
    pick = [torch.randperm(len(allowed), generator=g)[:k] for _ in range(t)]
    ids = torch.stack([torch.tensor(allowed)[p] for p in pick])
    x = torch.randn(t, h, generator=g).to(dtype).to(device).requires_grad_()
    tw = torch.rand(t, k, generator=g).to(device).requires_grad_()
    wgu = weight(e, h, 2 * i, w_layout, dtype, device, g)
    wd = weight(e, i, h, w_layout, dtype, device, g)
    return x, ids.to(device), tw, wgu, wd


@pytest.mark.parametrize(
    "save,w_layout,dtype",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        save={"recompute": False, "save": True},
        w_layout=["kn", "nk"],
        dtype=[torch.float32, torch.bfloat16, torch.float16],
    ),
)
def test_moe_ffn_grads_match_float64(save, w_layout, dtype, device, monkeypatch, poison):
    """moe_ffn's gradients for x, topk_weights, w_gate_up and w_down against float64 autograd, with the
    gate/up product recomputed in the backward or saved from the forward (SAVE_GATE_UP); an expert no
    token chose gets exact zero weight gradients."""
    monkeypatch.setattr(ag, "SAVE_GATE_UP", save)
    x, ids, tw, wgu, wd = ffn_inputs(dtype, w_layout, device, seed=11 + save)
    y = moe_ffn(x, ids, tw, wgu, wd, w_layout=w_layout)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    y.backward(dy)
    ref = [t.detach().double().cpu().requires_grad_() for t in (x, tw, wgu, wd)]
    yr = ref_ffn(ref[0], ids.cpu(), *ref[1:], w_layout)
    yr.backward(dy.double().cpu())
    tol = TOL[dtype]
    assert rel_err(y.detach(), yr.detach()) < tol
    names = ("x", "topk_weights", "w_gate_up", "w_down")
    for name, got, want in zip(names, (x.grad, tw.grad, wgu.grad, wd.grad), (r.grad for r in ref)):
        assert got.dtype == (torch.float32 if name == "topk_weights" else dtype)
        assert rel_err(got, want) < tol * (2 if dtype != torch.float32 else 1), name
    assert (wgu.grad[3] == 0).all() and (wd.grad[3] == 0).all()


def test_backward_is_bitwise_deterministic(device):
    """Two backward passes on the same inputs give bitwise-identical gradients (bf16, the fused kernel's
    partials and the weight gradients' ordered reductions)."""
    x, ids, tw, wgu, wd = ffn_inputs(torch.bfloat16, "nk", device, seed=21)
    grads = []
    for _ in range(2):
        for t in (x, tw, wgu, wd):
            t.grad = None
        moe_ffn(x, ids, tw, wgu, wd, w_layout="nk").float().square().sum().backward()
        grads.append([t.grad.clone() for t in (x, tw, wgu, wd)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("w_layout", ["kn", "nk"])
def test_grouped_dw_against_float64(w_layout, device, poison):
    """grouped_dw alone: gathered A and B rows, scaled B rows, an expert with no rows (exact zeros), the
    result in the weight's layout; every element written (the output starts as NaN here)."""
    g = torch.Generator().manual_seed(9)
    sizes = [0, 13, 1, 0, 20]
    m, k, n = sum(sizes), 33, 17
    a_src = torch.randn(40, k, generator=g).to(device)
    b_src = torch.randn(50, n, generator=g).to(device)
    a_idx = torch.randint(0, 40, (m,), generator=g).to(torch.int32).to(device)
    b_idx = torch.randint(0, 50, (m,), generator=g).to(torch.int32).to(device)
    s = torch.rand(m, generator=g).to(device)
    w_like = torch.empty((5, k, n) if w_layout == "kn" else (5, n, k), device=device)
    dw = bw.grouped_dw(
        a_src, b_src, offsets_of(sizes, device), w_like, w_layout, a_idx=a_idx, b_idx=b_idx, scale=s
    )
    a = a_src.double().cpu()[a_idx.long().cpu()]
    b = b_src.double().cpu()[b_idx.long().cpu()] * s.double().cpu()[:, None]
    r = 0
    for e, sz in enumerate(sizes):
        want = a[r : r + sz].T @ b[r : r + sz]
        got = dw[e] if w_layout == "kn" else dw[e].T
        if sz == 0:
            assert (got == 0).all()
        else:
            torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
        r += sz


class LaunchSpy:
    """Stands in for a Triton kernel object: records each launch, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.grid, self.kwargs = kernel, 0, None, {}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches += 1
            self.grid, self.kwargs = grid, kwargs
            return self.kernel[grid](*args, **kwargs)

        return run


@pytest.fixture
def tma_spies(monkeypatch):
    """The backward's TMA kernels wrapped so that a test can see that they ran."""
    from moegemm.grouped import swiglu_bwd, weight_grad

    spies = {}
    for module, name in (
        (weight_grad, "_grouped_dw_tma_kernel"),
        (weight_grad, "_grouped_dw_kernel"),
        (swiglu_bwd, "_swiglu_bwd_kernel"),
    ):
        spies[name] = LaunchSpy(getattr(module, name))
        monkeypatch.setattr(module, name, spies[name])
    return spies


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_layout", ["kn", "nk"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_grouped_dw_tma_against_float64(dtype, w_layout, scaled, device, poison, tma_spies):
    """grouped_dw through the TMA kernel (16-bit, aligned rows, no gather; B's rows scaled where asked, s B
    made first): experts of no rows (exact zeros), of a whole number of row steps, of fewer rows than one
    step and ragged; K and N not multiples of the tiles; every element written (the output starts as NaN);
    the result in the weight's layout, its unit stride along N ("kn") or K ("nk")."""
    g = torch.Generator().manual_seed(19)
    sizes = [0, 32, 5, 0, 23, 16]
    m, k, n = sum(sizes), 40, 24
    a = torch.randn(m + 3, k, generator=g).to(dtype).to(device)  # rows past the last expert's: not read
    b = torch.randn(m + 3, n, generator=g).to(dtype).to(device)
    s = torch.rand(m + 3, generator=g).to(device) if scaled else None
    w_like = torch.empty((6, k, n) if w_layout == "kn" else (6, n, k), dtype=dtype, device=device)
    dw = bw.grouped_dw(a, b, offsets_of(sizes, device), w_like, w_layout, scale=s)
    assert tma_spies["_grouped_dw_tma_kernel"].launches == 1
    assert tma_spies["_grouped_dw_kernel"].launches == 0
    a64, b64, r = a.double().cpu(), b.double().cpu(), 0
    if scaled:
        b64 = b64 * s.double().cpu()[:, None]
    for e, sz in enumerate(sizes):
        want = a64[r : r + sz].T @ b64[r : r + sz]
        got = dw[e] if w_layout == "kn" else dw[e].T
        if sz == 0:
            assert (got == 0).all()
        else:
            assert rel_err(got, want) < TOL[dtype] / 3
        r += sz


def tma_h() -> int:
    """A hidden size H that every TMA kernel takes at the tiles it runs with: a whole number of K steps of
    the interpreter's 16-wide tiles, or of the widest on a GPU (128), so that no TMA read of the down
    weight [E, H, I] along H crosses into the next expert's rows."""
    return 32 if bw.INTERPRET else 128


def assert_ffn_grads(x, ids, tw, wgu, wd, dy, w_layout, tol):
    """moe_ffn's gradients (after y.backward(dy)) for x, topk_weights, w_gate_up and w_down against float64
    autograd through ref_ffn, each within ``tol`` (largest error / largest value)."""
    ref = [t.detach().double().cpu().requires_grad_() for t in (x, tw, wgu, wd)]
    ref_ffn(ref[0], ids.cpu(), *ref[1:], w_layout).backward(dy.double().cpu())
    names = ("x", "topk_weights", "w_gate_up", "w_down")
    for name, got, want in zip(names, (x.grad, tw.grad, wgu.grad, wd.grad), (r.grad for r in ref)):
        assert rel_err(got, want) < tol, name


@pytest.mark.parametrize(
    "save,w_layout,dtype",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        save={"recompute": False, "save": True},
        w_layout=["kn", "nk"],
        dtype=[torch.bfloat16, torch.float16],
    ),
)
def test_moe_ffn_grads_through_the_tma_kernels(save, w_layout, dtype, device, monkeypatch, poison, tma_spies):
    """moe_ffn's gradients where every operand is TMA-readable (H and I multiples of the tiles, 16-bit): the
    down projection's dX GEMM through the forward's grouped GEMM, then the SwiGLU backward's pointwise pass
    over it (dGU over the gate/up buffer, s A over P), and both weight gradients through the TMA kernels,
    against float64; an unrouted expert's weight gradients exact zeros."""
    monkeypatch.setattr(ag, "SAVE_GATE_UP", save)
    x, ids, tw, wgu, wd = ffn_inputs(dtype, w_layout, device, seed=51 + save, t=13, h=tma_h(), i=16, e=5, k=2)
    y = moe_ffn(x, ids, tw, wgu, wd, w_layout=w_layout)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    y.backward(dy)
    spy = tma_spies["_swiglu_bwd_kernel"]
    assert spy.launches == 1 and not spy.kwargs["P_GEMM"] and not spy.kwargs["RECOMPUTE"]
    assert spy.kwargs["IN_PLACE"]
    assert tma_spies["_grouped_dw_tma_kernel"].launches == 2 and tma_spies["_grouped_dw_kernel"].launches == 0
    assert_ffn_grads(x, ids, tw, wgu, wd, dy, w_layout, TOL[dtype] * 2)
    assert (wgu.grad[3] == 0).all() and (wd.grad[3] == 0).all()


@pytest.mark.parametrize("w_layout", ["kn", "nk"])
def test_moe_ffn_in_fp32_fuses_the_swiglu_backward(w_layout, device, monkeypatch, poison, tma_spies):
    """In fp32 the down projection's dX GEMM and the SwiGLU backward run as one launch of the pointer kernel
    (P in its K loop, the backward in its epilogue), with the same gradients as float64."""
    monkeypatch.setattr(ag, "SAVE_GATE_UP", True)
    x, ids, tw, wgu, wd = ffn_inputs(torch.float32, w_layout, device, seed=57, t=11, h=tma_h(), i=16)
    y = moe_ffn(x, ids, tw, wgu, wd, w_layout=w_layout)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(device)
    y.backward(dy)
    spy = tma_spies["_swiglu_bwd_kernel"]
    assert spy.launches == 1 and spy.kwargs["P_GEMM"] and not spy.kwargs["RECOMPUTE"]
    assert_ffn_grads(x, ids, tw, wgu, wd, dy, w_layout, TOL[torch.float32] * 2)


@pytest.mark.parametrize("in_place", [False, True])
def test_swiglu_backward_from_a_given_product(in_place, device, poison):
    """The SwiGLU backward's pointwise pass alone (swiglu_backward with the upstream gradient P given and the
    gate/up product loaded, no weight): dGU, s A and rowdot(P, A) against float64, ragged experts and an
    empty one; with ``in_place``, dGU over the gate/up product and s A over P."""
    g = torch.Generator().manual_seed(12)
    sizes, i = [7, 0, 20, 5], 40
    rows = sum(sizes)
    p = torch.randn(rows, i, generator=g).bfloat16().to(device)
    gu = torch.randn(rows, 2 * i, generator=g).bfloat16().to(device)
    s = torch.rand(rows, generator=g).to(device)
    p64, gu64, s64 = p.double().cpu(), gu.double().cpu(), s.double().cpu()[:, None]
    out, act = (gu, p) if in_place else (None, None)
    dgu, sact, ds = bw.swiglu_backward(
        offsets_of(sizes, device),
        rows,
        p,
        x=None,
        w_gate_up=None,
        w_layout="nk",
        gu=gu,
        scale=s,
        rowdot=True,
        store_act=True,
        out=out,
        act=act,
    )
    gate, up = gu64[:, :i], gu64[:, i:]
    sig = torch.sigmoid(gate)
    a = gate * sig * up
    want_dgu = torch.cat([s64 * p64 * up * sig * (1 + gate * (1 - sig)), s64 * p64 * gate * sig], 1)
    assert rel_err(dgu, want_dgu) < TOL[torch.bfloat16]
    assert rel_err(sact, s64 * a) < TOL[torch.bfloat16]
    assert rel_err(ds, (p64 * a).sum(1)) < TOL[torch.bfloat16]
    if in_place:
        assert dgu.data_ptr() == gu.data_ptr() and sact.data_ptr() == p.data_ptr()


def test_saved_gate_up_backs_one_backward_only(device):
    """With the gate/up product kept (SAVE_GATE_UP), the backward writes its gradient over it: a second
    backward through the same graph (retain_graph) raises autograd's in-place error instead of reading the
    overwritten product; a recomputing layer backs both."""
    for save in (True, False, None):  # None: the default, which keeps it
        x, ids, tw, wgu, wd = ffn_inputs(torch.float32, "nk", device, seed=61)
        y = moe_ffn(x, ids, tw, wgu, wd, w_layout="nk", save_gate_up=save).sum()
        y.backward(retain_graph=True)
        first = x.grad.clone()
        if save is not False:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()
        else:
            y.backward()
            torch.testing.assert_close(x.grad, 2 * first)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_in_float32(device):
    """torch.autograd.gradcheck of grouped_mm_swiglu (x, w, row_scale) and moe_ffn (x, topk_weights) in
    float32 (the kernels take no float64: their tl.dot runs 16- and 32-bit operands), at step 1e-2 and
    tolerance 1e-3, on tiny shapes (the step's error: a few 1e-5 here). Not fast mode: a random projection
    of the Jacobian missed a 10% error in silu's derivative."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 4, generator=g).to(device).requires_grad_()
    w = torch.randn(2, 4, 4, generator=g).to(device).requires_grad_()
    rs = torch.rand(4, generator=g).to(device).requires_grad_()
    off = offsets_of([4, 0], device)
    f = lambda x, w, rs: grouped_mm_swiglu(x, w, off, w_layout="nk", row_scale=rs)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w, rs), eps=1e-2, atol=1e-3, rtol=1e-3)
    x2, ids, tw, wgu, wd = ffn_inputs(torch.float32, "kn", device, seed=8, t=2, h=4, i=4, e=3, empty=())
    wgu, wd = (t.detach() * 3 for t in (wgu, wd))
    for save in (False, True):  # gradcheck backs each graph many times: the kept product once only

        def f(x, tw, save=save):
            return moe_ffn(x, ids, tw, wgu, wd, w_layout="kn", save_gate_up=save)

        if save:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.gradcheck(f, (x2, tw), eps=1e-2, atol=1e-3, rtol=1e-3)
        else:
            assert torch.autograd.gradcheck(f, (x2, tw), eps=1e-2, atol=1e-3, rtol=1e-3)


def test_bad_input_raises_naming_the_argument(device):
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(2, 8, 4, device=device, requires_grad=True)
    off = offsets_of([2, 4], device)
    with pytest.raises(ValueError, match="epilogue"):
        grouped_mm(x, w, off, w_layout="kn", epilogue="relu")
    with pytest.raises(ValueError, match="out"):
        grouped_mm(x, w, off, w_layout="kn", out=torch.empty(6, 4, device=device))
    with pytest.raises(ValueError, match="w_layout"):
        grouped_mm(x, w, off, w_layout="km")
    with pytest.raises(ValueError, match="w: K="):
        grouped_mm(x, w, off, w_layout="nk")
    with pytest.raises(TypeError, match="w: dtype"):
        grouped_mm(x, w.detach().half().requires_grad_(), off, w_layout="kn")
    xf, ids, tw, wgu, wd = ffn_inputs(torch.float32, "nk", device, seed=1)
    with pytest.raises(TypeError, match="w_gate_up: dtype"):
        moe_ffn(xf, ids, tw, wgu.detach().half().requires_grad_(), wd, w_layout="nk")
    if device == "cpu":  # on a GPU the ids are checked on the device, with no host sync: a device-side
        # assertion that ends the CUDA context (tests/test_grouped_gpu.py checks it in a process of its own)
        with pytest.raises(ValueError, match="topk_ids"):
            moe_ffn(xf, ids + 10, tw, wgu, wd, w_layout="nk")


def test_no_grad_calls_take_the_inference_path(device, monkeypatch):
    """Under torch.no_grad (or with nothing requiring grad) no autograd Function runs."""
    called = []
    monkeypatch.setattr(ag, "grouped_mm_train", lambda *a, **k: called.append(1))
    monkeypatch.setattr(ag, "moe_ffn_train", lambda *a, **k: called.append(1))
    x, ids, tw, wgu, wd = ffn_inputs(torch.float32, "nk", device, seed=2)
    with torch.no_grad():
        moe_ffn(x, ids, tw, wgu, wd, w_layout="nk")
        grouped_mm(x, wgu, offsets_of([9, 0, 0, 0, 0], device), w_layout="nk")
    assert not called


@pytest.mark.parametrize("save", [False, True], ids=["recompute", "save"])
def test_torch_compile_backward_matches_eager(save, device, monkeypatch):
    """moe_ffn and grouped_mm under torch.compile(fullgraph=True): the training ops (functional custom ops
    with registered autograd; with the gate/up product kept, a backward op that writes its gradient over
    it) trace with no graph break, and the compiled step's gradients equal the eager ones bitwise (the
    same kernels)."""
    monkeypatch.setattr(ag, "SAVE_GATE_UP", save)
    torch._dynamo.reset()
    x, ids, tw, wgu, wd = ffn_inputs(torch.float32, "kn", device, seed=31)
    off = offsets_of([4, 5, 0, 3], device)
    w2 = weight(4, 24, 8, "nk", torch.float32, device, torch.Generator().manual_seed(1))

    def step(x, tw, wgu, wd, w2):
        y = moe_ffn(x, ids, tw, wgu, wd, w_layout="kn")
        z = grouped_mm(y[:, :24].repeat(2, 1)[:12], w2, off, w_layout="nk")
        return y.square().sum() + z.sum()

    leaves = (x, tw, wgu, wd, w2)
    step(*leaves).backward()
    eager = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(*leaves).backward()
    for a, b in zip(eager, (t.grad for t in leaves)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    explained = torch._dynamo.explain(step)(*leaves)
    assert explained.graph_break_count == 0


def test_checkpoint_recomputes_the_layer(device):
    """Inside torch.utils.checkpoint (non-reentrant) the layer's gradients equal those without it."""
    x, ids, tw, wgu, wd = ffn_inputs(torch.float32, "nk", device, seed=41)
    leaves = (x, tw, wgu, wd)
    moe_ffn(x, ids, tw, wgu, wd, w_layout="nk").square().sum().backward()
    plain = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    y = torch.utils.checkpoint.checkpoint(
        lambda *a: moe_ffn(a[0], ids, *a[1:], w_layout="nk"), *leaves, use_reentrant=False
    )
    y.square().sum().backward()
    for a, b in zip(plain, (t.grad for t in leaves)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _qwen3_blocks(device, seed):
    """(a small Qwen3-MoE block on ``device`` with experts_implementation="moegemm", the same block in float64
    on transformers' eager experts, the generator that drew its random parameters)."""
    import copy

    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=32,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=97,
    )
    block = Qwen3MoeSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ref = Qwen3MoeSparseMoeBlock(copy.deepcopy(cfg)).double()
    ref.load_state_dict(block.state_dict())
    ref.experts.config._experts_implementation = "eager"
    block = block.to(device)
    block.experts.config._experts_implementation = "moegemm"
    return block, ref, g


def test_transformers_backend_backward(device):
    """loss.backward() through a transformers MoE block on experts_implementation="moegemm": every
    parameter's gradient (the router's included) against the same block in float64 on the eager experts."""
    pytest.importorskip("transformers")
    moe = pytest.importorskip("transformers.integrations.moe")
    if not hasattr(moe, "ExpertsInterface"):
        pytest.skip("transformers without ExpertsInterface")

    import moegemm.integrations.transformers  # noqa: F401

    block, ref, g = _qwen3_blocks(device, seed=1)
    x = torch.randn(2, 5, 32, generator=g)
    out = block(x.to(device))
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    want = ref(x.double())
    want = want[0] if isinstance(want, tuple) else want
    want.square().sum().backward()
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-4, atol=1e-4)
    for (name, p), (_, q) in zip(block.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.double().cpu(), q.grad, rtol=1e-3, atol=1e-4, msg=name)


# ---- GPU, real shapes ----

REAL = [  # (E, H, I, top_k): Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B (their float64 references fit)
    (128, 2048, 768, 8),
    (128, 4096, 1536, 8),
    (8, 4096, 14336, 2),
]


def _real_inputs(e, h, i, k, t, w_layout, dtype, seed, zipf=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if zipf:
        p = 1.0 / torch.arange(1, e + 1, device="cuda", dtype=torch.float64) ** 1.2
        ids = torch.multinomial(p.expand(t, e).float(), k, generator=g)
    else:
        ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1).indices
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype).requires_grad_()
    tw = torch.rand(t, k, device="cuda", generator=g).softmax(-1).requires_grad_()
    wgu = (
        (
            torch.randn((e, h, 2 * i) if w_layout == "kn" else (e, 2 * i, h), device="cuda", generator=g)
            * h**-0.5
        )
        .to(dtype)
        .requires_grad_()
    )
    wd = (
        (torch.randn((e, i, h) if w_layout == "kn" else (e, h, i), device="cuda", generator=g) * i**-0.5)
        .to(dtype)
        .requires_grad_()
    )
    return x, ids, tw, wgu, wd


# (shape, dtype, load): each real shape once, each float dtype once, both loads. Each case holds tens of GB
# and runs alone, so the cases run in series on the pipeline's verify step's critical path (the six cases
# of two dtypes per shape took 147 s of it on the H200); every dtype on every case of the small-shape grid
# is test_moe_ffn_grads_match_float64's, on the CPU and the GPU
REAL_CASES = [
    (0, torch.float32, True),
    (1, torch.float16, False),
    (2, torch.bfloat16, True),
]
REAL_IDS = ["qwen3-30b", "qwen3-235b", "mixtral-8x7b"]


@pytest.mark.gpu
@BIG
@pytest.mark.parametrize(
    "shape, dtype, zipf",
    [(REAL[s], d, z) for s, d, z in REAL_CASES],
    ids=[f"{REAL_IDS[s]}-{str(d).split('.')[-1]}-{'zipf' if z else 'uniform'}" for s, d, z in REAL_CASES],
)
def test_gpu_moe_ffn_grads_at_real_shapes(shape, dtype, zipf):
    e, h, i, k = shape
    t = 1024 if dtype == torch.float32 else 2048
    x, ids, tw, wgu, wd = _real_inputs(e, h, i, k, t, "nk", dtype, seed=1, zipf=zipf)
    y = moe_ffn(x, ids, tw, wgu, wd, w_layout="nk")
    dy = torch.randn_like(y)
    y.backward(dy)
    tol = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}[dtype]
    got = {"x": x.grad, "topk_weights": tw.grad, "w_gate_up": wgu.grad, "w_down": wd.grad}
    for name, err in _relative_grad_errors(x, ids, tw, wgu, wd, dy, got).items():
        assert err < tol, (name, err)


@torch.no_grad()
def _relative_grad_errors(x, ids, tw, wgu, wd, dy, got: dict) -> dict:
    """{gradient: ||got - float64|| / ||float64||} of the layer's four gradients ([E, N, K] weights), the
    float64 reference built expert by expert from E9's closed forms (one expert's weights in float64 at a
    time: the whole layer's float64 weights and their gradients would hold tens of GB)."""
    from experiments.e9_moe_train import _expert_terms

    xd, twd = x.detach(), tw.detach()
    dx = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    dtw = torch.zeros(tw.shape, dtype=torch.float64, device=x.device)
    sq = {name: [0.0, 0.0] for name in ("w_gate_up", "w_down")}  # [error, reference] squared norms
    for e in range(wgu.shape[0]):
        t = _expert_terms(e, xd, ids, twd, wgu.detach(), wd.detach(), dy)
        if t is None:
            refs = {"w_gate_up": torch.zeros_like(got["w_gate_up"][e], dtype=torch.float64)}
            refs["w_down"] = torch.zeros_like(got["w_down"][e], dtype=torch.float64)
        else:
            refs = {"w_gate_up": t["dgu"].T @ t["xe"], "w_down": (t["s"] * t["dye"]).T @ t["act"]}
            dx.index_add_(0, t["tok"], t["dgu"] @ t["gu_w"])
            dtw[t["tok"], t["j"]] = (t["dye"] * (t["act"] @ t["dn_w"].T)).sum(1)
        for name, ref in refs.items():
            sq[name][0] += float((got[name][e].double() - ref).square().sum())
            sq[name][1] += float(ref.square().sum())
    out = {name: (err / ref) ** 0.5 for name, (err, ref) in sq.items()}
    for name, ref in (("x", dx), ("topk_weights", dtw)):
        out[name] = float((got[name].double() - ref).norm() / ref.norm())
    return out


@pytest.mark.gpu
@BIG
@pytest.mark.parametrize("w_layout", ["kn", "nk"])
def test_gpu_step_captures_in_a_cuda_graph_and_is_deterministic(w_layout):
    """A forward + backward step with default arguments captures in a CUDA graph (no host sync), replays
    to the eager gradients, and two backward passes are bitwise equal."""
    e, h, i, k = REAL[0]
    x, ids, tw, wgu, wd = _real_inputs(e, h, i, k, 4096, w_layout, torch.bfloat16, seed=2, zipf=True)
    leaves = (x, tw, wgu, wd)

    def step():
        for p in leaves:
            p.grad = None
        moe_ffn(x, ids, tw, wgu, wd, w_layout=w_layout).float().square().mean().backward()
        return [p.grad for p in leaves]

    first = [g.clone() for g in step()]
    second = [g.clone() for g in step()]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for p in leaves:
            p.grad = None
        moe_ffn(x, ids, tw, wgu, wd, w_layout=w_layout).float().square().mean().backward()
        captured = [p.grad for p in leaves]
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(first, captured):
        assert torch.equal(a, b)


@pytest.mark.gpu
@BIG
@pytest.mark.parametrize("w_layout", ["kn", "nk"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["mm", "swiglu"])
def test_gpu_grouped_mm_grads_at_real_shapes(w_layout, swiglu):
    e, h, i, _ = REAL[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    sizes = torch.randint(0, 200, (e,), generator=g, device="cuda")
    sizes[::7] = 0
    off = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    off[1:] = sizes.cumsum(0)
    m = int(off[-1])
    n = 2 * i if swiglu else i
    x = torch.randn(m, h, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (
        (torch.randn((e, h, n) if w_layout == "kn" else (e, n, h), device="cuda", generator=g) * h**-0.5)
        .bfloat16()
        .requires_grad_()
    )
    rs = torch.rand(m, device="cuda", generator=g).requires_grad_()
    fn = grouped_mm_swiglu if swiglu else grouped_mm
    y = fn(x, w, off, w_layout=w_layout, row_scale=rs)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [a.detach().double().requires_grad_() for a in (x, w, rs)]
    yr = ref_mm(ref[0], ref[1], sizes.tolist(), w_layout, ref[2], swiglu)
    yr.backward(dy.double())
    for name, got, want in zip(("x", "w", "row_scale"), (x.grad, w.grad, rs.grad), (r.grad for r in ref)):
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2, name
    for ex in range(e):
        if int(sizes[ex]) == 0:
            assert (w.grad[ex] == 0).all()


# ---- the step-by-step API in training: route, permute, grouped_mm, unpermute ----


def _pipeline_inputs(t, k, e, dtype, device, seed, h=16, n=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    ids[: max(t // 2, 1)] = ids[0]  # skew: half the tokens on the first token's experts
    tw = torch.rand(t, k, generator=g).to(dtype).to(device)
    w = (torch.randn(e, n, h, generator=g) * 0.3).to(dtype).to(device)
    dy = torch.randn(t, n, generator=g).to(dtype).to(device)
    return x, ids, tw, w, dy


def _pipeline_grads(x, ids, tw, w, dy, fused_scale):
    """Gradients of x, topk_weights and w through route -> permute -> grouped_mm -> unpermute, the gating
    weights applied in the un-permute, or (``fused_scale``) as grouped_mm's row_scale after
    route_and_permute."""
    from moegemm.grouped import permute, route, route_and_permute, sorted_weights, unpermute

    x, tw, w = (t.detach().clone().requires_grad_() for t in (x, tw, w))
    e = w.shape[0]
    if fused_scale:
        plan, xs, ws = route_and_permute(x, ids, tw, e)
        assert torch.equal(ws.detach(), sorted_weights(tw.detach(), plan))
        y = unpermute(grouped_mm(xs, w, plan.group_offsets, row_scale=ws), plan, None)
    else:
        plan = route(ids, e)
        y = unpermute(grouped_mm(permute(x, plan), w, plan.group_offsets), plan, tw)
    assert y.requires_grad
    y.backward(dy)
    return x.grad, tw.grad, w.grad


@pytest.mark.parametrize(
    "fused_scale,slots,dtype",
    case_params(  # on a GPU every combination, under the interpreter every pair
        HAS_CUDA,
        fused_scale={"weights-in-unpermute": False, "weights-as-row-scale": True},
        slots={"decode-one-launch": (5, 2, 4), "three-kernels": (40, 3, 6)},
        dtype={str(d): d for d in (torch.float32, torch.bfloat16)},
    ),
)
def test_step_by_step_pipeline_trains(fused_scale, slots, dtype, device, poison):
    """The README's pipeline gets gradients for x, the gating weights and the weights, against float64, at
    decode (at most 64 slots: the routing's one-launch kernel, which has no gradient, gives way) and above;
    two backwards give bitwise the same gradients (no atomics)."""
    t, k, e = slots
    x, ids, tw, w, dy = _pipeline_inputs(t, k, e, dtype, device, seed=t * 10 + k)
    got = _pipeline_grads(x, ids, tw, w, dy, fused_scale)
    again = _pipeline_grads(x, ids, tw, w, dy, fused_scale)
    for a, b in zip(got, again):
        assert torch.equal(a, b)
    x64, tw64, w64 = (v.detach().double().cpu().requires_grad_() for v in (x, tw, w))
    ids_c = ids.cpu()
    y64 = sum(tw64[:, j : j + 1] * torch.einsum("th,tnh->tn", x64, w64[ids_c[:, j]]) for j in range(k))
    y64.backward(dy.double().cpu())
    for name, g, r in zip(("x", "topk_weights", "w"), got, (x64.grad, tw64.grad, w64.grad)):
        assert g.dtype == dtype, name
        assert rel_err(g, r) < TOL[dtype], (name, rel_err(g, r))


def test_step_by_step_pipeline_under_torch_compile(device):
    """The same pipeline compiled (fullgraph): the routing steps trace as custom ops with their autograd,
    and the gradients equal the eager ones."""
    torch._dynamo.reset()
    x, ids, tw, w, dy = _pipeline_inputs(12, 2, 4, torch.float32, device, seed=3)

    def step(x, tw, w):
        from moegemm.grouped import permute, route, unpermute

        plan = route(ids, 4)
        return (unpermute(grouped_mm(permute(x, plan), w, plan.group_offsets), plan, tw) * dy).sum()

    assert_compiled_grads_match(step, (x, tw, w), rtol=1e-6, atol=1e-6)


def test_double_backward_raises_instead_of_dropping_terms(device):
    """A gradient of a gradient through grouped_mm or moe_ffn raises (their backwards are differentiable
    once), where it used to return a graph without the weights' part: asked for with create_graph=True,
    whether the loss is linear in the layer's output (a gradient penalty) or not."""
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(2, 8, 4, device=device, requires_grad=True)
    for loss in (lambda y: y.square().sum(), lambda y: y.sum()):
        y = grouped_mm(x, w, offsets_of([2, 4], device), w_layout="kn")
        with pytest.raises(RuntimeError, match="grouped_mm: a gradient of its gradient"):
            torch.autograd.grad(loss(y), x, create_graph=True)
    xf, ids, tw, wgu, wd = ffn_inputs(torch.float32, "nk", device, seed=4)
    with pytest.raises(RuntimeError, match="moe_ffn: a gradient of its gradient"):
        torch.autograd.grad(moe_ffn(xf, ids, tw, wgu, wd).sum(), xf, create_graph=True)
    y = grouped_mm(x, w, offsets_of([2, 4], device), w_layout="kn")
    (gx,) = torch.autograd.grad(y.square().sum(), x)  # a plain backward is unaffected
    assert gx.shape == x.shape and not gx.requires_grad


def test_training_calls_check_their_arguments_by_name(device):
    """The training path refuses what the inference path refuses, by name: a token count topk_ids does not
    route, integer gating weights, a save_gate_up that is not a bool; grouped_mm_masked, which has no
    gradient, says so; a config must be a GroupedConfig or its dict; row_scale a float tensor."""
    from moegemm.grouped import grouped_mm_masked, sorted_weights

    x, ids, tw, wgu, wd = ffn_inputs(torch.float32, "nk", device, seed=5)
    for grad in (False, True):
        xx = x.detach().clone().requires_grad_(grad)
        with pytest.raises(ValueError, match="topk_ids: routes"):
            moe_ffn(xx[:-1], ids, tw, wgu, wd)
        with pytest.raises(TypeError, match="topk_weights"):
            moe_ffn(xx, ids, (tw * 10).long(), wgu, wd)
    with pytest.raises(TypeError, match="save_gate_up"):
        moe_ffn(x, ids, tw, wgu, wd, save_gate_up="no")
    xm = torch.randn(3, 4, 8, device=device, requires_grad=True)
    wm = torch.randn(3, 5, 8, device=device)
    with pytest.raises(RuntimeError, match="grouped_mm_masked has no gradient"):
        grouped_mm_masked(xm, wm, torch.tensor([4, 0, 2], device=device))
    with torch.no_grad():
        assert grouped_mm_masked(xm, wm, torch.tensor([4, 0, 2], device=device)).shape == (3, 4, 5)
    xs = torch.randn(6, 8, device=device)
    w2 = torch.randn(2, 4, 8, device=device)
    off = offsets_of([2, 4], device)
    cfg = {"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2}
    from moegemm.grouped import GroupedConfig

    torch.testing.assert_close(
        grouped_mm(xs, w2, off, config=cfg), grouped_mm(xs, w2, off, config=GroupedConfig(**cfg))
    )
    with pytest.raises(TypeError, match="config"):
        grouped_mm(xs, w2, off, config="fast")
    with pytest.raises(TypeError, match="config"):
        grouped_mm(xs, w2, off, config={"bogus": 1})
    with pytest.raises(TypeError, match="row_scale"):
        grouped_mm(xs, w2, off, row_scale=torch.ones(6, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="topk_weights"):
        from moegemm.grouped import route

        sorted_weights([[1.0, 0.5]] * 9, route(ids, wgu.shape[0]))


def test_transformers_backend_under_autocast(device):
    """Mixed-precision training through the transformers backend: fp32 parameters under autocast run the
    expert GEMMs in autocast's dtype (as transformers' own backends do), close to float64 at that dtype's
    rounding, with fp32 gradients for every parameter."""
    pytest.importorskip("transformers")
    moe = pytest.importorskip("transformers.integrations.moe")
    if not hasattr(moe, "ExpertsInterface"):
        pytest.skip("transformers without ExpertsInterface")

    import moegemm.integrations.transformers as hf

    block, ref, g = _qwen3_blocks(device, seed=2)
    seen = []
    real = hf.moe_ffn

    def spy(x, *args, **kwargs):
        seen.append(x.dtype)
        return real(x, *args, **kwargs)

    hf.moe_ffn = spy
    try:
        x = torch.randn(2, 5, 32, generator=g)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            out = block(x.to(device))
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().sum().backward()
    finally:
        hf.moe_ffn = real
    assert seen == [torch.bfloat16]
    want = ref(x.double())
    want = want[0] if isinstance(want, tuple) else want
    assert rel_err(out.detach(), want.detach()) < 3e-2
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name


def test_moe_ffn_trains_on_no_tokens(device):
    """A step with no tokens (an expert-parallel rank that received none): zero-size input gradients and
    exact zeros for every weight's."""
    x, ids, tw, wgu, wd = ffn_inputs(torch.float32, "nk", device, seed=6)
    x0, ids0, tw0 = (t[:0].detach().clone() for t in (x, ids, tw))
    x0.requires_grad_()
    tw0.requires_grad_()
    moe_ffn(x0, ids0, tw0, wgu, wd).sum().backward()
    assert x0.grad.shape == x0.shape and tw0.grad.shape == tw0.shape
    assert (wgu.grad == 0).all() and (wd.grad == 0).all()
