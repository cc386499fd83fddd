"""The seed's PyTorch formulation of Decompose-K, kept with its contract (K must be divisible by S)."""

from __future__ import annotations

import torch

from ..epilogue import Epilogue


def _bmm_fp32(a3: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    """Batched product with fp32 output. ``torch.bmm(..., out_dtype=torch.float32)`` where the backend
    has it (CUDA), else the same arithmetic on fp32 copies (16-bit values are exact in fp32)."""
    if a3.dtype != torch.float32 and a3.is_cuda:
        try:
            return torch.bmm(a3, b3, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return torch.bmm(a3.float(), b3.float())


def decompose_k(a: torch.Tensor, b: torch.Tensor, k_splits: int) -> torch.Tensor:
    """C = A @ B computed as S partial GEMMs ``[S,M,K/S] x [S,K/S,N]`` summed over S in fp32.

    Raises ``ValueError`` if the shapes do not chain or K is not divisible by ``k_splits``.
    """
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"b: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if not isinstance(k_splits, int) or k_splits < 1:
        raise ValueError(f"k_splits: expected a positive int, got {k_splits!r}")
    if k % k_splits != 0:
        raise ValueError(f"k_splits: K={k} is not divisible by k_splits={k_splits}")
    kc = k // k_splits
    a3 = a.reshape(m, k_splits, kc).permute(1, 0, 2)  # [S, M, K/S]
    b3 = b.reshape(k_splits, kc, n)  # [S, K/S, N]
    return _bmm_fp32(a3, b3).sum(dim=0).to(a.dtype)


def decompose_k_relu(a: torch.Tensor, b: torch.Tensor, k_splits: int) -> torch.Tensor:
    """The seed's unfused epilogue: ReLU as a separate op after the cast."""
    return torch.relu(decompose_k(a, b, k_splits))


def reference_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    epilogue: str = "none",
    bias: torch.Tensor | None = None,
    on_cpu: bool = True,
) -> torch.Tensor:
    """float64 ground truth of ``epilogue(a @ b + bias)``: on the CPU, or where the operands live
    (``on_cpu=False``, e.g. a GPU's float64 matmul for the large experiment shapes)."""
    dev = torch.device("cpu") if on_cpu else a.device
    c = a.detach().to(dev, torch.float64) @ b.detach().to(dev, torch.float64)
    if bias is not None:
        c = c + bias.detach().to(dev, torch.float64)
    return Epilogue.parse(epilogue).torch_apply(c)
