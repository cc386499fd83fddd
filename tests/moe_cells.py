"""Small random MoE cells the harness's tests share (the probes' and the experiments' contenders)."""

from __future__ import annotations


def small_moe_cell(device, seed: int, e: int, k: int, n: int, t: int, top_k: int = 2):
    """(routing plan, sorted bf16 rows, bf16 weights [E, N, K], float64 reference) of a small random MoE
    cell."""
    import torch

    from experiments.e7_grouped_skew import ref_rows
    from moegemm.grouped import permute, route

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(device)
    plan = route(ids, e)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(e, n, k, generator=g) / 8).to(torch.bfloat16).to(device)
    xs = permute(x, plan)
    return plan, xs, w, ref_rows(xs, w, plan.group_offsets)


def small_ffn_cell(device, monkeypatch, seed: int):
    """(E, tokens, expert ids, gating weights, gate/up and down weights, all on ``device``, and the float64
    reference of the layer) of a small random FFN cell: 9 tokens of top-2 over 5 experts, with the grouped
    GEMM's config tables replaced by one small config."""
    import torch

    from tests.test_grouped import _ffn_ref

    one_small_config(monkeypatch)
    g = torch.Generator().manual_seed(seed)
    e, t, top_k, h, i = 5, 9, 2, 32, 16
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)])
    wts = torch.rand(t, top_k, generator=g)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / 6).to(torch.bfloat16)
    w_dn = (torch.randn(e, h, i, generator=g) / 4).to(torch.bfloat16)
    ref = _ffn_ref(x, ids, wts, w_gu, w_dn)
    return (e, *[v.to(device) for v in (x, ids, wts, w_gu, w_dn)], ref)


def one_small_config(monkeypatch) -> None:
    """The grouped GEMM's config tables replaced by one small config for every regime (no tuned entry): the
    interpreter's tiles."""
    import moegemm.grouped.config as api
    from moegemm.grouped import GroupedConfig

    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)
