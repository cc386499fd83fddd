"""A per-cell memory ceiling for the grouped GEMM: one kernel that moves exactly the bytes the cell's floor
counts -- reads the active experts' weights and the activation rows, writes the output rows -- and does
nothing else. Its CUDA-graph time is what this GPU needs to stream those bytes, fixed costs (launch, ramp,
tail) included; no GEMM kernel can move them faster. E7 times it beside the GEMMs (``ceiling:stream``):
the floor over its time is the share of the floor the memory system allows in that cell.

The kernel sums what it reads (so no load is dead code) and counts the elements it read, per program: the
sums and counts are its result, from which :func:`check_stream` tells that every byte was read once and
every output element written.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    block: int = 8192  # elements one program moves per step
    programs_per_sm: int = 4
    num_warps: int = 8


# the light search E7 runs once per (model, projection, tokens): the best one is the ceiling
CANDIDATES = (
    StreamConfig(8192, 4, 8),
    StreamConfig(16384, 2, 8),
    StreamConfig(4096, 8, 4),
    StreamConfig(8192, 8, 8),
)


@triton.jit
def _stream_kernel(w_ptr, experts_ptr, x_ptr, y_ptr, sums_ptr, counts_ptr,
                   n_active, w_elems, x_elems, y_elems, BLOCK: tl.constexpr):
    """Chunks of BLOCK elements, dealt round robin over the programs: first the active experts' weights
    (expert experts[i] is w[experts[i]], w_elems contiguous elements), then x, then y (written with zeros)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    w_chunks = tl.cdiv(w_elems, BLOCK)
    n_w = n_active * w_chunks
    n_x = tl.cdiv(x_elems, BLOCK)
    n_all = n_w + n_x + tl.cdiv(y_elems, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    for c in range(pid, n_all, tl.num_programs(0)):
        if c < n_w:
            e = tl.load(experts_ptr + c // w_chunks).to(tl.int64)
            o = (c % w_chunks).to(tl.int64) * BLOCK + offs  # (one offset type in every branch)
            ok = o < w_elems
            acc += tl.load(w_ptr + e * w_elems + o, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
            cnt += ok.to(tl.int32)
        elif c < n_w + n_x:
            o = (c - n_w).to(tl.int64) * BLOCK + offs
            ok = o < x_elems
            acc += tl.load(x_ptr + o, mask=ok, other=0.0).to(tl.float32)
            cnt += ok.to(tl.int32)
        else:
            o = (c - n_w - n_x).to(tl.int64) * BLOCK + offs
            tl.store(y_ptr + o, tl.zeros([BLOCK], dtype=tl.float32).to(y_ptr.dtype.element_ty), mask=o < y_elems)
    tl.store(sums_ptr + pid, tl.sum(acc, axis=0))
    tl.store(counts_ptr + pid, tl.sum(cnt, axis=0))


@dataclasses.dataclass
class Stream:
    """The buffers of one streaming call: ``experts`` (int32 ids of the active experts), the output ``y``
    and the per-program ``sums`` / ``counts``."""

    experts: torch.Tensor
    y: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor
    config: StreamConfig


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so that the round robin still deals several chunks each


def stream_setup(w: torch.Tensor, group_sizes: torch.Tensor, rows: int, config: StreamConfig = StreamConfig()
                 ) -> Stream:
    """Buffers for streaming the weights of the experts with rows (``group_sizes`` > 0) out of ``w``
    ([E, ...], each expert contiguous), ``rows`` activation rows in and ``rows`` output rows out
    (w.shape[1] wide: the [E, N, K] layout). Reads group_sizes on the host: call it before timing."""
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"w: expected a contiguous [E, N, K] tensor, got shape {tuple(w.shape)}")
    if group_sizes.dim() != 1 or group_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"group_sizes: expected [{w.shape[0]}], got {tuple(group_sizes.shape)}")
    if rows < 0:
        raise ValueError(f"rows: expected >= 0, got {rows}")
    experts = torch.nonzero(group_sizes > 0).flatten().to(torch.int32)
    programs = config.programs_per_sm * _sm_count(w.device)
    return Stream(experts=experts, y=torch.empty(rows, w.shape[1], dtype=w.dtype, device=w.device),
                  sums=torch.empty(programs, dtype=torch.float32, device=w.device),
                  counts=torch.empty(programs, dtype=torch.int32, device=w.device), config=config)


def stream_bytes(w: torch.Tensor, x: torch.Tensor, s: Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """One streaming pass (one launch, no host sync): reads w[e] for each active expert e and all of ``x``,
    writes zeros to all of ``s.y``. Returns (per-program sums, per-program element counts)."""
    if w.dtype != x.dtype or not x.is_contiguous() or x.shape[0] != s.y.shape[0] or w.shape[2] != x.shape[1]:
        raise ValueError(f"x: expected a contiguous [{s.y.shape[0]}, {w.shape[2]}] {w.dtype} tensor, "
                         f"got {tuple(x.shape)} {x.dtype}")
    grid = (s.sums.shape[0],)
    _stream_kernel[grid](w, s.experts, x, s.y, s.sums, s.counts, s.experts.shape[0], w.shape[1] * w.shape[2],
                         x.numel(), s.y.numel(), BLOCK=s.config.block, num_warps=s.config.num_warps)
    return s.sums, s.counts


def check_stream(out: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor, x: torch.Tensor,
                 group_sizes: torch.Tensor, y: torch.Tensor) -> tuple[bool, float, str]:
    """(ok, relative error of the sum, why) of one pass's result, judged from the cell itself, not from the
    pass's own buffers: the element count read must equal the weights of the experts with rows
    (``group_sizes`` > 0) plus x exactly, every element of the output ``y`` must be zero (poison it before
    the pass), and the sum of what was read must match a float64 sum of those elements."""
    sums, counts = out
    active = torch.nonzero(group_sizes > 0).flatten().tolist()
    want_count = len(active) * w.shape[1] * w.shape[2] + x.numel()
    got_count = int(counts.long().sum())
    if got_count != want_count:
        return False, float("nan"), f"read {got_count} elements, expected {want_count}"
    if not bool((y == 0).all()):
        return False, float("nan"), "output not fully written"
    ref = sum(float(w[e].double().sum()) for e in active) + float(x.double().sum())
    scale = sum(float(w[e].double().abs().sum()) for e in active) + float(x.double().abs().sum())
    got = float(sums.double().sum())
    rel = abs(got - ref) / max(scale, 1e-30)
    ok = rel <= 1e-5 and got == got
    return ok, rel, "ok: every byte read once, every output element written" if ok else f"sum off by {rel:.2e}"
