"""Expert loads for the grouped-GEMM experiment: top-k distinct experts per token, sampled on the device
with a fixed seed, under uniform, Zipf and hot-expert skews; and how skewed a load is."""

from __future__ import annotations

import torch


def sample_topk(tokens: int, experts: int, top_k: int, load: str, seed: int, device="cuda") -> torch.Tensor:
    """int64 [tokens, top_k], distinct experts per token.

    load: "uniform"; "zipf<alpha>" (experts drawn without replacement with weights 1/rank^alpha, the ranks
    a seeded permutation of the experts); "hot<fraction>" (one expert is chosen by that fraction of the
    tokens, the other choices uniform; with distinct top-k an expert can hold at most 1/top_k of all
    assignments, so the fraction is of tokens, not of assignments).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    perm = torch.randperm(experts, generator=g, device=device)
    if load == "uniform":
        w = torch.ones(experts, device=device)
    elif load.startswith("zipf"):
        alpha = float(load[4:])
        w = torch.empty(experts, device=device)
        w[perm] = 1.0 / torch.arange(1, experts + 1, device=device, dtype=torch.float32) ** alpha
    elif load.startswith("hot"):
        frac = float(load[3:])
        hot = perm[0]
        w = torch.ones(experts, device=device)
        w[hot] = 0.0
        ids = torch.multinomial(w.expand(tokens, experts), top_k, replacement=False, generator=g)
        takes_hot = torch.rand(tokens, generator=g, device=device) < frac
        ids[:, 0] = torch.where(takes_hot, hot, ids[:, 0])
        return ids
    else:
        raise ValueError(f"load: unknown load {load!r}; expected uniform, zipf<alpha> or hot<fraction>")
    return torch.multinomial(w.expand(tokens, experts), top_k, replacement=False, generator=g)


def skew_stats(group_sizes: torch.Tensor) -> dict:
    """max/mean rows per expert, Gini coefficient of the rows, and the number of active experts."""
    x = group_sizes.double().cpu().sort().values
    n, total = x.numel(), float(x.sum())
    if total == 0:
        return {"max_mean_ratio": 0.0, "gini": 0.0, "active_experts": 0}
    idx = torch.arange(1, n + 1, dtype=torch.float64)
    gini = float((2 * idx - n - 1).mul(x).sum() / (n * total))
    return {
        "max_mean_ratio": float(x.max() / (total / n)),
        "gini": gini,
        "active_experts": int((x > 0).sum()),
    }
