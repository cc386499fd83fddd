"""E4 split-sweep: how does latency depend on the split count S?

For each grid shape (bf16) and each variant, every S in the configured sweep that the variant accepts: our
kernels at their tuned tile shape with S varied (any S <= K/BLOCK_K; K need not be divisible), and the
seed's PyTorch decomposeK (S must divide K).

    python -m experiments.e4_split_sweep --out results/<slug>/split_sweep.csv
"""

from __future__ import annotations

import dataclasses

import torch

from experiments import dk
from experiments.common import Progress, ResultWriter, cli, load_config, provenance_fields, require_gpu
from experiments.common import timing_settings


def contenders_for(a, n, k, cfg) -> list:
    cs = []
    for s in cfg["decompose_k"]["split_sweep"]:
        for kernel in dk.KERNELS:
            base, _ = dk.tuned_or_heuristic(a, n, "none", kernel)
            if k // s < base.block_k:
                continue
            c = dataclasses.replace(base, split_k=s)
            if kernel == "flat":
                c = dataclasses.replace(c, rblock=min(c.rblock, 1 << (s - 1).bit_length()) or 1)
            cs.append(dk.ours(kernel, "none", c, name=f"ours:{kernel}:S{s}", variant=kernel, split_k=s))
        if k % s == 0:
            cs.append(dk.seed_decompose_k(s, "none", variant="pytorch:decompose_k", split_k=s))
            cs[-1].name = f"pytorch:decompose_k:S{s}"
    return cs


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    settings = timing_settings(cfg, args.quick)
    prov = provenance_fields()
    tiny = dk.tiny_kernel_us()
    writer = ResultWriter(args.out, ("m", "n", "k"))
    shapes = dk.grid_shapes(cfg)[:1] if args.quick else dk.grid_shapes(cfg)
    bar = Progress(len(shapes), "E4")
    for m, n, k in shapes:
        if not writer.done(m=m, n=n, k=k):
            probe = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
            writer.add(dk.run_shape("E4", contenders_for(probe, n, k, cfg), m, n, k, torch.bfloat16, "none",
                                    settings, prov, tiny, seed=m * 19 + k))
        bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
