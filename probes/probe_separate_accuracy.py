"""The SwiGLU backward's two forms checked as E9 checks a step (not a pipeline step): on the tune split's
cells (E9's inputs, uniform load), the step's dX from moe_ffn (the gate/up product kept) with the fused
kernel (dswiglu_fused.fused_swiglu_grad) and with the separate form (the library's backward.swiglu_grad:
P through the forward's GEMM, rounded to the operands' dtype, then the pointwise pass), each against E9's
float64 reference with E9's check (experiments.harness.correctness.check, K = H + I), and the largest relative
error of every other gradient (topk_weights, w_gate_up, w_down) between the two forms.

    python -m probes.probe_separate_accuracy --out results/<slug>/probe_swiglu_accuracy.csv
"""

from __future__ import annotations

import argparse
import time

import torch

from experiments.common import load_config, provenance_fields, require_gpu
from experiments.e9_moe_train import cell_inputs, ref_step
from experiments.harness.correctness import check
from moegemm.grouped import backward as bw
from moegemm.grouped import moe_ffn
from probes.dswiglu_fused import fused_swiglu_grad
from probes.probe_backward import CELLS, write


def grads(x, ids, wts, w_gu, w_dn, dy):
    """(dX, d topk_weights, d w_gate_up, d w_down) of one step, the leaves' gradients cleared after."""
    leaves = (x, wts, w_gu, w_dn)
    for t in leaves:
        t.grad = None
    moe_ffn(x, ids, wts, w_gu, w_dn, w_layout="nk", validate=False, save_gate_up=True).backward(dy)
    out = tuple(t.grad.detach().clone() for t in leaves)
    for t in leaves:
        t.grad = None
    return out


def largest(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """max |a| (with ``b``: max |a - b|), a leading slice at a time in float32 (a weight gradient of
    DeepSeek-V3 in float64 whole would take 56 GiB)."""
    a = a.reshape(a.shape[0], -1)
    b = a.new_zeros(()).expand(a.shape) if b is None else b.reshape(a.shape)
    return torch.stack([(s.float() - t.float()).abs().max() for s, t in zip(a, b)]).max()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", type=int, help="only the first N cells")
    args = ap.parse_args()
    require_gpu()
    g = load_config()["grouped"]
    prov = provenance_fields()
    rows, weights = [], {}
    for model, t in CELLS[: args.cells]:
        t0 = time.perf_counter()
        _, e, _, h, i, ids, x, wts, dy = cell_inputs(g, model, t, "uniform", weights)
        w_gu, w_dn = weights[model]
        _, ref_dx = ref_step(x, ids, wts, w_gu, w_dn, dy)
        kept = bw.swiglu_grad
        got = {}
        for form, fn in (("fused", fused_swiglu_grad), ("separate", kept)):
            bw.swiglu_grad = fn
            try:
                got[form] = grads(x, ids, wts, w_gu, w_dn, dy)
            finally:
                bw.swiglu_grad = kept
            ok, rel, why = check(got[form][0], ref_dx, h + i)
            rows.append(
                dict(model=model, tokens=t, form=form, grad="x", ok=ok, rel_err=rel, note=why, **prov)
            )
        for name, a, b in zip(("topk_weights", "w_gate_up", "w_down"), got["fused"][1:], got["separate"][1:]):
            d = (largest(a, b) / largest(a)).item()
            rows.append(dict(model=model, tokens=t, form="separate vs fused", grad=name, rel_err=d, **prov))
        del ref_dx, got
        torch.cuda.empty_cache()
        write(args.out, rows)
        print(f"{model} T={t}: {time.perf_counter() - t0:.0f} s", flush=True)
    for r in rows:
        ok = r.get("ok", "")
        print(f"{r['model']:16s} {r['tokens']:6d} {r['form']:18s} {r['grad']:12s} {r['rel_err']:.3e} {ok}")


if __name__ == "__main__":
    main()
