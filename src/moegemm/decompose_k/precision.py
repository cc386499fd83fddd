"""The precision of cuBLAS's fp32 products for the calls Decompose-K hands to cuBLAS: IEEE unless the caller
allows TF32, whatever the process-wide setting."""

from __future__ import annotations

import contextlib

import torch


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
