"""E5 decompose-k-grid: who wins on the full grid M=N in {16..64} x K in {8192..32768}, per suite
(bf16+ReLU, bf16, fp16, fp32 with IEEE fp32 products)?

Contenders: eager torch.mm (+ReLU), torch.compile(max-autotune-no-cudagraphs), the custom-op autotuned path
(moegemm::mm / moegemm::mm_relu, candidates: mm and decomposeK at every valid split), the seed's PyTorch
decomposeK, the seed's two Triton kernels at the configs of their own search (tune_seed), and each of our
kernels at its tuned config, plus our `auto` dispatch. Each row also has Python's cost of one call (cpu_us).

    python -m experiments.e5_decompose_k_grid --out results/<slug>/decompose_k_grid.csv
"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments import dk
from experiments.common import (
    DTYPES,
    Progress,
    ResultWriter,
    cli,
    load_config,
    provenance_fields,
    require_gpu,
    timing_settings,
)
from moegemm.inductor import custom_op


def contenders_for(a, n, dtype, epilogue, cfg, with_compiled: bool, results_dir: str) -> list:
    cs = [dk.eager(epilogue)]
    cs += dk.seed_kernels(results_dir, a.shape[0], n, a.shape[1], dtype, epilogue)
    if epilogue == "none" or epilogue == "relu":
        cs.append(dk.seed_decompose_k(cfg["decompose_k"]["seed_split"], epilogue))
    if with_compiled:
        mn = (a.shape[0], n)
        cs.append(
            dk.compiled(dk.epilogue_fn(epilogue), "max-autotune-no-cudagraphs", "compiled", inspect_mn=mn)
        )
        op = custom_op.mm_relu if epilogue == "relu" else custom_op.mm
        cs.append(
            dk.compiled(
                lambda x, y: op(x, y), "max-autotune-no-cudagraphs", "custom-op-autotuned", inspect_mn=mn
            )
        )
    for kernel in dk.KERNELS:
        c, src = dk.tuned_or_heuristic(a, n, epilogue, kernel)
        cs.append(dk.ours(kernel, epilogue, c, config_source=src))
    cs.append(dk.ours("auto", epilogue, None, name="ours:auto", config_source=dk.auto_choice(a, n, epilogue)))
    return cs


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    torch.backends.cuda.matmul.allow_tf32 = False  # true IEEE fp32 for the fp32 suite
    torch.backends.cudnn.allow_tf32 = False
    custom_op.register()
    settings = timing_settings(cfg)
    prov = provenance_fields()
    tiny = dk.tiny_kernel_us()
    writer = ResultWriter(args.out, ("suite", "m", "n", "k"))
    shapes = dk.grid_shapes(cfg)
    suites = cfg["decompose_k"]["suites"]
    compiled_suites = set(cfg["decompose_k"].get("grid_compiled_suites", suites))
    compiled_k = set(cfg["decompose_k"].get("grid_compiled_k", cfg["decompose_k"]["grid_k"]))
    compiled_mn = set(cfg["decompose_k"].get("grid_compiled_mn", cfg["decompose_k"]["grid_mn"]))
    bar = Progress(len(shapes) * len(suites), "E5")
    for suite, s in suites.items():
        dtype = DTYPES[s["dtype"]]
        for m, n, k in shapes:
            if writer.done(suite=suite, m=m, n=n, k=k):
                bar.update()
                continue
            # a fresh compile per exact shape (the recompile limit would degrade later ones)
            torch._dynamo.reset()
            probe = torch.empty(m, k, dtype=dtype, device="cuda")
            cs = contenders_for(
                probe,
                n,
                dtype,
                s["epilogue"],
                cfg,
                suite in compiled_suites and k in compiled_k and m in compiled_mn,
                str(Path(args.out).parent),
            )
            writer.add(
                dk.run_shape(
                    "E5",
                    cs,
                    m,
                    n,
                    k,
                    dtype,
                    s["epilogue"],
                    settings,
                    prov,
                    tiny,
                    seed=m * 31 + k,
                    suite=suite,
                )
            )
            bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
