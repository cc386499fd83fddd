"""Routing in a few launches: the flat (token, k) slots grouped by expert, stable, with no sort.

Row of slot s = (rows of every expert before e) + (slots before s with the same expert e), e = its expert id.
The slots are cut into chunks of ``CHUNK``:

1. ``_count_kernel`` (one program per chunk): the chunk's per-expert counts, and how many of its ids lie
   outside [0, E);
2. ``_scan_kernel`` (one program): the experts' sizes and offsets, and for every (chunk, expert) the row
   where that chunk's first slot of the expert goes; the check's flag;
3. ``_place_kernel`` (one program per chunk): each slot's row (3.'s base plus its rank among the chunk's
   slots of the same expert, from a pairwise comparison within the chunk) and the permutation's three
   arrays.

Where every slot fits one chunk (decode), ``_small_kernel`` does all of it in one program; up to GATHER_SLOTS
slots ``_small_gather_kernel`` does the same with the permutation of the token rows and gating weights it
drives, in one launch; past them ``_place_gather_kernel`` is step 3 with that permutation. No atomics: the
plan is the same on every run, equal to a stable sort by expert id. An id outside [0, E) counts as expert 0,
so the plan stays a permutation, and the check's flag is 0 (the caller asserts it on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import launch

CHUNK = 128  # slots per program (the pairwise rank is CHUNK x CHUNK)
EB = 128  # experts per step of the count and scan loops
PB = 128  # chunks per step of the scan (its one program walks the chunks serially: few, long steps)
# the most slots plan_and_gather takes in one launch: its one program per column block works the whole plan
# out, so past 64 slots over many experts that serial plan costs more than the count and scan launches save
GATHER_SLOTS = 64
# the columns of a token row each program of the placement copies (128 slots x 256 columns: 64 KB of bf16)
PLACE_BLOCK_H = 256


@triton.jit
def _experts_of(ids_ptr, s, live, E):
    """(expert of each slot, 0 for an id outside [0, E); 1 where the id is outside [0, E) and the slot
    live)."""
    v = tl.load(ids_ptr + s, mask=live, other=0)
    ok = (v >= 0) & (v < E)
    return tl.where(ok, v, 0).to(tl.int32), (live & (ok == 0)).to(tl.int32)


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, bad_ptr, N, E, CHUNK: tl.constexpr, EB: tl.constexpr):
    p = tl.program_id(0)
    s = p * CHUNK + tl.arange(0, CHUNK)
    live = s < N
    ex, bad = _experts_of(ids_ptr, s, live, E)
    tl.store(bad_ptr + p, tl.sum(bad, axis=0))
    for e0 in range(0, E, EB):
        ec = e0 + tl.arange(0, EB)
        hit = (ex[:, None] == ec[None, :]) & live[:, None]
        tl.store(hist_ptr + p * E + ec, tl.sum(hit.to(tl.int32), axis=0), mask=ec < E)


@triton.jit
def _scan_kernel(
    hist_ptr, bad_ptr, base_ptr, sizes_ptr, offsets_ptr, ok_ptr, P, E, PB: tl.constexpr, EB: tl.constexpr
):
    bad = tl.zeros((PB,), dtype=tl.int32)
    for p0 in range(0, P, PB):
        pr = p0 + tl.arange(0, PB)
        bad += tl.load(bad_ptr + pr, mask=pr < P, other=0)
    tl.store(ok_ptr, tl.sum(bad, axis=0) == 0)
    done = tl.sum(tl.zeros((EB,), dtype=tl.int32), axis=0)  # rows of the experts before this block
    for e0 in range(0, E, EB):
        ec = e0 + tl.arange(0, EB)
        em = ec < E
        size = tl.zeros((EB,), dtype=tl.int32)
        for p0 in range(0, P, PB):
            pr = p0 + tl.arange(0, PB)
            h = tl.load(
                hist_ptr + pr[:, None] * E + ec[None, :], mask=(pr < P)[:, None] & em[None, :], other=0
            )
            size += tl.sum(h, axis=0)
        start = done + tl.cumsum(size, axis=0) - size
        tl.store(sizes_ptr + ec, size, mask=em)
        tl.store(offsets_ptr + ec, start, mask=em)
        done += tl.sum(size, axis=0)
        run = start
        for p0 in range(0, P, PB):
            pr = p0 + tl.arange(0, PB)
            m = (pr < P)[:, None] & em[None, :]
            h = tl.load(hist_ptr + pr[:, None] * E + ec[None, :], mask=m, other=0)
            tl.store(
                base_ptr + pr[:, None] * E + ec[None, :], run[None, :] + tl.cumsum(h, axis=0) - h, mask=m
            )
            run += tl.sum(h, axis=0)
    tl.store(offsets_ptr + E, done)


@triton.jit
def _rank_in_chunk(ex, CHUNK: tl.constexpr):
    """For each slot of the chunk, how many slots before it have the same expert."""
    i = tl.arange(0, CHUNK)
    before = (ex[:, None] == ex[None, :]) & (i[None, :] < i[:, None])
    return tl.sum(before.to(tl.int32), axis=1)


@triton.jit
def _store_rows(s, row, live, tok_ptr, slot_ptr, rows_ptr, TOP_K):
    tl.store(rows_ptr + s, row, mask=live)
    tl.store(slot_ptr + row, s, mask=live)
    tl.store(tok_ptr + row, s // TOP_K, mask=live)


@triton.jit
def _place_kernel(ids_ptr, base_ptr, tok_ptr, slot_ptr, rows_ptr, N, E, TOP_K, CHUNK: tl.constexpr):
    p = tl.program_id(0)
    s = p * CHUNK + tl.arange(0, CHUNK)
    live = s < N
    ex, _ = _experts_of(ids_ptr, s, live, E)
    row = tl.load(base_ptr + p * E + ex, mask=live, other=0) + _rank_in_chunk(ex, CHUNK)
    _store_rows(s, row, live, tok_ptr, slot_ptr, rows_ptr, TOP_K)


@triton.jit
def _place_gather_kernel(
    ids_ptr, base_ptr, x_ptr, w_ptr, xs_ptr, ws_ptr, tok_ptr, slot_ptr, rows_ptr,
    N, E, TOP_K, H, stride_x,
    CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """_place_kernel with the permutation it drives: program (chunk, column block) works out its chunk's
    rows and copies its BLOCK_H columns of each slot's token row to the slot's row of ``xs``; the programs
    of column block 0 also store the chunk's part of the plan and of the gating weights in row order."""
    p = tl.program_id(0)
    s = p * CHUNK + tl.arange(0, CHUNK)
    live = s < N
    ex, _ = _experts_of(ids_ptr, s, live, E)
    row = tl.load(base_ptr + p * E + ex, mask=live, other=0) + _rank_in_chunk(ex, CHUNK)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = live[:, None] & (cols < H)[None, :]
    v = tl.load(x_ptr + (s // TOP_K).to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m)
    tl.store(xs_ptr + row.to(tl.int64)[:, None] * H + cols[None, :], v, mask=m)
    if tl.program_id(1) == 0:
        _store_rows(s, row, live, tok_ptr, slot_ptr, rows_ptr, TOP_K)
        tl.store(ws_ptr + row, tl.load(w_ptr + s, mask=live), mask=live)


@triton.jit
def _small_rows(ex, live, CHUNK: tl.constexpr):
    """Each of at most CHUNK slots' row: the number of live slots ordered before it by (expert, slot)."""
    first = (ex[None, :] < ex[:, None]) & live[None, :]
    return tl.sum(first.to(tl.int32), axis=1) + _rank_in_chunk(ex, CHUNK)


@triton.jit
def _store_sizes(ex, live, sizes_ptr, offsets_ptr, E, EB: tl.constexpr):
    """The experts' sizes and offsets from the live slots' experts, EB experts per step."""
    done = tl.sum(tl.zeros((EB,), dtype=tl.int32), axis=0)
    for e0 in range(0, E, EB):
        ec = e0 + tl.arange(0, EB)
        size = tl.sum(((ex[:, None] == ec[None, :]) & live[:, None]).to(tl.int32), axis=0)
        tl.store(sizes_ptr + ec, size, mask=ec < E)
        tl.store(offsets_ptr + ec, done + tl.cumsum(size, axis=0) - size, mask=ec < E)
        done += tl.sum(size, axis=0)
    tl.store(offsets_ptr + E, done)


@triton.jit
def _small_kernel(
    ids_ptr,
    tok_ptr,
    slot_ptr,
    rows_ptr,
    sizes_ptr,
    offsets_ptr,
    ok_ptr,
    N,
    E,
    TOP_K,
    CHUNK: tl.constexpr,
    EB: tl.constexpr,
):
    """All of it for N <= CHUNK slots: a slot's row is the number of slots ordered before it by (expert,
    slot)."""
    i = tl.arange(0, CHUNK)
    live = i < N
    ex, bad = _experts_of(ids_ptr, i, live, E)
    tl.store(ok_ptr, tl.sum(bad, axis=0) == 0)
    row = _small_rows(ex, live, CHUNK)
    _store_rows(i, row, live, tok_ptr, slot_ptr, rows_ptr, TOP_K)
    _store_sizes(ex, live, sizes_ptr, offsets_ptr, E, EB)


@triton.jit
def _small_gather_kernel(
    ids_ptr,
    x_ptr,
    w_ptr,
    xs_ptr,
    ws_ptr,
    tok_ptr,
    slot_ptr,
    rows_ptr,
    sizes_ptr,
    offsets_ptr,
    ok_ptr,
    N,
    E,
    TOP_K,
    H,
    stride_x,
    CHUNK: tl.constexpr,
    EB: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """_small_kernel's plan and the permutation it drives, in one launch: every program works the plan out
    (a few slots: cheap) and copies its BLOCK_H columns of each slot's token row to the slot's row of
    ``xs``; program 0 also stores the plan and the gating weights in row order (``ws``)."""
    p = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    live = i < N
    ex, bad = _experts_of(ids_ptr, i, live, E)
    row = _small_rows(ex, live, CHUNK)
    cols = p * BLOCK_H + tl.arange(0, BLOCK_H)
    m = live[:, None] & (cols < H)[None, :]
    v = tl.load(x_ptr + (i // TOP_K).to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m)
    tl.store(xs_ptr + row.to(tl.int64)[:, None] * H + cols[None, :], v, mask=m)
    if p == 0:
        tl.store(ok_ptr, tl.sum(bad, axis=0) == 0)
        _store_rows(i, row, live, tok_ptr, slot_ptr, rows_ptr, TOP_K)
        tl.store(ws_ptr + row, tl.load(w_ptr + i, mask=live), mask=live)
        _store_sizes(ex, live, sizes_ptr, offsets_ptr, E, EB)


def small_blocks(n: int, num_experts: int) -> tuple[int, int]:
    """(CHUNK, EB) of ``_small_kernel`` for n <= CHUNK slots over ``num_experts``: the slots and the experts
    per step rounded up to powers of two (at least 16), so that a decode step's few slots compare only with
    each other and with as many experts as there are."""
    return max(16, triton.next_power_of_2(n)), min(EB, max(16, triton.next_power_of_2(num_experts)))


def plan_buffers(flat_ids: torch.Tensor, num_experts: int):
    """The plan's arrays, unwritten, for the flat ids (fake tensors too, for the custom ops' shapes):
    (sorted_token_ids, sorted_slot, slot_rows [n], group_sizes [E], group_offsets [E + 1], all int32; ok, bool
    [1])."""
    n = flat_ids.shape[0]
    i32 = dict(dtype=torch.int32)
    return (
        flat_ids.new_empty(n, **i32),
        flat_ids.new_empty(n, **i32),
        flat_ids.new_empty(n, **i32),
        flat_ids.new_empty(num_experts, **i32),
        flat_ids.new_empty(num_experts + 1, **i32),
        flat_ids.new_empty(1, dtype=torch.bool),
    )


def plan_arrays(flat_ids: torch.Tensor, num_experts: int, top_k: int):
    """(sorted_token_ids, sorted_slot, slot_rows, group_sizes, group_offsets, ok) for the flat ids (any
    integer dtype, contiguous), all int32 but ok (bool [1]: every id in [0, num_experts))."""
    n, e = flat_ids.numel(), num_experts
    tok, slot, rows, sizes, offsets, ok = plan_buffers(flat_ids, e)
    if n <= CHUNK:
        chunk, eb = small_blocks(n, e)
        launch(
            _small_kernel,
            (1,),
            (flat_ids, tok, slot, rows, sizes, offsets, ok, n, e, top_k),
            dict(CHUNK=chunk, EB=eb, num_warps=4 if chunk * max(chunk, eb) > 4096 else 1),
        )
        return tok, slot, rows, sizes, offsets, ok
    base, p = _count_and_scan(flat_ids, e, sizes, offsets, ok)
    launch(
        _place_kernel,
        (p,),
        (flat_ids, base, tok, slot, rows, n, e, top_k),
        dict(CHUNK=CHUNK, num_warps=4),
    )
    return tok, slot, rows, sizes, offsets, ok


def _count_and_scan(flat_ids: torch.Tensor, e: int, sizes, offsets, ok) -> tuple[torch.Tensor, int]:
    """Steps 1 and 2 of the module's plan for more than CHUNK slots: the experts' sizes and offsets and the
    check's flag stored; returns (each (chunk, expert)'s first row [P * E], P chunks)."""
    n = flat_ids.numel()
    p = triton.cdiv(n, CHUNK)
    if 2 * p * e + p >= 2**31:  # the kernels index the per-chunk counts with 32-bit offsets
        raise ValueError(
            f"topk_ids: {n} slots over {e} experts need {2 * p * e} per-chunk counts, more than "
            "the routing kernels' 32-bit offsets hold"
        )
    scratch = torch.empty(2 * p * e + p, dtype=torch.int32, device=flat_ids.device)
    hist, base, bad = scratch[: p * e], scratch[p * e : 2 * p * e], scratch[2 * p * e :]
    launch(_count_kernel, (p,), (flat_ids, hist, bad, n, e), dict(CHUNK=CHUNK, EB=EB, num_warps=4))
    launch(_scan_kernel, (1,), (hist, bad, base, sizes, offsets, ok, p, e), dict(PB=PB, EB=EB, num_warps=8))
    return base, p


def plan_and_gather(
    flat_ids: torch.Tensor,
    num_experts: int,
    top_k: int,
    x: torch.Tensor,
    flat_weights: torch.Tensor,
    copy_x: bool = True,
):
    """plan_arrays with x's rows permuted (``xs`` [n, H]: row i is token sorted_token_ids[i]) and the gating
    weights in row order (``ws`` [n]): (sorted_token_ids, sorted_slot, slot_rows, group_sizes,
    group_offsets, ok, xs, ws). Up to GATHER_SLOTS slots in one launch; past them the count and the scan,
    then the placement with the permutation it drives (three launches in all, where the plan and two
    gathers would take five). x: [T, H] with unit column stride; flat_weights: [n], contiguous.
    ``copy_x=False``: x's rows are not copied (``xs`` is [n, 0]; for a GEMM that gathers them itself)."""
    n, e, dev = flat_ids.numel(), num_experts, flat_ids.device
    h = x.shape[1] if copy_x else 0
    tok, slot, rows, sizes, offsets, ok = plan_buffers(flat_ids, e)
    xs = torch.empty(n, h, dtype=x.dtype, device=dev)
    ws = torch.empty(n, dtype=flat_weights.dtype, device=dev)
    if n > GATHER_SLOTS:
        base, p = _count_and_scan(flat_ids, e, sizes, offsets, ok)
        block_h = min(max(16, triton.next_power_of_2(h)), PLACE_BLOCK_H)
        launch(
            _place_gather_kernel,
            (p, max(1, triton.cdiv(h, block_h))),
            (flat_ids, base, x, flat_weights, xs, ws, tok, slot, rows, n, e, top_k, h, x.stride(0)),
            dict(CHUNK=CHUNK, BLOCK_H=block_h, num_warps=4),
        )
        return tok, slot, rows, sizes, offsets, ok, xs, ws
    chunk, eb = small_blocks(n, e)
    block_h = max(64, 8192 // chunk)
    launch(
        _small_gather_kernel,
        (max(1, triton.cdiv(h, block_h)),),
        (flat_ids, x, flat_weights, xs, ws, tok, slot, rows, sizes, offsets, ok, n, e, top_k, h, x.stride(0)),
        dict(CHUNK=chunk, EB=eb, BLOCK_H=block_h, num_warps=4),
    )
    return tok, slot, rows, sizes, offsets, ok, xs, ws
