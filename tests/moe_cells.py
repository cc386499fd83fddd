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


def one_small_config(monkeypatch) -> None:
    """The grouped GEMM's config tables replaced by one small config for every regime (no tuned entry): the
    interpreter's tiles."""
    import moegemm.grouped.config as api
    from moegemm.grouped import GroupedConfig

    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)
