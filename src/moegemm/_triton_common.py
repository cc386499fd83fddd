"""Small pieces shared by every Triton kernel: the tile product, dtype/precision plumbing, and the launch
of a compiled kernel without Triton's per-call binding."""

from __future__ import annotations

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
def k_loop(a_ptrs, b_ptrs, k_start, k_end, stride_ak, stride_bk,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
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
        raise TypeError(f"{name}: unsupported dtype {str(t.dtype).replace('torch.', '')}; expected one of {names}")


def _raw_stream_fn():
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return fn if fn is not None else (lambda idx: torch.cuda.current_stream(idx).cuda_stream)


raw_stream = _raw_stream_fn()  # raw_stream(device index) -> the current CUDA stream's handle


class BoundKernel:
    """A Triton kernel compiled for the arguments of one call, launched straight through its compiled
    launcher: no per-call argument binding, specialization or cache look-up, which on a Triton JIT launch
    cost about as much Python as the launch itself, more for a kernel of many arguments.

    ``slots`` names the arguments that change from call to call (tensors, descriptors); the rest stay as
    given here. A later call must match this one in everything Triton specializes on: the dtypes, the
    16-byte alignment of each pointer, the ints (their values here are kept), the constexprs. The caller's
    cache key guarantees it. GPU only (the interpreter has no compiled launcher)."""

    __slots__ = ("_run", "_function", "_packed", "_grid", "_args", "_slots")

    def __init__(self, kernel, grid: tuple, args: tuple, kwargs: dict, slots: tuple[str, ...]):
        compiled = kernel.warmup(*args, grid=grid, **kwargs)  # compiles (or takes Triton's cache); no launch
        if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
            compiled = compiled.result()
        compiled._init_handles()
        names = list(kernel.arg_names)
        full = list(args)
        for i in range(len(args), len(names)):
            if names[i] in kwargs:
                full.append(kwargs[names[i]])
            else:
                default = kernel.params[i].default
                if default is inspect.Parameter.empty:
                    raise TypeError(f"{kernel.fn.__name__}: argument {names[i]} not given")
                full.append(default)
        self._run, self._function, self._packed = compiled.run, compiled.function, compiled.packed_metadata
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._slots = tuple(names.index(s) for s in slots)
        for i in self._slots:
            full[i] = None  # holds no tensor of the call it was made from
        self._args = full

    def __call__(self, stream: int, *values) -> None:
        """Launch on ``stream`` (a raw handle) with ``values`` in the slots' order."""
        self._launch(self._grid, stream, values)

    def on_grid(self, grid: tuple, stream: int, values: tuple) -> None:
        """Launch on ``grid`` (1-3 dimensions) with ``values`` in the slots' order."""
        self._launch(tuple(grid) + (1,) * (3 - len(grid)), stream, values)

    def _launch(self, g: tuple, stream: int, values) -> None:
        args = self._args.copy()
        for i, v in zip(self._slots, values):
            args[i] = v
        self._run(g[0], g[1], g[2], stream, self._function, self._packed, None, None, None, *args)


def _specialization(v) -> object:
    """What Triton specializes a kernel on for one runtime argument, or finer: a tensor's dtype and whether
    its data is 16-byte aligned; an int's width and whether it is 1 or divisible by 16."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return (bool, v)
    if isinstance(v, int):
        return (v == 1, v % 16 == 0, -2**31 <= v < 2**31, 0 <= v < 2**64)
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
        bound = BoundKernel(kernel, grid, args, kwargs, tuple(kernel.arg_names[:len(args)]))
        _BOUND[key] = bound
    bound.on_grid(grid, raw_stream(device), args)
