"""E4 split-sweep: how does latency depend on the split count S?

For each of E3's shapes (bf16, ``fusion_grid_k`` x ``fusion_grid_mn``) and each variant, every S in the
configured sweep that the variant accepts: our kernels at their tuned tile shape with S varied (any S <=
K/BLOCK_K; K need not be divisible), the seed's two Triton kernels at the tile their own search chose
(tune_seed) with S varied, and the seed's PyTorch decomposeK (for the seed's code S must divide K).

    python -m experiments.e4_split_sweep --out results/<slug>/split_sweep.csv
"""

from __future__ import annotations

import dataclasses

from experiments import dk


def contenders_for(a, n, k, cfg, results_dir) -> list:
    cs = []
    for s in cfg["decompose_k"]["split_sweep"]:
        for kernel in dk.KERNELS:
            base, _ = dk.tuned_or_heuristic(a, n, "none", kernel)
            if k // s < base.block_k:
                continue
            c = dataclasses.replace(base, split_k=s)
            if kernel == "flat":
                c = dataclasses.replace(c, rblock=min(c.rblock, 1 << (s - 1).bit_length()))
            cs.append(dk.ours(kernel, "none", c, name=f"ours:{kernel}:S{s}", variant=kernel, split_k=s))
        cs += dk.seed_kernels(results_dir, a.shape[0], n, k, a.dtype, "none", split=s)
        if k % s == 0:
            cs.append(dk.seed_decompose_k(s, "none", variant="pytorch:decompose_k", split_k=s))
            cs[-1].name = f"pytorch:decompose_k:S{s}"
    return cs


def main():
    dk.run_grid(
        "E4",
        __doc__,
        "none",
        contenders_for,
        seed=lambda m, k: m * 19 + k,
        reset_dynamo=False,
        ks="fusion_grid_k",
    )


if __name__ == "__main__":
    main()
