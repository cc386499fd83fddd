"""Single-launch Decompose-K with a parallel reduction.

Grid (tiles, S): program (t, s) computes the fp32 partial of output tile t over K split s. Then the tile's
S programs finish it together: each reduces one slice of ``BLOCK_M * BLOCK_N / S`` elements over the S
partials (a fixed reduction tree: bitwise the same on every run), applies the epilogue and stores its
slice of C. Each program reads ``1/S`` of the tile's partials, where a last-arriving program would read
them all, and no second launch is needed.

A program knows a partial is there by its flag: each partial element is stored as one 64-bit word, the
launch's number above the value's fp32 bits, and a reader waits until every word of its slice carries the
current number. The number comes from a per-tile launch counter that every program reads first thing (the
read overlaps the K loop) and that split 0 bumps once its wait is over (by then every program of the tile
has read it), so there is no fence, no barrier and no counter reset on the critical path.

Waiting on another program is safe only when every program of the grid is resident at once. The plan
checks that from the compiled kernel's registers and shared memory, and launches the grid cooperatively
(``launch_cooperative_grid``: the driver refuses a grid that would not fit rather than letting it hang).
A grid too large for that, a direct :func:`launch`, and the CPU interpreter (which runs programs one at a
time) take the same kernel with ``COOP=False``: the program that takes the tile's last ticket (after a
release fence) reduces the whole tile, a few thousand partial values at a time, and resets the ticket
counter for the next launch and every CUDA-graph replay. Each form is deterministic; a plan keeps its form.

N and K are compile-time constants (one compile per weight shape): the K loop has a constant trip count
and the split boundaries need no run-time arithmetic; M stays a run-time value, so one compile serves
every token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import compile_only, compiled_per_sm, mma, sm_resources
from ..epilogue import apply_epilogue
from ._partial import tile_coords
from .configs import GROUP_M, DecomposeKConfig, Prepared, cdiv, next_pow2
from .workspace import alloc_workspace, coop_state, counters, grid


@triton.jit
def _store_slice(
    total,
    c_ptr,
    bias_ptr,
    M,
    stride_cm,
    stride_cn,
    e,
    in_tile,
    pid_m,
    pid_n,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """Tile elements e (flattened) with their fp32 sums: the epilogue, then the store into C."""
    offs_m = pid_m * BLOCK_M + e // BLOCK_N
    offs_n = pid_n * BLOCK_N + e % BLOCK_N
    ok = in_tile & (offs_m < M) & (offs_n < N)
    total = apply_epilogue(total, bias_ptr, offs_n, ok, HAS_BIAS, EPILOGUE)
    tl.store(c_ptr + offs_m * stride_cm + offs_n * stride_cn, total.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _reduce_slice(
    p_tile,
    c_ptr,
    bias_ptr,
    M,
    stride_cm,
    stride_cn,
    q,
    pid_m,
    pid_n,
    N: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    SLICE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """The last-arriver form: elements [q*SLICE, (q+1)*SLICE) of the tile summed over its S fp32 partials."""
    e = q * SLICE + tl.arange(0, SLICE)
    r = tl.arange(0, SP)
    in_tile = e < BLOCK_M * BLOCK_N
    vals = tl.load(
        p_tile + r[:, None] * (BLOCK_M * BLOCK_N) + e[None, :],
        mask=(r[:, None] < S) & in_tile[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    _store_slice(
        tl.sum(vals, axis=0),
        c_ptr,
        bias_ptr,
        M,
        stride_cm,
        stride_cn,
        e,
        in_tile,
        pid_m,
        pid_n,
        N,
        BLOCK_M,
        BLOCK_N,
        HAS_BIAS,
        EPILOGUE,
    )


@triton.jit
def _single_launch_kernel(
    a_ptr,
    b_ptr,
    p_ptr,
    c_ptr,
    bias_ptr,
    counter_ptr,
    M,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    N: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SP: tl.constexpr,
    SLICE: tl.constexpr,
    CHUNK: tl.constexpr,
    COOP: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    tile_id = tl.program_id(0)
    split = tl.program_id(1)
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    if COOP:
        # This launch's number for the tile: the count of launches before it, plus one. Read first, so its
        # round trip overlaps the K loop's loads; bumped by split 0 once every program has read it.
        flag = (tl.load(counter_ptr + tile_id, volatile=True) + 1).to(tl.int32)
    pid_m, pid_n = tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    KPS: tl.constexpr = (K + S - 1) // S  # K per split; the last split may be shorter (or empty)
    EVEN_K: tl.constexpr = (K % S == 0) and (KPS % BLOCK_K == 0)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = offs_m % M  # rows/columns past the edge re-read valid ones; the stores mask them out
    rn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * KPS
    a_ptrs = a_ptr + rm[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, KPS, BLOCK_K):  # a constant trip count
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k_start + kk + offs_k < K) & (kk + offs_k < KPS)
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = mma(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    e = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    if S == 1:  # nothing to reduce: the epilogue and the store
        _store_slice(
            acc,
            c_ptr,
            bias_ptr,
            M,
            stride_cm,
            stride_cn,
            e,
            e < TILE,
            pid_m,
            pid_n,
            N,
            BLOCK_M,
            BLOCK_N,
            HAS_BIAS,
            EPILOGUE,
        )
    elif COOP:
        # Each partial element goes out as one 64-bit word: the launch's flag above its fp32 bits. A reader
        # that sees its flag sees its value (one single-copy-atomic store), so no fence or barrier is needed.
        p_tile = p_ptr + tile_id.to(tl.int64) * (S * TILE)
        bits = acc.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        tl.store(p_tile + split * TILE + e, (flag.to(tl.int64) << 32) | bits)
        # This program's slice, from all S partials: wait until every word carries this launch's flag.
        es = split * SLICE + tl.arange(0, SLICE)
        r = tl.arange(0, SP)
        live = (r[:, None] < S) & (es < TILE)[None, :]
        ptrs = p_tile + r[:, None] * TILE + es[None, :]
        ready = flag.to(tl.int64) << 32
        words = tl.load(ptrs, mask=live, other=ready, volatile=True)
        while tl.min(((words >> 32).to(tl.int32) == flag).to(tl.int32)) == 0:
            words = tl.load(ptrs, mask=live, other=ready, volatile=True)
        vals = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        vals = tl.where(live, vals, 0.0)
        _store_slice(
            tl.sum(vals, axis=0),
            c_ptr,
            bias_ptr,
            M,
            stride_cm,
            stride_cn,
            es,
            es < TILE,
            pid_m,
            pid_n,
            N,
            BLOCK_M,
            BLOCK_N,
            HAS_BIAS,
            EPILOGUE,
        )
        if split == 0:  # every program's words carry the flag, so every program has read the counter
            tl.atomic_add(counter_ptr + tile_id, 1, sem="relaxed", scope="gpu")
    else:
        p_tile = p_ptr + tile_id.to(tl.int64) * (S * TILE)
        tl.store(p_tile + split * TILE + e, acc)
        # Every thread's partial store is ordered before the ticket (CTA barrier, then a gpu-scope release);
        # the acquire side orders the last program's reads of the other partials after their releases.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if ticket == S - 1:
            tl.debug_barrier()
            for q in range(0, (TILE + CHUNK - 1) // CHUNK):  # CHUNK elements over all S partials at a time
                _reduce_slice(
                    p_tile,
                    c_ptr,
                    bias_ptr,
                    M,
                    stride_cm,
                    stride_cn,
                    q,
                    pid_m,
                    pid_n,
                    N,
                    S,
                    SP,
                    CHUNK,
                    BLOCK_M,
                    BLOCK_N,
                    HAS_BIAS,
                    EPILOGUE,
                )
            tl.atomic_xchg(counter_ptr + tile_id, 0, sem="relaxed", scope="gpu")


def slice_len(cfg: DecomposeKConfig) -> int:
    """Elements of a tile each program reduces: BLOCK_M*BLOCK_N/S rounded up to a power of two."""
    return next_pow2(cdiv(cfg.block_m * cfg.block_n, cfg.split_k))


def chunk_len(cfg: DecomposeKConfig) -> int:
    """Elements the last-arriver form reduces per step: about 4096 partial values (all S of them) at a time,
    so that a tile takes a few dependent round trips to L2, not one per slice."""
    tile = cfg.block_m * cfg.block_n
    return max(1, min(tile, 4096 // next_pow2(cfg.split_k)))


def kernel_args(p: Prepared, cfg: DecomposeKConfig, workspace, counter_buf, coop: bool) -> dict:
    return dict(
        a_ptr=p.a,
        b_ptr=p.b,
        p_ptr=workspace,
        c_ptr=p.out,
        bias_ptr=p.bias_arg,
        counter_ptr=counter_buf,
        M=p.m,
        stride_am=p.a.stride(0),
        stride_ak=p.a.stride(1),
        stride_bk=p.b.stride(0),
        stride_bn=p.b.stride(1),
        stride_cm=p.out.stride(0),
        stride_cn=p.out.stride(1),
        N=p.n,
        K=p.k,
        S=cfg.split_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=GROUP_M,
        SP=next_pow2(cfg.split_k),
        SLICE=slice_len(cfg),
        CHUNK=chunk_len(cfg),
        COOP=coop,
        HAS_BIAS=p.bias is not None,
        EPILOGUE=int(p.epilogue),
        **p.dot_meta,
    )


def compile_for(p: Prepared, cfg: DecomposeKConfig) -> tuple[object, bool]:
    """(compiled kernel, coop) without launching: the cooperative form where S > 1 and the whole grid is
    resident at once, else the last-arriver form (S = 1: no reduction at all)."""
    g = grid(p.m, p.n, cfg)
    meta = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    device = p.a.device.index if p.a.device.index is not None else torch.cuda.current_device()
    if cfg.split_k > 1:
        ws, cnt = coop_state(p.m, p.n, cfg, p.a.device)
        coop_args = dict(kernel_args(p, cfg, ws, cnt, True), launch_cooperative_grid=True, **meta)
        coop_kernel = compile_only(_single_launch_kernel, g, (), coop_args)
        resident = compiled_per_sm(coop_kernel, cfg.num_warps, device) * sm_resources(device)["sms"]
        if g[0] * g[1] <= resident:
            return coop_kernel, True
    ws = alloc_workspace(p.m, p.n, cfg, p.a.device)
    plain = compile_only(
        _single_launch_kernel, g, (), dict(kernel_args(p, cfg, ws, counters(p.a.device, g[0]), False), **meta)
    )
    return plain, False


def launch(p: Prepared, cfg: DecomposeKConfig) -> torch.Tensor:
    """The generic launch through Triton, in the last-arriver form (the CPU interpreter runs programs one at
    a time, so no program may wait for another there). :class:`moegemm.decompose_k.plans.Plan` runs the
    cooperative form where it applies."""
    workspace = alloc_workspace(p.m, p.n, cfg, p.a.device)
    g = grid(p.m, p.n, cfg)
    _single_launch_kernel[g](
        **kernel_args(p, cfg, workspace, counters(p.a.device, g[0]), False),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return p.out
