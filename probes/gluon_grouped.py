"""A warp-specialized persistent grouped GEMM written in Gluon (Triton's layout-explicit dialect), for
Hopper: the kernel that probes/probe_gluon_prefill.py measures against the library's grouped kernel at
prefill. Not part of the library: it serves the contiguous layout with w as [E, N, K] (nn.Linear), 16-bit
operands and a plain store only.

Where the library's TMA kernel leaves the software pipeline to Triton (a K loop of tl.dot on descriptor
loads; Triton 3.6 on sm_90 does not split its warps), this one splits them by hand, the way CUTLASS's Hopper
kernels do: a producer warp with few registers only issues TMA copies into a ring of STAGES shared-memory
slots, and the consumer warp groups (num_warps, with the registers the producer gives up) only wait for a
slot, issue the asynchronous warp-group MMA on it and hand it back. The two sides meet at two mbarriers per
slot ("ready": the copies landed; "empty": the MMA that read it is done). Both walk the same tiles, in the
library's order (expert by expert, bands of GROUP_M row tiles column by column), each tile's expert found
from the group offsets in-kernel; the consumer stores each finished tile from registers while the producer
already fills the slots for the next.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without Gluon's host descriptors
    TensorDescriptor = None

# TMA's global-to-shared copy: async_load in newer Triton, async_copy_global_to_shared in 3.6
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_M = 128
BLOCK_K = 64
PRODUCER_REGS = 56  # the producer warp's registers (setmaxnreg); the consumers get the rest
CONSUMER_REGS = 232  # ping-pong: the second consumer's


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def tile_plan(
    offsets_ptr,
    E,
    N,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    E_BLOCK: gl.constexpr,
    layout: gl.constexpr,
):
    """(expert ids, first rows, end rows, inclusive prefix of tiles per expert, total tiles), as the library's
    _tile_plan, in ``layout`` (1-D, over the warps of the partition that computes it)."""
    e = gl.arange(0, E_BLOCK, layout=layout)
    lo = gl.load(offsets_ptr + e, mask=e < E, other=0)
    hi = gl.load(offsets_ptr + e + 1, mask=e < E, other=0)
    m_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    n_tiles = gl.cdiv(N, BLOCK_N)
    cum = gl.associative_scan(m_tiles, 0, _add) * n_tiles
    return e, lo, hi, cum, gl.sum(m_tiles, axis=0) * n_tiles


@gluon.jit
def tile_coords(tile, e, lo, hi, cum, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(expert, first row of the tile, the expert's end row, first column) of tile number ``tile`` of
    tile_plan's plan: the library's _tile_coords."""
    n_tiles = gl.cdiv(N, BLOCK_N)
    expert = gl.sum((cum <= tile).to(gl.int32), axis=0)
    sel = e == expert
    row_start = gl.sum(gl.where(sel, lo, 0), axis=0)
    row_end = gl.sum(gl.where(sel, hi, 0), axis=0)
    mt = (row_end - row_start + BLOCK_M - 1) // BLOCK_M
    local = tile - (gl.sum(gl.where(sel, cum, 0), axis=0) - mt * n_tiles)
    band = local // (GROUP_M * n_tiles)
    in_band = local % (GROUP_M * n_tiles)
    band_rows = gl.maximum(gl.minimum(mt - band * GROUP_M, GROUP_M), 1)  # 1 past the plan's tiles: no / 0
    tm = band * GROUP_M + in_band % band_rows
    tn = in_band // band_rows
    return expert, row_start + tm * BLOCK_M, row_end, tn * BLOCK_N


