"""OpenAI's ``triton_kernels`` (the ragged ``matmul_ogs`` MoE matmul of the Triton repository's
python/triton_kernels; vLLM runs it for gpt-oss) as an E7 and E8 contender, where its source is at hand.

Where it comes from: ``MOEGEMM_TRITON_KERNELS_SOURCE``, a folder holding the ``triton_kernels`` package (a
Triton checkout's ``python/triton_kernels``, or the copy vLLM ships as ``vllm/third_party``), or the package
folder itself. It is imported from there at run time; nothing of it is in this repository. The rows name it
by a hash of its Python files and, where the folder has one, the first line of a ``REVISION`` file beside
the package (experiments/fetch_peers.sh writes it).

This adapter drives the ``matmul_ogs`` generation of its API (``routing``, ``matmul_ogs``, ``FusedActivation``
with ``swiglu_fn``), as vLLM 0.33's gpt-oss path drives the copy it ships; a tree without ``routing()`` (its
later generations: routing from ``topk``'s SparseMatrix, or ``matmul`` in place of ``matmul_ogs``) is
refused with the reason.

As its users run it (vLLM's ``triton_kernel_moe_forward``): its own routing (``routing``: top-k, the expert
histogram, the sorted order and the gather/scatter indices, in its kernels), then ``matmul_ogs`` for gate/up
with the gather of the tokens' rows fused and its SwiGLU fused (``swiglu_fn``), then ``matmul_ogs`` for down
with the scatter, the routing weights (``gammas``) and the top-k sum fused. Two adaptations, made once per
cell, outside the timing, and named in the rows:
- its ``swiglu_fn`` is gpt-oss's, ``s * (up + 1)`` with ``s = gate * sigmoid(alpha * gate)`` and a clamp;
  with ``alpha = 1``, no clamp and a bias of -1 on every up column (its fused bias), it is SiLU(gate) * up
  exactly, the zoo's activation. It reads gate and up interleaved, so the gate/up weights' rows are
  interleaved once (as vLLM's gpt-oss weight loader lays them out).
- the cell's routing is given (top-k ids and weights): ``routing`` takes the ids (``expt_indx``, in int32:
  see ``routing_indices``) and, as logits, the log of the weights at those ids (its softmax over the top-k
  gives the weights back).
Weights stay [E, N, K] as E7 and E8 hold them; matmul_ogs takes them as [E, K, N] (a transposed view:
its ``w_transpose`` path).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import sys
from pathlib import Path

import torch

ENV = "MOEGEMM_TRITON_KERNELS_SOURCE"
NAME = "tk:matmul_ogs"


@dataclasses.dataclass
class TritonKernels:
    matmul_ogs: object  # the module triton_kernels.matmul_ogs
    routing: object  # the module triton_kernels.routing
    swiglu: object  # the module triton_kernels.swiglu
    origin: str  # "triton_kernels <revision> sha256:<hex of its .py files>"


def package_dir(source: str | os.PathLike) -> Path:
    """The ``triton_kernels`` package folder under ``source`` (the folder holding it, or itself)."""
    path = Path(source)
    if not path.is_dir():
        raise FileNotFoundError(f"{ENV}: no folder at {path}")
    for cand in (path / "triton_kernels", path):
        if cand.name == "triton_kernels" and (cand / "__init__.py").is_file():
            return cand
    raise ValueError(f"{ENV}: {path} holds no triton_kernels package (no triton_kernels/__init__.py)")


def tree_digest(pkg: Path) -> str:
    """sha256 (12 hex digits) over the package's .py files, by relative path and content."""
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def revision(pkg: Path) -> str:
    """The first line of a REVISION file beside or inside the package folder, else "unnamed revision"."""
    for f in (pkg / "REVISION", pkg.parent / "REVISION"):
        if f.is_file():
            line = f.read_text().strip().splitlines()
            if line:
                return line[0].strip()
    return "unnamed revision"


