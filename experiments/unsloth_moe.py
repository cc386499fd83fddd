"""Unsloth's Triton grouped-GEMM MoE kernels (unsloth/kernels/moe/grouped_gemm: forward, dX and dW kernels
behind one autograd Function), loaded at run time from a checkout of Unsloth's source named by
``MOEGEMM_UNSLOTH_SOURCE`` (the repository's root, or any folder holding ``unsloth/kernels/moe``). Nothing
of Unsloth is part of this project.

Only the grouped-GEMM package is imported: ``unsloth`` and its parents are set up as bare namespace
packages (Unsloth's own ``__init__`` imports its whole training stack), with the one name the kernels'
interface reads from it (``DEVICE_TYPE = "cuda"``). The revision recorded in the rows: the checkout's git
commit where it is a git repository, else ``MOEGEMM_UNSLOTH_REVISION``, else "unknown".

The layer as Unsloth's fused Qwen3-MoE block runs it (reference/layers/qwen3_moe.py there): its routing
(get_routing_indices: histc counts and a stable argsort), the gate/up grouped GEMM with the permutation
fused into its prologue (permute_x), SiLU(gate) * up as torch ops, the down grouped GEMM with the
un-permutation fused into its epilogue (permute_y), then the gating weights and the sum over top_k as
torch ops; autotuned kernels (autotune=True, their advice).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import torch

ENV = "MOEGEMM_UNSLOTH_SOURCE"
PACKAGE = Path("unsloth") / "kernels" / "moe" / "grouped_gemm"


@dataclasses.dataclass
class Unsloth:
    grouped_gemm: object  # interface.grouped_gemm
    get_routing_indices: object  # reference.moe_ops.get_routing_indices
    revision: str
    origin: str


def _root(source: str) -> Path:
    p = Path(source).expanduser().resolve()
    for cand in (p, p.parent, p.parent.parent, p.parent.parent.parent, p.parent.parent.parent.parent):
        if (cand / PACKAGE / "interface.py").is_file():
            return cand
    raise ValueError(f"{ENV}={source}: no {PACKAGE}/interface.py under it")


def revision_of(root: Path) -> str:
    """The commit of the git repository whose top is ``root`` (not of a repository it merely sits in), else
    MOEGEMM_UNSLOTH_REVISION, else "unknown"."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == root.resolve():
            return lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("MOEGEMM_UNSLOTH_REVISION", "unknown")


def load(source: str | None = None) -> tuple[Unsloth | None, str]:
    """(Unsloth's kernels, "") or (None, why not)."""
    source = source or os.environ.get(ENV)
    if not source:
        return None, f"not available ({ENV} not set)"
    try:
        root = _root(source)
    except ValueError as ex:
        return None, str(ex)
    if "unsloth" in sys.modules and not hasattr(sys.modules["unsloth"], "__path__"):
        return None, "a module named unsloth is already imported and is not a package"
    for name, sub in (
        ("unsloth", "unsloth"),
        ("unsloth.kernels", "unsloth/kernels"),
        ("unsloth.kernels.moe", "unsloth/kernels/moe"),
    ):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(root / sub)]
            sys.modules[name] = mod
    if not hasattr(sys.modules["unsloth"], "DEVICE_TYPE"):
        sys.modules["unsloth"].DEVICE_TYPE = "cuda"
    try:
        interface = importlib.import_module("unsloth.kernels.moe.grouped_gemm.interface")
        ops = importlib.import_module("unsloth.kernels.moe.grouped_gemm.reference.moe_ops")
    except Exception as ex:  # noqa: BLE001 - an optional peer: recorded, not fatal
        return None, f"import failed: {type(ex).__name__}: {str(ex)[:200]}"
    rev = revision_of(root)
    return Unsloth(interface.grouped_gemm, ops.get_routing_indices, rev, f"unsloth {rev[:12]} ({root})"), ""


def moe_layer(
    uk: Unsloth,
    x: torch.Tensor,
    ids: torch.Tensor,
    wts: torch.Tensor,
    w_gu: torch.Tensor,
    w_dn: torch.Tensor,
    autotune: bool = True,
) -> torch.Tensor:
    """[T, H]: the expert FFN on Unsloth's kernels (w_gu [E, 2I, H], w_dn [E, H, I], as nn.Linear stores
    them; ids [T, top_k]; wts [T, top_k]); differentiable in x, wts, w_gu and w_dn."""
    t, h = x.shape
    top_k = ids.shape[1]
    e, two_i, _ = w_gu.shape
    i = two_i // 2
    counts, gather = uk.get_routing_indices(ids, e)
    y = uk.grouped_gemm(
        X=x,
        W=w_gu,
        m_sizes=counts,
        gather_indices=gather,
        topk=top_k,
        permute_x=True,
        permute_y=False,
        autotune=autotune,
        is_first_gemm=True,
    )
    act = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    y = uk.grouped_gemm(
        X=act,
        W=w_dn,
        m_sizes=counts,
        gather_indices=gather,
        topk=top_k,
        permute_x=False,
        permute_y=True,
        autotune=autotune,
        is_first_gemm=False,
    )
    return (y.view(t, top_k, h) * wts[..., None].to(y.dtype)).sum(1).to(x.dtype)
