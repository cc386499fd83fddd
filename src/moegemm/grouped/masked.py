"""``grouped_mm_masked``, the masked layout: static [E, m_max, K] activations of which each expert's first
masked_m[e] rows count. Shapes never change with the load, so a call can be captured in a CUDA graph and
replayed with new masked_m values. Also the torch custom op it traces as (registered here, beside the
implementation it runs)."""

from __future__ import annotations

import torch
import triton

from .._runtime import check_device, records_grad
from .._triton_common import check_dtype, dot_meta
from ..epilogue import Epilogue
from . import config as _config
from .call import MaskedCall, register_op
from .checks import check_counts, check_masked_m_values, check_w
from .config import GroupedConfig, masked_config
from .launch import launch
from .masked_kernels import _grouped_mm_masked_kernel, _grouped_mm_masked_tma_kernel
from .tma import ensure_allocator, tma_rows_ok, w_descriptor


def grouped_mm_masked(
    x: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    w_layout: str = "nk",
    epilogue: str | Epilogue = "none",
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool = False,
    check_masked_m: bool = False,
    leave_tail_unwritten: bool = False,
) -> torch.Tensor:
    """Y[e, :masked_m[e]] = epilogue(X[e, :masked_m[e]] @ W_e^T), and Y[e, masked_m[e]:] = 0: every row of the
    output is defined. Rows of x at or past masked_m[e] are never read. ``leave_tail_unwritten=True``
    leaves the output's rows past masked_m[e] unwritten instead (a new output then holds whatever memory
    held, ``out`` whatever it held), for a caller that never reads them and would rather not pay their
    stores. Static shapes: capturable in a CUDA graph, and correct on replay with new masked_m values. x:
    [E, m_max, K]; w: [E, N, K] (w_layout="nk", the default: the nn.Linear convention) or [E, K, N] ("kn");
    masked_m: int [E].

    masked_m values outside [0, m_max] are clamped to it by the kernel, with no host sync. With
    ``check_masked_m=True`` they are checked first instead, and a value outside raises a ValueError naming
    masked_m: that reads masked_m to the host, a sync, so it cannot be captured in a CUDA graph and is off
    by default (while torch.compile traces the call, the check is a device-side assertion instead).

    config: tiles, grid and load path (``flatten``, ``tail_m``, ``merge_tail`` and ``mix`` are not used);
    default: this GPU's tuned tiles for m_max rows per expert, on the persistent grid. With ``tma=True``
    and 16-bit inputs whose rows are 16-byte aligned (w as for :func:`moegemm.grouped.grouped_mm`), x's
    rows come in by TMA through a descriptor made in-kernel for each expert's first masked_m[e] rows, so
    rows past them are still not read; other inputs take the pointer kernel with the same tiles.
    Under ``torch.compile`` this traces as the custom op ``moegemm::grouped_mm_masked``.

    No gradient: the masked layout serves decode (inference). Where autograd would record one (x or w
    requires grad, grad mode on), a RuntimeError says so; :func:`moegemm.grouped.grouped_mm` trains."""
    if records_grad(x, w):
        raise RuntimeError(
            "x, w: grouped_mm_masked has no gradient (the masked layout serves decode); train through "
            "grouped_mm (contiguous rows and group offsets), or call this under torch.no_grad()"
        )
    compiling = torch.compiler.is_compiling()  # a traced call checks masked_m on the device, not in the op
    check = check_masked_m and not compiling
    call = MaskedCall.of(w_layout, epilogue, config, allow_tf32, check, leave_tail_unwritten)
    if compiling:
        n = w.shape[2] if w_layout == "kn" else w.shape[1]
        out = x.new_empty((x.shape[0], x.shape[1], n)) if out is None else out
        if check_masked_m:
            torch._assert_async(
                ((masked_m >= 0) & (masked_m <= x.shape[1])).all(), "masked_m: values must lie in [0, m_max]"
            )
        grouped_mm_masked_op(x, w, masked_m, out, *call.op_args())
        return out
    return _masked(call, x, w, masked_m, out)


def _masked(call: MaskedCall, x, w, masked_m, out) -> torch.Tensor:
    """grouped_mm_masked's checks and launch."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"x: expected a 3-D [E, m_max, K] tensor, got {got}")
    check_dtype("x", x)
    check_device("x", x)
    ex, m_max, k = x.shape
    w_layout = call.w_layout
    e, n, s_e, s_k, s_n = check_w(w, x, w_layout, k)
    if e != ex:
        raise ValueError(f"w: has {e} experts but x has {ex}")
    check_counts("masked_m", masked_m, (e,), x, "x")
    if call.check_masked_m and e:
        check_masked_m_values(masked_m, m_max)
    epi = Epilogue.parse(call.epilogue)
    if out is None:
        out = torch.empty((e, m_max, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (e, m_max, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected an ({e}, {m_max}, {n}) {x.dtype} tensor on {x.device}")
    if e == 0 or m_max == 0 or n == 0 or k == 0:
        if k == 0 and e and m_max and n:
            raise ValueError("x: K = 0 is not supported by the masked layout")
        return out
    cfg = masked_config(x, n, w_layout, call.config)
    max_tiles = e * triton.cdiv(m_max, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if max_tiles >= 2**31:
        raise ValueError(
            f"x: {e} x {m_max} rows x N={n} need {max_tiles} tiles of "
            f"{cfg.block_m}x{cfg.block_n}, more than the kernel's int32 tile index holds"
        )
    common = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        E_BLOCK=max(16, triton.next_power_of_2(e)),
        GROUP_M=_config.GROUP_M,
        EPILOGUE=int(epi),
        ZERO_TAIL=not call.leave_tail_unwritten,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    w_desc = w_descriptor(w, w_layout, e, n, k, cfg) if cfg.tma and tma_rows_ok(x) else None
    if w_desc is not None:
        ensure_allocator()
        launch(
            _grouped_mm_masked_tma_kernel,
            max_tiles,
            cfg,
            x,
            (
                x,
                w_desc,
                out,
                masked_m,
                e,
                m_max,
                n,
                k,
                x.stride(0),
                x.stride(1),
                out.stride(0),
                out.stride(1),
                out.stride(2),
            ),
            dict(W_KN=w_layout == "kn", UPCAST=dot_meta(x.dtype, call.allow_tf32)["UPCAST"], **common),
        )
        return out
    launch(
        _grouped_mm_masked_kernel,
        max_tiles,
        cfg,
        x,
        (
            x,
            w,
            out,
            masked_m,
            e,
            m_max,
            n,
            k,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            s_e,
            s_k,
            s_n,
            out.stride(0),
            out.stride(1),
            out.stride(2),
        ),
        dict(EVEN_K=k % cfg.block_k == 0, **common, **dot_meta(x.dtype, call.allow_tf32)),
    )
    return out


# The custom op writes into an output it is given, as the eager call can; it never reads masked_m to the host
# (a traced call checks it on the device first, see grouped_mm_masked).
grouped_mm_masked_op = register_op(
    "moegemm::grouped_mm_masked",
    MaskedCall,
    "Tensor x, Tensor w, Tensor masked_m, Tensor(a!) out",
    _masked,
)
