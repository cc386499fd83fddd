"""``python -m moegemm``: what this machine runs and whether the kernels are right on it.

Prints torch, Triton, the GPU (or that kernels run under Triton's interpreter on the CPU), the tuned table
that serves this GPU for each kernel family (its own, the nearest card's of its architecture, or none: then
shapes are timed on their first call), the cache directory of those first-call choices, and then checks
each public kernel once against float64 on fresh random data (a few seconds; tiny shapes on the CPU).
Exit status 0 only if every check passes."""

from __future__ import annotations

import os
import sys
import time

import torch

if not torch.cuda.is_available():  # Triton decides this when the kernels are defined: before importing them
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _report_setup() -> bool:
    import triton

    from . import __version__, autotune, tuned
    from ._runtime import INTERPRET, gpu_slug

    on_gpu = torch.cuda.is_available() and not INTERPRET
    print(f"moegemm {__version__}: torch {torch.__version__}, Triton {triton.__version__}")
    if on_gpu:
        probe = torch.empty(0, device="cuda")
        slug = gpu_slug(probe)
        props = torch.cuda.get_device_properties(probe.device)
        print(f"GPU: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)")
        for family, table in tuned.describe(slug).items():
            how = (
                "its own"
                if table == slug
                else f"the nearest card's ({table})"
                if table
                else "none: shapes are timed on their first call"
            )
            print(f"  tuned table, {family}: {how}")
        cache = autotune.cache_file(slug)
        print(f"first-call choices kept in: {cache if cache else 'memory only (MOEGEMM_CACHE_DIR is empty)'}")
    else:
        print("no CUDA GPU: kernels run under Triton's interpreter on the CPU (tiny shapes)")
    return on_gpu


def _checks(on_gpu: bool) -> list[tuple[str, float, float]]:
    """(name, relative error, tolerance) of each kernel's check against float64."""
    from .decompose_k import matmul
    from .grouped import grouped_mm, grouped_mm_masked, moe_ffn, permute, route

    dev = "cuda" if on_gpu else "cpu"
    g = torch.Generator(device=dev).manual_seed(int(time.time()) % 10_000)  # fresh data on every run
    t, h, i, e, k = (256, 2048, 768, 32, 4) if on_gpu else (6, 32, 16, 4, 2)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(bf)

    def rel(got, ref):
        return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))

    out = []
    a, b = rnd(t, 4 * h), rnd(4 * h, 64, scale=(4 * h) ** -0.5)
    ref = torch.sigmoid(a.double() @ b.double())
    out.append(("decompose_k.matmul (sigmoid)", rel(matmul(a, b, epilogue="sigmoid"), ref), 1e-2))
    ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)])
    x = rnd(t, h)
    w = rnd(e, i, h, scale=h**-0.5)
    plan = route(ids, e)
    xs = permute(x, plan)
    offs = plan.group_offsets.tolist()
    ref = torch.zeros(xs.shape[0], i, dtype=torch.float64, device=dev)
    for ex in range(e):
        ref[offs[ex] : offs[ex + 1]] = xs[offs[ex] : offs[ex + 1]].double() @ w[ex].double().T
    out.append(("grouped_mm", rel(grouped_mm(xs, w, plan.group_offsets), ref), 1e-2))
    m_max = 8
    xm = rnd(e, m_max, h)
    masked = torch.randint(0, m_max + 1, (e,), device=dev, generator=g, dtype=torch.int32)
    got = grouped_mm_masked(xm, w, masked)
    refm = torch.zeros(e, m_max, i, dtype=torch.float64, device=dev)
    for ex, mm in enumerate(masked.tolist()):
        refm[ex, :mm] = xm[ex, :mm].double() @ w[ex].double().T
    out.append(("grouped_mm_masked", rel(got, refm), 1e-2))
    wgu, wd = rnd(e, 2 * i, h, scale=h**-0.5), rnd(e, h, i, scale=i**-0.5)
    wts = torch.rand(t, k, device=dev, generator=g)
    refl = torch.zeros(t, h, dtype=torch.float64, device=dev)
    for ex in range(e):
        tok, j = (ids == ex).nonzero(as_tuple=True)
        gu = x[tok].double() @ wgu[ex].double().T
        act = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        refl.index_add_(0, tok, wts[tok, j].double()[:, None] * (act @ wd[ex].double().T))
    out.append(("moe_ffn", rel(moe_ffn(x, ids, wts, wgu, wd), refl), 2e-2))
    return out


def main() -> int:
    on_gpu = _report_setup()
    start = time.perf_counter()
    results = _checks(on_gpu)
    # Triton's interpreter casts fp32 to bf16 by truncation, not to nearest: up to twice the GPU's rounding
    scale = 1.0 if on_gpu else 2.0
    results = [(name, err, tol * scale) for name, err, tol in results]
    ok = True
    print("self-check against float64 (relative error, bf16):")
    for name, err, tol in results:
        good = err == err and err <= tol  # NaN never passes
        ok &= good
        print(f"  {name:<30} {err:.1e}  {'ok' if good else f'FAILED (over {tol:.0e})'}")
    print(f"{'all right' if ok else 'FAILED'} in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
