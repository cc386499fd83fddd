"""moegemm in five minutes: an MoE layer's router and experts through the public API, with its defaults.

    python examples/quickstart.py

On a machine with a CUDA GPU it runs real-ish shapes there; without one it runs tiny shapes on the CPU
under Triton's interpreter (it sets TRITON_INTERPRET=1 itself, before importing moegemm). Every step is
checked against a float64 reference and printed; the exit status is 0 only if all of them pass.

Expert weights are stored as nn.Linear stores them, [E, out_features, in_features]: the library's default
``w_layout="nk"``.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():  # Triton decides this when moegemm's kernels are defined: set it first
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moegemm import decompose_k  # noqa: E402
from moegemm.grouped import (  # noqa: E402
    grouped_mm,
    grouped_mm_masked,
    moe_ffn,
    permute,
    route,
    sorted_weights,
    unpermute,
)

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16
TOL = 2e-2  # bf16 inputs, fp32 accumulation: largest error over the reference's largest magnitude

# tokens, hidden size, expert FFN (intermediate) width, experts, experts per token
T, H, INTER, E, TOP_K = (512, 2048, 768, 64, 8) if ON_GPU else (8, 32, 16, 4, 2)

failures: list[str] = []


def report(step: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Print one step's result against its float64 reference; remember a failure."""
    got = got.detach().double().cpu()
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)) if ref.numel() else 0.0
    ok = got.shape == ref.shape and not torch.isnan(got).any() and err <= TOL
    print(f"{step:<24} {str(tuple(got.shape)):<16} rel. error {err:.1e}  {'ok' if ok else 'FAILED'}")
    if not ok:
        failures.append(step)


def main() -> int:
    torch.manual_seed(0)
    where = "GPU " + torch.cuda.get_device_name() if ON_GPU else "CPU (Triton interpreter)"
    print(
        f"moegemm quick start on {where}: T={T} tokens, H={H}, I={INTER}, E={E} experts, top-{TOP_K}, {DTYPE}"
    )
    rand = lambda *shape, scale=1.0: (torch.randn(*shape) * scale).to(DEVICE, DTYPE)  # noqa: E731

    x = rand(T, H)
    w_router = rand(E, H, scale=H**-0.5)  # nn.Linear(H, E).weight
    w_up = rand(E, INTER, H, scale=H**-0.5)  # one nn.Linear(H, INTER) per expert, stacked: [E, N, K]
    w_down = rand(E, H, INTER, scale=INTER**-0.5)  # nn.Linear(INTER, H) per expert
    w_gate_up = rand(E, 2 * INTER, H, scale=H**-0.5)  # gate rows first, then up rows
    x64 = x.double().cpu()

    # 1. The router GEMM by Decompose-K: a skinny [T, H] @ [H, E] with a long K.
    logits = decompose_k.matmul(x, w_router.t())
    report("decompose_k.matmul", logits, x64 @ w_router.double().cpu().t())

    # 2. Top-k routing, then the tokens grouped by expert (one row per (token, expert) pair).
    weights, ids = torch.topk(logits.float().softmax(-1), TOP_K)
    weights = weights / weights.sum(-1, keepdim=True)
    plan = route(ids, E)
    xs = permute(x, plan)
    report("route + permute", xs, x64[plan.sorted_token_ids.long().cpu()])

    # 3. One grouped GEMM for all experts: rows of expert e times w_up[e]^T.
    h = grouped_mm(xs, w_up, plan.group_offsets)
    off = plan.group_offsets.tolist()
    expert_of_row = [e for e in range(E) for _ in range(off[e], off[e + 1])]
    xs64, up64 = xs.double().cpu(), w_up.double().cpu()
    h64 = torch.stack([xs64[r] @ up64[e].t() for r, e in enumerate(expert_of_row)]) if xs.shape[0] else None
    report("grouped_mm", h, h64)

    # 4. Down projection with the gating weights fused into its store, then back to token order.
    ys = grouped_mm(h, w_down, plan.group_offsets, row_scale=sorted_weights(weights, plan))
    y = unpermute(ys, plan, None)
    h_in = h.double().cpu()
    dn64 = w_down.double().cpu()
    y64 = torch.zeros(T, H, dtype=torch.float64)
    w_sorted = sorted_weights(weights, plan).double().cpu()
    for r, e in enumerate(expert_of_row):
        y64[int(plan.sorted_token_ids[r])] += w_sorted[r] * (h_in[r] @ dn64[e].t())
    report("grouped_mm + unpermute", y, y64)

    # 5. Decode without a host sync: static [E, m_max, H] rows per expert, of which masked_m[e] count.
    m_max = max(1, max(off[e + 1] - off[e] for e in range(E)))
    x_e = torch.zeros(E, m_max, H, device=DEVICE, dtype=DTYPE)
    for e in range(E):
        x_e[e, : off[e + 1] - off[e]] = xs[off[e] : off[e + 1]]
    masked_m = plan.group_sizes
    h_e = grouped_mm_masked(x_e, w_up, masked_m)
    report("grouped_mm_masked", torch.cat([h_e[e, : off[e + 1] - off[e]] for e in range(E)]), h64)

    # 6. The whole expert FFN in one call: SwiGLU experts, routing and combine included. The reference
    # rounds the [rows, INTER] activation to bf16, as the layer keeps it in x's dtype between its two GEMMs.
    y = moe_ffn(x, ids, weights, w_gate_up, w_down)
    gu64, y64 = w_gate_up.double().cpu(), torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(TOP_K):
            e = int(ids[t, j])
            gu = x64[t] @ gu64[e].t()
            act = (torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]).to(DTYPE).double()
            y64[t] += float(weights[t, j]) * (act @ dn64[e].t())
    report("moe_ffn", y, y64)

    if failures:
        print(f"quick start: {len(failures)} step(s) FAILED: {', '.join(failures)}")
        return 1
    print("quick start: every step matches its float64 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
