"""moe_ffn at decode as one CUDA-graph replay: the host's cost of a decode step is a dictionary lookup, three
copies into the graph's inputs, the replay and a copy of its output, in place of the layer's launches and
the Python around each.

A decode step (at most GRAPH_ROWS routed rows, T * top_k) of a call signature seen before (the shapes,
strides, dtypes and device of every tensor, the weights' addresses, the call's arguments and whether the
gathering gate/up form may be taken, the current stream) replays a graph of the whole layer captured at its
second call (its first runs eagerly: its GEMMs' first calls time their configs there, outside any capture).
The graph reads the weights where they live, so new values written into them are read; its inputs are copies
made on each call, and its output is copied out, so the caller owns what it gets and can hold it across calls.
The graphs of one stream share one memory pool (their replays are ordered by the stream; each keeps its output
alone), so a graph costs its inputs and its output, a few rows of H each. Nothing is captured while the caller
captures a graph of its own (its capture takes the layer's kernels), under torch.compile, under the
interpreter, where a gradient is recorded, or with ``MOEGEMM_LAYER_GRAPHS=0``. At most MAX_GRAPHS graphs are
kept; past them the least recently used is dropped, and its signature, like one whose capture failed, runs
eagerly from then on (no signature is captured twice, and a capture costs milliseconds)."""

from __future__ import annotations

import collections
import os
import threading

import torch

from .._runtime import INTERPRET
from . import ffn

GRAPH_ROWS = 512  # the most routed rows (T * top_k) a captured step holds: decode
MAX_GRAPHS = 256  # (a model's MoE layers x its decode batch sizes)
ENV = "MOEGEMM_LAYER_GRAPHS"


class _Graph:
    """One captured layer: the graph, its static inputs and its output."""

    __slots__ = ("graph", "x", "ids", "wts", "y")

    def __init__(self, graph, x, ids, wts, y):
        self.graph, self.x, self.ids, self.wts, self.y = graph, x, ids, wts, y


_GRAPHS: collections.OrderedDict = collections.OrderedDict()  # key -> _Graph, least recently used first
_SEEN: dict = {}  # the keys whose first call ran eagerly, not yet captured
_EAGER: dict = {}  # the keys whose capture failed or whose graph was dropped (oldest first)
_POOLS: dict = {}  # (device, stream) -> the memory pool its graphs share
_LOCK = threading.RLock()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _key(call, x, ids, wts, w_gate_up, w_down) -> tuple:
    return (
        torch.cuda.current_stream(x.device).cuda_stream,  # (a graph's inputs are written on one stream)
        ffn.GATHER,  # (the gate/up forms the layer may take)
        call.key,
        x.shape,
        x.stride(),
        x.dtype,
        x.device,
        ids.shape,
        ids.stride(),
        ids.dtype,
        wts.stride(),
        wts.dtype,
        w_gate_up.data_ptr(),
        w_gate_up.shape,
        w_gate_up.stride(),
        w_down.data_ptr(),
        w_down.shape,
        w_down.stride(),
    )


def forward(forward_fn, call, x, ids, wts, w_gate_up, w_down) -> torch.Tensor:
    """``forward_fn(call, x, ids, wts, w_gate_up, w_down)`` (the layer's eager forward, no gradient), or the
    replay of its graph for this call signature where one applies (see the module's doc)."""
    if (
        torch.compiler.is_compiling()  # (first: nothing after it is traced)
        or ids.numel() > GRAPH_ROWS
        or INTERPRET
        or not x.is_cuda
        or not enabled()
        or torch.cuda.is_current_stream_capturing()
    ):
        return forward_fn(call, x, ids, wts, w_gate_up, w_down)
    key = _key(call, x, ids, wts, w_gate_up, w_down)
    with _LOCK:  # (threads on one stream: each call's copies, replay and copy out enqueued together)
        return _run(key, forward_fn, call, x, ids, wts, w_gate_up, w_down)


def _run(key, forward_fn, call, x, ids, wts, w_gate_up, w_down) -> torch.Tensor:
    g = _GRAPHS.get(key)
    if g is None:
        if key in _EAGER:  # its capture failed, or it was dropped: eager from now on (no capture twice)
            return forward_fn(call, x, ids, wts, w_gate_up, w_down)
        if key not in _SEEN:  # the first call: eager (its GEMMs' first calls time their configs)
            if len(_SEEN) >= 8 * MAX_GRAPHS:  # (signatures seen once and never again)
                _SEEN.clear()
            _SEEN[key] = True
            return forward_fn(call, x, ids, wts, w_gate_up, w_down)
        del _SEEN[key]
        try:
            g = _capture(forward_fn, call, x, ids, wts, w_gate_up, w_down)
        except Exception:  # noqa: BLE001 - a step that cannot be captured here runs eagerly from now on
            _EAGER[key] = True
            return forward_fn(call, x, ids, wts, w_gate_up, w_down)
        _GRAPHS[key] = g
        while len(_GRAPHS) > MAX_GRAPHS:
            _EAGER[_GRAPHS.popitem(last=False)[0]] = True
        while len(_EAGER) > 8 * MAX_GRAPHS:
            _EAGER.pop(next(iter(_EAGER)))
    else:
        _GRAPHS.move_to_end(key)
    g.x.copy_(x)
    g.ids.copy_(ids)
    g.wts.copy_(wts)
    g.graph.replay()
    return g.y.clone()


def _capture(forward_fn, call, x, ids, wts, w_gate_up, w_down) -> _Graph:
    """The layer captured on inputs of this call's signature: a warm-up call on the capture's stream first,
    as CUDA-graph capture asks, then the capture, into the memory pool the graphs of this stream share (their
    replays are ordered by the stream, and each keeps only its output), with no device-wide sync and no
    capture-wide error mode (other threads' CUDA calls go on). The static inputs are ordinary tensors even
    under inference_mode, so that a later call outside it can write them."""
    with torch.inference_mode(False):
        sx, sids, swts = (
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in (x, ids, wts)
        )
    sx.copy_(x)
    sids.copy_(ids)
    swts.copy_(wts)
    current = torch.cuda.current_stream(x.device)
    side = torch.cuda.Stream(x.device)
    side.wait_stream(current)
    pool = _POOLS.setdefault((x.device, current.cuda_stream), torch.cuda.graph_pool_handle())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        forward_fn(call, sx, sids, swts, w_gate_up, w_down)
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            y = forward_fn(call, sx, sids, swts, w_gate_up, w_down)
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return _Graph(graph, sx, sids, swts, y)


def clear() -> None:
    """Drop every captured layer (and the memory of its intermediates) and what was kept of the others."""
    with _LOCK:
        _GRAPHS.clear()
        _SEEN.clear()
        _EAGER.clear()
        _POOLS.clear()
