"""Probe (not a pipeline step): registers, spills and shared memory of the grouped TMA kernel as the GPU's
Triton compiles it, with tails as tiles of their own and merged into the row tile before them, for the
prefill (128 x 256) and middle (64 x 128) tiles. Compiling on the GPU matters: the specialization of the
launch arguments there changes the code a CPU-side compile for sm_90 gives.

    python -m experiments.probe_kernel_resources
"""

from __future__ import annotations

import torch

from moegemm.grouped import GroupedConfig, grouped_mm
from moegemm.grouped.kernels import _grouped_mm_tma_kernel


def main():
    x = torch.randn(1000, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 1536, 2048, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor([0, 130, 260, 400, 530, 660, 790, 900, 1000], device="cuda", dtype=torch.int32)
    for bm, bn in ((128, 256), (64, 128)):
        for merge in (False, True):
            cfg = GroupedConfig(bm, bn, 64, num_warps=8 if bm == 128 else 4, num_stages=4, tma=True, tail_m=32,
                                merge_tail=merge)
            grouped_mm(x, w, off, w_layout="nk", config=cfg)
    torch.cuda.synchronize()
    for cache in _grouped_mm_tma_kernel.device_caches.values():
        for k in cache[0].values():
            k._init_handles()
            consts = {name: v for name, v in getattr(k.src, "constants", {}).items()}
            print(f"regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} warps {k.metadata.num_warps} "
                  f"{consts}", flush=True)


if __name__ == "__main__":
    main()