def load(source: str | os.PathLike | None = None) -> TritonKernels | None:
    """triton_kernels from ``source`` (default: $MOEGEMM_TRITON_KERNELS_SOURCE), or None where none is
    named."""
    source = source if source is not None else os.environ.get(ENV)
    if not source:
        return None
    pkg = package_dir(source)
    loaded = sys.modules.get("triton_kernels")
    if loaded is not None and Path(loaded.__file__).resolve().parent != pkg.resolve():
        raise ValueError(
            f"{ENV}: a triton_kernels from {Path(loaded.__file__).parent} is already imported; "
            f"cannot also import the one at {pkg}"
        )
    root = str(pkg.parent.resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        mods = {m: importlib.import_module(f"triton_kernels.{m}") for m in ("matmul_ogs", "swiglu")}
    except ImportError as ex:
        raise ValueError(
            f"{ENV}: the triton_kernels at {pkg} has no matmul_ogs API this adapter drives "
            f"(a later generation: matmul in place of matmul_ogs?): {ex}"
        ) from ex
    try:
        mods["routing"] = importlib.import_module("triton_kernels.routing")
    except ImportError as ex:
        raise ValueError(
            f"{ENV}: the triton_kernels at {pkg} has no routing() (its routing comes from "
            f"topk's SparseMatrix there); this adapter drives routing(): {ex}"
        ) from ex
    for mod, names in (
        (mods["matmul_ogs"], ("matmul_ogs", "FusedActivation", "FnSpecs")),
        (mods["routing"], ("routing",)),
        (mods["swiglu"], ("swiglu_fn",)),
    ):
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            raise ValueError(f"{ENV}: {mod.__name__} at {pkg} lacks {', '.join(missing)}")
    return TritonKernels(
        mods["matmul_ogs"],
        mods["routing"],
        mods["swiglu"],
        f"triton_kernels {revision(pkg)} sha256:{tree_digest(pkg)}",
    )


def routing_logits(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """fp32 logits [T, E] whose values at the given ids are log(weights) (-inf elsewhere): with the ids given,
    routing's softmax over the top-k values returns the weights (for weights summing to 1 per token)."""
    if topk_ids.shape != topk_weights.shape or topk_ids.ndim != 2:
        raise ValueError(
            f"topk_ids, topk_weights: expected the same [T, top_k] shape, got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if not 0 < num_experts < 32768:
        raise ValueError(f"num_experts: expected 1..32767, got {num_experts}")
    logits = torch.full(
        (topk_ids.shape[0], num_experts), float("-inf"), dtype=torch.float32, device=topk_ids.device
    )
    return logits.scatter_(1, topk_ids.long(), topk_weights.float().log())


def interleave_gate_up(w_gu: torch.Tensor) -> torch.Tensor:
    """[E, 2I, K] gate rows then up rows -> [E, 2I, K] with gate and up rows alternating (gate_i, up_i, ...),
    the order swiglu_fn reads the columns of the product in."""
    if w_gu.ndim != 3 or w_gu.shape[1] % 2:
        raise ValueError(f"w_gu: expected [E, 2I, K], got shape {tuple(w_gu.shape)}")
    e, two_i, k = w_gu.shape
    return w_gu.view(e, 2, two_i // 2, k).transpose(1, 2).reshape(e, two_i, k).contiguous()


def silu_bias(e: int, two_i: int, device) -> torch.Tensor:
    """fp32 [E, 2I]: 0 on the gate columns, -1 on the up columns (interleaved): swiglu_fn's ``s * (up + 1)``
    becomes SiLU(gate) * up."""
    b = torch.zeros(e, two_i // 2, 2, dtype=torch.float32, device=device)
    b[..., 1] = -1.0
    return b.reshape(e, two_i)


def silu_activation(tk: TritonKernels):
    """Its fused activation (reduction 2: gate/up pairs -> one column), swiglu_fn at alpha 1 and no clamp."""
    mo = tk.matmul_ogs
    specs = mo.FnSpecs("swiglu", tk.swiglu.swiglu_fn, ("alpha", "limit"))
    try:
        return mo.FusedActivation(specs, (1.0, None), 2)
    except TypeError:  # a generation whose FnSpecs carries the reduction
        specs = mo.FnSpecs("swiglu", tk.swiglu.swiglu_fn, ("alpha", "limit"), reduction_n=2)
        return mo.FusedActivation(specs, (1.0, None))


def routing_indices(topk_ids: torch.Tensor) -> torch.Tensor:
    """The top-k ids as its routing() takes them (``expt_indx``): int32, contiguous [T, top_k].

    Not int16, the type its top-k kernel writes ids in when it picks them itself: with the ids given, that
    kernel builds the expert bitmatrix (the histogram, hence every offset and index downstream) from them
    as ``1 << (id % 32)`` in the ids' own type. In int16 the shift drops the experts 16-31 of each word of
    32 and sign-extends expert 15 over them, so with more than 16 experts the routing is wrong. In int32
    every bit of the word is kept."""
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [T, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    return topk_ids.to(torch.int32).contiguous()


def route(tk: TritonKernels, topk_ids: torch.Tensor, logits: torch.Tensor, ids32: torch.Tensor | None = None):
    """(routing data, gather indices, scatter indices) from its routing() with the ids given; ``ids32``: the
    ids as routing_indices gives them, made beforehand (a timed call then pays no cast: vLLM's gpt-oss path
    gets its ids from its own top-k kernel in the dtype routing() takes)."""
    idx = routing_indices(topk_ids) if ids32 is None else ids32
    return tk.routing.routing(logits, topk_ids.shape[1], sm_first=False, expt_indx=idx)


def slot_order(gather) -> torch.Tensor:
    """The (token, k) slot of each row of its expert-sorted order (gather.src_indx), int64."""
    return gather.src_indx.long()


def layer(tk: TritonKernels, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, e: int):
    """bind(w_gu [E, 2I, H], w_dn [E, H, I]) -> a call of the whole expert FFN as vLLM's gpt-oss path runs
    triton_kernels (routing, matmul_ogs gate/up with gather + fused SwiGLU, matmul_ogs down with scatter +
    gammas + top-k sum), returning [T, H]. The weights' interleave and the bias are made at bind time."""
    t, top_k = topk_ids.shape
    logits = routing_logits(topk_ids, topk_weights, e)
    ids32 = routing_indices(topk_ids)  # once, outside the timed call
    act = silu_activation(tk)
    mo = tk.matmul_ogs

    def bind(w_gu: torch.Tensor, w_dn: torch.Tensor):
        two_i, h = w_gu.shape[1], w_dn.shape[1]
        w1 = interleave_gate_up(w_gu).transpose(1, 2)  # [E, H, 2I], a view of [E, 2I, H]
        w2 = w_dn.transpose(1, 2)  # [E, I, H]
        b1 = silu_bias(e, two_i, x.device)
        inter = torch.empty(1, t * top_k, two_i // 2, dtype=x.dtype, device=x.device)
        out = torch.empty(1, t, h, dtype=x.dtype, device=x.device)

        def call():
            rd, gather, scatter = route(tk, topk_ids, logits, ids32)
            mo.matmul_ogs(x, w1, b1, rd, gather_indx=gather, fused_activation=act, y=inter)
            mo.matmul_ogs(
                inter.view(t * top_k, two_i // 2),
                w2,
                None,
                rd,
                scatter_indx=scatter,
                gammas=rd.gate_scal,
                y=out,
            )
            return out.view(t, h)

        return call

    return bind


def projection(tk: TritonKernels, a: torch.Tensor, topk_ids: torch.Tensor, e: int, gather_rows: bool):
    """(bind(w [E, N, K]) -> a call of one matmul_ogs writing [slots, N] in its expert-sorted order, the slot
    of each output row). ``gather_rows``: ``a`` holds the tokens [T, K] and the kernel gathers each slot's row
    (gate/up, as its users run it); else ``a`` holds the slots' rows in slot order [slots, K], put in its
    sorted order here, before timing, and read as they lie (down, without the scatter: the same work as a
    grouped GEMM on permuted rows). Routing is made once, before timing (E7 times the GEMM)."""
    weights = torch.full(topk_ids.shape, 1.0 / topk_ids.shape[1], device=topk_ids.device)
    rd, gather, _ = route(tk, topk_ids, routing_logits(topk_ids, weights, e))
    order = slot_order(gather)
    x = a if gather_rows else a[order].contiguous()
    mo = tk.matmul_ogs

    def bind(w: torch.Tensor):
        wt = w.transpose(1, 2)
        y = torch.empty(1, order.numel(), w.shape[1], dtype=a.dtype, device=a.device)  # it writes [1, M, N]

        def call():
            mo.matmul_ogs(x, wt, None, rd, gather_indx=gather if gather_rows else None, y=y)
            return y.view(order.numel(), w.shape[1])

        return call

    return bind, order
