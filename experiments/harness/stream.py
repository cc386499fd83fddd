"""A per-cell memory ceiling for the grouped GEMM: one kernel that moves as many bytes as the cell's floor
counts -- reads as many experts' weights as the cell has active experts, and the activation rows, writes the
output rows -- and does nothing else. Its CUDA-graph time is what this GPU needs to stream those bytes,
fixed costs (launch, ramp, tail) included. E7 times it beside the GEMMs (``ceiling:stream``): the floor
over its time is the share of the floor that streaming alone reaches in that cell.

The weights read are the first ``active`` experts of w, one contiguous slab: the same number of bytes as
the active experts' (each expert's weights are one contiguous block of megabytes either way, so which
experts they are does not matter to the memory system), without an indirection per chunk. Two kinds:
pointer loads of BLOCK elements (``flat``), and TMA boxes of BOX_ROWS x 256 elements (``tma``), the
way our GEMM kernels bring in their weight tiles.

The kernel sums what it reads (so no load is dead code) and counts the elements it read, per program: the
sums and counts are its result, from which :func:`check_stream` tells that every byte was read once and
every output element written.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: the flat kind only
    TensorDescriptor = None

COLS = 256  # elements per row of the slab's TMA view (512 bytes at 16 bits)


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    block: int = 8192  # flat: elements one program moves per step; tma: rows of a box (of COLS elements)
    programs_per_sm: int = 4
    num_warps: int = 8
    kind: str = "flat"  # "flat" (pointer loads) or "tma" (TMA boxes for the weights)
    num_stages: int = 3


# the light search E7 runs once per (model, projection, tokens): the fastest one is the ceiling. 64-row TMA
# boxes with two or four programs per SM stream an H200's HBM fastest on every slab size; the pointer-load
# shapes serve weights TMA cannot box.
CANDIDATES = (
    StreamConfig(64, 2, 4, "tma", 2),
    StreamConfig(64, 2, 4, "tma", 4),
    StreamConfig(64, 4, 4, "tma", 4),
    StreamConfig(64, 4, 4, "tma", 2),
    StreamConfig(8192, 8, 8),
    StreamConfig(16384, 1, 8),
)


@triton.jit
def _stream_rest(acc, cnt, x_ptr, y_ptr, x_elems, y_elems, pid, nprog, BLOCK: tl.constexpr):
    """Reads x and writes zeros to y in chunks of BLOCK elements, round robin over the programs."""
    offs = tl.arange(0, BLOCK)
    for c in range(pid, tl.cdiv(x_elems, BLOCK), nprog):
        o = tl.cast(c, tl.int64) * BLOCK + offs
        ok = o < x_elems
        acc += tl.load(x_ptr + o, mask=ok, other=0.0).to(tl.float32)
        cnt += ok.to(tl.int32)
    for c in range(pid, tl.cdiv(y_elems, BLOCK), nprog):
        o = tl.cast(c, tl.int64) * BLOCK + offs
        tl.store(y_ptr + o, tl.zeros([BLOCK], dtype=tl.float32).to(y_ptr.dtype.element_ty), mask=o < y_elems)
    return acc, cnt


@triton.jit
def _stream_flat_kernel(
    w_ptr, x_ptr, y_ptr, sums_ptr, counts_ptr, w_elems, x_elems, y_elems, BLOCK: tl.constexpr
):
    """The slab w[0:w_elems], then x, in chunks of BLOCK elements dealt round robin over the programs; then
    y written with zeros."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    for c in range(pid, tl.cdiv(w_elems, BLOCK), nprog):
        o = tl.cast(c, tl.int64) * BLOCK + offs
        ok = o < w_elems
        acc += tl.load(w_ptr + o, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        cnt += ok.to(tl.int32)
    acc, cnt = _stream_rest(acc, cnt, x_ptr, y_ptr, x_elems, y_elems, pid, nprog, BLOCK)
    tl.store(sums_ptr + pid, tl.sum(acc, axis=0))
    tl.store(counts_ptr + pid, tl.sum(cnt, axis=0))


@triton.jit
def _stream_tma_kernel(
    w_desc,
    x_ptr,
    y_ptr,
    sums_ptr,
    counts_ptr,
    w_rows,
    x_elems,
    y_elems,
    BOX_ROWS: tl.constexpr,
    COLS_: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The slab as [w_rows, COLS_] in boxes of BOX_ROWS rows brought in by TMA, dealt round robin over the
    programs (the box reads zeros past the last row: counted out); then x and y as the flat kernel does,
    in chunks of BLOCK elements."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    box = tl.zeros([BOX_ROWS, COLS_], dtype=tl.float32)
    n = 0
    for r in range(pid * BOX_ROWS, w_rows, nprog * BOX_ROWS):
        box += w_desc.load([r, 0]).to(tl.float32)
        n += tl.minimum(w_rows - r, BOX_ROWS) * COLS_
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    acc, cnt = _stream_rest(acc, cnt, x_ptr, y_ptr, x_elems, y_elems, pid, nprog, BLOCK)
    tl.store(sums_ptr + pid, tl.sum(acc, axis=0) + tl.sum(tl.sum(box, axis=1), axis=0))
    tl.store(counts_ptr + pid, tl.sum(cnt, axis=0) + n)


@dataclasses.dataclass
class Stream:
    """The buffers of one streaming call: the number of ``active`` experts whose bytes it reads, the output
    ``y`` and the per-program ``sums`` / ``counts``."""

    active: int
    y: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor
    config: StreamConfig


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so that the round robin still deals several chunks each


def fits(w: torch.Tensor, config: StreamConfig) -> bool:
    """Whether ``config`` can stream these weights ([E, N, K]): the tma kind needs 16-bit weights of a whole
    number of COLS-element rows per expert, and a Triton with TMA descriptors."""
    if config.kind != "tma":
        return True
    return TensorDescriptor is not None and w.element_size() == 2 and (w.shape[1] * w.shape[2]) % COLS == 0


def stream_setup(
    w: torch.Tensor, group_sizes: torch.Tensor, rows: int, config: StreamConfig = StreamConfig()
) -> Stream:
    """Buffers for streaming as many experts' weights out of ``w`` ([E, N, K], contiguous) as have rows
    (``group_sizes`` > 0), ``rows`` activation rows in and ``rows`` output rows out (N wide). Reads
    group_sizes on the host: call it before timing. The tma kind needs 16-bit weights whose experts are a
    whole number of COLS-element rows, and a Triton with TMA descriptors."""
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"w: expected a contiguous [E, N, K] tensor, got shape {tuple(w.shape)}")
    if group_sizes.dim() != 1 or group_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"group_sizes: expected [{w.shape[0]}], got {tuple(group_sizes.shape)}")
    if rows < 0:
        raise ValueError(f"rows: expected >= 0, got {rows}")
    if config.kind not in ("flat", "tma"):
        raise ValueError(f"config.kind: expected 'flat' or 'tma', got {config.kind!r}")
    if not fits(w, config):
        raise ValueError(
            f"config.kind: 'tma' needs 16-bit weights of a multiple of {COLS} elements per "
            f"expert and Triton's TensorDescriptor, got {w.dtype} [{w.shape[1]}, {w.shape[2]}]"
        )
    active = int((group_sizes > 0).sum())
    programs = config.programs_per_sm * _sm_count(w.device)
    return Stream(
        active=active,
        y=torch.empty(rows, w.shape[1], dtype=w.dtype, device=w.device),
        sums=torch.empty(programs, dtype=torch.float32, device=w.device),
        counts=torch.empty(programs, dtype=torch.int32, device=w.device),
        config=config,
    )


