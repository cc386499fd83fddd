"""E10's cells of one projection's grouped GEMM and our own contenders on them (experiments/e10_fp8.py;
the peers' are experiments/fp8_peers.py): the rows of a (T, load), one projection's weights in bf16 and in
each FP8 format, and the float64 references each format's operands are held to (experiments/fp8_refs.py),
computed once per cell and format.

- ``ours:fp8``: moegemm.grouped.fp8.grouped_mm_fp8 on the expert-sorted rows (contiguous, one launch);
- ``ours:fp8-masked`` (decode): grouped_mm_fp8_masked on [E, m_max, K];
- ``ours:bf16``: grouped_mm on the bf16 rows and weights (no config: the default path), held to the bf16
  check (experiments.harness.correctness.check) against E7's float64 reference.

Every contender's output is poisoned with NaN before its checked call: the buffers it writes where it takes
one, else the allocator's block its output is served from (``poison_pool``).
"""

from __future__ import annotations

import dataclasses

import torch

from experiments import deepgemm_peer, fp8_refs
from experiments.harness.correctness import check, check_bounded
from experiments.harness.runner import Contender
from moegemm.grouped import choose_config, grouped_mm
from moegemm.grouped.fp8 import grouped_mm_fp8, grouped_mm_fp8_masked, quantize_fp8_rows
from moegemm.grouped.fp8.config import choice_key, chosen

BLOCK_NOTE = "e4m3; x: fp32 scale per token and 128 channels; w: fp32 scale per 128x128 block"


@dataclasses.dataclass
class Unrunnable:
    """A contender that cannot run here: its rows name it and say why; it is not timed."""

    name: str
    why: str
    fields: dict = dataclasses.field(default_factory=dict)

    def row(self) -> dict:
        return {
            "contender": self.name,
            **self.fields,
            "config": "",
            "status": "not runnable",
            "note": self.why,
        }


def poison_pool(numel: int, dtype: torch.dtype, device) -> None:
    """NaN into a block of the size an output of ``numel`` elements takes, freed at once: PyTorch's caching
    allocator serves a contender that allocates its output next from it, so an element it leaves unwritten
    reads NaN."""
    torch.full((max(numel, 1),), float("nan"), dtype=dtype, device=device)


