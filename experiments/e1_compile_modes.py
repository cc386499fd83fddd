"""E1 compile-modes: which torch.compile mode serves skinny large-K GEMMs best?

For each configured shape, three functions -- mm, relu(mm), the seed's decomposeK (fixed S) + ReLU -- run
eager and under each compile mode; latency on both clocks (modes that replay CUDA graphs of their own are
timed on the launch-inclusive clock only) and the compile time of the first call. Dynamo is reset between
exact shapes.

    python -m experiments.e1_compile_modes --out results/<slug>/compile_modes.csv
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

# Compile times must be cold whatever ran before (in a pipeline run E3, E5 and E6 compile the same graphs
# into the shared caches): Triton's and Inductor's on-disk caches are private to this process, set before
# torch is imported, and Inductor's caches are switched off below.
_CACHE = tempfile.mkdtemp(prefix="moegemm-e1-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHE, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE, "triton")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import torch  # noqa: E402

from experiments import dk  # noqa: E402
from experiments.common import (  # noqa: E402
    Progress,
    ResultWriter,
    cli,
    load_config,
    provenance_fields,
    require_gpu,
    timing_settings,
)
from experiments.harness.runner import Contender  # noqa: E402
from moegemm.inductor.custom_op import decompose_k_relu_impl  # noqa: E402


def functions(split: int) -> dict:
    return {
        "mm": (lambda a, b: a @ b, "none"),
        "relu(mm)": (lambda a, b: torch.relu(a @ b), "relu"),
        "decompose_k+relu": (lambda a, b: decompose_k_relu_impl(a, b, split), "relu"),
    }


def cold_compiles() -> str:
    """Switch Inductor's caches off (each mode compiles from scratch); returns what the rows record."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "force_disable_caches"):
        inductor_config.force_disable_caches = True
        return "inductor caches off; private triton cache"
    return "private inductor and triton caches"


def main():
    args = cli(__doc__)
    require_gpu()
    caches = cold_compiles()
    cfg = load_config(args.config)
    d = cfg["decompose_k"]
    settings = timing_settings(cfg)
    prov = provenance_fields()
    tiny = dk.tiny_kernel_us()
    writer = ResultWriter(args.out, ("function", "m", "n", "k"))
    shapes = [tuple(s) for s in d["compile_shapes"]]
    modes = d["compile_modes"]
    fns = functions(d["seed_split"])
    bar = Progress(len(shapes) * len(fns), "E1")
    for m, n, k in shapes:
        for fname, (fn, epilogue) in fns.items():
            if writer.done(function=fname, m=m, n=n, k=k):
                bar.update()
                continue
            torch._dynamo.reset()
            eager = Contender(
                "eager",
                lambda inp, fn=fn: lambda: fn(inp[0], inp[1]),
                config="eager",
                fields={"compile_mode": "eager"},
            )
            cs = [eager] + [
                dk.compiled(fn, mode, f"compiled:{mode}", inspect_mn=(m, n), compile_mode=mode)
                for mode in modes
            ]
            # Modes that replay CUDA graphs of their own (cudagraph trees) are measured in a group of their
            # own, after the graph-clock group's captured graphs are freed: interleaving our captured graphs
            # with cudagraph trees in one measurement produced an illegal memory access on torch 2.11.
            own = [c for c in cs if not c.graph]
            rows = []
            for group in ([c for c in cs if c.graph], own):
                if group:
                    rows += dk.run_shape(
                        "E1",
                        group,
                        m,
                        n,
                        k,
                        torch.bfloat16,
                        epilogue,
                        settings,
                        prov,
                        tiny,
                        seed=m + k,
                        function=fname,
                        compile_caches=caches,
                    )
                    torch.cuda.synchronize()
                    gc.collect()
            writer.add(rows)
            bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
