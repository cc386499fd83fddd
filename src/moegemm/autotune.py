"""First-call timing, for a shape no tuned table covers: the caller's shortlist of configs is timed on the
call's own inputs, and the fastest kept in memory and on disk, so later calls, and later processes, take it
with no timing and no host sync. The grouped GEMM times the distilled shortlist of a shape's regime
(experiments/distill_grouped.py), or on a GPU no table serves a generic one (moegemm.grouped.config);
Decompose-K, on a GPU no table serves, a few backends and splits around its heuristic
(moegemm.decompose_k.first_call). Each keys its choices by its own tuple.

The grouped GEMM's first call compiles its shortlist's kernels side by side, from a pool of threads
(MOEGEMM_COMPILE_THREADS=1: one after another), then times them one at a time.

Where a call cannot time (it is being captured into a CUDA graph, traced by torch.compile, run by Triton's
interpreter, or MOEGEMM_AUTOTUNE=0), it takes the shortlist's first config and remembers nothing, so a
later call that can time still does.

The disk cache is one JSON file per GPU in $MOEGEMM_CACHE_DIR (default ~/.cache/moegemm), keyed also by
the Triton and moegemm versions that measured it; MOEGEMM_CACHE_DIR= (empty) keeps the choices in memory
only."""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import triton

from . import __version__
from ._runtime import INTERPRET, compile_threads, launch_side_by_side

REPS, ROUNDS = 5, 3  # calls per timing, interleaved rounds over the shortlist

_MEMORY: dict = {}  # (slug, key) -> config dict
_LOADED: set = set()  # slugs whose disk cache has been read


def enabled() -> bool:
    return os.environ.get("MOEGEMM_AUTOTUNE", "1") != "0"


def can_time(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` may time candidates now: a CUDA tensor, outside a graph capture and a
    torch.compile trace, not under the interpreter, autotuning not switched off. A bad
    MOEGEMM_COMPILE_THREADS raises here, before anything is timed (inside a timing it would read as a
    candidate that cannot run)."""
    if not enabled() or INTERPRET or not x.is_cuda:
        return False
    compile_threads(1)
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return False
    return not torch.cuda.is_current_stream_capturing()


def cache_file(slug: str) -> Path | None:
    d = os.environ.get("MOEGEMM_CACHE_DIR", str(Path.home() / ".cache" / "moegemm"))
    return Path(d) / f"autotune-{slug}.json" if d else None


def _versions() -> dict:
    return {"triton": triton.__version__, "moegemm": __version__}


def _read(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [e for e in data.get("entries", []) if isinstance(e, dict) and e.get("versions") == _versions()]


def lookup(slug: str, key: tuple) -> dict | None:
    """The config dict chosen earlier for ``key`` on this GPU (this process, or the disk cache), or None."""
    if slug not in _LOADED:
        _LOADED.add(slug)
        path = cache_file(slug)
        if path is not None:
            for e in _read(path):
                _MEMORY.setdefault((slug, tuple(e["key"])), e["config"])
    return _MEMORY.get((slug, key))


def remember(slug: str, key: tuple, config: dict, times_us: dict) -> None:
    """Keep ``config`` for ``key`` in memory and merge it into the disk cache (written atomically)."""
    _MEMORY[(slug, key)] = config
    path = cache_file(slug)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = [e for e in _read(path) if tuple(e["key"]) != key]
        entries.append({"key": list(key), "config": config, "versions": _versions(), "times_us": times_us})
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only home: the choice stays in memory for this process
        pass


def compile_side_by_side(launch, configs: list, kernel_of=None) -> int:
    """Launch each of ``configs`` once from a pool of threads (moegemm._runtime.launch_side_by_side: on the
    caller's device and stream), so that the kernels they need compile side by side rather than one after
    another (the first call of an unseen shape otherwise waits for every candidate's compile in turn).
    ``kernel_of(config)``: what the compiled kernel depends on, so that configs differing only in their
    launch are launched once here. Errors are left for the caller's own first launches, made afterwards one
    at a time. Returns the threads used (0: none, where there is one kernel to compile, or
    MOEGEMM_COMPILE_THREADS=1)."""
    firsts: dict = {}
    for c in configs:
        firsts.setdefault(kernel_of(c) if kernel_of is not None else c, c)
    return launch_side_by_side([functools.partial(launch, c) for c in firsts.values()])


def fastest(launch, configs: list, parallel_compile: bool = False, kernel_of=None) -> tuple[object, dict]:
    """(the fastest of ``configs``, {index: median us per call}) by CUDA events: each launched once (its
    compile), then ROUNDS interleaved rounds of REPS calls each, who goes first rotating. A config whose
    launch raises (e.g. more shared memory than this GPU has) is left out; if all raise, the first error
    is raised. ``parallel_compile``: ``launch`` is one kernel launch (no timing of its own), so the
    configs' compiles may first run side by side (:func:`compile_side_by_side`, with ``kernel_of``)."""
    if parallel_compile:
        compile_side_by_side(launch, configs, kernel_of)
    ok, first_error = [], None
    for c in configs:
        try:
            launch(c)
            ok.append(c)
        except Exception as ex:  # noqa: BLE001 - a candidate this GPU cannot run
            first_error = first_error or ex
    if not ok:
        raise first_error
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: dict = {i: [] for i in range(len(ok))}
    for r in range(ROUNDS):
        for i in [(r + j) % len(ok) for j in range(len(ok))]:
            start.record()
            for _ in range(REPS):
                launch(ok[i])
            end.record()
            end.synchronize()
            samples[i].append(start.elapsed_time(end) * 1000 / REPS)
    med = {i: statistics.median(s) for i, s in samples.items()}
    best = min(med, key=med.get)
    return ok[best], {str(configs.index(ok[i])): round(t, 3) for i, t in med.items()}
