"""Probe (not a pipeline step): where the expert FFN's GPU time goes, kernel by kernel. E8 times the whole
layer; this probe profiles a few of its cells (E8's weights, routing and activations) with torch.profiler
and sums each kernel's device time per call, for:

- ``ours:moe_ffn``: moegemm.grouped.moe_ffn as it stands (the un-permute a gather kernel);
- ``ours:moe_ffn:scatter-unpermute``: the same with the un-permute as an fp32 scatter to [T * top_k, H]
  slots and a sum over top_k (how moe_ffn un-permuted before the gather kernel);
- ``torch._grouped_mm pipeline`` and ``hf:grouped_mm:compiled``: E8's peers.

One row per (cell, contender, kernel): its device microseconds per call.

    python -m experiments.probe_moe_breakdown --out results/<slug>/probe_moe_breakdown.csv
"""

from __future__ import annotations

import argparse
import collections

import torch

from experiments.common import ResultWriter, load_config, provenance_fields, require_gpu
from experiments.e8_moe_layer import ffn_weights, hf_experts, layer_sizes, torch_pipeline
from moegemm.bench.moe_loads import sample_topk
from moegemm.grouped import grouped_mm, grouped_mm_swiglu, moe_ffn, permute, route, sorted_weights

CELLS = [("qwen3-30b-a3b", 4096), ("olmoe-1b-7b", 4096), ("qwen3-235b-a22b", 4096), ("gpt-oss-20b", 4096),
         ("qwen3-30b-a3b", 256), ("deepseek-v2-lite", 1024)]
ITERS = 10


def scatter_unpermute_ffn(x, ids, wts, w_gu, w_dn, e: int):
    plan = route(ids, e, validate=False)
    act = grouped_mm_swiglu(permute(x, plan), w_gu, plan.group_offsets, w_layout="nk", validate=False)
    ys = grouped_mm(act, w_dn, plan.group_offsets, w_layout="nk", row_scale=sorted_weights(wts, plan),
                    validate=False)
    t, k, n = plan.num_tokens, plan.top_k, ys.shape[1]
    slots = torch.empty((t * k, n), dtype=torch.float32, device=ys.device)
    slots[plan.sorted_slot.to(torch.int64)] = ys.float()
    return slots.view(t, k, n).sum(dim=1).to(ys.dtype)


def kernel_times(fn) -> tuple[dict, float]:
    """({kernel name: device us per call}, CUDA-event us per call) over ITERS calls after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) * 1000 / ITERS
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    per: dict = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / ITERS if hasattr(ev, "device_time") else ev.cuda_time / ITERS
    return dict(per), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    require_gpu()
    g = load_config()["grouped"]
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("model", "tokens"))
    for model, t in CELLS:
        m = g["models"][model]
        e, top_k = m["experts"], m["top_k"]
        h, i = layer_sizes(m)
        w_gu, w_dn = ffn_weights(g["seed"] + 8, e, h, i)
        ids = sample_topk(t, e, top_k, "uniform", g["seed"] + t).to(torch.int64)
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        wts = torch.softmax(torch.randn(t, top_k, device="cuda"), -1)
        torch._dynamo.reset()
        hf = torch.compile(hf_experts(w_gu, w_dn, "grouped_mm"), fullgraph=True)
        fns = {"ours:moe_ffn": lambda: moe_ffn(x, ids, wts, w_gu, w_dn),
               "ours:moe_ffn:scatter-unpermute": lambda: scatter_unpermute_ffn(x, ids, wts, w_gu, w_dn, e),
               "torch._grouped_mm pipeline": lambda: torch_pipeline(x, ids, wts, w_gu, w_dn, e),
               "hf:grouped_mm:compiled": lambda: hf(x, ids, wts)}
        ref = moe_ffn(x, ids, wts, w_gu, w_dn).float()
        rows = []
        for name, fn in fns.items():
            err = float((fn().float() - ref).abs().max() / ref.abs().max())
            per, wall = kernel_times(fn)
            for kname, us in sorted(per.items(), key=lambda kv: -kv[1]):
                rows.append({"model": model, "tokens": t, "split": m["split"], "contender": name,
                             "kernel": kname[:120], "device_us": round(us, 2), "event_us": round(wall, 2),
                             "max_rel_diff_vs_ours": err, **prov})
            top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
            print(f"{model} T={t} {name}: {wall:.0f} us (kernels {sum(per.values()):.0f}); "
                  + "; ".join(f"{k[:40]} {v:.0f}" for k, v in top), flush=True)
        writer.add(rows)
        del w_gu, w_dn, hf
    writer.finish()


if __name__ == "__main__":
    main()
