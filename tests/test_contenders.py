"""E7's and E8's contenders on small random cells: each computes its product (against float64), and
E8's rows get their cell's columns."""

from __future__ import annotations

import pytest

from tests.moe_cells import small_moe_cell


def test_e7_memory_ceiling_search_and_contender(device, monkeypatch):
    """E7's memory ceiling: every launch shape checked (all bytes read, all outputs written) and timed, the
    fastest kept (GPU clock faked on the CPU); its contender passes its own check on the cell's rows, and a
    launch shape that fails the check is never chosen."""
    import dataclasses

    import experiments.e7_grouped_skew as e7
    from experiments.harness import stream
    from experiments.harness.runner import Settings

    times = iter([30.0, 10.0, 20.0, 40.0, 50.0, 60.0])  # one per launch shape

    class FakeTimer:
        def __init__(self, calls, n):
            self.n = n
            for c in calls:
                c()

        def sample(self, n):
            return [next(times)] * n

    monkeypatch.setattr("experiments.harness.timing.GraphTimer", FakeTimer)
    plan, xs, w, _ = small_moe_cell(device, 5, 6, 64, 16, 9)  # 1024 weights per expert: every kind fits
    settings = Settings(calls_per_graph=2)
    choice = e7.stream_search([w, w.clone()], xs, plan, settings)
    assert choice["config"] == stream.CANDIDATES[1] and choice["tried"] == len(stream.CANDIDATES)
    c = e7.stream_contender(choice, w, xs, plan)
    ok, rel, why = c.check(c.bind((xs, w))())
    assert ok, why
    # the fastest launch shape reads one active expert too few: it fails its check and is not timed, so the
    # fastest right one is chosen
    real_setup = stream.stream_setup

    def setup(w_, sizes, rows, config):
        s = real_setup(w_, sizes, rows, config)
        return dataclasses.replace(s, active=s.active - 1) if config == stream.CANDIDATES[1] else s

    monkeypatch.setattr(e7, "stream_setup", setup)
    times = iter([30.0, 20.0, 40.0, 50.0, 60.0])
    assert e7.stream_search([w, w.clone()], xs, plan, settings)["config"] == stream.CANDIDATES[2]
    # weights the tma kind cannot stream: only the flat launch shapes are tried
    plan, xs, w, _ = small_moe_cell(device, 5, 6, 40, 24, 9)  # 960 weights per expert
    monkeypatch.setattr(e7, "stream_setup", real_setup)
    times = iter([30.0, 20.0])
    tried = e7.stream_search([w, w.clone()], xs, plan, settings)["tried"]
    assert tried == sum(c.kind == "flat" for c in stream.CANDIDATES)


def test_e7_heldout_contenders_compute_their_products(device, monkeypatch, tmp_path):
    """E7's held-out cell: the default path (no config; records its first call's wall time, the config it
    kept and where it came from: on a GPU it times the shortlist, under the interpreter it does not), the
    distilled shortlist's first config, and torch._grouped_mm, each right against float64 on fresh data; no
    tuned entry covers the shape."""
    import experiments.e7_grouped_skew as e7
    import moegemm.grouped.config as api
    from experiments.harness.correctness import check
    from moegemm import autotune
    from moegemm.grouped import GroupedConfig

    first = GroupedConfig(16, 16, 32)
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((first, GroupedConfig(32, 32, 32)),) * 4)
    e, k, n = 5, 64, 40
    plan, xs, w, ref = small_moe_cell(device, 23, e, k, n, t=7)
    cs = e7.heldout_contenders(xs, plan, e, n)
    assert [c.name for c in cs] == ["ours:auto", e7.NEAREST, "ours:default", "torch._grouped_mm"]
    for c in cs:
        ok, rel, why = check(c.bind((xs, w))(), ref, k)
        assert ok, (c.name, why)
    auto = cs[0]
    timed = xs.is_cuda
    assert auto.fields["first_call_s"] > 0
    assert auto.fields["config_source"] == ("autotuned on this call" if timed else "default")
    kept = [__import__("dataclasses").asdict(c) for c in (first, GroupedConfig(32, 32, 32))]
    assert auto.config in (kept if timed else kept[:1]) and cs[2].config == kept[0]
    ok, _, why = check(auto.bind((xs, w))(), ref, k)  # later calls: no first-call bookkeeping
    assert ok, why
    # the same default path with this GPU's own tables hidden: the table that then served it, named
    hidden = cs[1]
    assert hidden.fields["first_call_s"] > 0 and "tables hidden" in hidden.fields["config_source"]
    assert hidden.config in (kept if timed else kept[:1])
    assert "MOEGEMM_HIDE_TABLES" not in __import__("os").environ