def stream_bytes(w: torch.Tensor, x: torch.Tensor, s: Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """One streaming pass (one launch, no host sync): reads the first ``s.active`` experts of w and all of
    ``x``, writes zeros to all of ``s.y``. Returns (per-program sums, per-program element counts)."""
    if w.dtype != x.dtype or not x.is_contiguous() or x.shape[0] != s.y.shape[0] or w.shape[2] != x.shape[1]:
        raise ValueError(
            f"x: expected a contiguous [{s.y.shape[0]}, {w.shape[2]}] {w.dtype} tensor, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    grid = (s.sums.shape[0],)
    c = s.config
    w_elems = s.active * w.shape[1] * w.shape[2]
    if c.kind == "tma" and w_elems:
        slab = w.view(-1, COLS)
        desc = TensorDescriptor(slab, [w_elems // COLS, COLS], [COLS, 1], [c.block, COLS])
        _stream_tma_kernel[grid](
            desc,
            x,
            s.y,
            s.sums,
            s.counts,
            w_elems // COLS,
            x.numel(),
            s.y.numel(),
            BOX_ROWS=c.block,
            COLS_=COLS,
            BLOCK=4096,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
    else:
        _stream_flat_kernel[grid](
            w, x, s.y, s.sums, s.counts, w_elems, x.numel(), s.y.numel(), BLOCK=c.block, num_warps=c.num_warps
        )
    return s.sums, s.counts


def check_stream(
    out: tuple[torch.Tensor, torch.Tensor],
    w: torch.Tensor,
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    y: torch.Tensor,
) -> tuple[bool, float, str]:
    """(ok, relative error of the sum, why) of one pass's result, judged from the cell itself, not from the
    pass's own buffers: the element count read must equal as many experts' weights as have rows
    (``group_sizes`` > 0) plus x exactly, every element of the output ``y`` must be zero (poison it before
    the pass), and the sum of what was read must match a float64 sum of those elements (the first experts
    of w, see the module's doc)."""
    sums, counts = out
    active = int((group_sizes > 0).sum())
    want_count = active * w.shape[1] * w.shape[2] + x.numel()
    got_count = int(counts.long().sum())
    if got_count != want_count:
        return False, float("nan"), f"read {got_count} elements, expected {want_count}"
    if not bool((y == 0).all()):
        return False, float("nan"), "output not fully written"
    ref, scale = 0.0, 0.0
    for v in [w[e] for e in range(active)] + [x]:  # one float64 copy of each expert at a time
        v = v.double()
        ref, scale = ref + float(v.sum()), scale + float(v.abs().sum())
    got = float(sums.double().sum())
    rel = abs(got - ref) / max(scale, 1e-30)
    ok = rel <= 1e-5 and got == got
    why = "ok: every byte read once, every output element written" if ok else f"sum off by {rel:.2e}"
    return ok, rel, why
