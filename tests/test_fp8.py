"""The block-scaled FP8 grouped GEMMs (moegemm.grouped.fp8) against float64 computed on the dequantised
operands, on fresh random data with realistic ranges, outliers and all-zero blocks; K and N not multiples of
128; both layouts; the SwiGLU variant's fused e4m3 quantisation; and bad input."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, HAS_CUDA
from moegemm.grouped.fp8 import (
    Fp8Config,
    dequantize_fp8_rows,
    dequantize_fp8_weights,
    grouped_mm_fp8,
    grouped_mm_fp8_masked,
    grouped_mm_fp8_swiglu,
    moe_ffn_fp8,
    quantize_fp8_rows,
    quantize_fp8_weights,
)
from moegemm.grouped.fp8.quant import BLOCK, E4M3_MAX

U_E4M3 = 2.0**-4  # e4m3's unit roundoff (3 mantissa bits)
SUB_E4M3 = 2.0**-10  # half of e4m3's smallest subnormal, 2**-9, as a fraction of the block's scale
U32 = 2.0**-24
# The error of one 128-channel block's product, as a fraction of |a| @ |w| over the block: BLOCK fp32 adds
# under the interpreter; on Hopper, the FP8 tensor-core MMA keeps about 14 bits of its running sum
# (DeepSeek-V3 technical report, arXiv:2412.19437, section 3.3.2), over BLOCK / 32 chained k32 steps (the
# block's scales are then applied in fp32, so the error does not grow past one block)
BLOCK_ACC = (BLOCK // 32 + 1) * 2.0**-13 if HAS_CUDA else BLOCK * U32
# the output's rounding: half an ulp, but a whole one for bf16 under Triton's CPU interpreter, which converts
# fp32 to bf16 by truncation
U_OUT = {torch.bfloat16: 2.0 ** (-8 if HAS_CUDA else -7), torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _operands(gen, e, n, k, m, outliers=True, zero_blocks=True):
    """Activations of unit scale with a few large outliers and a zero row; weights of an FFN's scale with an
    all-zero 128 x 128 block."""
    x = torch.randn(m, k, generator=gen) * 2
    w = torch.randn(e, n, k, generator=gen) * 0.05
    if outliers and m:
        x[m // 2, k // 3] = 300.0  # its 128-channel group quantises the others coarsely
        w[0, 0, 0] = 9.0
    if zero_blocks:
        if m > 1:
            x[1] = 0.0
        w[-1, :BLOCK, :BLOCK] = 0.0
    return x.to(DEVICE), w.to(DEVICE)


def _expected(xd, wd, offsets):
    """float64 X_e @ W_e^T per expert, and |X_e| @ |W_e|^T (the accumulation's error scale)."""
    ref, mag = [], []
    for i in range(wd.shape[0]):
        a = xd[offsets[i] : offsets[i + 1]]
        ref.append(a @ wd[i].T)
        mag.append(a.abs() @ wd[i].abs().T)
    return torch.cat(ref), torch.cat(mag)


def _assert_within(got, ref, bound, what):
    got = got.double().cpu()
    ref, bound = ref.cpu(), bound.cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN"
    err = (got - ref).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements outside the bound, worst excess {(err - bound).max():.3e}"
    )


def test_weight_quantisation_is_one_e4m3_rounding_per_element():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 200, 300, generator=gen) * 0.05
    w[0, 3, 5] = 40.0
    w[1, 128:, 128:256] = 0.0
    w_q, s = quantize_fp8_weights(w.to(DEVICE))
    assert w_q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 2, 3)
    wd = dequantize_fp8_weights(w_q, s).cpu()
    scale = s.double().cpu().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :200, :300]
    _assert_within(wd, w.double(), U_E4M3 * w.double().abs() + SUB_E4M3 * scale, "dequantised w")
    assert (wd[1, 128:, 128:256] == 0).all()  # an all-zero block stays zeros
    assert w_q.float().abs().max() <= E4M3_MAX  # no block saturates


