"""Correctness gate shared by tests and experiments: a contender is timed only if it matches float64."""

from __future__ import annotations

import math

import torch

# Per output dtype: relative tolerance (output rounding) and absolute tolerance per sqrt(K) of a product
# of unit-variance operands (fp32 accumulation, fp32 rounding of partials).
TOL = {
    torch.float32: (2e-5, 2e-6),
    torch.float16: (2e-3, 2e-4),
    torch.bfloat16: (1.6e-2, 2e-3),
}
# The same for tf32 products (torch.compile/cuBLAS may use them for fp32 when allowed).
TOL_TF32 = (2e-3, 1e-3)
# fp32 accumulation: a sum of K unit-variance products rounds each partial sum (of size ~sqrt(j)), so its
# error grows like eps32 * K for a sequential chain (random-walk bound), not like sqrt(K): at K = 28672 an
# fp32 IEEE kernel's element that cancels to 0.7 can be 4.2e-4 off, as one measured on the H200 was.
ACC_EPS = 1.2e-7


def atol_for(dtype: torch.dtype, k: int, tf32: bool = False) -> tuple[float, float]:
    """(rtol, atol) for an output of this dtype from a K-long reduction of unit-variance products."""
    rtol, atol_unit = TOL_TF32 if tf32 else TOL[dtype]
    k = max(k, 1)
    return rtol, atol_unit * math.sqrt(k) + ACC_EPS * k


# Unit roundoff of each dtype (half the distance from 1 to the next number)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Roundings an operand of a gradient's product may carry before the product, each of at most one unit
# roundoff of the layer's dtype relative to its magnitude: the forward's stored activations (the gate/up
# product, SwiGLU's output), dY times the gating weight, the SwiGLU derivative's factors. A bound, not a
# fit: one such rounding per factor at most, counted for both factors of each product.
OPERAND_ROUNDINGS = 8


def check(
    out: torch.Tensor,
    ref64: torch.Tensor,
    k: int,
    tf32: bool = False,
    scale: float = 1.0,
    magnitude: torch.Tensor | None = None,
) -> tuple[bool, float, str]:
    """(ok, relative Frobenius error, reason). NaN anywhere is never ok. ``scale`` multiplies both
    tolerances, for an arithmetic whose roundings err more than round-to-nearest (Triton's interpreter,
    which casts fp32 to bf16 by truncation).

    ``magnitude``: for a product whose operands are themselves rounded intermediates (a gradient), the
    float64 sum over its K terms of their absolute values (``|A| @ |B|``). The absolute tolerance is then
    the error bound of such a dot product, ``(OPERAND_ROUNDINGS * u + K * u32) * magnitude`` with u the
    output dtype's unit roundoff and u32 fp32's, which holds however the terms cancel; without it, the
    bound of a product of unit-variance operands (:func:`atol_for`)."""
    rtol, atol = atol_for(out.dtype, k, tf32)
    got = out.detach().double()
    ref = ref64.to(got.device)
    if got.shape != ref.shape:
        return False, math.inf, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if magnitude is not None:
        unit = UNIT_ROUNDOFF[out.dtype] if not tf32 else 2.0**-11
        atol = (OPERAND_ROUNDINGS * unit + max(k, 1) * UNIT_ROUNDOFF[torch.float32]) * magnitude.to(
            got.device
        )
    rtol, atol = scale * rtol, scale * atol
    if torch.isnan(got).any():
        return False, math.nan, "NaN in output"
    err = (got - ref).abs()
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30)) if ref.numel() else 0.0
    bad = err > atol + rtol * ref.abs()
    if bad.any():
        return False, rel, f"{int(bad.sum())} elements outside tolerance (max abs err {float(err.max()):.3g})"
    # the Frobenius norm of the error: within 4 rtol of the reference's, plus the bound's own norm
    budget = 4 * rtol * float(ref.norm()) + (
        float(torch.as_tensor(atol).norm()) if magnitude is not None else 0.0
    )
    if ref.numel() and float((got - ref).norm()) >= max(budget, 1e-30):
        return False, rel, f"relative error {rel:.2e}"
    return True, rel, ""


def status_of(ok: bool, why: str) -> str:
    """A result row's status: "ok"; "error" where the contender could not run (an exception, e.g. a tile
    that needs more shared memory than the GPU has; ``why`` starts with "error:"); "wrong" where it ran and
    its values failed the check against float64 (NaN included)."""
    return "ok" if ok else "error" if why.startswith("error:") else "wrong"


# FP8 e4m3 (3 mantissa bits): the unit roundoff of a normal value, and half the subnormal step (2**-9) in
# units of its scale block's scale (a block's scale maps its amax to 448)
U_E4M3 = 2.0**-4
SUB_E4M3 = 2.0**-10
# fp8 products on Hopper's tensor cores keep about 14 bits of the sum while they accumulate inside a scale
# block (DeepSeek-V3's report), and each block's sum is then added in fp32: 2**-11 of the products'
# magnitudes (sum over K of |a| |b|) bounds both, with room
FP8_ACC = 2.0**-11


def check_bounded(
    out: torch.Tensor, ref64: torch.Tensor, bound: torch.Tensor, rel_budget: float
) -> tuple[bool, float, str]:
    """(ok, relative Frobenius error, reason) of an output whose error has a bound of its own: every element
    within ``bound`` (float64, elementwise, the worst case its roundings allow) of the float64 reference,
    and the relative Frobenius error at most ``rel_budget`` (what its roundings give on average, with room:
    the worst case of a long sum is loose, so this part tells a wrong result from a rounded one). NaN
    anywhere is never ok."""
    got = out.detach().double()
    ref = ref64.to(got.device)
    if got.shape != ref.shape:
        return False, math.inf, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if torch.isnan(got).any():
        return False, math.nan, "NaN in output"
    err = (got - ref).abs()
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30)) if ref.numel() else 0.0
    bad = err > bound.to(got.device)
    if bad.any():
        worst = float((err - bound.to(got.device)).max())
        return False, rel, f"{int(bad.sum())} elements outside their bound (worst excess {worst:.3g})"
    if ref.numel() and rel > rel_budget:
        return False, rel, f"relative error {rel:.2e} over its budget {rel_budget:.2e}"
    return True, rel, ""
