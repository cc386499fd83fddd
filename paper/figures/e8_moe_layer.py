"""E8: the whole expert FFN. Left: on the held-out models at prefill (T >= 1024), each peer's time over ours
per model (geomean over the prefill token counts and loads; decode, where the models differ less than the
token counts do, is on the right). Right: the same
against the token count (geomean over the held-out models and loads), with what fusing SwiGLU into the
gate/up GEMM saves (our unfused time over the fused one)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from paper.figures.common import args, finish, geomean, load, save, setup
from paper.numbers.e8 import HF_COMPILED, OURS, PREFILL, TK, TORCH, UNFUSED, VLLM, e8_frame

PEERS = {
    TORCH: "#d62728",
    HF_COMPILED: "#9467bd",
    "hf:grouped_mm": "#c5b0d5",
    VLLM: "#ff7f0e",
    TK: "#2ca02c",
    UNFUSED: "#6baed6",
}
# the legend's names
NAMES = {
    TORCH: "torch._grouped_mm pipeline",
    HF_COMPILED: "transformers grouped_mm, compiled",
    "hf:grouped_mm": "transformers grouped_mm, eager",
    VLLM: "vLLM fused_experts",
    TK: "triton_kernels matmul_ogs",
    UNFUSED: "ours, SwiGLU unfused",
}


def main():
    a = args(__doc__)
    setup()
    raw = load(a.results, "moe_layer.csv")
    o = e8_frame(raw)
    held = o[o.split == "heldout"] if (o.split == "heldout").any() else o
    peers = [c for c in PEERS if c in held]
    fig, axes = plt.subplots(1, 2, figsize=(6.7, 2.9), gridspec_kw={"width_ratios": [1.1, 1]})
    models = list(dict.fromkeys(held.model))
    y = np.arange(len(models))
    width = 0.8 / max(len(peers), 1)
    pre = held[held.tokens >= PREFILL]
    for j, c in enumerate(peers):
        vals = [geomean(pre[pre.model == m][c] / pre[pre.model == m][OURS]) for m in models]
        axes[0].barh(y + (j - (len(peers) - 1) / 2) * width, vals, width, color=PEERS[c], label=NAMES[c])
    axes[0].axvline(1.0, color="black", lw=0.8)
    axes[0].set_yticks(y, models)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("their GPU time / ours")
    axes[0].set_title(f"held out, prefill (T >= {PREFILL}), per model")
    ts = sorted(held.tokens.unique())
    for c in peers:
        axes[1].plot(
            ts,
            [geomean(held[held.tokens == t][c] / held[held.tokens == t][OURS]) for t in ts],
            marker="o",
            ms=2,
            color=PEERS[c],
        )
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("tokens T")
    axes[1].set_ylabel("their GPU time / ours")
    axes[1].set_title("held out, per T")
    h, lab = axes[0].get_legend_handles_labels()
    finish(fig, h, lab, ncol=3)
    save(fig, a.out)


if __name__ == "__main__":
    main()