@pytest.mark.parametrize("gather", [False, True])
def test_row_quantisation_and_its_gather(gather):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(11, 300, generator=gen) * 3).to(torch.bfloat16)
    x[4, 10] = 1000.0
    x[7] = 0.0
    rows = torch.tensor([3, 3, 0, 10, 7, 4], dtype=torch.int32) if gather else None
    q, s = quantize_fp8_rows(x.to(DEVICE), None if rows is None else rows.to(DEVICE))
    src = x if rows is None else x[rows.long()]
    assert tuple(q.shape) == tuple(src.shape) and tuple(s.shape) == (src.shape[0], 3)
    xd = dequantize_fp8_rows(q, s).cpu()
    scale = s.double().cpu().repeat_interleave(BLOCK, -1)[:, :300]
    _assert_within(xd, src.double(), U_E4M3 * src.double().abs() + SUB_E4M3 * scale, "dequantised x")
    if gather:
        assert (xd[4] == 0).all()  # x's row 7, all zeros


def _gemm_bound(ref, mag, k, out_dtype, row_scale=None):
    """Output rounding of the result, plus fp32 accumulation over K (each 128-block's product, its scaling and
    the running sum: a few fp32 roundings per term, bounded by (K/128 + 128 + 2) u32 of |x| @ |w|)."""
    acc = (BLOCK_ACC + (k // BLOCK + 4) * U32) * mag
    if row_scale is not None:
        acc = acc * row_scale.abs()[:, None]
        ref = ref * row_scale[:, None]
    tiny = {torch.bfloat16: 1e-30, torch.float16: 6e-8, torch.float32: 1e-44}[out_dtype]
    return ref, U_OUT[out_dtype] * ref.abs() * (1 + 1e-6) + acc * (1 + U_OUT[out_dtype]) + tiny


@pytest.mark.parametrize(
    "counts,n,k",
    [([5, 0, 9], 96, 200), ([40, 17, 1, 0], 256, 128), ([0, 0, 3], 130, 384), ([33], 64, 7)],
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_contiguous_against_float64_on_the_dequantised_operands(counts, n, k, out_dtype):
    gen = torch.Generator().manual_seed(sum(counts) * 7 + n + k)
    e, m = len(counts), sum(counts)
    x, w = _operands(gen, e, n, k, m)
    x_q, x_s = quantize_fp8_rows(x)
    w_q, w_s = quantize_fp8_weights(w)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    rs = torch.rand(m, generator=gen, dtype=torch.float64) + 0.1
    off = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    y = grouped_mm_fp8(x_q, x_s, w_q, w_s, off, row_scale=rs.float().to(DEVICE), out_dtype=out_dtype)
    assert y.dtype == out_dtype and tuple(y.shape) == (m, n)
    ref, mag = _expected(dequantize_fp8_rows(x_q, x_s).cpu(), dequantize_fp8_weights(w_q, w_s).cpu(), offsets)
    ref, bound = _gemm_bound(ref, mag, k, out_dtype, rs.float().double())
    _assert_within(y, ref, bound, f"grouped_mm_fp8 {counts} N={n} K={k} {out_dtype}")


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 128), (64, 256)])
def test_contiguous_tiles_agree(block_m, block_n, tma):
    """Tiles of every shape, through TMA boxes (K = 272: rows 16-byte aligned, a partial last K block) and
    pointer loads."""
    gen = torch.Generator().manual_seed(5)
    counts = [3, 50, 0, 21]
    x, w = _operands(gen, 4, 200, 272, sum(counts))
    x_q, x_s = quantize_fp8_rows(x)
    w_q, w_s = quantize_fp8_weights(w)
    offsets = [0, 3, 53, 53, 74]
    off = torch.tensor(offsets, device=DEVICE)
    cfg = Fp8Config(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2, tma=tma)
    y = grouped_mm_fp8(x_q, x_s, w_q, w_s, off, config=cfg, out_dtype=torch.float32)
    ref, mag = _expected(dequantize_fp8_rows(x_q, x_s).cpu(), dequantize_fp8_weights(w_q, w_s).cpu(), offsets)
    ref, bound = _gemm_bound(ref, mag, 272, torch.float32)
    _assert_within(y, ref, bound, f"tiles {block_m}x{block_n}")


