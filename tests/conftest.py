"""Test setup: without a CUDA GPU every kernel runs under Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before Triton decorates any kernel, i.e. before moegemm is imported, so it
is decided here, at collection start.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poison_partials(monkeypatch):
    """Make every Decompose-K partial buffer start as NaN, so an element stage 1 forgot shows up."""
    from moegemm.decompose_k import configs

    real = configs.alloc_partials

    def poisoned(*args, **kwargs):
        return real(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(configs, "alloc_partials", poisoned)
