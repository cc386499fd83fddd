"""The multicast grouped GEMM on 2-CTA clusters (a probe, not part of the library): plans, the launch and
the entry points :func:`grouped_mm` and :func:`grouped_mm_swiglu` of the Gluon kernel in
:mod:`probes.cluster_grouped_kernel` (whose docstring describes the kernel). Where it cannot serve a call,
the library's :func:`moegemm.grouped.grouped_mm` (or ``grouped_mm_swiglu``) runs it."""

from __future__ import annotations

import dataclasses

import torch
import triton

from moegemm.epilogue import Epilogue
from moegemm.grouped.checks import check_offsets, check_w
from probes import cluster_grouped_kernel as K
from probes.cluster_dk_kernel import unsupported_reason
from probes.cluster_grouped_kernel import ClusterGroupedConfig, gluon


def cluster_supported(device: torch.device | int | None = None) -> bool:
    """True when the multicast kernel can run: the Gluon features (the Decompose-K cluster kernel's probe,
    which checks the same ones) and, given a device, a Hopper GPU."""
    if isinstance(device, torch.device):
        device = (
            None
            if device.type != "cuda"
            else (device.index if device.index is not None else torch.cuda.current_device())
        )
    return gluon is not None and unsupported_reason(device) is None


_GL = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _layouts(dtype: torch.dtype, cfg: ClusterGroupedConfig, w_kn: bool):
    g = getattr(K.gl, _GL[dtype])
    box_a = [2 * cfg.block_m, cfg.block_k]
    box_w = [cfg.block_k, cfg.block_n] if w_kn else [cfg.block_n, cfg.block_k]
    la = K.gl.NVMMASharedLayout.get_default_for(box_a, g, cga_layout=[[1, 0]])
    lw = K.gl.NVMMASharedLayout.get_default_for(box_w, g, cga_layout=[[0, 0]])
    return la, lw, box_a, box_w


def constexprs(
    num_experts: int,
    cfg: ClusterGroupedConfig,
    w_kn: bool,
    epilogue: Epilogue,
    has_scale: bool,
    swiglu: bool = False,
) -> dict:
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "E_BLOCK": triton.next_power_of_2(max(num_experts + 1, 2)),
        "GROUP_M": cfg.group_m,
        "STAGES": cfg.stages,
        "W_KN": w_kn,
        "HAS_SCALE": has_scale,
        "EPILOGUE": int(epilogue),
        "SWIGLU": swiglu,
        "SCOPE_CTA": cfg.scope == "cta",
        "LAG": cfg.lag,
        "WS": cfg.ws,
        "PRODUCER_REGS": PRODUCER_REGS,
    }


# the warp-specialized form's producer warp group: its registers (setmaxnreg); the warps that multiply get
# the rest
PRODUCER_REGS = 40


def compile_sm90(
    dtype: torch.dtype,
    num_experts: int,
    cfg: ClusterGroupedConfig,
    *,
    w_kn: bool = False,
    epilogue: Epilogue = Epilogue.NONE,
    has_scale: bool = False,
    swiglu: bool = False,
):
    """The kernel compiled for sm_90a with the installed Triton, no GPU needed; returns Triton's compiled
    kernel (``.asm["ptx"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    la, lw, box_a, box_w = _layouts(dtype, cfg, w_kn)
    t = _SIG[dtype]
    sig = {
        "a_desc": f"tensordesc<{t}[{box_a[0]},{box_a[1]}],{la!r}>",
        "w_desc": f"tensordesc<{t}[{box_w[0]},{box_w[1]}],{lw!r}>",
        "y_ptr": f"*{t}",
        "offsets_ptr": "*i32",
        "scale_ptr": f"*{t}",
        "E": "i32",
        "N": "i32",
        "K": "i32",
        "stride_ym": "i32",
    }
    c = constexprs(num_experts, cfg, w_kn, epilogue, has_scale, swiglu)
    sig.update({name: "constexpr" for name in c})
    return triton.compile(
        GluonASTSource(fn=K._grouped_cluster_kernel, signature=sig, constexprs=c),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": cfg.num_warps, "num_ctas": 2},
    )


def _eligible(
    x: torch.Tensor, w: torch.Tensor, w_layout: str, out: torch.Tensor, row_scale, cfg: ClusterGroupedConfig
) -> bool:
    """TMA reads x and w as the kernel needs (16-bit; rows 16-byte aligned; experts stacked densely), the
    output's rows are contiguous and "kn" weights hold a whole number of BLOCK_K rows per expert."""
    if x.dtype not in _GL or x.device.type != "cuda":
        return False
    k = x.shape[1]
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    if not w.is_contiguous() or (w.shape[2] * 2) % 16:
        return False
    if w_layout == "kn" and k % cfg.block_k:
        return False
    return out.stride(1) == 1 and (row_scale is None or row_scale.stride(0) == 1)


