"""E3 epilogue-fusion: what does fusing ReLU into the reduction's store buy?

For every Decompose-K variant, ReLU fused vs ReLU as a separate op with the same config: our three kernels
(tuned config), the seed's two Triton kernels (the configs of its own search, tune_seed), the seed's PyTorch
decomposeK (eager, ReLU separate) vs the same function compiled by Inductor (default mode; ReLU fuses into the
sum's store), and Inductor's own lowering of relu(mm) under max-autotune-no-cudagraphs (with what it emitted).
bf16, the M=N x K grid at the K and M = N that `fusion_grid_k` and `fusion_grid_mn` name.

    python -m experiments.e3_epilogue_fusion --out results/<slug>/epilogue_fusion.csv
"""

from __future__ import annotations

from experiments import dk
from moegemm.inductor.custom_op import decompose_k_relu_impl


def contenders_for(a, n, k, cfg, results_dir) -> list:
    s = cfg["decompose_k"]["seed_split"]
    cs = []
    for kernel in dk.KERNELS:
        c, _ = dk.tuned_or_heuristic(a, n, "relu", kernel)
        cs.append(
            dk.ours(kernel, "relu", c, fused=True, variant=kernel, epilogue_fused=True, split_k=c.split_k)
        )
        cs.append(
            dk.ours(kernel, "relu", c, fused=False, variant=kernel, epilogue_fused=False, split_k=c.split_k)
        )
    m = a.shape[0]
    for fused in (True, False):  # the seed's Triton kernels, ReLU fused into their reducer or after it
        for c in dk.seed_kernels(results_dir, m, n, k, a.dtype, "relu" if fused else "none"):
            if not fused:
                c = dk.unfused_relu(c)
            c.fields["epilogue_fused"] = fused
            cs.append(c)
    cs.append(dk.seed_decompose_k(s, "relu", variant="pytorch:decompose_k", epilogue_fused=False, split_k=s))
    cs.append(
        dk.compiled(
            lambda x, y: decompose_k_relu_impl(x, y, s),
            "default",
            "pytorch:decompose_k+compiled",
            inspect_mn=(a.shape[0], n),
            variant="pytorch:decompose_k",
            epilogue_fused=True,
            split_k=s,
        )
    )
    cs.append(
        dk.compiled(
            dk.epilogue_fn("relu"),
            "max-autotune-no-cudagraphs",
            "inductor:relu(mm)",
            inspect_mn=(a.shape[0], n),
            variant="inductor",
            epilogue_fused="inductor's choice",
        )
    )
    return cs


def main():
    dk.run_grid(
        "E3",
        __doc__,
        "relu",
        contenders_for,
        seed=lambda m, k: m * 17 + k,
        reset_dynamo=True,
        ks="fusion_grid_k",
    )


if __name__ == "__main__":
    main()
