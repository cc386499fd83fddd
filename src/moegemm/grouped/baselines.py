"""What the grouped kernels are measured against (all in PyTorch). Expert weights as for the kernels:
[E, N, K] (w_layout="nk", nn.Linear's, the default) or [E, K, N] ("kn")."""

from __future__ import annotations

import math

import torch

from .routing import RoutingPlan, row_positions


def _w_kn(w: torch.Tensor, w_layout: str) -> torch.Tensor:
    return w if w_layout == "kn" else w.transpose(1, 2)


def per_expert_loop(
    x_sorted: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, w_layout: str = "nk"
) -> torch.Tensor:
    """One torch.mm per expert: reads the offsets on the host (a sync) and launches E GEMMs."""
    wk = _w_kn(w, w_layout)
    out = torch.empty((x_sorted.shape[0], wk.shape[2]), dtype=x_sorted.dtype, device=x_sorted.device)
    off = group_offsets.tolist()
    for e in range(wk.shape[0]):
        if off[e + 1] > off[e]:
            torch.mm(x_sorted[off[e] : off[e + 1]], wk[e], out=out[off[e] : off[e + 1]])
    return out


def capacity(num_rows: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * num_rows / num_experts))


def padded_bmm(
    x_sorted: torch.Tensor, w: torch.Tensor, plan: RoutingPlan, capacity_factor: float, w_layout: str = "nk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every expert to a capacity C = ceil(cf * T*k / E) rows and run one bmm; rows past C are dropped
    (their output is zero). Returns (y_sorted, number of dropped rows as a device tensor). No host sync."""
    wk = _w_kn(w, w_layout)
    e, k, n = wk.shape
    m = x_sorted.shape[0]
    c = capacity(m, e, capacity_factor)
    expert, pos = row_positions(plan.group_offsets, m)
    keep = pos < c
    slot = torch.where(keep, expert * c + pos, torch.full_like(pos, e * c))  # dropped rows -> a spill slot
    buf = torch.zeros((e * c + 1, k), dtype=x_sorted.dtype, device=x_sorted.device)
    buf[slot] = x_sorted
    y = torch.bmm(buf[: e * c].view(e, c, k), wk).view(e * c, n)
    y = torch.cat([y, y.new_zeros(1, n)])[slot]
    return y, (~keep).sum()


def torch_grouped_mm(
    x_sorted: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, w_layout: str = "nk"
) -> torch.Tensor:
    """``torch._grouped_mm`` (CUTLASS on sm90 for bf16), where this PyTorch has it."""
    if not hasattr(torch, "_grouped_mm"):
        raise NotImplementedError("this PyTorch has no torch._grouped_mm")
    return torch._grouped_mm(x_sorted, _w_kn(w, w_layout), offs=group_offsets[1:].to(torch.int32))


def dense_reference(
    x_sorted: torch.Tensor, w: torch.Tensor, w_layout: str = "nk", expert: int = 0
) -> torch.Tensor:
    """One ordinary GEMM over all M_total rows with one expert's weights: the yardstick of a dense GEMM that
    moves the activations but only one expert's weights."""
    return x_sorted @ _w_kn(w, w_layout)[expert]