@dataclasses.dataclass(eq=False)
class _Plan:
    grid: int
    shared: int
    geom: tuple
    layouts: tuple
    boxes: tuple
    run_fn: object
    function: object
    packed: tuple
    tail: tuple

    def run(self, x, w, offsets, scale, out, e, n, k):
        w2 = w.view(self.geom[0])
        da = K.TensorDescriptor(x, list(x.shape), [x.stride(0), 1], list(self.boxes[0]), self.layouts[0])
        dw = K.TensorDescriptor(w2, list(w2.shape), [w2.stride(0), 1], list(self.boxes[1]), self.layouts[1])
        from moegemm._triton_common import raw_stream

        self.run_fn(
            self.grid,
            1,
            1,
            raw_stream(x.device.index),
            self.function,
            self.packed,
            None,
            None,
            None,
            da,
            dw,
            out,
            offsets,
            scale,
            e,
            n,
            k,
            out.stride(0),
            *self.tail,
        )


_PLANS: dict = {}
FALLBACK_REASONS: dict = {}


def _make_plan(x, w, w_layout, offsets, scale, out, e, n, k, epi, has_scale, cfg, swiglu=False):
    compiled, c, grid, geom, la, lw, box_a, box_w = compile_for(
        x, w, w_layout, offsets, scale, out, e, n, k, epi, has_scale, cfg, swiglu
    )
    compiled._init_handles()
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return _finish_plan(compiled, c, grid, geom, la, lw, box_a, box_w, x.shape[0], n, k, cfg, sms)


def compile_for(x, w, w_layout, offsets, scale, out, e, n, k, epi, has_scale, cfg, swiglu=False):
    """The kernel compiled through Triton's launcher for exactly these arguments (no launch), with what the
    plan needs: (compiled, constexprs, grid, w's 2-D view, the layouts and boxes of x and w)."""
    w_kn = w_layout == "kn"
    m = x.shape[0]
    wn = 2 * n if swiglu else n  # the weights' columns per expert
    geom = ((e * k, wn),) if w_kn else ((e * wn, k),)
    la, lw, box_a, box_w = _layouts(x.dtype, cfg, w_kn)
    c = constexprs(e, cfg, w_kn, epi, has_scale, swiglu)
    pair = 2 * cfg.block_m
    grid = (_cdiv(m, pair) + e) * _cdiv(n, cfg.block_n)  # an upper bound of the pair tiles
    w2 = w.view(geom[0])
    da = K.TensorDescriptor(x, list(x.shape), [x.stride(0), 1], box_a, la)
    dw = K.TensorDescriptor(w2, list(w2.shape), [w2.stride(0), 1], box_w, lw)
    args = (da, dw, out, offsets, scale, e, n, k, out.stride(0))  # the kernel's, as the plan launches them
    compiled = K._grouped_cluster_kernel.warmup(
        *args,
        grid=(grid,),
        num_warps=cfg.num_warps,
        num_ctas=2,
        **c,
    )
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    return compiled, c, grid, geom, la, lw, box_a, box_w


