"""Small pieces shared by every Triton kernel: the tile product, dtype/precision plumbing, and the launch
of a compiled kernel without Triton's per-call binding."""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from ._runtime import INTERPRET

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc += a @ b with fp32 accumulation.

    UPCAST is the one interpreter-only workaround in this project: Triton's CPU interpreter computes
    ``tl.dot`` on bf16/fp16 operands by reinterpreting their bits (garbage results), so under the
    interpreter we cast the tiles to fp32 first, which is exact (every 16-bit value is an fp32 value and
    the products are accumulated in fp32 either way). It is never set on a GPU, where the native 16-bit
    tensor-core path runs and is exercised by ``pytest -m gpu``.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def k_loop(
    a_ptrs,
    b_ptrs,
    k_start,
    k_end,
    stride_ak,
    stride_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """fp32 sum over k in [k_start, k_end) of A-tile x B-tile, the pointers at k_start. EVEN_K: the range
    is a whole number of BLOCK_K steps (no K masks)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k + offs_k) < k_end
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = mma(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


def dot_meta(dtype: torch.dtype, allow_tf32: bool) -> dict:
    """Constexpr arguments for :func:`mma` given the operand dtype."""
    upcast = INTERPRET and dtype != torch.float32
    if dtype == torch.float32 or upcast:
        precision = "tf32" if (allow_tf32 and dtype == torch.float32) else "ieee"
    else:
        precision = "tf32"  # Triton's default; ignored for 16-bit operands
    return {"PRECISION": precision, "UPCAST": upcast}


def check_dtype(name: str, t: torch.Tensor, allowed=SUPPORTED_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        got = str(t.dtype).replace("torch.", "")
        raise TypeError(f"{name}: unsupported dtype {got}; expected one of {names}")


def _raw_stream_fn():
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return fn if fn is not None else (lambda idx: torch.cuda.current_stream(idx).cuda_stream)


raw_stream = _raw_stream_fn()  # raw_stream(device index) -> the current CUDA stream's handle


class BoundKernel:
    """A Triton kernel compiled for the arguments of one call, launched straight through its compiled
    launcher: no per-call argument binding, specialization or cache look-up, which on a Triton JIT launch
    cost about as much Python as the launch itself, more for a kernel of many arguments.

    ``slots``: how many leading arguments change from call to call (tensors, descriptors, pointers); the
    rest stay as given here. A later call must match this one in everything Triton specializes on: the
    dtypes, the 16-byte alignment of each pointer, the ints (their values here are kept), the constexprs.
    The caller's cache key guarantees it. GPU only (the interpreter has no compiled launcher).

    ``compiled``: the kernel already compiled for these arguments (e.g. with launch options of its own);
    by default it is compiled here. The launcher's calling convention is feature-detected (see
    :func:`_direct_launcher`): where this Triton's differs from the one known here, the launch goes
    through the compiled kernel's own ``compiled[grid](...)``, still without the JIT's binding."""

    __slots__ = ("_run", "_function", "_packed", "_compiled", "_grid", "_tail", "_slots")

    def __init__(self, kernel, grid: tuple, args: tuple, kwargs: dict, slots: int, compiled=None):
        if not 0 <= slots <= len(args):
            raise ValueError(f"slots: expected 0..{len(args)} leading positional arguments, got {slots}")
        if compiled is None:
            compiled = compile_only(kernel, grid, args, kwargs)
        params = list(inspect.signature(kernel.fn).parameters.values())
        full = list(args)
        for p in params[len(args) :]:
            if p.name in kwargs:
                full.append(kwargs[p.name])
            elif p.default is not inspect.Parameter.empty:
                full.append(p.default)
            else:
                raise TypeError(f"{kernel.fn.__name__}: argument {p.name} not given")
        self._compiled = compiled
        self._run, self._function, self._packed = _direct_launcher(compiled)
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._slots = slots
        self._tail = tuple(full[slots:])  # holds no tensor of the call it was made from

    def __call__(self, stream: int, *values) -> None:
        """Launch on ``stream`` (a raw handle) with ``values`` for the leading arguments."""
        if self._run is not None:
            g = self._grid
            self._run(
                g[0], g[1], g[2], stream, self._function, self._packed, None, None, None, *values, *self._tail
            )
        else:
            self._compiled[self._grid](*values, *self._tail, stream=stream)

    def on_grid(self, grid: tuple, stream: int, values: tuple) -> None:
        """Launch on ``grid`` (1-3 dimensions) with ``values`` for the leading arguments."""
        g = tuple(grid) + (1,) * (3 - len(grid))
        if self._run is not None:
            self._run(
                g[0], g[1], g[2], stream, self._function, self._packed, None, None, None, *values, *self._tail
            )
        else:
            self._compiled[g](*values, *self._tail, stream=stream)


# The compiled launcher's leading parameters, in the order Triton 3.x calls it (CompiledKernel.__getitem__):
# the grid, the stream and the loaded function, then the packed metadata, the launch metadata and the two
# launch hooks (named in some versions, taken by *args in others), then the kernel's arguments (all of them,
# constexprs included, which it skips).
_LAUNCHER_HEAD = ("gridX", "gridY", "gridZ", "stream", "function")
_LAUNCHER_NAMED = ("kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook")


def _direct_launcher(compiled) -> tuple:
    """(launcher, function, packed metadata) of a compiled kernel where its launcher takes the calling
    convention above, else (None, None, None): the caller then launches through ``compiled[grid]``."""
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        params = list(inspect.signature(run).parameters.values())
    except (AttributeError, TypeError, ValueError):
        return None, None, None
    head = len(_LAUNCHER_HEAD)
    if [p.name for p in params[:head]] != list(_LAUNCHER_HEAD):
        return None, None, None
    rest = params[head:]
    if rest and rest[0].kind is inspect.Parameter.VAR_POSITIONAL:  # everything after the function as *args
        return run, function, packed
    named = [p.name for p in rest[: len(_LAUNCHER_NAMED)]]
    if (
        named == list(_LAUNCHER_NAMED)
        and len(rest) > len(named)
        and rest[len(named)].kind is inspect.Parameter.VAR_POSITIONAL
    ):
        return run, function, packed
    return None, None, None


def compile_only(kernel, grid: tuple, args: tuple, kwargs: dict):
    """``kernel`` compiled for these arguments (or taken from Triton's cache) and loaded, not launched."""
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    compiled._init_handles()  # loads it; sets n_regs
    return compiled


# The occupancy model shared by every kernel family. Registers are allocated per warp in units of 256
# (CUDA's allocation granularity on sm_70 through sm_90), so a kernel of 255 registers per thread takes
# 8192 per warp, not 8160: counting unrounded registers would overstate how many programs fit. Each
# resident program also holds 1 KiB of shared memory the system reserves.
REG_UNIT = 256
SMEM_RESERVED = 1024


def programs_per_sm(
    shared_bytes: int,
    regs_per_thread: int,
    num_warps: int,
    *,
    smem_per_sm: int,
    regs_per_sm: int = 65536,
    threads_per_sm: int = 2048,
    blocks_per_sm: int = 32,
) -> int:
    """Programs of a compiled kernel that one multiprocessor holds at once (0 if none fits), by its
    registers, threads and shared memory, at most ``blocks_per_sm`` (the hardware's resident blocks)."""
    per_warp = -(-max(regs_per_thread, 1) * 32 // REG_UNIT) * REG_UNIT
    by_regs = regs_per_sm // (per_warp * num_warps)
    by_threads = threads_per_sm // (32 * num_warps)
    by_smem = smem_per_sm // (shared_bytes + SMEM_RESERVED)
    return max(0, min(by_regs, by_threads, by_smem, blocks_per_sm))


@functools.lru_cache(maxsize=None)
def sm_resources(device_index: int) -> dict:
    """The multiprocessor's registers, threads and shared memory and the SM count of a GPU (Hopper's
    values where this torch lacks a property)."""
    p = torch.cuda.get_device_properties(device_index)
    return {
        "regs_per_sm": int(getattr(p, "regs_per_multiprocessor", 65536)),
        "threads_per_sm": int(getattr(p, "max_threads_per_multi_processor", 2048)),
        "smem_per_sm": int(getattr(p, "shared_memory_per_multiprocessor", 228 * 1024)),
        "sms": p.multi_processor_count,
    }


def compiled_per_sm(compiled, num_warps: int, device_index: int) -> int:
    """:func:`programs_per_sm` of a compiled, loaded kernel (Triton's metadata) on this GPU."""
    res = sm_resources(device_index)
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    regs = int(getattr(compiled, "n_regs", 0) or 0)
    return programs_per_sm(
        shared,
        regs,
        num_warps,
        smem_per_sm=res["smem_per_sm"],
        regs_per_sm=res["regs_per_sm"],
        threads_per_sm=res["threads_per_sm"],
    )


def _specialization(v) -> object:
    """What Triton specializes a kernel on for one runtime argument, or finer: a tensor's dtype and whether
    its data is 16-byte aligned; an int's width and whether it is 1 or divisible by 16."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return (bool, v)
    if isinstance(v, int):
        return (v == 1, v % 16 == 0, -(2**31) <= v < 2**31, 0 <= v < 2**64)
    return (type(v), v)


_BOUND: dict = {}


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``. On a GPU through a BoundKernel per (kernel, specialization of
    ``args``, ``kwargs``): the first call of each compiles and binds, the rest launch directly. ``kwargs``
    hold the constexprs and launch options only (every runtime argument positional)."""
    if INTERPRET:  # callers launch only where Triton runs: on a GPU, or anywhere under the interpreter
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()  # where Triton's own launch runs a kernel
    key = (kernel, device, tuple(_specialization(a) for a in args), tuple(kwargs.items()))
    bound = _BOUND.get(key)
    if bound is None:
        bound = BoundKernel(kernel, grid, args, kwargs, len(args))
        _BOUND[key] = bound
    bound.on_grid(grid, raw_stream(device), args)
