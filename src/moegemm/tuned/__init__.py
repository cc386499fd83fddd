"""Tuned configuration tables (data), one JSON file per kernel family and GPU slug, written by the tuning
experiments (experiments/tune_decompose_k.py, experiments/tune_grouped.py, experiments/distill_grouped.py)
and read by the library; ``hardware.json`` holds the traits of each GPU a table was tuned on.

A table is keyed by the card that measured it, but what decides a config is the hardware: the architecture,
the multiprocessors, the shared memory per program, the memory. So a GPU is served by its own table where
one is packaged, else by the table of the nearest card of its architecture (:func:`serving`); a GPU of an
architecture no table was tuned on gets none, and the library then times a shortlist on the first call of
each shape. ``MOEGEMM_HIDE_TABLES`` (slugs, comma-separated, or ``all``) hides packaged tables, as if they
were not there: what a card without its own table gets, measured on one that has it."""

from __future__ import annotations

import functools
import json
import math
import os
from importlib import resources

from .._runtime import GpuTraits, traits_of

FAMILIES = ("decompose_k", "grouped", "grouped_default")


def entries(family: str, slug: str | None) -> list[dict]:
    """The entries of ``<family>/<slug>.json``, or [] when no table is packaged for that GPU (or slug is
    None)."""
    if slug is None:
        return []
    try:
        text = resources.files(__name__).joinpath(family, f"{slug}.json").read_text()
    except (FileNotFoundError, OSError):
        return []
    return json.loads(text)["entries"]


@functools.lru_cache(maxsize=None)
def packaged(family: str) -> tuple[str, ...]:
    """The slugs with a table of ``family`` in the package, sorted."""
    folder = resources.files(__name__).joinpath(family)
    try:
        names = [p.name for p in folder.iterdir()]
    except (FileNotFoundError, OSError, NotADirectoryError):
        return ()
    return tuple(sorted(n[: -len(".json")] for n in names if n.endswith(".json")))


@functools.lru_cache(maxsize=None)
def hardware() -> dict[str, GpuTraits]:
    """{slug: the traits of the GPU its tables were tuned on} (hardware.json)."""
    try:
        text = resources.files(__name__).joinpath("hardware.json").read_text()
    except (FileNotFoundError, OSError):
        return {}
    return {slug: GpuTraits.from_dict(d) for slug, d in json.loads(text)["gpus"].items()}


def hidden() -> set[str] | None:
    """The slugs whose tables MOEGEMM_HIDE_TABLES hides (None: every table)."""
    raw = os.environ.get("MOEGEMM_HIDE_TABLES", "").strip()
    if raw == "all":
        return None
    return {s.strip() for s in raw.split(",") if s.strip()}


def distance(a: GpuTraits, b: GpuTraits) -> tuple[float, float, float] | None:
    """How far card ``b``'s configs are from fitting card ``a``: None across architectures (another
    compute capability: other instructions, other tiles), else the log-ratios of SM count, shared memory
    per program and memory size, compared in that order."""
    if a.capability != b.capability:
        return None

    def gap(x: float, y: float) -> float:
        return abs(math.log(max(x, 1e-9) / max(y, 1e-9)))

    return (
        gap(a.sm_count, b.sm_count),
        gap(a.smem_per_block, b.smem_per_block),
        gap(a.memory_gib, b.memory_gib),
    )


def serving(family: str, slug: str) -> str | None:
    """The slug of the packaged ``family`` table that serves the GPU named ``slug``: its own, else that of
    the nearest card of the same architecture (:func:`distance`; the slug breaks a tie), else None. A
    hidden table (MOEGEMM_HIDE_TABLES) serves no GPU. Cached per (family, GPU, traits, hidden tables): a
    call on a hot path costs a dictionary look-up."""
    me = traits_of(slug) or hardware().get(slug)
    return _serving(family, slug, me, os.environ.get("MOEGEMM_HIDE_TABLES", ""))


@functools.lru_cache(maxsize=None)
def _serving(family: str, slug: str, me: GpuTraits | None, hide_env: str) -> str | None:
    hide = hidden()
    tables = [s for s in packaged(family) if hide is not None and s not in hide]
    if slug in tables:
        return slug
    if me is None:
        return None
    known = hardware()
    near = [(d, s) for s in tables if s in known and (d := distance(me, known[s])) is not None]
    return min(near)[1] if near else None


def describe(slug: str) -> dict[str, str | None]:
    """{family: the slug of the table that serves this GPU, or None} (for reports: ``python -m moegemm``)."""
    return {family: serving(family, slug) for family in FAMILIES}
