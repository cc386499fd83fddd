"""harness.stream: the per-cell memory ceiling kernel reads every active expert's weights and x once,
writes every output element, and its check catches a pass that does less."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEVICE
from experiments.harness.stream import CANDIDATES, StreamConfig, check_stream, stream_bytes, stream_setup


def _cell(e, n, k, sizes, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g).to(dtype).to(DEVICE)
    rows = int(sum(sizes))
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    return w, x, torch.tensor(sizes, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    "config", [StreamConfig(64, 2, 4), StreamConfig(256, 1, 4), *[c for c in CANDIDATES if c.kind == "flat"]]
)
@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 7, 0], [0, 0, 0, 0], [2, 2, 2, 2]])
def test_stream_reads_active_experts_and_x_and_writes_y(config, sizes):
    w, x, gs = _cell(4, 24, 40, sizes)  # 960 weight elements per expert: not a multiple of the blocks
    s = stream_setup(w, gs, x.shape[0], config)
    assert s.active == sum(m > 0 for m in sizes)
    s.y.fill_(float("nan"))
    out = stream_bytes(w, x, s)
    ok, rel, why = check_stream(out, w, x, gs, s.y)
    assert ok, why
    assert rel < 1e-5
    assert int(out[1].long().sum()) == s.active * 24 * 40 + x.numel()


@pytest.mark.parametrize(
    "config",
    [
        StreamConfig(2, 2, 4, "tma", 2),
        StreamConfig(4, 1, 4, "tma", 3),
        *[c for c in CANDIDATES if c.kind == "tma"],
    ],
)
@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 0, 0], [2, 2, 2, 2]])
def test_stream_by_tma_boxes(config, sizes):
    w, x, gs = _cell(4, 16, 48, sizes, seed=3)  # 3 rows of 256 per expert: boxes overrun the slab's end
    s = stream_setup(w, gs, x.shape[0], config)
    s.y.fill_(float("nan"))
    ok, rel, why = check_stream(stream_bytes(w, x, s), w, x, gs, s.y)
    assert ok, why
    short = dataclasses.replace(s, active=max(s.active - 1, 0))
    s.y.fill_(float("nan"))
    assert check_stream(stream_bytes(w, x, short), w, x, gs, s.y)[0] == (s.active == 0)


def test_check_catches_a_pass_that_skips_an_expert_or_an_output():
    w, x, gs = _cell(5, 16, 32, [4, 1, 0, 2, 3])
    s = stream_setup(w, gs, x.shape[0], StreamConfig(128, 2, 4))
    short = dataclasses.replace(s, active=s.active - 1)  # one active expert's bytes not read
    s.y.fill_(float("nan"))
    ok, _, why = check_stream(stream_bytes(w, x, short), w, x, gs, s.y)
    assert not ok and "elements" in why
    out = stream_bytes(w, x, s)
    s.y[-1, -1] = float("nan")  # an output element left unwritten
    ok, _, why = check_stream(out, w, x, gs, s.y)
    assert not ok and "written" in why
    s.y.zero_()
    sums, counts = out
    bad = (sums.clone(), counts)
    bad[0][0] += 1000.0  # the read values summed wrong
    ok, _, why = check_stream(bad, w, x, gs, s.y)
    assert not ok and "sum" in why
    nan = (torch.full_like(sums, float("nan")), counts)
    assert not check_stream(nan, w, x, gs, s.y)[0]


def test_stream_rejects_bad_input():
    w, x, gs = _cell(3, 8, 16, [1, 2, 0])
    with pytest.raises(ValueError, match="w: expected a contiguous"):
        stream_setup(w.transpose(1, 2), gs, 3)
    with pytest.raises(ValueError, match="group_sizes"):
        stream_setup(w, gs[:2], 3)
    with pytest.raises(ValueError, match="rows"):
        stream_setup(w, gs, -1)
    s = stream_setup(w, gs, 3)
    with pytest.raises(ValueError, match="x: expected"):
        stream_bytes(w, x[:2], s)
    with pytest.raises(ValueError, match="x: expected"):
        stream_bytes(w, x.float(), s)
    with pytest.raises(ValueError, match="config.kind: expected"):
        stream_setup(w, gs, 3, StreamConfig(kind="ldg"))
    with pytest.raises(ValueError, match="config.kind: 'tma' needs"):
        stream_setup(w, gs, 3, StreamConfig(4, kind="tma"))  # 128 elements per expert
    with pytest.raises(ValueError, match="config.kind: 'tma' needs"):
        stream_setup(torch.randn(3, 16, 32, device=DEVICE), gs, 3, StreamConfig(4, kind="tma"))  # 32-bit
