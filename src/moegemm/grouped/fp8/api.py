"""The block-scaled FP8 grouped GEMMs' public entry points: the contiguous layout (prefill, the training
forward), the masked layout (decode, CUDA-graph capturable), and the gate/up projection with SwiGLU and the
down projection's e4m3 quantisation fused in its epilogue. Operands are e4m3 with fp32 block scales as
:mod:`moegemm.grouped.fp8.quant` makes them (DeepSeek-V3's format); the output is bf16 (or fp16, fp32)."""

from __future__ import annotations

import torch

from ..._runtime import check_device
from ..checks import check_counts, check_masked_m_values, check_offsets
from .config import Fp8Config, choice_key, choose, default_config
from .launch import OUT_DTYPES, run
from .quant import BLOCK, FP8, blocks


def _check_fp8(name: str, t, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != FP8:
        raise TypeError(
            f"{name}: expected float8_e4m3fn (quantise with moegemm.grouped.fp8.quantize_*), got {t.dtype}"
        )
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor, got shape {tuple(t.shape)}")
    check_device(name, t)


def _check_scale(name: str, s, shape: tuple, like: torch.Tensor) -> None:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(s).__name__}")
    if s.dtype != torch.float32:
        raise TypeError(f"{name}: expected float32 scales, got {s.dtype}")
    if tuple(s.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} (one scale per 128-block), got {tuple(s.shape)}")
    if s.device != like.device:
        raise ValueError(f"{name}: on {s.device}, but the operands are on {like.device}")


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype}")


def _check_weights(w_q, w_scale, k: int, x: torch.Tensor, swiglu: bool) -> tuple[int, int]:
    """(E, N) of the weights [E, N, K] (N: the output's width; with SwiGLU w holds 2N rows)."""
    _check_fp8("w_q", w_q, 3)
    e, nw, kw = w_q.shape
    if kw != k:
        raise ValueError(f"w_q: K={kw} differs from x_q's K={k}")
    if w_q.device != x.device:
        raise ValueError(f"w_q: on {w_q.device}, but x_q is on {x.device}")
    _check_scale("w_scale", w_scale, (e, blocks(nw), blocks(k)), x)
    if swiglu and nw % 2:
        raise ValueError(f"w_q: the gate/up weights stack 2N rows, got an odd {nw}")
    return e, nw // 2 if swiglu else nw


def _check_config(cfg: Fp8Config, swiglu: bool) -> None:
    if swiglu and cfg.block_n != BLOCK:
        raise ValueError(
            f"config.block_n: the SwiGLU variant quantises 128 columns per tile, got {cfg.block_n}"
        )


def _contiguous(x_q, x_scale, w_q, w_scale, group_offsets, row_scale, out_dtype, config, validate, swiglu):
    _check_fp8("x_q", x_q, 2)
    m, k = x_q.shape
    _check_scale("x_scale", x_scale, (m, blocks(k)), x_q)
    e, n = _check_weights(w_q, w_scale, k, x_q, swiglu)
    check_counts("group_offsets", group_offsets, (e + 1,), x_q, "x_q")
    if row_scale is not None:
        if swiglu:
            raise ValueError(
                "row_scale: the SwiGLU variant takes none (the gating weight scales the down projection)"
            )
        if not isinstance(row_scale, torch.Tensor) or tuple(row_scale.shape) != (m,):
            raise ValueError(f"row_scale: expected a tensor of shape ({m},)")
        if row_scale.device != x_q.device:
            raise ValueError(f"row_scale: on {row_scale.device}, but x_q is on {x_q.device}")
    _check_out_dtype(out_dtype)
    if validate and e:
        check_offsets(group_offsets, m)

    def launch(cfg):
        return run(
            x_q, x_scale, w_q, w_scale, group_offsets, row_scale, out_dtype, cfg, False, False, swiglu, e, n
        )

    if config is None:  # (a call with nothing to compute, or one being traced, has nothing to time)
        config = default_config(m / max(e, 1), swiglu)
        if e and m and n and k and not torch.compiler.is_compiling():
            key = choice_key(False, swiglu, out_dtype, e, k, n, m)
            config = choose(x_q, key, m / max(e, 1), swiglu, launch)
    _check_config(config, swiglu)
    y, sy = launch(config)
    return (y, sy) if swiglu else y


