"""Probe (not a pipeline step): gate/up reading each row of x by token id inside the GEMM, against the
permuted copy of x written first and read by the TMA kernel, on E7's gate/up cells of the tune-split models.

Why: ``moe_ffn`` writes x_sorted [T * top_k, H] (the routing's gather) and gate/up reads it back; vLLM's
kernel and triton_kernels' gate/up load each row from x by its token id instead, so that copy is never
written. Hopper's TMA cannot gather rows (its row-gather mode needs sm_100), so a gathering kernel loads its
row tiles with pointer loads (the compiler stages them through shared memory, cp.async) while the weight
tiles still come by TMA. This measures whether that costs the GEMM more than the copy it saves.

Per cell, side by side (experiments.harness.runner.measure, E7's timing settings), all with the
library's own config for the shape:
- ``permute+unfused`` / ``permute+fused``: the layer's way, the permuted copy (``permute``) then
  ``grouped_mm`` (the [rows, 2I] product) or ``grouped_mm_swiglu`` (SiLU(gate) * up fused);
- ``gather:unfused`` / ``gather:fused``: the same products from x and the routing's token order, the row
  tiles gathered by pointer loads and the weight tiles by TMA (the kernel below), with the tiles of
  ``grouped_mm``'s config (``grouped_mm_swiglu``'s timed choice for the fused one);
- ``rows:unfused``: ``grouped_mm`` on rows already permuted (the GEMM alone).
The fused rows are checked against SiLU(gate) * up of the float64 product.

    python -m probes.probe_gather_gate_up --out results/<slug>/probe_gather_gate_up.csv
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from experiments.e7_grouped_skew import run_probe
from experiments.harness.correctness import check
from experiments.harness.runner import Contender
from moegemm import autotune
from moegemm._runtime import device_sm_count, gpu_slug
from moegemm._triton_common import dot_meta, mma
from moegemm.grouped import choose_config, grouped_mm, grouped_mm_swiglu, permute
from moegemm.grouped.config import GROUP_M, autotune_key, swiglu_config
from moegemm.grouped.tiles import _store_tile, _swiglu, _tile_coords, _tile_plan, _w_tile
from moegemm.grouped.tma import w_descriptor

MODELS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
CELLS = [(m, "up", t, "uniform") for m in MODELS for t in (256, 4096, 16384)] + [
    (m, "up", 4096, "zipf1.2") for m in MODELS
]


@triton.jit
def _gather_gate_up_kernel(
    x_ptr, tok_ptr, w_desc, y_ptr, offsets_ptr,
    N, K, E, M, stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr, SWIGLU: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """y[r] = (x[tok[r]] W_e) for the rows r of expert e (SWIGLU: silu of the first N columns of each
    expert's 2N times the second N; N is y's width). Row tiles by pointer loads of x's rows through the
    token ids, weight tiles by TMA from the [E * width, K] descriptor."""
    width = 2 * N if SWIGLU else N
    e_offs, lo, hi, cum, total = _tile_plan(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        expert, _, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        tok = tl.load(tok_ptr + tl.minimum(row0 + tl.arange(0, BLOCK_M), row_end - 1)).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_x + kk[None, :]
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=(kk + k)[None, :] < K, other=0.0)
            gate = mma(a, _w_tile(w_desc, expert, k, col0, width, K, False), gate, "tf32", UPCAST)
            if SWIGLU:
                up = mma(a, _w_tile(w_desc, expert, k, col0 + N, width, K, False), up, "tf32", UPCAST)
            a_ptrs += BLOCK_K
        if SWIGLU:
            gate = _swiglu(gate, up)
        _store_tile(gate, y_ptr, y_ptr, row0, row_end, col0, N, stride_y, 1, BLOCK_M, BLOCK_N, False, 0)


def gather_gate_up(x, tok, w, offsets, cfg, swiglu: bool) -> torch.Tensor:
    """The kernel above on x [T, H], the routing's token ids ``tok`` (int32, one per permuted row), w
    [E, 2I, H] and its group offsets, with ``cfg``'s tiles (already the fused kernel's, with ``swiglu``)."""
    e, n_w, k = w.shape
    n = n_w // 2 if swiglu else n_w
    rows = tok.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    desc = w_descriptor(w, "nk", e, n_w, k, cfg)
    tiles = (triton.cdiv(rows, cfg.block_m) + min(e, rows)) * triton.cdiv(n, cfg.block_n)
    grid = min(tiles, 2 * device_sm_count(x)) if cfg.persistent else tiles
    _gather_gate_up_kernel[(grid,)](
        x, tok, desc, out, offsets, n, k, e, rows, x.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        E_BLOCK=max(16, triton.next_power_of_2(e)), GROUP_M=GROUP_M, SWIGLU=swiglu,
        UPCAST=dot_meta(x.dtype, False)["UPCAST"], num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def contenders_of(xs, plan, ref, w, t, e, k, n, g, cell, ws, settings, x, ids) -> list[Contender]:
    off, tok = plan.group_offsets, plan.sorted_token_ids
    i = n // 2
    act_ref = torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]
    fused_check = {"check": lambda out: check(out, act_ref, k)}
    cfg, source = choose_config(xs, e, n, "nk")
    grouped_mm_swiglu(xs, w, off, validate=False)  # its first call times its shortlist where it may
    slug = gpu_slug(xs)
    timed = autotune.lookup(slug, autotune_key(xs.shape[0], k, xs.dtype, e, n, "nk+swiglu", slug))
    fused_cfg = swiglu_config(type(cfg).from_dict(timed) if timed else cfg)

    def make(name, call, c, **more):
        return Contender(
            name,
            lambda inp: lambda: call(inp[1]),
            config=dataclasses.asdict(c),
            parallel_compile=True,
            fields={"config_source": source},
            **more,
        )

    cs = [
        make("rows:unfused", lambda wi: grouped_mm(xs, wi, off, validate=False), cfg),
        make("permute+unfused", lambda wi: grouped_mm(permute(x, plan), wi, off, validate=False), cfg),
        make(
            "permute+fused",
            lambda wi: grouped_mm_swiglu(permute(x, plan), wi, off, validate=False),
            fused_cfg,
            **fused_check,
        ),
    ]
    if cfg.tma and w_descriptor(w, "nk", e, n, k, cfg) is not None:
        cs += [
            make("gather:unfused", lambda wi: gather_gate_up(x, tok, wi, off, cfg, False), cfg),
            make(
                "gather:fused",
                lambda wi: gather_gate_up(x, tok, wi, off, fused_cfg, True),
                fused_cfg,
                **fused_check,
            ),
        ]
    return cs


def summary(out: list[dict]) -> str:
    us = {r["contender"]: r.get("graph_us", math.nan) for r in out}
    parts = [f"{name}={v:.1f}" for name, v in us.items()]
    for form in ("unfused", "fused"):
        p, gth = us.get(f"permute+{form}"), us.get(f"gather:{form}")
        if p and gth:
            parts.append(f"permute/gather {form} {p / gth:.3f}")
    return " ".join(parts)


def main():
    run_probe(__doc__, "probe_gather_gate_up", CELLS, contenders_of, summary, with_sets=True)


if __name__ == "__main__":
    main()