@pytest.mark.parametrize("tma", [True, False])
def test_swiglu_quantises_its_output_within_one_e4m3_rounding(tma):
    gen = torch.Generator().manual_seed(6)
    counts, n, k = [7, 0, 30], 192, 256  # N = 192: the last 128-column scale block half full
    x, w = _operands(gen, 3, 2 * n, k, sum(counts))
    x_q, x_s = quantize_fp8_rows(x)
    w_q, w_s = quantize_fp8_weights(w)
    offsets = [0, 7, 7, 37]
    cfg = Fp8Config(block_m=32, block_n=128, tma=tma)
    h_q, h_s = grouped_mm_fp8_swiglu(x_q, x_s, w_q, w_s, torch.tensor(offsets, device=DEVICE), config=cfg)
    assert h_q.dtype == torch.float8_e4m3fn and tuple(h_q.shape) == (37, n) and tuple(h_s.shape) == (37, 2)
    gu, mag = _expected(dequantize_fp8_rows(x_q, x_s).cpu(), dequantize_fp8_weights(w_q, w_s).cpu(), offsets)
    gate, up = gu[:, :n], gu[:, n:]
    h64 = gate * torch.sigmoid(gate) * up
    # the fp32 product's error (accumulation, propagated through silu(g) * u by its magnitude), then one
    # e4m3 rounding of the result at the block's scale
    acc = (BLOCK_ACC + (k // BLOCK + 8) * U32) * (mag[:, :n] * up.abs() * 1.1 + mag[:, n:] * gate.abs())
    scale = h_s.double().cpu().repeat_interleave(BLOCK, -1)[:, :n]
    bound = U_E4M3 * (h64.abs() + acc) * 1.001 + SUB_E4M3 * scale + acc
    _assert_within(dequantize_fp8_rows(h_q, h_s), h64, bound, "swiglu h")
    assert h_q.float().abs().max() <= E4M3_MAX


@pytest.mark.parametrize("k", [200, 256])  # pointer loads; TMA boxes
@pytest.mark.parametrize("leave_tail_unwritten", [False, True])
def test_masked_layout_and_its_tail(leave_tail_unwritten, k):
    gen = torch.Generator().manual_seed(8)
    e, m_max, n = 3, 24, 160
    x = (torch.randn(e, m_max, k, generator=gen) * 2).to(DEVICE)
    w = (torch.randn(e, n, k, generator=gen) * 0.05).to(DEVICE)
    x_q, x_s = quantize_fp8_rows(x.reshape(e * m_max, k))
    x_q, x_s = x_q.view(e, m_max, k), x_s.view(e, m_max, -1)
    w_q, w_s = quantize_fp8_weights(w)
    masked_m = torch.tensor([5, 0, 99], dtype=torch.int32, device=DEVICE)  # 99 > m_max: clamped to 24
    y = grouped_mm_fp8_masked(
        x_q, x_s, w_q, w_s, masked_m, out_dtype=torch.float32, leave_tail_unwritten=leave_tail_unwritten
    )
    xd = dequantize_fp8_rows(x_q, x_s).cpu()
    wd = dequantize_fp8_weights(w_q, w_s).cpu()
    for i, mm in enumerate([5, 0, 24]):
        ref, bound = _gemm_bound(xd[i, :mm] @ wd[i].T, xd[i, :mm].abs() @ wd[i].abs().T, k, torch.float32)
        _assert_within(y[i, :mm], ref, bound, f"masked expert {i}")
        if not leave_tail_unwritten:
            assert (y[i, mm:] == 0).all(), f"expert {i}: rows past masked_m not zeros"


def test_empty_and_k_zero():
    x_q = torch.zeros(0, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    w_q, w_s = quantize_fp8_weights(torch.randn(2, 32, 64).to(DEVICE))
    y = grouped_mm_fp8(
        x_q, torch.zeros(0, 1, device=DEVICE), w_q, w_s, torch.zeros(3, dtype=torch.int32, device=DEVICE)
    )
    assert tuple(y.shape) == (0, 32)


def test_bad_input_names_the_argument():
    w_q, w_s = quantize_fp8_weights(torch.randn(2, 32, 64).to(DEVICE))
    x_q, x_s = quantize_fp8_rows(torch.randn(6, 64).to(DEVICE))
    off = torch.tensor([0, 2, 6], device=DEVICE)
    with pytest.raises(TypeError, match="x_q: expected float8_e4m3fn"):
        grouped_mm_fp8(x_q.float(), x_s, w_q, w_s, off)
    with pytest.raises(ValueError, match=r"x_scale: expected shape \(6, 1\)"):
        grouped_mm_fp8(x_q, x_s[:, :0], w_q, w_s, off)
    with pytest.raises(TypeError, match="w_scale: expected float32"):
        grouped_mm_fp8(x_q, x_s, w_q, w_s.double(), off)
    with pytest.raises(ValueError, match="w_q: K=64 differs"):
        grouped_mm_fp8(x_q[:, :32], x_s, w_q, w_s, off)
    with pytest.raises(ValueError, match="group_offsets: expected an int tensor of shape"):
        grouped_mm_fp8(x_q, x_s, w_q, w_s, off[:2])
    with pytest.raises(ValueError, match="config.block_n"):
        grouped_mm_fp8_swiglu(x_q, x_s, w_q, w_s, off, config=Fp8Config(block_n=64))
    with pytest.raises(ValueError, match="rows: indices must lie"):
        quantize_fp8_rows(torch.randn(4, 8), torch.tensor([0, 4]))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="group_offsets"):
            grouped_mm_fp8(x_q, x_s, w_q, w_s, torch.tensor([0, 5, 4]))


def test_inconsistent_offsets_unchecked_stay_inside_the_tensors():
    """validate=False with offsets past x's rows: the kernel bounds every row it derives into x_q's rows."""
    w_q, w_s = quantize_fp8_weights(torch.randn(3, 32, 64).to(DEVICE))
    x_q, x_s = quantize_fp8_rows(torch.randn(10, 64).to(DEVICE))
    y = grouped_mm_fp8(x_q, x_s, w_q, w_s, torch.tensor([0, 3, 3, 700], device=DEVICE), validate=False)
    assert tuple(y.shape) == (10, 32) and not torch.isnan(y.float()[:3]).any()


@pytest.mark.parametrize("t,top_k", [(1, 2), (13, 3)])
def test_moe_ffn_fp8_against_float64(t, top_k):
    """The layer: x quantised as it is gathered (one e4m3 rounding), the SwiGLU output quantised in the
    gate/up epilogue (a second), each against float64 on the dequantised weights."""
    gen = torch.Generator().manual_seed(10 + t)
    e, h, i = 4, 160, 192
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    gw = torch.rand(t, top_k, generator=gen)
    wgu_q, wgu_s = quantize_fp8_weights(torch.randn(e, 2 * i, h, generator=gen) * 0.1)
    wd_q, wd_s = quantize_fp8_weights(torch.randn(e, h, i, generator=gen) * 0.1)
    y = moe_ffn_fp8(*(v.to(DEVICE) for v in (x, ids, gw, wgu_q, wgu_s, wd_q, wd_s)))
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (t, h)
    xq, xs = quantize_fp8_rows(x.to(DEVICE))
    xd = dequantize_fp8_rows(xq, xs).cpu()
    gud, dd = dequantize_fp8_weights(wgu_q, wgu_s), dequantize_fp8_weights(wd_q, wd_s)
    ref = torch.zeros(t, h, dtype=torch.float64)
    bound = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(top_k):
            ex = int(ids[tok, j])
            gu = gud[ex] @ xd[tok]
            g, u = gu[:i], gu[i:]
            h64 = g * torch.sigmoid(g) * u
            mag = gud[ex].abs() @ xd[tok].abs()
            acc = (BLOCK_ACC + (h // BLOCK + 8) * U32) * (mag[:i] * u.abs() * 1.1 + mag[i:] * g.abs())
            dh = U_E4M3 * (h64.abs() + acc) * 1.001 + SUB_E4M3 * (h64.abs().max() / E4M3_MAX) * 2 + acc
            out = dd[ex] @ h64
            err = dd[ex].abs() @ dh + (BLOCK_ACC + (i // BLOCK + 4) * U32) * (dd[ex].abs() @ (h64.abs() + dh))
            ref[tok] += float(gw[tok, j]) * out
            bound[tok] += float(gw[tok, j]) * (err + U_OUT[torch.bfloat16] * out.abs() * 1.01)
    bound = bound * (1 + 1e-3) + U_OUT[torch.bfloat16] * ref.abs() * 1.01 + 1e-30
    _assert_within(y, ref, bound, f"moe_ffn_fp8 T={t} top_k={top_k}")


def test_moe_ffn_fp8_traces_whole_under_torch_compile(monkeypatch, tmp_path):
    """fullgraph: routing, quantisation and both GEMMs trace as custom ops, and run the same kernels; a
    trace that comes first in its process (the first-call choices not yet read from disk) traces too."""
    from moegemm import autotune

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    gen = torch.Generator().manual_seed(12)
    t, e, h, i, top_k = 6, 4, 128, 128, 2
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to(DEVICE)
    gw = torch.rand(t, top_k, generator=gen).to(DEVICE)
    wgu = quantize_fp8_weights((torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(DEVICE))
    wd = quantize_fp8_weights((torch.randn(e, h, i, generator=gen) * 0.1).to(DEVICE))
    torch._dynamo.reset()
    compiled = torch.compile(moe_ffn_fp8, fullgraph=True, backend="aot_eager")(x, ids, gw, *wgu, *wd)
    eager = moe_ffn_fp8(x, ids, gw, *wgu, *wd)
    if DEVICE == "cpu":  # (on a GPU the eager call may time its way to other tiles than the trace's start)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    else:
        torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_moe_ffn_takes_fp8_experts_with_their_scales():
    """The public layer dispatches e4m3 weights with their scales to the FP8 layer (the same result), and
    names what is missing or mixed."""
    from moegemm.grouped import moe_ffn

    gen = torch.Generator().manual_seed(13)
    t, e, h, i, top_k = 5, 4, 128, 128, 2
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to(DEVICE)
    gw = torch.rand(t, top_k, generator=gen).to(DEVICE)
    wgu, sgu = quantize_fp8_weights((torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(DEVICE))
    wd, sd = quantize_fp8_weights((torch.randn(e, h, i, generator=gen) * 0.1).to(DEVICE))
    y = moe_ffn(x, ids, gw, wgu, wd, w_gate_up_scale=sgu, w_down_scale=sd)
    torch.testing.assert_close(y, moe_ffn_fp8(x, ids, gw, wgu, sgu, wd, sd), rtol=0, atol=0)
    with pytest.raises(ValueError, match="w_down_scale: FP8 experts need"):
        moe_ffn(x, ids, gw, wgu, wd, w_gate_up_scale=sgu)
    with pytest.raises(TypeError, match="w_down: FP8 experts take float8_e4m3fn"):
        moe_ffn(x, ids, gw, wgu, wd.to(torch.bfloat16), w_gate_up_scale=sgu, w_down_scale=sd)
    with pytest.raises(ValueError, match="w_layout: FP8 experts"):
        moe_ffn(x, ids, gw, wgu, wd, w_gate_up_scale=sgu, w_down_scale=sd, w_layout="kn")


def test_first_call_times_its_regimes_shortlist_once(monkeypatch, tmp_path):
    """With no config, a call that can time runs its regime's shortlist (SwiGLU: 128-column tiles only) on
    its own inputs, keeps the fastest in memory and on disk, and computes with it; a later call, in this
    process or the next, takes it untimed; where a call cannot time, it takes the untimed start and keeps
    nothing. Each layout, variant and output dtype is its own key."""
    from moegemm import autotune
    from moegemm.grouped.fp8 import config as fp8_config

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(fp8_config, "gpu_slug", lambda t: "test-fp8-gpu")
    gen = torch.Generator().manual_seed(8)
    counts, n, k = [5, 0, 19], 128, 256
    x, w = _operands(gen, 3, 2 * n, k, sum(counts))
    x_q, x_s = quantize_fp8_rows(x)
    w_q, w_s = quantize_fp8_weights(w)
    off = torch.tensor([0, 5, 5, 24], dtype=torch.int32, device=DEVICE)
    short = fp8_config.shortlist(24 / 3, False)
    assert short[0] == fp8_config.default_config(24 / 3, False) and len(short) > 2
    assert all(c.block_n == BLOCK for c in fp8_config.shortlist(24 / 3, True))
    timed: list = []

    def fastest(launch, cands, **kw):
        for c in cands:
            timed.append(c)
            launch(c)
        return cands[2], {str(i): 1.0 for i in range(len(cands))}

    monkeypatch.setattr(autotune, "fastest", fastest)
    monkeypatch.setattr(autotune, "can_time", lambda t: False)
    grouped_mm_fp8(x_q, x_s, w_q, w_s, off)
    assert timed == [] and autotune._MEMORY == {}
    monkeypatch.setattr(autotune, "can_time", lambda t: True)
    y = grouped_mm_fp8(x_q, x_s, w_q, w_s, off)
    assert timed == short
    key = fp8_config.choice_key(False, False, torch.bfloat16, 3, k, 2 * n, 24)
    assert fp8_config.chosen(x_q, key, 24 / 3, False) == (short[2], "autotuned")
    ref = grouped_mm_fp8(x_q, x_s, w_q, w_s, off, config=short[2])
    assert torch.equal(y, ref)
    timed.clear()
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    grouped_mm_fp8(x_q, x_s, w_q, w_s, off)  # the next process: from the disk cache
    assert timed == []
    grouped_mm_fp8(x_q, x_s, w_q, w_s, off, out_dtype=torch.float32)
    h_q, h_s = grouped_mm_fp8_swiglu(x_q, x_s, w_q, w_s, off)
    assert timed == short + fp8_config.shortlist(24 / 3, True) and h_q.shape == (24, n)
    other = fp8_config.choice_key(True, False, torch.bfloat16, 3, k, 2 * n, 24)
    assert fp8_config.chosen(x_q, other, 8.0, False) == (short[0], "default")


@pytest.mark.gpu
def test_masked_and_layer_capture_in_a_cuda_graph_with_no_host_sync(monkeypatch, tmp_path):
    """The masked FP8 GEMM with its default config (its first call times the shortlist, outside the capture)
    and the FP8 layer at decode, each captured in one CUDA graph (a capture fails on any host sync), then
    replayed with new values in the captured inputs: new rows, new masked_m, new routing; the GEMM right
    against float64 after each replay, the layer equal to its eager call on the same inputs (which the
    layer's own test holds to float64)."""
    from moegemm import autotune
    from tests.test_grouped_gpu import _captured

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))  # (a first call that times: no choice kept yet)
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    gen = torch.Generator().manual_seed(12)
    e, m_max, n, k = 8, 32, 256, 512
    x_q, x_s = quantize_fp8_rows((torch.randn(e * m_max, k, generator=gen) * 2).to("cuda"))
    x_q, x_s = x_q.view(e, m_max, k), x_s.view(e, m_max, -1)
    w_q, w_s = quantize_fp8_weights((torch.randn(e, n, k, generator=gen) * 0.05).to("cuda"))
    masked_m = torch.tensor([3, 0, 32, 7, 1, 0, 16, 9], dtype=torch.int32, device="cuda")
    graph, y = _captured(lambda: grouped_mm_fp8_masked(x_q, x_s, w_q, w_s, masked_m, out_dtype=torch.float32))
    wd = dequantize_fp8_weights(w_q, w_s).cpu()
    for r in range(2):
        q, s = quantize_fp8_rows((torch.randn(e * m_max, k, generator=gen) * 2).to("cuda"))
        x_q.copy_(q.view(e, m_max, k))
        x_s.copy_(s.view(e, m_max, -1))
        masked_m.copy_(torch.randint(0, m_max + 1, (e,), generator=gen, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        xd = dequantize_fp8_rows(x_q, x_s).cpu()
        for i, mm in enumerate(masked_m.tolist()):
            ref, bound = _gemm_bound(xd[i, :mm] @ wd[i].T, xd[i, :mm].abs() @ wd[i].abs().T, k, torch.float32)
            _assert_within(y[i, :mm], ref, bound, f"replay {r} expert {i}")
            assert (y[i, mm:] == 0).all(), f"replay {r} expert {i}: rows past masked_m not zeros"
    # the layer at decode: routing, the fused gather and quantisation, gate/up with SwiGLU, down, combine
    t, top_k, h, i = 4, 2, 256, 128
    w_gu = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to("cuda")
    w_dn = (torch.randn(e, h, i, generator=gen) / i**0.5).to("cuda")
    gu_q, gu_s = quantize_fp8_weights(w_gu)
    dn_q, dn_s = quantize_fp8_weights(w_dn)
    xt = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to("cuda")
    wts = torch.softmax(torch.randn(t, top_k, generator=gen), -1).to("cuda")
    with torch.no_grad():
        graph, y = _captured(lambda: moe_ffn_fp8(xt, ids, wts, gu_q, gu_s, dn_q, dn_s))
        for r in range(2):
            xt.copy_(torch.randn(t, h, generator=gen))
            ids.copy_(torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]))
            graph.replay()
            torch.cuda.synchronize()
            want = moe_ffn_fp8(xt, ids, wts, gu_q, gu_s, dn_q, dn_s)
            assert torch.equal(y, want), f"layer replay {r}: differs from the eager call on the same inputs"
