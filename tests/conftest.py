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
    spread_long_tests(items, getattr(config, "workerinput", {}).get("workercount", 1))
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def spread_long_tests(items: list, workers: int) -> None:
    """Under pytest-xdist's work stealing each worker is first dealt a contiguous 1/workers of the
    collection, and the others steal from the end of a worker's queue: long tests in one chunk run one after
    the other, and one deep in a chunk starts late (the S4 runs' verify: the six compile-check shards were all
    dealt to one worker, and five of them and a 75 s test were among the last to finish). So the tests
    marked ``long`` go to the heads of the chunks, one each (every worker collects in the same order, so all
    agree). Without xdist: no change."""
    long_items = [it for it in items if "long" in it.keywords]
    if workers < 2 or not long_items:
        return
    rest = [it for it in items if "long" not in it.keywords]
    per = len(items) / workers
    heads = {int(round(j * per)): it for j, it in enumerate(long_items[:workers])}
    spill = long_items[workers:]
    out, r = [], iter(spill + rest)
    for pos in range(len(items)):
        out.append(heads[pos] if pos in heads else next(r))
    items[:] = out


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
