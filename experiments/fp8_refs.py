"""FP8 operands in the formats E10's contenders take, and the float64 references their results are held to.

The formats (a tensor is its e4m3 values times their scale; each scale maps its group's largest magnitude to
448, e4m3's largest finite value, so nothing saturates):
- ``block``: DeepSeek-V3's: one fp32 scale per token and 128 channels of the activations, one per 128 x 128
  block of the weights (moegemm.grouped.fp8's quantisers; vLLM's block-FP8 path and DeepGEMM take the same);
- ``rowwise``: one scale per token over all of K, one per expert and output channel (the scales
  torch._scaled_grouped_mm takes);
- ``tensor``: one scale for all the activations, one per expert for the weights (triton_kernels' flexpoint
  scales).

A projection's reference is the float64 product of the contender's own dequantised operands, expert by
expert: its error is then the accumulation's and the output's rounding (``gemm_reference``). The whole FFN's
is computed on the dequantised weights and the activations as given, and bounds one e4m3 rounding of each
activation the layer quantises (x, and the SwiGLU output), with the bf16 roundings of vLLM's intermediates
(``ffn_reference``). Both go to experiments.harness.correctness.check_bounded with ``rel_budget``.
"""

from __future__ import annotations

import torch

from experiments.harness.correctness import FP8_ACC, SUB_E4M3, U_E4M3
from moegemm._runtime import INTERPRET
from moegemm.grouped.fp8 import dequantize_fp8_rows, dequantize_fp8_weights, quantize_fp8_weights
from moegemm.grouped.fp8.quant import AMAX_FLOOR, BLOCK, E4M3_MAX, FP8

FORMATS = ("block", "rowwise", "tensor")
U_BF16 = 2.0**-8
# the output's rounding: half a bf16 ulp, a whole one under Triton's CPU interpreter (it truncates to bf16)
U_OUT = U_BF16 * (2 if INTERPRET else 1)
EXPERTS_PER_CHUNK = 8  # weights are quantised this many experts at a time (DeepSeek-V3's up: 15 GB in bf16)


def _q(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (v.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float().clamp_min(AMAX_FLOOR) / E4M3_MAX).contiguous()


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 [M]): one scale per row over all of K."""
    s = _scale(x.abs().amax(dim=1))
    return _q(x, s[:, None]), s


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 of x's shape, fp32 [1]): one scale for the whole tensor."""
    s = _scale(x.abs().amax().reshape(1))
    return _q(x, s), s