class Weights:
    """One projection's expert weights [E, N, K]: bf16, one rotated copy per input set, and in each FP8
    format (fp8_refs.quantize_weights), made on first use."""

    def __init__(self, bf16: list[torch.Tensor]):
        self.bf16 = bf16
        self._q: dict = {}

    def q(self, fmt: str, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if (fmt, i) not in self._q:
            self._q[fmt, i] = fp8_refs.quantize_weights(self.bf16[i], fmt)
        return self._q[fmt, i]


@dataclasses.dataclass
class GemmCell:
    """One projection's rows at one (T, load): x [T, K] bf16 (the tokens), its top-k ids, the routing plan,
    the rows grouped by expert xs [T * top_k, K]; N; whether it is a decode cell."""

    x: torch.Tensor
    ids: torch.Tensor
    plan: object
    xs: torch.Tensor
    n: int
    proj: str
    decode: bool
    refs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.offsets = self.plan.group_offsets.tolist()
        self.sizes = [b - a for a, b in zip(self.offsets, self.offsets[1:])]
        self.slots = self.plan.sorted_slot.long()

    def ref(self, key: str, fmt: str, xq, xscale, w: Weights):
        """(reference, bound) of rows xq (expert-sorted, in format ``fmt``) against w's ``fmt`` weights,
        computed once per cell and ``key``."""
        if key not in self.refs:
            wq, ws = w.q(fmt, 0)
            x64 = fp8_refs.rows64(fmt, xq, xscale)
            self.refs[key] = fp8_refs.gemm_reference(
                x64, self.offsets, lambda e: fp8_refs.weights64(fmt, wq, ws, e), self.n
            )
        return self.refs[key]

    def checker(self, key, fmt, xq, xscale, w, to_sorted=lambda out: out):
        return lambda out: check_bounded(
            to_sorted(out), *self.ref(key, fmt, xq, xscale, w), fp8_refs.rel_budget(0)
        )


def block_rows(cell: GemmCell):
    """The expert-sorted rows in the block format (our quantiser; the format vLLM and DeepGEMM take)."""
    if cell.proj == "up":  # gathered as they are quantised
        return quantize_fp8_rows(cell.x, cell.plan.sorted_token_ids)
    return quantize_fp8_rows(cell.xs)


def first_call_config(first_call, x_q, key, rows_per_expert: float) -> tuple[dict, str]:
    """(config, its source) of our FP8 GEMM on this cell: its first call made here (which times its regime's
    shortlist where the call can, moegemm.grouped.fp8.config), then the choice it keeps."""
    first_call()
    cfg, source = chosen(x_q, key, rows_per_expert, False)
    return dataclasses.asdict(cfg), {"autotuned": "timed on its first call", "default": "untimed start"}[
        source
    ]


def ours_fp8(cell: GemmCell, w: Weights, xq, xscale) -> Contender:
    off = cell.plan.group_offsets
    e, k = len(cell.sizes), xq.shape[1]
    wq0, ws0 = w.q("block", 0)
    config, source = first_call_config(
        lambda: grouped_mm_fp8(xq, xscale, wq0, ws0, off, validate=False),
        xq,
        choice_key(False, False, torch.bfloat16, e, k, cell.n, xq.shape[0]),
        xq.shape[0] / e,
    )

    def bind(inp):
        wq, ws = w.q("block", inp[0])
        poison_pool(xq.shape[0] * cell.n, torch.bfloat16, xq.device)
        return lambda: grouped_mm_fp8(xq, xscale, wq, ws, off, validate=False)

    return Contender(
        "ours:fp8",
        bind,
        config=config,
        fields={"quant": BLOCK_NOTE, "config_source": source},
        parallel_compile=True,
        check=cell.checker("block", "block", xq, xscale, w),
    )


def masked_rows(cell: GemmCell, q, s, m_max: int):
    """q, s (expert-sorted rows and their scales) in the masked layout [E, m_max, ...] (zeros, scale 1 past
    each expert's rows), masked_m, and each sorted row's (expert, position)."""
    masked_m, expert, pos = deepgemm_peer.masked_layout(cell.sizes, m_max, q.device)
    e = len(cell.sizes)
    qm = torch.zeros(e, m_max, q.shape[1], dtype=q.dtype, device=q.device)
    sm = torch.ones(e, m_max, s.shape[1], dtype=s.dtype, device=s.device)
    qm[expert, pos], sm[expert, pos] = q, s
    return qm, sm, masked_m, expert, pos


def ours_fp8_masked(cell: GemmCell, w: Weights, xq, xscale) -> Contender:
    m_max = max(1, max(cell.sizes))
    qm, sm, masked_m, expert, pos = masked_rows(cell, xq, xscale, m_max)
    e, k = len(cell.sizes), xq.shape[1]
    wq0, ws0 = w.q("block", 0)
    config, source = first_call_config(
        lambda: grouped_mm_fp8_masked(qm, sm, wq0, ws0, masked_m),
        qm,
        choice_key(True, False, torch.bfloat16, e, k, cell.n, e * m_max),
        float(m_max),
    )

    def bind(inp):
        wq, ws = w.q("block", inp[0])
        poison_pool(qm.shape[0] * m_max * cell.n, torch.bfloat16, xq.device)
        return lambda: grouped_mm_fp8_masked(qm, sm, wq, ws, masked_m)

    return Contender(
        "ours:fp8-masked",
        bind,
        config={"m_max": m_max, **config},
        fields={"quant": BLOCK_NOTE, "config_source": source},
        parallel_compile=True,
        check=cell.checker("block", "block", xq, xscale, w, lambda out: out[expert, pos]),
    )


def ours_bf16(cell: GemmCell, w: Weights, ref64) -> Contender:
    off, k = cell.plan.group_offsets, cell.xs.shape[1]
    base, source = choose_config(cell.xs, len(cell.sizes), cell.n, "nk")

    def bind(inp):
        poison_pool(cell.xs.shape[0] * cell.n, torch.bfloat16, cell.xs.device)
        return lambda: grouped_mm(cell.xs, w.bf16[inp[0]], off, w_layout="nk", validate=False)

    return Contender(
        "ours:bf16",
        bind,
        config=dataclasses.asdict(base),
        fields={"quant": "bf16", "config_source": source},
        parallel_compile=True,
        check=lambda out: check(out, ref64, k),
    )
