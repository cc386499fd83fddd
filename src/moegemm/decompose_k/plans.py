"""Decompose-K's plans: what one (shapes, strides, dtypes, devices, pointer alignment, epilogue, bias/out
presence, kernel, config) runs, made once and cached.

A plan holds the chosen backend and config, the compiled kernel's launch handle, the grid and, per stream,
the workspace and counters (shared with the other plans on that stream where that is safe:
``workspace.plan_state``). A repeat call computes its key, finds the plan and launches: no table
look-up, no device-name query, no validation beyond what the key already pins. :func:`plan` hands the plan
to callers who want no look-up at all."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import autotune
from .._runtime import INTERPRET
from .._triton_common import BoundKernel, raw_stream
from ..epilogue import Epilogue
from . import first_call, flat, single_launch, two_stage, workspace
from .checks import check_operands
from .configs import BACKENDS, DecomposeKConfig, Prepared, choose
from .precision import fp32_matmul_precision

_LAUNCHERS = {"two_stage": two_stage.launch, "flat": flat.launch, "single_launch": single_launch.launch}
# single_launch's leading arguments, the ones a plan's launch passes anew: a, b, workspace, c, bias, counters
_DYNAMIC = 6


@dataclasses.dataclass(eq=False)
class Plan:
    """Everything one (shape, dtype, strides, epilogue) needs to run: ``plan.run(a, b, bias, out)``.

    The operands given to :meth:`run` must match the ones the plan was made for in shape, dtype, device,
    strides and 16-byte alignment; :func:`matmul` guarantees that by keying its cache on them, a direct
    caller of :meth:`run` promises it (``plan.matches(a, b, bias, out)`` checks)."""

    backend: str  # "single_launch" | "two_stage" | "flat" | "cublas" | "empty" (K=0) | "empty_out" (M or N 0)
    config: DecomposeKConfig | None
    source: str  # "tuned" | "heuristic" | "generic" | "autotuned" | "autotuned on this call" | "explicit"
    epilogue: Epilogue
    m: int
    n: int
    k: int
    dtype: torch.dtype
    device: torch.device
    allow_tf32: bool
    key: tuple
    coop: bool = False
    final: bool = True  # False: an untimed choice a later call may replace (first_call), not cached
    _bound: BoundKernel | None = None  # the compiled single_launch kernel (on a GPU)
    _grid: tuple = (1, 1)
    _per_stream: dict = dataclasses.field(default_factory=dict)

    def matches(self, a, b, bias=None, out=None) -> bool:
        return _key(a, b, bias, out, *self.key[-6:]) == self.key

    def run(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.backend == "empty_out":  # M or N is 0: nothing to compute
            if out is not None:
                return out
            return torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        if self.backend == "cublas" and out is None:  # cuBLAS allocates its own output (cheaper than out=)
            if self.dtype is torch.float32:
                with fp32_matmul_precision(self.allow_tf32):
                    c = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
            else:
                c = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
            return self._activate(c)
        if out is None:
            out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        if self._bound is not None:
            stream = raw_stream(self.device.index)
            state = self._per_stream.get(stream)
            if state is None:
                state = self._stream_state(stream)
            ws, cnt = state
            self._bound(
                stream,
                a.data_ptr(),
                b.data_ptr(),
                ws,
                out.data_ptr(),
                out.data_ptr() if bias is None else bias.data_ptr(),
                cnt,
            )
            return out
        return self._run_generic(a, b, bias, out)

    # -- the slower forms: kept out of the fast path above --------------------------------------------------

    def _stream_state(self, stream: int):
        state = workspace.plan_state(self.m, self.n, self.config, self.device, stream, self.coop)
        self._per_stream[stream] = state
        return state

    def _run_generic(self, a, b, bias, out):
        if self.backend == "empty":
            return _empty_sum(out, bias, self.epilogue)
        if self.backend == "cublas":
            precision = (
                fp32_matmul_precision(self.allow_tf32)
                if self.dtype is torch.float32
                else contextlib.nullcontext()
            )
            with precision:
                if bias is None:
                    torch.mm(a, b, out=out)
                else:
                    torch.addmm(bias, a, b, out=out)
            return self._activate(out)
        p = Prepared(
            a=a,
            b=b,
            out=out,
            bias=bias.contiguous() if bias is not None else None,
            epilogue=self.epilogue,
            allow_tf32=self.allow_tf32,
        )
        return _LAUNCHERS[self.backend](p, self.config)

    def _activate(self, c: torch.Tensor) -> torch.Tensor:
        """The epilogue's activation in place, after cuBLAS."""
        if self.epilogue is Epilogue.RELU:
            c.relu_()
        elif self.epilogue is Epilogue.SIGMOID:
            c.sigmoid_()
        return c

    def _bind_fast(self, a, b, bias, out) -> None:
        """On a GPU, compile single_launch now and bind it, so that run() launches it directly: the six
        pointers change from call to call, M, the strides (fixed by the plan's key) and the constexprs
        do not."""
        if INTERPRET or self.backend != "single_launch" or self.device.type != "cuda":
            return
        if bias is not None and bias.stride(0) != 1:
            return  # the generic launch makes it contiguous first
        p = Prepared(a=a, b=b, out=out, bias=bias, epilogue=self.epilogue, allow_tf32=self.allow_tf32)
        self._grid = single_launch.grid(self.m, self.n, self.config)
        compiled, self.coop = single_launch.compile_for(p, self.config)
        kernel = single_launch._single_launch_kernel
        named = single_launch.kernel_args(p, self.config, None, None, self.coop)
        args = tuple(named[name] for name in kernel.arg_names)
        self._bound = BoundKernel(kernel, self._grid, args, {}, _DYNAMIC, compiled=compiled)


