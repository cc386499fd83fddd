"""Read Inductor's generated output code and say, machine-readably, what it chose.

The facts we record for ``relu(mm)``-like programs: which Triton kernels and extern calls it emitted,
whether a decompose-K (bmm into an fp32 [S, M, N] buffer + a sum) was chosen and its split S, and whether
the ReLU was fused into the GEMM template / the reduction or emitted as a kernel of its own.
"""

from __future__ import annotations

import re

# Triton kernels on a GPU (launched as name.run(...)); C++ kernels on a CPU (called as name(...)).
_KERNEL_DEF = re.compile(r"^def ((?:triton|cpp)_\w+)\(", re.M)
_KERNEL_CALL = re.compile(r"^\s*((?:triton_\w+)(?=\.run\()|(?:cpp_\w+)(?=\())", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(|\btorch\.ops\.aten\.(\w+)(?:\.\w+)?\(")


def _buffer_shapes(code: str) -> list[tuple[int, ...]]:
    shapes = []
    for m in re.finditer(r"empty_strided_\w+\(\(([\d, ]+)\)", code):
        dims = tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)
        shapes.append(dims)
    return shapes


def inspect(code: str, m: int, n: int) -> dict:
    """Summarise one program's output code (all modules concatenated) for an [M, N] result."""
    defined = _KERNEL_DEF.findall(code)
    launched = _KERNEL_CALL.findall(code)
    kernels = list(dict.fromkeys(launched or defined))
    externs = sorted({a or b for a, b in _EXTERN.findall(code)})
    splits = sorted({s[0] for s in _buffer_shapes(code) if len(s) == 3 and s[1:] == (m, n) and s[0] > 1})
    bmm = any("bmm" in e for e in externs) or any("bmm" in k for k in kernels)
    decompose = bool(splits) and (bmm or any("sum" in k for k in kernels))
    relu_kernels = [k for k in kernels if "relu" in k]
    mm_template = [k for k in kernels if k.startswith("triton_tem")]
    if not relu_kernels and "relu" not in code:
        relu = "absent"
    elif any(k.startswith("triton_tem") for k in relu_kernels):
        relu = "fused-into-mm-template"
    elif any(("sum" in k or k.startswith(("triton_per", "triton_red"))) for k in relu_kernels):
        relu = "fused-into-reduction"
    elif relu_kernels:
        relu = "separate-kernel"
    else:
        relu = "other"
    return {
        "kernels": kernels,
        "n_kernel_launches": len(launched) + sum(code.count(f"extern_kernels.{e}(") for e in externs),
        "extern_calls": externs,
        "mm_template": bool(mm_template),
        "decompose_k": decompose,
        "split_k": splits[0] if len(splits) == 1 else (splits or None),
        "relu": relu,
    }


def run_and_get_code(fn, *args):
    """(result, output code of the program, all modules' code) of the first call of a compiled function.

    Under max-autotune Inductor also compiles each benchmarked subgraph choice as a module of its own; the
    program's own module is the last one written, and only it says what runs."""
    from torch._inductor.utils import run_and_get_code as _run

    result, codes = _run(fn, *args)
    return result, (codes[-1] if codes else ""), "\n\n# ---- next module ----\n\n".join(codes)
