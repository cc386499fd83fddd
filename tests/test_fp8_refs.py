"""experiments/fp8_refs.py and check_bounded: the FP8 formats E10's contenders take dequantise within one
e4m3 rounding, and the layer's check tells a rounded result from a wrong one (under Triton's interpreter on
the CPU, on a GPU natively)."""

from __future__ import annotations

import torch

from conftest import DEVICE
from experiments import fp8_refs
from experiments.harness.correctness import check_bounded
from moegemm.grouped import moe_ffn
from tests.fp8_stand_ins import ffn_case


def test_formats_dequantise_within_one_e4m3_rounding():
    """Each weight format (block, row-wise, per expert) and the row-wise and per-tensor activations: every
    value within one e4m3 rounding of the original at its scale, no value saturated."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 200, 300, generator=g).to(DEVICE) * 0.05
    w[1, 7, 11] = 5.0
    for fmt in fp8_refs.FORMATS:
        q, s = fp8_refs.quantize_weights(w, fmt)
        assert q.dtype == fp8_refs.FP8 and q.float().abs().max() <= 448
        for e in range(3):
            got = fp8_refs.weights64(fmt, q, s, e).cpu()
            scale = w[e].abs().amax().double().cpu() / 448  # at most the expert's: every format's scale
            bound = fp8_refs.U_E4M3 * w[e].double().abs().cpu() + fp8_refs.SUB_E4M3 * scale * 1.001
            assert ((got - w[e].double().cpu()).abs() <= bound).all(), (fmt, e)
    x = torch.randn(9, 300, generator=g).to(torch.bfloat16).to(DEVICE)
    for fmt, quant in (("rowwise", fp8_refs.quantize_rowwise), ("tensor", fp8_refs.quantize_tensor)):
        q, s = quant(x)
        err = (fp8_refs.rows64(fmt, q, s) - x.double()).abs()
        amax = x.double().abs().amax()
        assert (err <= fp8_refs.U_E4M3 * x.double().abs() + fp8_refs.SUB_E4M3 * amax / 448 * 1.001).all()


def test_the_layers_check_tells_a_rounded_result_from_a_wrong_one():
    """ours:moe_ffn with e4m3 weights against float64 on the dequantised weights within the bound of its two
    activation roundings; the same output with two tokens swapped, or a NaN, does not pass."""
    x, ids, wts, e, q, (ref, bound) = ffn_case()
    y = moe_ffn(x, ids, wts, q[0], q[2], w_gate_up_scale=q[1], w_down_scale=q[3])
    ok, rel, why = check_bounded(y, ref, bound, fp8_refs.rel_budget(2))
    assert ok and rel < fp8_refs.rel_budget(2), why
    assert not check_bounded(y[[1, 0, *range(2, y.shape[0])]], ref, bound, fp8_refs.rel_budget(2))[0]
    y = y.clone()
    y[2, 5] = float("nan")
    assert check_bounded(y, ref, bound, fp8_refs.rel_budget(2))[2] == "NaN in output"
