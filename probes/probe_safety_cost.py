"""Probe: what the grouped kernels' safety costs on the GPU clock.

1. The row bounds. Every grouped kernel bounds the row ranges it derives from the group offsets into x's rows
   (``moegemm.grouped.tiles._bounded_rows``), so that no flag (``validate=False``) lets a kernel read or
   write outside its tensors. Here each contiguous forward kernel the default path launches is timed beside
   the same kernel built with the bound left out (its ``_tile_plan`` taking the offsets as they are), on the
   same arguments: the library's own launch is recorded once, then both kernels replay it.
2. The masked layout's zero tail. ``grouped_mm_masked`` writes zeros into the rows past ``masked_m`` by
   default; ``leave_tail_unwritten=True`` leaves them. Both timed at decode.

Cells: the tune-split models' gate/up and down projections at decode (T = 16, 256) and prefill (T = 4096),
uniform load. Each pair is timed in interleaved rounds under CUDA graphs (GPU clock); the row keeps each
side's median, their ratio (safe over unsafe) and a 95% bootstrap interval of the ratio over rounds.

    python -m probes.probe_safety_cost --out results/<slug>/probe_safety_cost.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import types

import torch
import triton
import triton.language as tl  # noqa: F401 (Triton looks for it in the module of a jit function)
from triton.testing import do_bench_cudagraph

from experiments.common import load_config, provenance_fields
from experiments.harness.moe_loads import sample_topk
from moegemm.grouped import grouped_mm, grouped_mm_masked, kernels, tiles
from moegemm.grouped.routing import route

ROUNDS = 9
TOKENS = (16, 256, 4096)
DECODE_MAX = 256
MODELS = ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b")
FORWARD_KERNELS = ("_grouped_mm_kernel", "_grouped_mm_tma_kernel")


@triton.jit
def _rows_as_given(lo, hi, M):
    """The row range exactly as the offsets give it (the bound left out)."""
    return lo, hi


def _rebuilt(jit_fn, overrides: dict):
    """A second JIT kernel of ``jit_fn``'s source whose globals take ``overrides``: compiled and cached on
    its own, beside the library's."""
    fn = jit_fn.fn
    glob = dict(fn.__globals__)
    glob.update(overrides)
    clone = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__module__, clone.__qualname__, clone.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    clone.__annotations__ = dict(fn.__annotations__)  # where Triton reads which parameters are constexpr
    clone.__kwdefaults__ = fn.__kwdefaults__
    return triton.jit(clone)


def unbounded_kernels() -> dict:
    plan = _rebuilt(tiles._tile_plan, {"_bounded_rows": _rows_as_given})
    return {name: _rebuilt(getattr(kernels, name), {"_tile_plan": plan}) for name in FORWARD_KERNELS}


def recorded_launch(call) -> tuple[str, dict] | None:
    """(kernel name, its run() arguments) of the forward kernel ``call`` launches (the last one)."""
    seen = {}
    originals = {name: getattr(kernels, name).run for name in FORWARD_KERNELS}
    try:
        for name in FORWARD_KERNELS:

            def spy(*args, _name=name, **kw):
                seen["launch"] = (_name, args, dict(kw))
                return originals[_name](*args, **kw)

            getattr(kernels, name).run = spy
        call()
    finally:
        for name in FORWARD_KERNELS:
            del getattr(kernels, name).run  # back to the class's method
    return seen.get("launch")


def paired(f_safe, f_unsafe) -> dict:
    """Interleaved rounds of both under CUDA graphs: medians (us), ratio safe / unsafe and its interval."""
    a, b = [], []
    f_safe(), f_unsafe()
    torch.cuda.synchronize()
    for r in range(ROUNDS):
        pair = [(a, f_safe), (b, f_unsafe)]
        for out, f in pair if r % 2 == 0 else pair[::-1]:
            out.append(do_bench_cudagraph(f, rep=40) * 1e3)
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return dict(
        safe_us=statistics.median(a),
        unsafe_us=statistics.median(b),
        ratio=statistics.median(ratios),
        ci_low=boots[50],
        ci_high=boots[1949],
    )


def cells(g: dict):
    for model in MODELS:
        m = g["models"][model]
        for proj, (k, n) in (("up", m["up"]), ("down", m["down"])):
            for t in TOKENS:
                yield model, m, proj, k, n, t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = load_config()["grouped"]
    prov = provenance_fields()
    variants = unbounded_kernels()
    rows = []
    for model, m, proj, k, n, t in cells(g):
        e, top_k = m["experts"], m["top_k"]
        gen = torch.Generator(device="cuda").manual_seed(t + k)
        ids = sample_topk(t, e, top_k, "uniform", seed=t + k)
        plan = route(ids, e)
        x = torch.randn(t * top_k, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        off = plan.group_offsets
        launch = recorded_launch(lambda: grouped_mm(x, w, off, validate=False))
        base = dict(model=model, projection=proj, tokens=t, phase="decode" if t <= DECODE_MAX else "prefill")
        if launch is not None:
            name, a, kw = launch
            lib, alt = getattr(kernels, name), variants[name]
            res = paired(lambda: lib.run(*a, **kw), lambda: alt.run(*a, **kw))
            rows.append(dict(base, what="row bounds", kernel=name, **res, **prov))
            print(rows[-1], flush=True)
        if t <= DECODE_MAX:
            m_max = max(16, triton.next_power_of_2(-(-t * top_k // e) * 2))
            xm = torch.randn(e, m_max, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            counts = plan.group_sizes.to(torch.int32).clamp(max=m_max)
            res = paired(
                lambda: grouped_mm_masked(xm, w, counts),
                lambda: grouped_mm_masked(xm, w, counts, leave_tail_unwritten=True),
            )
            rows.append(dict(base, what="zero tail", kernel="masked", **res, **prov))
            print(rows[-1], flush=True)
    tmp = args.out + ".tmp"  # no partial file: the CSV appears whole, or not at all
    with open(tmp, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    os.replace(tmp, args.out)
    print("what kernel model proj T ratio [95% CI]")
    for r in rows:
        print(r["what"], r["kernel"], r["model"], r["projection"], r["tokens"],
              f"{r['ratio']:.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}]")  # fmt: skip


if __name__ == "__main__":
    main()
