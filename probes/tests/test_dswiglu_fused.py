"""The fused SwiGLU backward (probes/dswiglu_fused.py: the backward in the epilogue of the down projection's
dX GEMM, one TMA launch), which the backward's probe measures against the library's two-launch form: its
gradients through moe_ffn against float64 with its epilogue whole or in column chunks, and its tiles
checked. On the CPU under Triton's interpreter at 16- and 32-column tiles; on a GPU at the probe's tiles."""

from __future__ import annotations

import functools

import pytest
import torch

from moegemm.grouped import autograd as ag
from moegemm.grouped import backward as bw
from moegemm.grouped import moe_ffn
from probes import dswiglu_fused as F
from tests.test_grouped_backward import (
    TOL,
    LaunchSpy,
    assert_ffn_grads,
    ffn_inputs,
    poison,  # noqa: F401 - the fixture: every torch.empty starts as NaN
    tma_h,
)

pytestmark = pytest.mark.probe  # the probes' own tests (the pipeline runs no probe)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch, tmp_path):
    """As in tests/test_grouped_backward.py: interpreter-sized forward tiles, no cache file at home."""
    from tests.moe_cells import one_small_config

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    if not torch.cuda.is_available():
        one_small_config(monkeypatch)


def tiles(**over) -> dict:
    """The fused kernel's tiles with ``over`` changed: the interpreter's 16-wide ones, or the probe's."""
    return dict(bw._INTERPRET_SWIGLU if bw.INTERPRET else F.FUSED_TILES, **over)


def use_fused(monkeypatch, t: dict) -> LaunchSpy:
    """moe_ffn's backward through the fused kernel at tiles ``t``; the kernel's launches spied on."""
    spy = LaunchSpy(F._dswiglu_tma_kernel)
    monkeypatch.setattr(F, "_dswiglu_tma_kernel", spy)
    monkeypatch.setattr(bw, "swiglu_grad", functools.partial(F.fused_swiglu_grad, tiles=t))
    return spy


@pytest.mark.parametrize("block_n, split", [(16, 1), (16, 2), (16, 4), (32, 2)])
@pytest.mark.parametrize("i", [48, 40])
def test_fused_dswiglu_against_float64(block_n, split, i, device, monkeypatch, poison):  # noqa: F811
    """The fused kernel's gradients through moe_ffn (the gate/up product kept and overwritten) against
    float64, its epilogue whole or through the accumulator's column halves or quarters (EPI_SPLIT). Under
    the interpreter: I = 48 whole tiles; I = 40 with 16-column tiles in quarters, a tile's last chunks wholly
    past I; with 32-column tiles in halves, a chunk across I. The row scale's gradient sums every chunk's
    partial. On a GPU, the probe's tiles at each split."""
    monkeypatch.setattr(ag, "SAVE_GATE_UP", True)
    t = tiles(EPI_SPLIT=split) if not bw.INTERPRET else tiles(BLOCK_N=block_n, EPI_SPLIT=split)
    spy = use_fused(monkeypatch, t)
    x, ids, tw, wgu, wd = ffn_inputs(torch.bfloat16, "nk", device, seed=60 + i, t=11, h=tma_h(), i=i, e=3)
    y = moe_ffn(x, ids, tw, wgu, wd, w_layout="nk")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8)).to(y.dtype).to(device)
    y.backward(dy)
    assert spy.launches == 1
    assert_ffn_grads(x, ids, tw, wgu, wd, dy, "nk", TOL[torch.bfloat16] * 2)


BAD_TILES = [({"FLATEN": True}, "FLATEN"), ({"EPI_SPLIT": 3}, "tiles: EPI_SPLIT")]


@pytest.mark.parametrize("over, match", BAD_TILES, ids=["key", "split"])
def test_fused_dswiglu_tiles_are_validated(over, match, device, monkeypatch):
    """A key the fused kernel's tiles do not know, or an epilogue split it has no branch for (3), is
    refused, naming it, not ignored or run wrongly."""
    use_fused(monkeypatch, tiles(**over))
    x, ids, tw, wgu, wd = ffn_inputs(torch.bfloat16, "nk", device, seed=71, t=5, h=tma_h(), i=16, e=3)
    y = moe_ffn(x, ids, tw, wgu, wd, w_layout="nk")
    with pytest.raises(ValueError, match=match):
        y.backward(torch.ones_like(y))
