"""Gate/up with SwiGLU reading each row of x by its token id inside the GEMM: the permuted copy of x is never
written.

``moe_ffn``'s routing otherwise writes x_sorted [T * top_k, H] and gate/up reads it back: at prefill two
passes over T * top_k rows of H that this kernel leaves out (it reads x's T rows, top_k times each, mostly
from L2). Hopper's TMA has no row gather (its gather mode needs sm_100), so the row tiles come by pointer
loads, staged through shared memory by the compiler's pipeline, while the weight tiles still come by TMA.
Tiles and tile order are the fused SwiGLU kernel's (``_grouped_mm_swiglu_tma_kernel``): the choice of
config for a shape is that kernel's. Where this form runs is the layer's choice
(:func:`moegemm.grouped.ffn.gate_up_act` times it against the other two on a shape's first call)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import autotune
from .._runtime import INTERPRET, device_smem_per_block, gpu_slug
from .._triton_common import BoundKernel, _specialization, dot_meta, mma, raw_stream
from .config import GROUP_M, GroupedConfig, choose, swiglu_config, timed_key
from .launch import _max_tiles, grid_size, per_sm
from .tiles import _store_tile, _swiglu, _tile_coords, _tile_plan, _w_tile
from .tma import w_descriptor


@triton.jit
def _gather_swiglu_kernel(
    x_ptr, tok_ptr, w_desc, y_ptr, offsets_ptr,
    M, T, N, K, E, stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr, W_KN: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """y[r] = silu(x[tok[r]] G_e) * (x[tok[r]] U_e) for the M permuted rows r of expert e (rows [off[e],
    off[e + 1])), y: [M, N]; w: the 2-D descriptor of the fused kernel over each expert's 2N columns (the
    gate's first). A token id outside [0, T) reads row 0 or T - 1, never past x. EVEN_K: K a multiple of
    BLOCK_K (the row loads need no mask)."""
    e_offs, lo, hi, cum, total = _tile_plan(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_BLOCK, 0)
    kk = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        expert, _, row_end, row0, col0 = _tile_coords(
            tile, e_offs, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M, 0
        )
        tok = tl.load(tok_ptr + tl.minimum(row0 + tl.arange(0, BLOCK_M), row_end - 1))
        tok = tl.minimum(tl.maximum(tok, 0), T - 1).to(tl.int64)
        a_ptrs = x_ptr + tok[:, None] * stride_x + kk[None, :]
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(kk + k)[None, :] < K, other=0.0)
            gate = mma(a, _w_tile(w_desc, expert, k, col0, 2 * N, K, W_KN), gate, "tf32", UPCAST)
            up = mma(a, _w_tile(w_desc, expert, k, col0 + N, 2 * N, K, W_KN), up, "tf32", UPCAST)
            a_ptrs += BLOCK_K
        _store_tile(
            _swiglu(gate, up), y_ptr, y_ptr, row0, row_end, col0, N, stride_y, 1, BLOCK_M, BLOCK_N, False, 0
        )


def fused_config(rows: int, x: torch.Tensor, w_gate_up: torch.Tensor, w_layout: str) -> GroupedConfig:
    """The fused SwiGLU kernel's tiles for a gate/up of ``rows`` rows (its first call's timed choice where one
    is kept, else the config the library chooses for the product), as that kernel takes them."""
    e, h = w_gate_up.shape[0], x.shape[1]
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    slug = gpu_slug(x)
    timed = autotune.lookup(slug, timed_key(rows, h, x.dtype, e, two_i, w_layout, True, slug))
    if timed is not None:
        return swiglu_config(GroupedConfig.from_dict(timed))
    smem = device_smem_per_block(x) if x.is_cuda else None
    return swiglu_config(choose(rows, h, x.dtype, slug, e, two_i, w_layout, smem)[0])


def can_gather(x: torch.Tensor, w_gate_up: torch.Tensor, w_layout: str, cfg: GroupedConfig) -> bool:
    """Whether this kernel serves these operands: 16-bit x with unit column stride and a config of TMA
    loads whose weight descriptor the weights allow."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1 or not cfg.tma:
        return False
    e, h = w_gate_up.shape[0], x.shape[1]
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    return w_descriptor(w_gate_up, w_layout, e, two_i, h, cfg) is not None


def gather_swiglu(
    x: torch.Tensor,
    tok: torch.Tensor,
    w_gate_up: torch.Tensor,
    group_offsets: torch.Tensor,
    w_layout: str,
    cfg: GroupedConfig,
) -> torch.Tensor:
    """silu(x[tok[r]] G_e) * (x[tok[r]] U_e) for every permuted row r: [rows, I]. x: [T, H] (16-bit, unit
    column stride); tok: int32 [rows], each row's token (the routing plan's sorted_token_ids);
    group_offsets: int32 [E + 1], contiguous; ``cfg``: the fused kernel's tiles (:func:`fused_config`),
    which :func:`can_gather` accepts for these operands. The arguments come from the layer's own routing:
    only their shapes are checked here."""
    e, h = w_gate_up.shape[0], x.shape[1]
    two_i = w_gate_up.shape[1] if w_layout == "nk" else w_gate_up.shape[2]
    i, rows = two_i // 2, tok.shape[0]
    out = torch.empty((rows, i), dtype=x.dtype, device=x.device)
    if rows == 0 or i == 0:
        return out
    for name, t in (("tok", tok), ("group_offsets", group_offsets)):
        if t.dtype != torch.int32 or t.data_ptr() % 16:
            raise ValueError(f"{name}: expected int32 with a 16-byte aligned base (the routing plan's)")
    desc = w_descriptor(w_gate_up, w_layout, e, two_i, h, cfg)
    t = x.shape[0]
    args = (x, tok, desc, out, group_offsets, rows, t, i, h, e, x.stride(0), out.stride(0))
    work = _max_tiles(rows, e, i, cfg, "I")
    # (rows and T change from call to call: leading arguments, keyed by what Triton specializes them on)
    key = (_specialization(rows), _specialization(t), x.stride(0), x.dtype, x.device, x.data_ptr() % 16)
    key += (e, h, two_i, w_layout, cfg)
    hit = None if INTERPRET or not x.is_cuda else _BOUND.get(key)
    if hit is None and (INTERPRET or not x.is_cuda or torch.cuda.is_current_stream_capturing()):
        # (Triton's own launch: no compiled launcher to bind here, or none to bind inside a capture)
        _gather_swiglu_kernel[(grid_size(work, cfg, x),)](*args, **_meta(x, e, w_layout, cfg))
        return out
    if hit is None:
        meta = _meta(x, e, w_layout, cfg)
        n_sm = per_sm(_gather_swiglu_kernel, cfg, x, args, meta) if cfg.persistent else 2
        hit = BoundKernel(_gather_swiglu_kernel, (grid_size(work, cfg, x, n_sm),), args, meta, 7), n_sm
        _BOUND[key] = hit
    bound, n_sm = hit
    bound.on_grid((grid_size(work, cfg, x, n_sm),), raw_stream(x.device.index), args[:7])
    return out


_BOUND: dict = {}  # gather_swiglu's compiled launches (and programs per SM), per specialization and config


def _meta(x: torch.Tensor, e: int, w_layout: str, cfg: GroupedConfig) -> dict:
    return dict(
        EVEN_K=x.shape[1] % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        E_BLOCK=max(16, triton.next_power_of_2(e)),
        GROUP_M=GROUP_M,
        W_KN=w_layout == "kn",
        UPCAST=dot_meta(x.dtype, False)["UPCAST"],
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
