"""The clustered Decompose-K (a probe, not part of the library): configs, the heuristic, plans and the launch
of the Gluon kernel in :mod:`probes.cluster_dk_kernel` (whose docstring describes the kernel). Where it
cannot serve a call, :func:`matmul` runs the library's :func:`moegemm.decompose_k.matmul`."""

from __future__ import annotations

import dataclasses
import math

import torch
import triton

from moegemm.epilogue import Epilogue
from probes import cluster_dk_kernel as K
from probes.cluster_dk_kernel import (  # noqa: F401 - the kernel's limits and checks, re-exported
    MAX_CLUSTER,
    SMEM_BUDGET,
    _gluon_api_ok,
    cluster_supported,
    unsupported_reason,
)

# ------------------------------------------------------------------------------------------------------------
# Configs and the launch
# ------------------------------------------------------------------------------------------------------------

_GL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """split_k: S, the CTAs of a cluster (1, 2, 4, 8 or 16); block_m/block_n: the output tile (block_n 8:
    twice the tiles of 16, so twice the CTAs on a tiny output); block_k: the
    K step of one MMA (one TMA box; 16-bit: 64, fp32: 32 give 128-byte rows); num_warps; stages: ring slots
    (0: as many as the shared-memory budget allows, at most one per K step); chains: independent
    accumulators (1, 2 or 4), whose MMAs interleave: K step i adds into chain i % chains."""

    split_k: int
    block_m: int = 16
    block_n: int = 32
    block_k: int = 64
    num_warps: int = 4
    stages: int = 0
    chains: int = 1

    def __post_init__(self) -> None:
        if self.split_k not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"config.split_k: expected 1, 2, 4, 8 or 16 (CTAs of a cluster), got {self.split_k!r}"
            )
        for name, lo, hi in (
            ("block_m", 16, 128),
            ("block_n", 8, 128),
            ("block_k", 16, 128),
            ("num_warps", 1, 8),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo or v > hi or v & (v - 1):
                raise ValueError(f"config.{name}: expected a power of two in [{lo}, {hi}], got {v!r}")
        if not isinstance(self.stages, int) or self.stages < 0:
            raise ValueError(f"config.stages: expected an int >= 0, got {self.stages!r}")
        if self.chains not in (1, 2, 4):
            raise ValueError(f"config.chains: expected 1, 2 or 4, got {self.chains!r}")

    @classmethod
    def coerce(cls, config) -> ClusterConfig:
        """``config`` itself, or the config a dict of its fields makes (split_k required, no other keys)."""
        if isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"config: expected ClusterConfig or dict, got {type(config).__name__}")
        unknown = set(config) - {f.name for f in dataclasses.fields(cls)}
        if unknown or "split_k" not in config:
            why = f"unknown keys {sorted(unknown)}" if unknown else "missing key 'split_k'"
            raise ValueError(f"config: {why}")
        return cls(**config)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


SMEM_PER_SM = 227 * 1024
GPC_SMS = 18  # SMs of a Hopper GPC at most: a cluster's CTAs share one GPC