def grouped_mm_fp8(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    row_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Fp8Config | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Y[rows of e] = (X_q * x_scale)[rows of e] @ (W_q[e] * w_scale[e])^T * row_scale[rows], every expert
    in ONE launch, fp32 accumulation, ``out_dtype`` out.

    x_q: e4m3 [M, K], rows grouped by expert; x_scale: fp32 [M, ceil(K/128)] (one per row and 128
    channels); w_q: e4m3 [E, N, K]; w_scale: fp32 [E, ceil(N/128), ceil(K/128)] (one per 128 x 128 block);
    group_offsets: int [E + 1], from 0 to M, non-decreasing; row_scale: optional [M] (the gating weights).
    K need not be a multiple of 128. ``validate`` checks the offsets' values (on a GPU on the device, no
    sync); the kernel bounds every row it derives from them into x_q's rows either way. With no ``config``,
    the first call of a shape times its regime's shortlist where it can (:mod:`moegemm.grouped.fp8.config`;
    the three FP8 GEMMs alike; a torch.compile trace takes the regime's untimed start)."""
    return _contiguous(
        x_q, x_scale, w_q, w_scale, group_offsets, row_scale, out_dtype, config, validate, False
    )


def grouped_mm_fp8_swiglu(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    group_offsets: torch.Tensor,
    *,
    config: Fp8Config | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_q, h_scale): silu(gate) * up of the gate/up projection, quantised to e4m3 in the kernel's epilogue
    with one scale per row and 128 columns (the down projection's operand format). w_q: e4m3 [E, 2N, K],
    each expert's gate rows then its up rows; h_q: e4m3 [M, N]; h_scale: fp32 [M, ceil(N/128)]."""
    return _contiguous(
        x_q, x_scale, w_q, w_scale, group_offsets, None, torch.bfloat16, config, validate, True
    )


def grouped_mm_fp8_masked(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Fp8Config | None = None,
    check_masked_m: bool = False,
    leave_tail_unwritten: bool = False,
) -> torch.Tensor:
    """Y[e, :masked_m[e]] = (X_q[e] * x_scale[e])[:masked_m[e]] @ (W_q[e] * w_scale[e])^T: the masked layout
    (x_q: e4m3 [E, m_max, K], x_scale: fp32 [E, m_max, ceil(K/128)], masked_m: int [E] on the device; a
    fixed grid serves any masked_m, so a call can be captured in a CUDA graph). Rows past masked_m[e] are
    zeros, written by the same launch; ``leave_tail_unwritten=True`` leaves them as they were (uninitialised
    memory). masked_m values are clamped into [0, m_max] in-kernel; ``check_masked_m`` raises on values
    outside (a host sync)."""
    _check_fp8("x_q", x_q, 3)
    ex, m_max, k = x_q.shape
    _check_scale("x_scale", x_scale, (ex, m_max, blocks(k)), x_q)
    e, n = _check_weights(w_q, w_scale, k, x_q, False)
    if e != ex:
        raise ValueError(f"w_q: has {e} experts but x_q has {ex}")
    check_counts("masked_m", masked_m, (e,), x_q, "x_q")
    _check_out_dtype(out_dtype)
    if check_masked_m and e:
        check_masked_m_values(masked_m, m_max)
    zero_tail = not leave_tail_unwritten

    def launch(cfg):
        return run(x_q, x_scale, w_q, w_scale, masked_m, None, out_dtype, cfg, True, zero_tail, False, e, n)

    if config is None:
        config = default_config(float(m_max), False)
        if e and m_max and n and k and not torch.compiler.is_compiling():
            config = choose(x_q, choice_key(True, False, out_dtype, e, k, n, e * m_max), m_max, False, launch)
    _check_config(config, False)
    return launch(config)[0]
