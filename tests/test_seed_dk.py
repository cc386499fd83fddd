"""The seed's kernels as contenders (experiments/seed_dk.py): loading from MOEGEMM_SEED_SOURCE and the config
search, on a stand-in module (the seed's own code is not in this repository; the GPU run uses it)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from experiments import seed_dk


def test_unset_source_is_none(monkeypatch):
    monkeypatch.delenv("MOEGEMM_SEED_SOURCE", raising=False)
    assert seed_dk.load() is None


def test_source_without_the_kernels_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEGEMM_SEED_SOURCE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"MOEGEMM_SEED_SOURCE={tmp_path}: missing kernels/"):
        seed_dk.load()


def test_load_imports_both_kernels_and_records_their_hash(monkeypatch, tmp_path):
    pkg = tmp_path / "decompose-k" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "decompose_k_triton_kernel.py").write_text("NAME = 'original'\n")
    (pkg / "decompose_k_triton_kernel_optimized.py").write_text(
        "from kernels.decompose_k_triton_kernel import NAME as BASE\nNAME = 'optimized'\n"
    )
    monkeypatch.setenv("MOEGEMM_SEED_SOURCE", str(tmp_path / "decompose-k"))
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    seed = seed_dk.load()
    assert seed.modules["original"].NAME == "original" and seed.modules["optimized"].BASE == "original"
    assert seed.origin.startswith(str(tmp_path / "decompose-k")) and " sha256:" in seed.origin


@dataclasses.dataclass(frozen=True)
class _Cfg:
    split_k: int
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


class _FakeSeed:
    """A module with the seed's interface: splits 2/4/8, three tiles, a correct matmul."""

    KernelConfig = _Cfg

    @staticmethod
    def inductor_like_splits(m, n, k, limit):
        return [s for s in (4, 2, 8) if k % s == 0]

    @staticmethod
    def candidate_configs(splits):
        return [_Cfg(s, bm, 16, 32, 8, 4, 4) for s in splits for bm in (16, 32, 64)]

    @staticmethod
    def decompose_k_relu_out(a, b, c, partials, config, *, fuse_relu):
        out = a.float() @ b.float()
        return c.copy_(torch.relu(out) if fuse_relu else out)


def test_search_walks_tiles_then_splits_then_the_best_tiles(monkeypatch):
    """Coordinate descent: every tile at the first split, every split at the best tile, the top tiles at the
    best split; each config checked before it is timed, and the fastest returned."""
    import experiments.common as common

    # a made-up clock: split 8 and block_m 32 are fastest, the two effects independent
    def fake_time(calls, ref, k, settings):
        out = calls[0]()
        assert torch.allclose(out.double(), ref, atol=1e-3)
        cfg = fake_time.current
        return {"status": "ok", "graph_us": 10.0 / cfg.split_k + abs(cfg.block_m - 32) / 16, "note": ""}

    made = []
    real_runner = seed_dk.runner

    def runner(mod, a, b, config, epilogue, bias=None):
        made.append(config)
        call = real_runner(mod, a, b, config, epilogue, bias)

        def timed():
            fake_time.current = config
            return call()

        return timed

    monkeypatch.setattr(common, "check_and_time", fake_time)
    monkeypatch.setattr(seed_dk, "runner", runner)
    a, b = torch.randn(8, 64), torch.randn(64, 16)
    ref = torch.relu(a.double() @ b.double())
    log = []
    best, us, n = seed_dk.search(_FakeSeed, "optimized", [(a, b, None)], ref, 64, "relu", None, log, top=2)
    assert (best.split_k, best.block_m) == (8, 32)
    tried = [(r["split_k"], r["block_m"]) for r in log]
    assert tried[:3] == [(4, 16), (4, 32), (4, 64)]  # tiles at the first split
    assert set(tried[3:5]) == {(2, 32), (8, 32)}  # the other splits at the best tile
    assert set(tried[5:]) == {(8, 16)}  # the second-best tile at the best split (the best one already timed)
    assert n == len(log) == 6 and us == pytest.approx(10.0 / 8)


def test_contender_applies_what_the_seed_cannot_fuse():
    a, b, bias = torch.randn(4, 32), torch.randn(32, 8), torch.randn(8)
    cfg = _Cfg(4, 16, 16, 32, 8, 4, 4)
    for epilogue, fused in (("relu", True), ("none", True), ("sigmoid", False)):
        c = seed_dk.contender(_FakeSeed, "optimized", cfg, epilogue)
        assert c.name == "seed: optimized" and c.fields["epilogue_fused"] is fused
        got = c.bind((a, b, bias))()
        want = {"relu": torch.relu, "none": lambda x: x, "sigmoid": torch.sigmoid}[epilogue](a @ b + bias)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