def _empty_sum(out, bias, epi):
    """K = 0: C = epilogue(0 + bias)."""
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    if bias is not None:
        acc = acc + bias.float()
    return out.copy_(epi.torch_apply(acc))


def _align(t) -> bool:
    return t.data_ptr() % 16 == 0


def _key(a, b, bias, out, kernel, split_k, epilogue, config, allow_tf32, _tag="dk"):
    return (
        a.shape,
        a.stride(),
        b.stride(),
        a.dtype,
        b.dtype,
        a.device,
        b.device,
        _align(a),
        _align(b),
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device, _align(bias)),
        None if out is None else (out.shape, out.stride(), out.dtype, out.device, _align(out)),
        b.shape,
        kernel,
        split_k,
        epilogue,
        config,
        allow_tf32,
        _tag,
    )


_PLANS: dict[tuple, Plan] = {}


def plan(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    kernel: str = "auto",
    split_k: int | None = None,
    epilogue: str | Epilogue = "none",
    bias: torch.Tensor | None = None,
    config: DecomposeKConfig | dict | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
) -> Plan:
    """The plan :func:`matmul` would run for these operands (made and cached on first use). Operands are
    used for their shapes, strides, dtypes and alignment only (and, on a GPU, to compile the kernel)."""
    return cached_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32)


def cached_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32) -> Plan:
    """The cache both :func:`plan` and :func:`matmul` read. Operands that cannot be keyed (not 2-D tensors)
    go straight to validation, which names what is wrong."""
    if isinstance(config, dict):
        config = DecomposeKConfig.coerce(config)
    key = (
        _key(a, b, bias, out, kernel, split_k, epilogue, config, allow_tf32)
        if isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dim() == 2
        and b.dim() == 2
        and _plain(bias)
        and _plain(out)
        else None
    )
    p = _PLANS.get(key) if key is not None else None
    if p is None:
        p = _make_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32, key)
        if key is not None and p.final:
            _PLANS[key] = p
    return p


def _make_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32, key) -> Plan:
    if not isinstance(kernel, str) or (kernel != "auto" and kernel not in BACKENDS):
        raise ValueError(f"kernel: unknown kernel {kernel!r}; expected 'auto' or one of {BACKENDS}")
    epi = Epilogue.parse(epilogue)
    check_operands(a, b, bias, out, split_k)
    if config is not None and not isinstance(config, DecomposeKConfig):
        config = DecomposeKConfig.coerce(config)
    m, k = a.shape
    n = b.shape[1]
    base = dict(epilogue=epi, m=m, n=n, k=k, dtype=a.dtype, device=a.device, allow_tf32=allow_tf32, key=key)
    if m == 0 or n == 0:
        return Plan(backend="empty_out", config=None, source="explicit", **base)
    if k == 0:
        return Plan(backend="empty", config=None, source="explicit", **base)
    name, cfg, source = choose(a, n, epi, kernel)
    final = True
    if source == "generic" and kernel == "auto" and config is None and split_k is None:
        got = first_call.choice(
            a,
            n,
            epi,
            bias is not None,
            allow_tf32,
            lambda nm, c: _candidate(a, b, nm, epi, bias, c, out, allow_tf32),
        )
        if got is None:  # not timed now (a capture, a trace, timing off): a later call may time it
            final = not autotune.enabled()
        else:
            name, cfg, source = got
    if config is not None:
        cfg, source = config, "explicit"
        if name == "cublas":  # an explicit config asks for one of our kernels
            name = "single_launch"
    if split_k is not None and name != "cublas" and split_k != cfg.split_k:
        cfg, source = DecomposeKConfig(**{**cfg.as_dict(), "split_k": split_k}), "explicit"
    if cfg is not None and cfg.split_k > k:
        raise ValueError(f"config.split_k: expected 1 <= split_k <= K={k}, got {cfg.split_k}")
    p = Plan(backend=name, config=cfg, source=source, final=final, **base)
    probe_out = out if out is not None else torch.empty((m, n), dtype=a.dtype, device=a.device)
    p._bind_fast(a, b, bias, probe_out)
    return p


def _candidate(a, b, name, epi, bias, cfg, out, allow_tf32):
    """A run of backend ``name`` at ``cfg`` on these operands (for first_call's timing), into ``out`` or a
    scratch output."""
    p = _make_plan(a, b, name, None, epi, bias, cfg, None, allow_tf32, None)
    dest = out if out is not None else torch.empty((p.m, p.n), dtype=a.dtype, device=a.device)
    return lambda: p.run(a, b, bias, dest)


def _plain(t) -> bool:
    return t is None or isinstance(t, torch.Tensor)
