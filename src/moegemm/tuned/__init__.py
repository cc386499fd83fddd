"""Tuned configuration tables (data), one JSON file per kernel family and GPU slug, written by the tuning
experiments (experiments/tune_decompose_k.py, experiments/tune_grouped.py) and read by the library."""

from __future__ import annotations

import json
from importlib import resources


def entries(family: str, slug: str) -> list[dict]:
    """The entries of ``<family>/<slug>.json``, or [] when no table is packaged for that GPU."""
    try:
        text = resources.files(__name__).joinpath(family, f"{slug}.json").read_text()
    except (FileNotFoundError, OSError):
        return []
    return json.loads(text)["entries"]