def test_e8_contenders_compute_the_expert_ffn(device, monkeypatch, tmp_path):
    """E8's contenders (ours, ours through transformers' interface, transformers' grouped_mm backend, the
    torch._grouped_mm pipeline, transformers' eager loop) each compute the whole expert FFN, against E8's
    float64 reference on fresh random data (a small zoo-like layer, 6 experts of which some get no token)."""
    import torch

    pytest.importorskip("transformers.integrations.moe")
    import experiments.e8_moe_layer as e8
    import moegemm.grouped.config as api
    from experiments.harness.correctness import check
    from moegemm.grouped import GroupedConfig

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)
    e, top_k, t, h, i = 6, 2, 5, 64, 32
    w_gu, w_dn = e8.ffn_weights(3, e, h, i, device=device)
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:top_k] for _ in range(t)]).to(device)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    wts = torch.softmax(torch.randn(t, top_k, generator=g), -1).to(device)
    ref = e8.ref_ffn(x, ids, wts, w_gu, w_dn)
    assert e8.layer_sizes({"up": [h, 2 * i], "down": [i, h]}) == (h, i)
    cs = e8.contenders(x, ids, wts, e, h, i, t, compiled=False, vk=None)
    assert [c.name for c in cs] == [
        "ours:moe_ffn",
        "ours:unfused-swiglu",
        "ours:moe_ffn:no-gather",
        "ours:moe_ffn:no-graph",
        "ours:hf-backend",
        "hf:grouped_mm",
        "torch._grouped_mm pipeline",
        "per-expert-loop",
    ]
    for c in cs:
        ok, rel, why = check(c.bind((w_gu, w_dn))(), ref, h + i)
        assert ok, (c.name, why)


def test_e8_annotate_gives_ffn_rows_their_cell_columns():
    """e8_moe_layer.annotate (E8's rows and probe_ffn_ceiling's): the cell's columns, the floor, bytes and
    FLOPs of the FFN's two GEMMs (gate/up [H, 2I], down [I, H]) together, and each timed row's rates."""
    import math

    from experiments.e7_grouped_skew import floor_us
    from experiments.e8_moe_layer import annotate

    m = {"split": "heldout", "experts": 8, "top_k": 2}
    rows = [{"contender": "a", "graph_us": 100.0}, {"contender": "b"}]
    annotate(rows, "E8", m, "mx", 16, "uniform", 64, 32, 5, 3, "nvidia-h200", {"gpu": "g"})
    up, dn = floor_us(32, 64, 64, 5, "nvidia-h200"), floor_us(32, 32, 64, 5, "nvidia-h200")
    assert rows[0]["floor_us"] == up[0] + dn[0] and rows[0]["bytes"] == up[1] + dn[1]
    assert rows[0]["flops"] == up[2] + dn[2] == 2 * 32 * (64 * 64 + 32 * 64)
    assert rows[0]["tflops_graph"] == rows[0]["flops"] / 100.0 / 1e6 and math.isnan(rows[1]["tflops_graph"])
    assert {
        k: rows[1][k]
        for k in ("experiment", "model", "split", "tokens", "experts", "top_k", "input_sets", "gpu")
    } == {
        "experiment": "E8",
        "model": "mx",
        "split": "heldout",
        "tokens": 16,
        "experts": 8,
        "top_k": 2,
        "input_sets": 3,
        "gpu": "g",
    }


def test_e8_gives_vllm_the_faster_of_its_own_config_and_a_light_search(monkeypatch):
    """E8's vLLM layer is timed at the fastest right config of its own choice and our light search (one
    config for both GEMMs, as vLLM takes it), each candidate checked first; duplicates are tried once; the
    row names the choice, vLLM's own config and both times; with no right config the search raises."""
    import torch

    import experiments.e8_moe_layer as e8

    own_cfg = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    fast = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16}
    wrong = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16}
    times = {str(own_cfg): 120.0, str(fast): 100.0, str(wrong): 50.0}
    monkeypatch.setattr(e8.vllm_moe, "own_choice", lambda *a: (dict(own_cfg), "vllm-default"))
    monkeypatch.setattr(e8.vllm_moe, "candidates", lambda rows: [dict(own_cfg), dict(fast), dict(wrong)])
    monkeypatch.setattr(e8.vllm_moe, "layer", lambda vk, x, ids, wts, e, config: lambda a, b: str(config))
    import experiments.e7_grouped_skew as e7

    monkeypatch.setattr(e7, "prewarm", lambda calls: len(calls))
    tried = []

    def fake_check_and_time(calls, ref, k, settings):
        cfg = calls[0]
        tried.append(cfg)
        if cfg == str(wrong):
            return {"status": "wrong", "note": "2 elements outside tolerance"}
        return {"status": "ok", "graph_us": times[cfg]}

    monkeypatch.setattr(e8, "check_and_time", fake_check_and_time)
    ids = torch.zeros(8, 2, dtype=torch.int64)
    got = e8.vllm_layer_search(None, None, ids, None, 4, 64, 32, [(1, 2)], None, None, "NVIDIA H200")
    assert got["config"] == fast and got["source"] == "search" and got["graph_us"] == 100.0
    assert got["tried"] == 3 and got["own"] == ("vllm-default", 120.0) and len(tried) == 3
    times[str(fast)] = 130.0  # vLLM's own config the faster: it is kept
    got = e8.vllm_layer_search(None, None, ids, None, 4, 64, 32, [(1, 2)], None, None, "NVIDIA H200")
    assert got["config"] == own_cfg and got["source"] == "vllm-default"
    monkeypatch.setattr(e8.vllm_moe, "candidates", lambda rows: [dict(wrong)])
    monkeypatch.setattr(e8.vllm_moe, "own_choice", lambda *a: None)
    with pytest.raises(RuntimeError, match="no config right"):
        e8.vllm_layer_search(None, None, ids, None, 4, 64, 32, [(1, 2)], None, None, "NVIDIA H200")