def _estimate(m: int, n: int, k: int, esize: int, sm_count: int, cfg: ClusterConfig) -> float:
    """A relative time of the config: waves of clusters x K steps per CTA x the cost of one step.

    A CTA's K loop is bound by latency (a wait, the shared-memory loads and a chain of dependent MMAs per
    step), not by the bytes a step moves, so a step costs about one unit plus a share for its bytes; CTAs
    that share an SM overlap their latencies, so a wave is as many clusters as the GPU holds at once (by
    shared memory: all of a CTA's steps in flight where they fit; a 16-CTA cluster needs 16 SMs of one GPC,
    so only one fits in a GPC)."""
    steps = k_per_split(k, cfg) // cfg.block_k
    stage = _stage_bytes(cfg, esize)
    smem = stages_for(k, cfg, esize) * stage + exchange_bytes(cfg) + 1024
    per_sm = max(1, min(8, SMEM_PER_SM // smem))
    gpcs = max(1, sm_count // GPC_SMS)
    held = gpcs * (GPC_SMS * per_sm // cfg.split_k) if cfg.split_k > 1 else sm_count * per_sm
    clusters = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    waves = _cdiv(clusters, max(1, held))
    return waves * steps * (1.0 + stage / 8192)


def heuristic_config(m: int, n: int, k: int, dtype: torch.dtype, sm_count: int = 132) -> ClusterConfig:
    """The config with the least :func:`_estimate` among S = 16 or 8 (fewer where a split would be under
    two K steps) and tiles of 16, 32 or 64 rows and columns (8 columns where N <= 16), no larger than M and N
    need; ties go to the config that reads the fewest bytes (larger tiles re-read less of A and B). Four
    accumulator chains (two on tiles over 32 x 32), every K step in flight where shared memory holds them,
    2 warps on tiles under 32 x 32, else 4."""
    esize = torch.empty((), dtype=dtype).element_size()
    bk = 32 if dtype == torch.float32 else 64
    best = None
    for s in (16, 8, 4, 2, 1):
        if s > 1 and k < 2 * s * bk:
            continue
        for bm in (16, 32, 64):
            for bn in (8, 16, 32, 64):
                if (bm > 16 and bm // 2 >= m) or (bn > 16 and bn // 2 >= n) or (bn == 8 and n > 16):
                    continue
                cfg = ClusterConfig(
                    split_k=s,
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    num_warps=2 if bm * bn < 32 * 32 else 4,
                    chains=4 if bm * bn <= 32 * 32 else 2,
                )
                reads = _cdiv(m, bm) * _cdiv(n, bn) * (bm + bn)
                score = (_estimate(m, n, k, esize, sm_count, cfg), reads)
                if best is None or score < best[0]:
                    best = (score, cfg)
        if best is not None and s <= 8:
            break
    return best[1]


def _warps(cfg: ClusterConfig) -> tuple[int, int]:
    """(warps along M, along N) for the MMA layout: M first (16 rows per warp), the rest along N (8 columns
    per warp at least: the warps along N halved while they would cover more columns than the tile has)."""
    wm = min(cfg.num_warps, cfg.block_m // 16)
    wn = cfg.num_warps // wm
    while wn > 1 and wn * 8 > cfg.block_n:
        wn //= 2
    return wm, wn


def _slice(cfg: ClusterConfig) -> int:
    return _cdiv(cfg.block_m * cfg.block_n, cfg.split_k)


def exchange_bytes(cfg: ClusterConfig) -> int:
    return cfg.split_k * _slice(cfg) * 4 if cfg.split_k > 1 else 0


def k_per_split(k: int, cfg: ClusterConfig) -> int:
    """K per CTA: a whole number of BLOCK_K steps (the last split may be shorter, or empty: boxes past K read
    zeros)."""
    return _cdiv(_cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


def _stage_bytes(cfg: ClusterConfig, esize: int) -> int:
    return (cfg.block_m + cfg.block_n) * cfg.block_k * esize


def stages_for(k: int, cfg: ClusterConfig, esize: int) -> int:
    """Ring slots: one per K step where they fit (every copy issued before the first MMA), else a multiple
    of ``chains`` (a group of chains steps refills its own slots)."""
    steps = k_per_split(k, cfg) // cfg.block_k
    if cfg.stages:
        want = cfg.stages
    else:
        want = (SMEM_BUDGET - exchange_bytes(cfg)) // _stage_bytes(cfg, esize)
    if want >= steps:
        return max(1, steps)
    return max(cfg.chains, want // cfg.chains * cfg.chains)


def _cga(s: int, rank: int) -> list:
    """Every CTA holds the whole tensor (its own values): log2(S) zero bases."""
    return [[0] * rank for _ in range(int(math.log2(s)))]


def _layouts(dtype, cfg: ClusterConfig, b_kn: bool):
    g = getattr(K.gl, _GL[dtype])
    la = K.gl.NVMMASharedLayout.get_default_for(
        [cfg.block_m, cfg.block_k], g, cga_layout=_cga(cfg.split_k, 2)
    )
    box_b = [cfg.block_k, cfg.block_n] if b_kn else [cfg.block_n, cfg.block_k]
    lb = K.gl.NVMMASharedLayout.get_default_for(box_b, g, cga_layout=_cga(cfg.split_k, 2))
    return la, lb, [cfg.block_m, cfg.block_k], box_b


def constexprs(
    n: int,
    k: int,
    dtype: torch.dtype,
    cfg: ClusterConfig,
    b_kn: bool,
    epilogue: Epilogue,
    has_bias: bool,
    allow_tf32: bool,
) -> dict:
    esize = torch.empty((), dtype=dtype).element_size()
    fma = dtype == torch.float32 and not allow_tf32
    wm, wn = _warps(cfg)
    sl = _slice(cfg)
    return {
        "N": n,
        "KPS": k_per_split(k, cfg),
        "S": cfg.split_k,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "STAGES": stages_for(k, cfg, esize),
        "CHAINS": cfg.chains,
        "B_KN": b_kn,
        "FMA": fma,
        "KW": 0 if fma else (1 if dtype == torch.float32 else 2),
        "PRECISION": "ieee" if fma else "tf32",
        "WARPS_M": wm,
        "WARPS_N": wn,
        "SL": sl,
        "SLP": max(32, _pow2(sl)),
        "HAS_BIAS": has_bias,
        "EPILOGUE": int(epilogue),
    }


def compile_sm90(
    dtype: torch.dtype,
    n: int,
    k: int,
    cfg: ClusterConfig,
    *,
    b_kn: bool = True,
    epilogue: Epilogue = Epilogue.NONE,
    has_bias: bool = False,
    allow_tf32: bool = False,
):
    """The kernel compiled for sm_90a with the installed Triton, no GPU needed (raises where it does not
    compile); returns Triton's compiled kernel (``.asm["ptx"]``, ``.metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    c = constexprs(n, k, dtype, cfg, b_kn, epilogue, has_bias, allow_tf32)
    la, lb, box_a, box_b = _layouts(dtype, cfg, b_kn)
    t = _SIG[dtype]
    sig = {
        "a_desc": f"tensordesc<{t}[{box_a[0]},{box_a[1]}],{la!r}>",
        "b_desc": f"tensordesc<{t}[{box_b[0]},{box_b[1]}],{lb!r}>",
        "c_ptr": f"*{t}",
        "bias_ptr": f"*{t}",
        "M": "i32",
        "stride_cm": "i32",
        "stride_cn": "i32",
    }
    sig.update({name: "constexpr" for name in c})
    return triton.compile(
        GluonASTSource(fn=K._cluster_dk_kernel, signature=sig, constexprs=c),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": c["WARPS_M"] * c["WARPS_N"], "num_ctas": cfg.split_k},
    )


def _tma_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[list, list, bool] | None:
    """(a's [shape, strides], b's [shape, strides] as TMA reads it, b_kn) or None where TMA cannot read the
    operands: a must be K-contiguous, b K- or N-contiguous, bases and row strides 16-byte aligned. A single
    row (or column) has no row stride to align: any aligned value serves, as TMA never steps past it."""
    esize = a.element_size()
    align = 16 // esize
    m, k = a.shape
    n = b.shape[1]
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return None
    if a.stride(1) != 1 and k > 1:
        return None
    sa = a.stride(0) if m > 1 else _cdiv(k, align) * align
    if sa % align:
        return None
    a_io = [[m, k], [sa, 1]]
    if b.stride(1) == 1 or n == 1:  # [K, N], N contiguous: boxes [BLOCK_K, BLOCK_N]
        sb = b.stride(0) if k > 1 else _cdiv(n, align) * align
        if sb % align == 0 and (b.stride(1) == 1 or n == 1):
            return a_io, [[k, n], [sb, 1]], True
    if b.stride(0) == 1 or k == 1:  # b = w.t() with w [N, K] row-major: boxes [BLOCK_N, BLOCK_K] of w
        sw = b.stride(1) if n > 1 else _cdiv(k, align) * align
        if sw % align == 0:
            return a_io, [[n, k], [sw, 1]], False
    return None


@dataclasses.dataclass(eq=False)
class ClusterPlan:
    """One (shapes, strides, dtypes, alignment, epilogue, config) compiled and bound:
    ``run(a, b, bias, out)``."""

    config: ClusterConfig
    epilogue: Epilogue
    dtype: torch.dtype
    device: torch.device
    m: int
    n: int
    k: int
    b_kn: bool
    a_geom: list
    b_geom: list
    boxes: tuple
    layouts: tuple
    grid: int
    shared: int  # dynamic shared memory per CTA: Triton's + the exchange area
    max_clusters: int  # clusters of this kernel the GPU holds at once (0: it cannot launch)
    _run: object = None
    _function: object = None
    _packed: tuple = ()
    _tail: tuple = ()

    def descriptors(self, a: torch.Tensor, b: torch.Tensor):
        bt = b if self.b_kn else b.t()
        return (
            K.TensorDescriptor(a, self.a_geom[0], self.a_geom[1], list(self.boxes[0]), self.layouts[0]),
            K.TensorDescriptor(bt, self.b_geom[0], self.b_geom[1], list(self.boxes[1]), self.layouts[1]),
        )

    def run(self, a: torch.Tensor, b: torch.Tensor, bias=None, out=None) -> torch.Tensor:
        """The plan's launch; bias and out (optional tensors) as in the library's plans."""
        if out is None:
            out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        from moegemm._triton_common import raw_stream

        da, db = self.descriptors(a, b)
        self._run(
            self.grid,
            1,
            1,
            raw_stream(self.device.index),
            self._function,
            self._packed,
            None,
            None,
            None,
            da,
            db,
            out,
            out if bias is None else bias,
            self.m,
            out.stride(0),
            out.stride(1),
            *self._tail,
        )
        return out


_PLANS: dict = {}
FALLBACK_REASONS: dict = {}  # (m, n, k, config) -> why a compiled kernel could not be launched here


def _key(a, b, bias, out, epilogue, config, allow_tf32):
    def geom(t):
        return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)

    return (geom(a), geom(b), geom(bias), geom(out), epilogue, config, allow_tf32)


def make_plan(
    a, b, *, epilogue: Epilogue = Epilogue.NONE, bias=None, out=None, config=None, allow_tf32: bool = False
) -> ClusterPlan | None:
    """The clustered kernel compiled for these operands (validated by the caller), or None where it cannot
    serve them here (see :func:`unsupported_reason`, :func:`_tma_operands`), or the GPU cannot hold one
    cluster of it."""
    if (
        a.device.type != "cuda"
        or unsupported_reason(a.device.index if a.device.index is not None else torch.cuda.current_device())
        is not None
    ):
        return None
    geo = _tma_operands(a, b)
    if geo is None or (bias is not None and bias.stride(0) != 1 and bias.shape[0] > 1):
        return None
    from moegemm._runtime import device_sm_count

    m, k = a.shape
    n = b.shape[1]
    cfg = (
        ClusterConfig.coerce(config)
        if config is not None
        else heuristic_config(m, n, k, a.dtype, device_sm_count(a))
    )
    p, compiled = compile_for(a, b, geo, epilogue, bias, out, cfg, allow_tf32)
    compiled._init_handles()
    p.shared = _cdiv(int(compiled.metadata.shared), 16) * 16 + exchange_bytes(cfg)
    from triton.runtime import driver

    # sets the kernel's dynamic shared memory limit to what the launch asks (and allows 16-CTA clusters)
    try:
        p.max_clusters = int(
            driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, p.shared, cfg.split_k)
        )
    except RuntimeError as e:  # e.g. more shared memory than a block may have
        FALLBACK_REASONS[(m, n, k, cfg)] = f"occupancy query: {e}"
        return None
    if p.max_clusters < 1:
        FALLBACK_REASONS[(m, n, k, cfg)] = f"no cluster of {cfg.split_k} CTAs with {p.shared} B fits"
        return None
    p._run, p._function = compiled.run, compiled.function
    p._packed = (compiled.metadata.num_warps, compiled.metadata.num_ctas, p.shared)
    names = list(K._cluster_dk_kernel.arg_names)
    c = constexprs(n, k, a.dtype, cfg, p.b_kn, epilogue, bias is not None, allow_tf32)
    p._tail = tuple(c[nm] for nm in names[names.index("stride_cn") + 1 :])
    return p


def compile_for(a, b, geo, epilogue, bias, out, cfg: ClusterConfig, allow_tf32: bool):
    """(the plan without its launch handles, the kernel compiled through Triton's launcher for exactly these
    arguments) - what a launch would compile; no launch."""
    a_io, b_io, b_kn = geo
    m, k = a.shape
    n = b.shape[1]
    c = constexprs(n, k, a.dtype, cfg, b_kn, epilogue, bias is not None, allow_tf32)
    la, lb, box_a, box_b = _layouts(a.dtype, cfg, b_kn)
    grid = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    p = ClusterPlan(
        config=cfg,
        epilogue=epilogue,
        m=m,
        n=n,
        k=k,
        dtype=a.dtype,
        device=a.device,
        b_kn=b_kn,
        a_geom=a_io,
        b_geom=b_io,
        boxes=(tuple(box_a), tuple(box_b)),
        layouts=(la, lb),
        grid=grid,
        shared=0,
        max_clusters=0,
    )
    probe = out if out is not None else torch.empty((m, n), dtype=a.dtype, device=a.device)
    da, db = p.descriptors(a, b)
    compiled = K._cluster_dk_kernel.warmup(
        da,
        db,
        probe,
        bias if bias is not None else probe,
        m,
        probe.stride(0),
        probe.stride(1),
        grid=(grid,),
        num_warps=c["WARPS_M"] * c["WARPS_N"],
        num_ctas=cfg.split_k,
        **c,
    )
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    return p, compiled


def plan(a, b, *, epilogue="none", bias=None, out=None, config=None, allow_tf32=False) -> ClusterPlan | None:
    """The cached clustered plan for these operands, or None where :func:`matmul` would fall back."""
    from moegemm.decompose_k.checks import check_operands as _validate

    epi = Epilogue.parse(epilogue)
    _validate(a, b, bias, out, None)
    if isinstance(config, dict):
        config = ClusterConfig.coerce(config)
    elif config is not None and not isinstance(config, ClusterConfig):
        raise TypeError(f"config: expected ClusterConfig or dict, got {type(config).__name__}")
    if config is not None and config.block_k * a.element_size() > 128:
        raise ValueError(
            f"config.block_k: a TMA box row holds at most 128 bytes (swizzled), so at most "
            f"{128 // a.element_size()} for {a.dtype}; got {config.block_k}"
        )
    key = _key(a, b, bias, out, epi, config, allow_tf32)
    if key in _PLANS:
        return _PLANS[key]
    m, k = a.shape
    n = b.shape[1]
    if config is not None and config.split_k > 1 and k < config.split_k:
        raise ValueError(f"config.split_k: expected 1 <= split_k <= K={k}, got {config.split_k}")
    p = None
    if m > 0 and n > 0 and k > 0:
        p = make_plan(a, b, epilogue=epi, bias=bias, out=out, config=config, allow_tf32=allow_tf32)
    _PLANS[key] = p
    return p


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: str | Epilogue = "none",
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: ClusterConfig | dict | None = None,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """``epilogue(a @ b + bias)`` by the clustered Decompose-K kernel (bitwise deterministic, CUDA-graph
    safe, no workspace). Same arguments and contract as :func:`moegemm.decompose_k.matmul`; where the
    clustered kernel cannot serve the call (see the module's docstring), that function serves it."""
    p = plan(a, b, epilogue=epilogue, bias=bias, out=out, config=config, allow_tf32=allow_tf32)
    if p is None:
        from moegemm.decompose_k.api import matmul as default_matmul

        return default_matmul(a, b, epilogue=epilogue, bias=bias, out=out, allow_tf32=allow_tf32)
    return p.run(a, b, bias, out)