def _finish_plan(compiled, c, grid, geom, la, lw, box_a, box_w, m, n, k, cfg, sms):
    shared = _cdiv(int(compiled.metadata.shared), 16) * 16 + 8 * cfg.stages  # + the pair's empty barriers
    from triton.runtime import driver

    try:
        clusters = int(driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, shared, 2))
    except RuntimeError as exc:
        FALLBACK_REASONS[(m, n, k, cfg)] = f"occupancy query: {exc}"
        return None
    if clusters < 1:
        FALLBACK_REASONS[(m, n, k, cfg)] = f"no 2-CTA cluster with {shared} B of shared memory fits"
        return None
    if cfg.ws:  # persistent: as many clusters as run at once, each walking every grid-th pair tile; at most
        # one per pair of SMs (Triton's occupancy query for clusters assumes 128 threads a CTA)
        grid = min(grid, clusters, sms // 2)
    names = list(K._grouped_cluster_kernel.arg_names)
    tail = tuple(c[nm] for nm in names[names.index("stride_ym") + 1 :])
    return _Plan(
        grid=grid,
        shared=shared,
        geom=geom,
        layouts=(la, lw),
        boxes=(tuple(box_a), tuple(box_w)),
        run_fn=compiled.run,
        function=compiled.function,
        packed=(compiled.metadata.num_warps, compiled.metadata.num_ctas, shared),
        tail=tail,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grouped_mm(
    x_sorted: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    w_layout: str = "kn",
    epilogue: str | Epilogue = "none",
    row_scale: torch.Tensor | None = None,
    config: ClusterGroupedConfig | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    strict: bool = False,
) -> torch.Tensor:
    """:func:`moegemm.grouped.grouped_mm` (same arguments and result) on 2-CTA clusters that multicast each
    weight tile to both CTAs. Where this kernel cannot serve the call (see the module's docstring), the
    library's grouped_mm does, or with ``strict`` a RuntimeError says so (a measurement of this kernel must
    not time the library's under its name)."""
    return _grouped(
        x_sorted, w, group_offsets, w_layout, epilogue, row_scale, config, out, validate, False, strict
    )


def grouped_mm_swiglu(
    x_sorted: torch.Tensor,
    w_gate_up: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    w_layout: str = "kn",
    row_scale: torch.Tensor | None = None,
    config: ClusterGroupedConfig | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """:func:`moegemm.grouped.grouped_mm_swiglu` (same arguments and result: silu(x @ G_e) * (x @ U_e) *
    row_scale, [M_total, I]) on 2-CTA clusters: both weight tiles of a K step are multicast. block_n is the
    output columns of a tile (of each of the two products), at most 128."""
    return _grouped(
        x_sorted, w_gate_up, group_offsets, w_layout, "none", row_scale, config, out, validate, True
    )


def _grouped(
    x_sorted, w, group_offsets, w_layout, epilogue, row_scale, config, out, validate, swiglu, strict=False
):
    from moegemm._runtime import check_device
    from moegemm._triton_common import check_dtype
    from moegemm.grouped import api as gapi

    def fallback():
        if strict:
            raise RuntimeError("the cluster kernel cannot serve this call (strict: no fallback)")
        if swiglu:
            return gapi.grouped_mm_swiglu(
                x_sorted, w, group_offsets, w_layout=w_layout, row_scale=row_scale, out=out, validate=validate
            )
        return gapi.grouped_mm(
            x_sorted,
            w,
            group_offsets,
            w_layout=w_layout,
            epilogue=epilogue,
            row_scale=row_scale,
            out=out,
            validate=validate,
        )

    if config is not None and not isinstance(config, ClusterGroupedConfig):
        raise TypeError(f"config: expected ClusterGroupedConfig or None, got {type(config).__name__}")
    if not isinstance(x_sorted, torch.Tensor) or x_sorted.dim() != 2:
        return fallback()  # the library names what is wrong
    check_dtype("x_sorted", x_sorted)
    check_device("x_sorted", x_sorted)
    m, k = x_sorted.shape
    e, n, *_ = check_w(w, x_sorted, w_layout, k, "x_sorted")
    epi = Epilogue.parse(epilogue)
    cfg = config or ClusterGroupedConfig()
    if swiglu:
        if n % 2:
            raise ValueError(f"w_gate_up: expected an even gate/up width 2I, got {n}")
        n //= 2
        if cfg.block_n > 128:
            cfg = dataclasses.replace(cfg, block_n=128)  # two accumulators of 2 * block_m x block_n
    if (
        not isinstance(group_offsets, torch.Tensor)
        or group_offsets.dtype != torch.int32
        or group_offsets.shape != (e + 1,)
        or not group_offsets.is_contiguous()
        or m == 0
        or n == 0
        or k == 0
    ):
        return fallback()
    if group_offsets.device != x_sorted.device:
        raise ValueError(f"group_offsets: on {group_offsets.device}, but x_sorted is on {x_sorted.device}")
    if row_scale is not None and (not isinstance(row_scale, torch.Tensor) or tuple(row_scale.shape) != (m,)):
        raise ValueError(f"row_scale: expected shape ({m},), got {getattr(row_scale, 'shape', None)}")
    if out is not None and (
        tuple(out.shape) != (m, n) or out.dtype != x_sorted.dtype or out.device != x_sorted.device
    ):
        raise ValueError(f"out: expected a ({m}, {n}) {x_sorted.dtype} tensor on {x_sorted.device}")
    y = out if out is not None else torch.empty((m, n), dtype=x_sorted.dtype, device=x_sorted.device)
    if not cluster_supported(x_sorted.device) or not _eligible(x_sorted, w, w_layout, y, row_scale, cfg):
        return fallback()
    if validate:
        check_offsets(group_offsets, m)
    key = (
        tuple(x_sorted.shape),
        x_sorted.stride(),
        tuple(w.shape),
        w.dtype,
        w_layout,
        epi,
        cfg,
        swiglu,
        None if row_scale is None else (row_scale.dtype, row_scale.data_ptr() % 16 == 0),
        y.stride(),
        y.data_ptr() % 16 == 0,
        group_offsets.data_ptr() % 16 == 0,
        x_sorted.device,
    )
    scale = row_scale if row_scale is not None else y
    if key not in _PLANS:
        _PLANS[key] = _make_plan(
            x_sorted, w, w_layout, group_offsets, scale, y, e, n, k, epi, row_scale is not None, cfg, swiglu
        )
    p = _PLANS[key]
    if p is None:
        return fallback()
    p.run(x_sorted, w, group_offsets, scale, y, e, n, k)
    return y
