"""``moegemm.decompose_k.matmul`` and its plans.

A call is served by a :class:`Plan`, made once per (shapes, strides, dtypes, devices, pointer alignment,
epilogue, bias/out presence, kernel, config) and cached: it holds the chosen backend and config, the
compiled kernel's launch handle, the grid and, per stream, the workspace and counters (shared with the other
plans on that stream where that is safe: ``single_launch.plan_state``). A repeat call
computes its key, finds the plan and launches: no table look-up, no device-name query, no validation
beyond what the key already pins. ``plan(...)`` hands the plan to callers who want no look-up at all.

Under ``torch.compile`` the call goes through the custom op ``moegemm::dk_matmul`` (registered below,
beside the cached plans it runs), so that ``torch.compile(fullgraph=True)`` traces a caller with no graph
break: its real implementation runs the same plans, its fake one gives the compiler the output's shape,
dtype and (contiguous) strides. Eager calls do not pass through the op: a plan costs less CPU time per
call than the dispatcher would, except where a gradient is recorded (``a``, ``b`` or ``bias`` requires
grad, grad mode on): then the op runs, whose registered autograd gives the router's gradients, eagerly and
compiled alike. Its backward: the epilogue's derivative from the saved output (ReLU: where it is positive;
sigmoid: ``c (1 - c)``), then ``dA = dZ B^T`` and ``dB = A^T dZ`` as cuBLAS GEMMs (neither is skinny in
K: their reduction runs over the router's N or the token count) and ``dbias`` the column sums.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import autotune
from .._runtime import INTERPRET, check_device, records_grad
from .._triton_common import BoundKernel, check_dtype, raw_stream
from ..epilogue import Epilogue
from . import first_call, flat, single_launch, two_stage
from .configs import BACKENDS, KERNELS, LEGACY, DecomposeKConfig, Prepared, choose

_LAUNCHERS = {"two_stage": two_stage.launch, "flat": flat.launch, "single_launch": single_launch.launch}
# single_launch's leading arguments, the ones a plan's launch passes anew: a, b, workspace, c, bias, counters
_DYNAMIC = 6


def _validate(a, b, bias, out, split_k):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
        check_dtype(name, t)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"b: dtype {b.dtype} differs from a's {a.dtype}")
    if b.device != a.device:
        raise ValueError(f"b: on {b.device}, but a is on {a.device}")
    check_device("a", a)
    m, k = a.shape
    n = b.shape[1]
    if split_k is not None:
        if isinstance(split_k, bool) or not isinstance(split_k, int):
            raise TypeError(f"split_k: expected an int, got {type(split_k).__name__}")
        if split_k < 1 or split_k > max(k, 1):
            raise ValueError(f"split_k: expected 1 <= split_k <= K={k}, got {split_k}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.dtype != a.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} differs from a's {a.dtype}")
        if bias.device != a.device:
            raise ValueError(f"bias: on {bias.device}, but a is on {a.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: expected shape ({m}, {n}), got {tuple(out.shape)}")
        if out.dtype != a.dtype:
            raise TypeError(f"out: dtype {out.dtype} differs from a's {a.dtype}")
        if out.device != a.device:
            raise ValueError(f"out: on {out.device}, but a is on {a.device}")


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
        state = single_launch.plan_state(self.m, self.n, self.config, self.device, stream, self.coop)
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


@contextlib.contextmanager
def fp32_matmul_precision(allow_tf32: bool):
    """cuBLAS's fp32 products within: TF32 where ``allow_tf32``, else IEEE, whatever the process-wide setting
    (``torch.backends.cuda.matmul.fp32_precision``, which ``torch.set_float32_matmul_precision`` and the
    legacy ``allow_tf32`` flag also set), put back after exactly as it was. A no-op where it already agrees.
    Process-wide while it lasts, as that setting is."""
    matmul = torch.backends.cuda.matmul
    want = "tf32" if allow_tf32 else "ieee"
    before = getattr(matmul, "fp32_precision", None)
    if before is None:  # a torch before the per-backend precision API: its one flag
        before = matmul.allow_tf32
        matmul.allow_tf32 = allow_tf32
        try:
            yield
        finally:
            matmul.allow_tf32 = before
        return
    agrees = before == want or (before == "none" and _legacy_tf32() == allow_tf32)
    if agrees:
        yield
        return
    matmul.fp32_precision = want
    try:
        yield
    finally:
        matmul.fp32_precision = before


def _legacy_tf32() -> bool | None:
    """The process-wide TF32 choice where no precision was set through the new API (None if unreadable)."""
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return None


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
    return _cached_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32)


def _cached_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32) -> Plan:
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
    _validate(a, b, bias, out, split_k)
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


def matmul(
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
) -> torch.Tensor:
    """``epilogue(a @ b + bias)`` by Decompose-K: S partial GEMMs over K chunks into fp32, then a reduction
    that applies the epilogue where the value first becomes final.

    a: [M, K], b: [K, N], any strides; bf16, fp16 or fp32 (both the same). Output: [M, N] in the input
    dtype (fp32 accumulation). K need not be divisible by S: the last split is shorter.

    kernel: "auto" (the tuned table for this GPU and shape, else the heuristic of
        :func:`moegemm.decompose_k.configs.heuristic_choice`; either may pick cuBLAS where it is faster, the
        epilogue then applied after it), "single_launch", "two_stage", "flat" or "cublas".
    split_k: S; overrides the config's (or the tuned/heuristic) split count.
    epilogue: "none" | "relu" | "sigmoid"; bias: optional [N] tensor added before the activation.
    config: explicit tiling (wins over the tuned table). out: optional [M, N] output of any strides.
    allow_tf32: fp32 inputs use IEEE-accurate products unless this is True.

    The default kernel is bitwise deterministic and safe in CUDA graphs (warm it up once outside capture).
    Under ``torch.compile`` this traces as the custom op ``moegemm::dk_matmul``.
    """
    if torch.compiler.is_compiling():
        return _traced_matmul(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32)
    if records_grad(a, b, bias):  # a gradient is recorded: the custom op, whose autograd is registered
        if out is not None:
            raise ValueError("out: not supported where a gradient is recorded (a, b or bias requires grad)")
        return _traced_matmul(a, b, kernel, split_k, epilogue, bias, config, None, allow_tf32)
    return _cached_plan(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32).run(a, b, bias, out)


def _plain(t) -> bool:
    return t is None or isinstance(t, torch.Tensor)


@torch.library.custom_op("moegemm::dk_matmul", mutates_args=())
def dk_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: str,
    split_k: int | None,
    epilogue: str,
    config: list[int] | None,
    allow_tf32: bool,
) -> torch.Tensor:
    cfg = DecomposeKConfig(*config) if config else None
    return _cached_plan(a, b, kernel, split_k, epilogue, bias, cfg, None, allow_tf32).run(a, b, bias, None)


@dk_matmul.register_fake
def _(a, b, bias, kernel, split_k, epilogue, config, allow_tf32):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "a, b: expected 2-D tensors")
    torch._check(a.shape[1] == b.shape[0], lambda: "b: inner dimensions differ")
    return a.new_empty((a.shape[0], b.shape[1]))


def _dk_setup_context(ctx, inputs, output):
    a, b, bias, _kernel, _split_k, epilogue, _config, allow_tf32 = inputs
    ctx.epilogue = Epilogue.parse(epilogue)
    ctx.has_bias = bias is not None
    ctx.allow_tf32 = allow_tf32
    keep = output if ctx.epilogue is not Epilogue.NONE else None  # the epilogue's derivative reads it
    ctx.save_for_backward(a, b, keep)


def _dk_backward(ctx, grad):
    """dZ = grad times the epilogue's derivative at the output; dA = dZ B^T, dB = A^T dZ, dbias = sum dZ."""
    a, b, c = ctx.saved_tensors
    if ctx.epilogue is Epilogue.RELU:
        dz = torch.where(c > 0, grad, torch.zeros_like(grad))
    elif ctx.epilogue is Epilogue.SIGMOID:
        cf = c.float()
        dz = (grad.float() * cf * (1.0 - cf)).to(grad.dtype)
    else:
        dz = grad
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    if dz.dtype is torch.float32:  # cuBLAS through the op: its precision holds eagerly and compiled alike
        da = dk_matmul(dz, b.t(), None, "cublas", None, "none", None, ctx.allow_tf32) if need_a else None
        db = dk_matmul(a.t(), dz, None, "cublas", None, "none", None, ctx.allow_tf32) if need_b else None
    else:
        da = dz @ b.t() if need_a else None
        db = a.t() @ dz if need_b else None
    dbias = dz.float().sum(0).to(dz.dtype) if ctx.has_bias and need_bias else None
    return da, db, dbias, None, None, None, None, None


