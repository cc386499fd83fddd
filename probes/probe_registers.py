"""Registers and spills of the fused SwiGLU backward's kernel (probes/dswiglu_fused.py) against the forward's
TMA kernel on the same tiles, compiled for sm_90 with no GPU (not a pipeline step; a CPU machine with
Triton's CUDA backend and its ptxas).

Each kernel is compiled by Triton for sm_90 (the arguments typed as a launch on aligned tensors types them:
pointers and sizes divisible by 16, the unit column strides the constant 1), then its PTX assembled by
Triton's ptxas with ``-v``: the registers per thread and the bytes spilled to local memory. The tiles are
probe_backward's DSWIGLU_CONFIGS.

    python -m probes.probe_registers --out results/nvidia-h200/probe_registers.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from experiments._io import atomic_path
from experiments.common import provenance_fields
from moegemm.grouped.kernels import _grouped_mm_tma_kernel
from probes.dswiglu_fused import _dswiglu_tma_kernel
from probes.probe_backward import DSWIGLU_CONFIGS

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compiled(kernel, ptrs: dict, consts: dict, ones: tuple, opts: dict) -> str:
    """The PTX of ``kernel`` for sm_90: ``ptrs`` typed as given, ``consts`` and ``ones`` (set to 1) constant,
    every other argument an i32 divisible by 16 (as Triton specializes aligned launches)."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts or name in ones:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            if ptrs[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name != "E":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs={**consts, **{o: 1 for o in ones}}, attrs=attrs)
    return triton.compile(src, target=TARGET, options=opts).asm["ptx"]


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) from ptxas -v for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [PTXAS, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True, check=True
        ).stderr
    return int(re.findall(r"Used (\d+) registers", out)[0]), int(
        re.findall(r"(\d+) bytes spill stores", out)[0]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prov = {k: v for k, v in provenance_fields().items() if k in ("triton", "git_commit", "git_dirty", "utc")}
    rows = []
    for cfg in DSWIGLU_CONFIGS:
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, E_BLOCK=16, GROUP_M=8, W_KN=True, UPCAST=False)
        descs = {"a": f"tensordesc<bf16[{bm},{bk}]>", "w": f"tensordesc<bf16[{bk},{bn}]>"}
        kernels = {
            "dswiglu": (
                _dswiglu_tma_kernel,
                {
                    "dy_desc": descs["a"],
                    "wd_desc": descs["w"],
                    "gu_ptr": "*bf16",
                    "scale_ptr": "*fp32",
                    "offsets_ptr": "*i32",
                    "dgu_ptr": "*bf16",
                    "act_ptr": "*bf16",
                    "part_ptr": "*fp32",
                },
                dict(
                    tiles,
                    HAS_SCALE=True,
                    ROWDOT=True,
                    STORE_ACT=True,
                    IN_PLACE=True,
                    EPI_SPLIT=cfg.get("EPI_SPLIT", 1),
                ),
                ("stride_gn", "stride_on", "stride_an"),
            ),
            "forward": (
                _grouped_mm_tma_kernel,
                {
                    "a_desc": descs["a"],
                    "w_desc": descs["w"],
                    "at_desc": descs["a"],
                    "y_ptr": "*bf16",
                    "offsets_ptr": "*i32",
                    "scale_ptr": "*fp32",
                },
                dict(
                    tiles,
                    TAIL_M=0,
                    WARP_SPECIALIZE=False,
                    FLATTEN=False,
                    MERGE_TAIL=False,
                    HAS_SCALE=True,
                    EPILOGUE=0,
                    MIX=0,
                ),
                ("stride_yn",),
            ),
        }
        for name, (kernel, ptrs, consts, ones) in kernels.items():
            regs, spill = ptxas_report(compiled(kernel, ptrs, consts, ones, opts))
            rows.append(
                dict(
                    kernel=name,
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    epi_split=cfg.get("EPI_SPLIT", 1) if name == "dswiglu" else 1,
                    **opts,
                    registers=regs,
                    spill_store_bytes=spill,
                    **prov,
                )
            )
            print(
                f"{name:8s} {bm}x{bn}x{bk} w{opts['num_warps']} s{opts['num_stages']} "
                f"e{rows[-1]['epi_split']}: {regs} registers, "
                f"{spill} bytes spilled",
                flush=True,
            )
    with atomic_path(args.out) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