@gluon.jit
def _producer(
    args,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    E_BLOCK: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: per K step of every tile of this program, wait for the slot to be empty (the first pass
    over the ring finds every slot empty: a fresh barrier passes a wait on parity 1), then copy the x box and
    the weight box into it, the slot's ready barrier counting the bytes. ``args``: the descriptors of x and
    w, the group offsets, the ring (ws_grouped_kernel's), E, N and K."""
    a_desc, w_desc, offsets_ptr, ring, E, N, K = args
    a_bufs, b_bufs, ready, empty, _ = ring
    plan_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    e, lo, hi, cum, total = tile_plan(offsets_ptr, E, N, BLOCK_M, BLOCK_N, E_BLOCK, plan_layout)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, row0, row_end, col0 = tile_coords(tile, e, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M)
        for k in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(a_desc, [row0, k], ready.index(s), a_bufs.index(s))
            _tma_load(w_desc, [expert * N + col0, k], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(
    args,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    E_BLOCK: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    WHICH: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """WARPS warps (whole warp groups) that take every CONSUMERS-th of this program's tiles, from the
    WHICH-th on: per K step wait for the slot's copies, issue the MMA on it asynchronously, wait for the MMA
    before it (one stays in flight) and hand that one's slot back; after a tile's last step, wait for all,
    hand the last slot back and store the rows of the tile's expert (columns < N). The slots of the j-th tile
    of the program are those of its steps j * (K steps) on, in the producer's order, so that with two
    consumers one stores its tile while the other already multiplies the next (ping-pong). Two consumers
    take turns: each starts a tile's products only once the other has passed the last slot of the tile
    before (``done``, one barrier per consumer, a phase per tile). Else one could wait on a slot two of its
    uses ahead of the copies, and an mbarrier's parity cannot tell those two phases apart. ``args``: y, the
    group offsets, the ring (ws_grouped_kernel's), E, N, K and y's row stride."""
    y_ptr, offsets_ptr, ring, E, N, K, stride_ym = args
    a_bufs, b_bufs, ready, empty, done = ring
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    plan_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    e, lo, hi, cum, total = tile_plan(offsets_ptr, E, N, BLOCK_M, BLOCK_N, E_BLOCK, plan_layout)
    steps = gl.cdiv(K, BLOCK_K)
    j = WHICH
    for tile in range(gl.program_id(0) + WHICH * gl.num_programs(0), total, CONSUMERS * gl.num_programs(0)):
        expert, row0, row_end, col0 = tile_coords(tile, e, lo, hi, cum, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        if CONSUMERS > 1:  # the other consumer's turn on tile j - 1 first (its (j - 1) // 2-th phase)
            mbarrier.wait(done.index(1 - WHICH), ((j - 1) // 2) & 1, pred=j > 0)
        it = j * steps
        for kk in range(0, steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
            it += 1
        if CONSUMERS > 1:
            mbarrier.arrive(done.index(WHICH))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        ptrs = y_ptr + gl.expand_dims(rows.to(gl.int64) * stride_ym, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < N, 0)
        gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        j += CONSUMERS


@gluon.jit
def ws_grouped_kernel(
    a_desc,
    w_desc,
    y_ptr,
    offsets_ptr,
    E,
    N,
    K,
    stride_ym,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    E_BLOCK: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """y[rows of expert e, :N] = x[those rows] @ w[e].T; a_desc over x [M, K], w_desc over w as [E*N, K]
    (rows past an expert's N belong to the next expert and are computed, not stored; boxes past the ends
    read zeros). PINGPONG: two consumers of num_warps warps each on alternate tiles (CONSUMER_REGS registers
    for the second); else one, all warp groups on each tile (cooperative)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(done.index(i), count=1)
    fence_async_shared()
    ring = (a_bufs, b_bufs, ready, empty, done)  # the slots and their barriers
    cons = (y_ptr, offsets_ptr, ring, E, N, K, stride_ym)
    prod = (a_desc, w_desc, offsets_ptr, ring, E, N, K)
    if PINGPONG:
        gl.warp_specialize(
            [
                (_consumer, (cons, BLOCK_M, BLOCK_N, BLOCK_K, E_BLOCK, GROUP_M, STAGES, num_warps, 0, 2)),
                (_consumer, (cons, BLOCK_M, BLOCK_N, BLOCK_K, E_BLOCK, GROUP_M, STAGES, num_warps, 1, 2)),
                (_producer, (prod, BLOCK_M, BLOCK_N, BLOCK_K, E_BLOCK, GROUP_M, STAGES)),
            ],
            [num_warps, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_consumer, (cons, BLOCK_M, BLOCK_N, BLOCK_K, E_BLOCK, GROUP_M, STAGES, num_warps, 0, 1)),
                (_producer, (prod, BLOCK_M, BLOCK_N, BLOCK_K, E_BLOCK, GROUP_M, STAGES)),
            ],
            [1],
            [PRODUCER_REGS],
        )


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def shared_layouts(block_n: int, dtype: torch.dtype):
    """The NVMMA shared-memory layouts of the x box [BLOCK_M, BLOCK_K] and the weight box [block_n,
    BLOCK_K]."""
    g = GL_DTYPES[dtype]
    return (
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], g),
        gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], g),
    )


def constexprs(num_experts: int, block_n: int, stages: int, group_m: int, pingpong: bool) -> dict:
    """The kernel's constexprs: cooperative, two warp groups (8 warps) on each 128-row tile; ping-pong, one
    warp group (4 warps) per consumer, two consumers."""
    return dict(
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        E_BLOCK=triton.next_power_of_2(max(num_experts, 2)),
        GROUP_M=group_m,
        STAGES=stages,
        PINGPONG=pingpong,
        PRODUCER_REGS=PRODUCER_REGS,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4 if pingpong else 8,
    )


def ws_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_n: int = 256,
    stages: int = 4,
    pingpong: bool = False,
    group_m: int = 8,
    programs: int | None = None,
) -> torch.Tensor:
    """[M, N] = the rows of each expert (``offsets`` [E + 1] int32) of ``x`` [M, K] times that expert's
    ``w`` [E, N, K]^T, on a persistent grid of ``programs`` (default: one per multiprocessor). 16-bit x and w
    of one dtype, both contiguous with 16-byte aligned rows (K a multiple of 8), on a CUDA device."""
    if x.dim() != 2 or w.dim() != 3 or not x.is_contiguous() or not w.is_contiguous():
        raise ValueError(
            f"x, w: expected contiguous [M, K] and [E, N, K], got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if x.dtype not in GL_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x, w: expected one 16-bit dtype, got {x.dtype} and {w.dtype}")
    e, n, k = w.shape
    if x.shape[1] != k or k % 8:
        raise ValueError(f"x: expected K = {k} (a multiple of 8) columns, got {x.shape[1]}")
    if offsets.dtype != torch.int32 or offsets.shape != (e + 1,):
        raise ValueError(f"offsets: expected int32 [{e + 1}], got {offsets.dtype} {tuple(offsets.shape)}")
    if block_n not in (64, 128, 256) or stages < 2:
        raise ValueError(f"block_n, stages: expected 64, 128 or 256 and at least 2, got {block_n}, {stages}")
    if pingpong and block_n > 128:
        raise ValueError(
            f"block_n: ping-pong holds a 128-row tile per warp group, so at most 128, got {block_n}"
        )
    if not x.is_cuda or TensorDescriptor is None:
        raise RuntimeError("ws_grouped_mm runs on a CUDA GPU with Gluon's TMA descriptors")
    y = out if out is not None else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    la, lb = shared_layouts(block_n, x.dtype)
    a_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [BLOCK_M, BLOCK_K], la)
    w2 = w.view(e * n, k)
    w_desc = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [block_n, BLOCK_K], lb)
    grid = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    c = constexprs(e, block_n, stages, group_m, pingpong)
    ws_grouped_kernel[(grid,)](a_desc, w_desc, y, offsets, e, n, k, y.stride(0), **c)
    return y


# The configs probes/probe_gluon_prefill.py measures: (name, block_n, stages, ping-pong)
VARIANTS = (
    ("n256-s4", 256, 4, False),
    ("n256-s3", 256, 3, False),
    ("n128-s6", 128, 6, False),
    ("pingpong-n128-s6", 128, 6, True),
)


def compile_sm90(
    num_experts: int, block_n: int, stages: int, pingpong: bool, dtype: torch.dtype = torch.bfloat16
):
    """The kernel compiled for sm_90 with the installed Triton, no GPU needed (a check: it raises where the
    kernel does not compile); returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    la, lb = shared_layouts(block_n, dtype)
    t = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    sig = {
        "a_desc": f"tensordesc<{t}[{BLOCK_M},{BLOCK_K}],{la!r}>",
        "w_desc": f"tensordesc<{t}[{block_n},{BLOCK_K}],{lb!r}>",
        "y_ptr": f"*{t}",
        "offsets_ptr": "*i32",
        "E": "i32",
        "N": "i32",
        "K": "i32",
        "stride_ym": "i32",
    }
    c = constexprs(num_experts, block_n, stages, 8, pingpong)
    sig.update({name: "constexpr" for name in c})
    return triton.compile(
        GluonASTSource(fn=ws_grouped_kernel, signature=sig, constexprs=c),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": c["num_warps"]},
    )
