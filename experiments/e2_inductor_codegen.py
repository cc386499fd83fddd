"""E2 inductor-codegen: what does Inductor emit for relu(mm) at small and large K (and the router)?

For each configured shape, compile relu(mm) (bf16) under max-autotune-no-cudagraphs, and the custom op
moegemm::mm_relu with its registered decompositions, then read the generated code: which kernels, whether
decompose-K was chosen and its split, whether ReLU was fused. The code itself is saved beside the CSV.

    python -m experiments.e2_inductor_codegen --out results/<slug>/inductor_codegen.csv
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from experiments._io import write_text
from experiments.common import ResultWriter, cli, load_config, provenance_fields, require_gpu, write_json
from moegemm.inductor import custom_op
from moegemm.inductor.codegen import inspect, run_and_get_code

PROGRAMS = {
    "relu(mm)": lambda a, b: torch.relu(a @ b),
    "custom-op mm_relu": lambda a, b: custom_op.mm_relu(a, b),
}


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    custom_op.register()
    prov = provenance_fields()
    code_dir = Path(args.out).with_name("inductor_code")
    writer = ResultWriter(args.out, ("program", "mode", "m", "n", "k"))
    shapes = [tuple(s) for s in cfg["decompose_k"]["codegen_shapes"]]
    for m, n, k in shapes:
        for pname, fn in PROGRAMS.items():
            for mode in ("default", "max-autotune-no-cudagraphs"):
                if writer.done(program=pname, mode=mode, m=m, n=n, k=k):
                    continue
                torch._dynamo.reset()
                g = torch.Generator(device="cuda").manual_seed(k)
                a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                b = torch.randn(k, n, device="cuda", generator=g).to(torch.bfloat16)
                t0 = time.perf_counter()
                try:
                    out, code, all_code = run_and_get_code(torch.compile(fn, mode=mode, dynamic=False), a, b)
                except Exception as e:  # recorded, not fatal: what fails to compile is itself a finding
                    writer.add(
                        [
                            {
                                "experiment": "E2",
                                "program": pname,
                                "mode": mode,
                                "m": m,
                                "n": n,
                                "k": k,
                                "dtype": "bfloat16",
                                "status": "error",
                                "note": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                                **prov,
                            }
                        ]
                    )
                    continue
                compile_s = time.perf_counter() - t0
                ref = torch.relu(a.double() @ b.double())
                rel = float((out.double() - ref).norm() / ref.norm())
                info = inspect(code, m, n)
                slug = f"{pname.replace(' ', '_').replace('(', '_').replace(')', '')}-{mode}-{m}x{n}x{k}.py"
                write_text(code_dir / slug, all_code)
                writer.add(
                    [
                        {
                            "experiment": "E2",
                            "program": pname,
                            "mode": mode,
                            "m": m,
                            "n": n,
                            "k": k,
                            "dtype": "bfloat16",
                            "compile_s": round(compile_s, 2),
                            "rel_err": rel,
                            "status": "ok" if rel < 2e-2 else "wrong",
                            "kernels": " ".join(info["kernels"]),
                            "extern_calls": " ".join(info["extern_calls"]),
                            "n_kernel_launches": info["n_kernel_launches"],
                            "mm_template": info["mm_template"],
                            "decompose_k": info["decompose_k"],
                            "split_k": json.dumps(info["split_k"]),
                            "relu": info["relu"],
                            "code_file": f"inductor_code/{slug}",
                            **prov,
                        }
                    ]
                )
    writer.finish()
    write_json(code_dir / "index.json", {"files": sorted(p.name for p in code_dir.glob("*.py"))})


if __name__ == "__main__":
    main()
