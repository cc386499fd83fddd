"""The buffers the single-launch Decompose-K kernel (:mod:`moegemm.decompose_k.single_launch`) runs with:
the fp32 partials and ticket counters of its last-arriver form, the (flag, value) words and launch counters
of its cooperative form, their sizes and the grid they serve; shared between plans where that is safe
(:func:`plan_state`)."""

from __future__ import annotations

import torch

from . import configs
from .configs import DecomposeKConfig, cdiv


def grid(m: int, n: int, cfg: DecomposeKConfig) -> tuple[int, int]:
    return (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), cfg.split_k)


# The last-arriver form's counters: one zero-initialised buffer per (device, stream), grown on demand. The
# kernel leaves every counter it used at zero, so the buffer is reusable by the next launch on the same
# stream without a memset launch, and a CUDA graph that captured the kernel stays correct on replay. Launch
# once outside capture first (the usual warm-up) so that the buffer is not allocated inside a capture.
_COUNTERS: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, n: int, stream: int | None = None) -> torch.Tensor:
    if stream is None:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (_device_key(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def workspace_numel(m: int, n: int, cfg: DecomposeKConfig) -> int:
    if cfg.split_k == 1:
        return 1
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return tiles * cfg.split_k * cfg.block_m * cfg.block_n


def alloc_workspace(m: int, n: int, cfg: DecomposeKConfig, device) -> torch.Tensor:
    """The last-arriver form's fp32 partials (every element written before it is read)."""
    return _partials(workspace_numel(m, n, cfg), device)


def _partials(numel: int, device) -> torch.Tensor:
    return configs.alloc_partials(1, 1, numel, device).view(-1)  # poisoned by the tests like any partials


def _coop_buffers(numel: int, tiles: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cooperative form's zeroed (flag, value) words and per-tile launch counters (:func:`coop_state`)."""
    return (
        torch.zeros(numel, dtype=torch.int64, device=device),
        torch.zeros(tiles, dtype=torch.int64, device=device),
    )


def _grown(need: int, held: int | None) -> int:
    """A shared buffer's new size: what is needed, and at least twice what is held."""
    return need if held is None else max(need, 2 * held)


# The buffers the plans of :mod:`moegemm.decompose_k.plans` launch with, shared between plans (see
# :func:`plan_state`): the last-arriver form's fp32 partials per (device, stream), and the cooperative form's
# (workspace, counters) per (device, stream, S, tile size).
_PARTIALS: dict[tuple, torch.Tensor] = {}
_COOP: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def plan_state(
    m: int, n: int, cfg: DecomposeKConfig, device: torch.device, stream: int, coop: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (workspace, counters) a plan launches with on one stream. Plans are cached per token count, so a
    server that sees every T from 1 to 256 holds hundreds; each holding a workspace of its own would keep
    megabytes per plan (a tile's S partials are padded to the whole tile). Plans on one stream run one after
    another, so they share what they safely can:

    - The last-arriver form writes every partial it reads within the same launch: one fp32 workspace per
      (device, stream) serves every plan, beside the counters of :func:`counters`.
    - In the cooperative form a word is current only if its flag matches its tile's launch counter, and tile
      t's words lie at ``t * S * BLOCK_M * BLOCK_N``: plans share a (workspace, counters) pair where S and the
      tile's size agree, so that every word of a tile is only ever written under that tile's counter, which
      only grows (a new pair starts at zero, words and counters together).

    A pair too small for a plan is replaced by one at least twice its size; the plans already holding the
    old one keep it (a CUDA graph that captured them keeps its pointers), so the buffers of one kind alive
    at once sum to less than twice the largest.

    A plan whose state is first made inside a CUDA-graph capture gets buffers of its own: what a capture
    allocates is filled only when the graph replays, so it cannot serve other plans. Graphs that captured
    plans warmed up on one stream share that stream's buffers, as graphs of one plan always did: replay
    them one at a time (on one stream, as servers do), not at once on several."""
    tiles = grid(m, n, cfg)[0]
    capturing = _capturing(device)
    if coop:
        return coop_state(m, n, cfg, device) if capturing else _shared_coop(tiles, cfg, device, stream)
    need = workspace_numel(m, n, cfg)
    ws = _partials(need, device) if capturing else _shared_partials(need, device, stream)
    return ws, counters(device, tiles, stream)


def _shared_partials(need: int, device: torch.device, stream: int) -> torch.Tensor:
    key = (_device_key(device), stream)
    ws = _PARTIALS.get(key)
    if ws is None or ws.numel() < need:
        ws = _partials(_grown(need, None if ws is None else ws.numel()), device)
        _PARTIALS[key] = ws
    return ws


def _shared_coop(tiles: int, cfg: DecomposeKConfig, device: torch.device, stream: int):
    tile = cfg.block_m * cfg.block_n
    key = (_device_key(device), stream, cfg.split_k, tile)
    held = _COOP.get(key)
    if held is None or held[1].numel() < tiles:
        tiles = _grown(tiles, None if held is None else held[1].numel())
        held = _coop_buffers(tiles * cfg.split_k * tile, tiles, device)
        _COOP[key] = held
    return held


def _device_key(device: torch.device) -> int:
    return device.index if device.type == "cuda" else -1


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def coop_state(m: int, n: int, cfg: DecomposeKConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A cooperative form's (workspace, counters) of its own (the probes' unshared form of
    :func:`plan_state`): 64-bit (flag, value) words, zeroed once (no launch's flag is 0), and one int64
    launch counter per tile, zeroed once and never reset (a flag is the launch's number, so the words of
    earlier launches never pass for new ones; it is the counter's low 32 bits, which repeat only after 2^32
    launches, long after every word has been rewritten)."""
    return _coop_buffers(workspace_numel(m, n, cfg), grid(m, n, cfg)[0], device)