def quantize_weights(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [E, N, K], fp32 scales) of expert weights w [E, N, K] in format ``fmt``, a few experts at a
    time: block [E, ceil(N/128), ceil(K/128)], rowwise [E, N], tensor [E]."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    e, n, k = w.shape
    q = torch.empty(e, n, k, dtype=FP8, device=w.device)
    shape = {"block": (e, -(-n // BLOCK), -(-k // BLOCK)), "rowwise": (e, n), "tensor": (e,)}[fmt]
    s = torch.empty(shape, dtype=torch.float32, device=w.device)
    for lo in range(0, e, EXPERTS_PER_CHUNK):
        part = w[lo : lo + EXPERTS_PER_CHUNK]
        if fmt == "block":
            q[lo : lo + len(part)], s[lo : lo + len(part)] = quantize_fp8_weights(part)
            continue
        amax = part.abs().amax(dim=2) if fmt == "rowwise" else part.abs().flatten(1).amax(dim=1)
        sc = _scale(amax)
        s[lo : lo + len(part)] = sc
        q[lo : lo + len(part)] = _q(part, sc[:, :, None] if fmt == "rowwise" else sc[:, None, None])
    return q, s


def weights64(fmt: str, q: torch.Tensor, s: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e``'s dequantised weights, float64 [N, K]."""
    if fmt == "block":
        return dequantize_fp8_weights(q[e : e + 1], s[e : e + 1])[0]
    if fmt == "rowwise":
        return q[e].double() * s[e].double()[:, None]
    if fmt == "tensor":
        return q[e].double() * s[e].double()
    raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")


def rows64(fmt: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Dequantised activation rows, float64 [M, K] (s: block [M, ceil(K/128)], rowwise [M], tensor [1])."""
    if fmt == "block":
        return dequantize_fp8_rows(q, s)
    if fmt == "rowwise":
        return q.double() * s.double()[:, None]
    if fmt == "tensor":
        return q.double() * s.double()
    raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")


def rel_budget(roundings: int) -> float:
    """The relative Frobenius error allowed for a result with ``roundings`` e4m3 roundings of an operand
    inside the call: one e4m3 unit roundoff each (a rounded operand's error averages a third of that, in
    the root mean square), and four of the output's rounding."""
    return roundings * U_E4M3 + 4 * U_OUT


def gemm_reference(x64: torch.Tensor, offsets: list[int], w64, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 reference [M, N], float32 bound [M, N]) of a grouped GEMM on rows x64 [M, K] grouped by
    expert (rows offsets[e]:offsets[e + 1] are expert e's; w64(e): its float64 [N, K] weights): the product,
    and the bound of its accumulation (FP8_ACC of sum |x| |w|) and of the output's rounding."""
    m = x64.shape[0]
    ref = torch.zeros(m, n, dtype=torch.float64, device=x64.device)
    bound = torch.zeros(m, n, dtype=torch.float32, device=x64.device)
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            w = w64(e)
            a = x64[lo:hi]
            y = a @ w.T
            ref[lo:hi] = y
            bound[lo:hi] = (U_OUT * y.abs() + FP8_ACC * (a.abs() @ w.abs().T) + 1e-30).float()
    return ref, bound


def _block_scales(v: torch.Tensor) -> torch.Tensor:
    """The scale each element of v [n, K] (magnitudes) gets in the block format: its 128-channel block's
    amax / 448, per element."""
    n, k = v.shape
    kb = -(-k // BLOCK)
    pad = torch.zeros(n, kb * BLOCK, dtype=v.dtype, device=v.device)
    pad[:, :k] = v.abs()
    s = pad.view(n, kb, BLOCK).amax(-1).clamp_min(AMAX_FLOOR) / E4M3_MAX
    return s.repeat_interleave(BLOCK, 1)[:, :k]


def _rounded(v: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """dv plus one e4m3 rounding, in the block format, of a value within dv of v."""
    big = v.abs() + dv
    return dv + U_E4M3 * big + SUB_E4M3 * _block_scales(big)


def ffn_reference(x, ids, wts, gate_up64, down64) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 reference [T, H], float64 bound [T, H]) of the expert FFN y[t] = sum_j wts[t, j] *
    down_e(silu(gate_e x_t) * up_e x_t) on the dequantised weights (gate_up64(e): float64 [2I, H];
    down64(e): [H, I]) and x as given, for a layer that quantises x and the SwiGLU output to e4m3 in the
    block format. The bound carries, expert by expert: one e4m3 rounding of x; the accumulation of each GEMM
    (FP8_ACC of its products' magnitudes); the bf16 roundings of the gate/up product, of the SwiGLU output and
    of the down product (vLLM's intermediates); through silu(g) * u with |silu'| <= 1.1; one e4m3 rounding of
    the SwiGLU output; and the output's rounding."""
    t, h = x.shape
    ref = torch.zeros(t, h, dtype=torch.float64, device=x.device)
    bound = torch.zeros(t, h, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok].double()
        dx = _rounded(xe, torch.zeros_like(xe))
        w = gate_up64(e)
        aw = w.abs()
        gu = xe @ w.T
        dgu = dx @ aw.T * (1 + FP8_ACC) + FP8_ACC * (xe.abs() @ aw.T)
        dgu = dgu + U_BF16 * (gu.abs() + dgu)
        i = w.shape[0] // 2
        g, u, dg, du = gu[:, :i], gu[:, i:], dgu[:, :i], dgu[:, i:]
        sg = torch.nn.functional.silu(g)
        hh = sg * u
        dh = 1.1 * dg * u.abs() + (sg.abs() + 1.1 * dg) * du
        dh = _rounded(hh, dh + U_BF16 * (hh.abs() + dh))
        d = down64(e)
        ad = d.abs()
        ys = hh @ d.T
        dys = dh @ ad.T * (1 + FP8_ACC) + FP8_ACC * (hh.abs() @ ad.T)
        dys = dys + U_BF16 * (ys.abs() + dys)
        gw = wts[tok, j].double()[:, None]
        ref.index_add_(0, tok, gw * ys)
        bound.index_add_(0, tok, gw.abs() * dys)
    return ref, bound + U_OUT * (ref.abs() + bound) + 1e-30