dk_matmul.register_autograd(_dk_backward, setup_context=_dk_setup_context)


# Read here, not while tracing (Dynamo does not trace dataclasses.fields on a class).
_FIELDS = tuple(f.name for f in dataclasses.fields(DecomposeKConfig))
_DEFAULTS = tuple(
    None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(DecomposeKConfig)
)


def _traced_matmul(a, b, kernel, split_k, epilogue, bias, config, out, allow_tf32):
    """What :func:`matmul` does while being traced: the custom op, then a copy into ``out`` if one is
    given."""
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in LEGACY or v != LEGACY[k]}
        unknown = [key for key in config if key not in _FIELDS]
        if unknown or "split_k" not in config:
            raise ValueError(
                f"config: unknown keys {sorted(unknown)}" if unknown else "config: missing key 'split_k'"
            )
        fields = [config.get(name, default) for name, default in zip(_FIELDS, _DEFAULTS)]
    elif config is not None:
        fields = [getattr(config, name) for name in _FIELDS]
    else:
        fields = None
    epi = epilogue.name.lower() if isinstance(epilogue, Epilogue) else epilogue
    res = dk_matmul(a, b, bias, kernel, split_k, epi, fields, allow_tf32)
    if out is not None:
        out.copy_(res)
        return out
    return res


__all__ = ["matmul", "plan", "Plan", "KERNELS", "BACKENDS"]
