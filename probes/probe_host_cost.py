"""Probe (not a pipeline step): the host's cost of one expert-FFN call, step by step.

Why: in E8 the launch-inclusive time of ``moe_ffn`` at decode (T <= 64) is several times its GPU time and
above vLLM's, so a user calling the layer eagerly waits on Python, not on the GPU. This times, per model
and token count (E8's inputs and seeds, uniform load), the host's wall time per call with no sync
(``cpu_us``, experiments.harness.runner.cpu_cost_us; the GPU's queue absorbs the launches) of:
- ``moe_ffn`` whole, and each of its steps on the same inputs (route, permute, gate/up with SwiGLU,
  the gating weights in row order, down, un-permute);
- vLLM's ``fused_experts`` as E8 calls it, and the ``torch._grouped_mm`` pipeline;
- ``moe_ffn:triton-launch``: the same call with every kernel launched through Triton's own launch and no
  grouped plan (the library before its cached launches), its cpu_us measured interleaved with
  ``moe_ffn``'s in rounds (medians), so the two are side by side;
- one empty Triton kernel and one ``torch.add``, for scale;
and GPU time per call from CUDA-graph replay (``graph_us``) and the launch-inclusive clock (``launch_us``)
for the whole calls. With ``--profile DIR`` it also writes cProfile's top functions for ``moe_ffn`` per
cell (DIR/<model>-T<t>.txt).

    python -m probes.probe_host_cost --out probe_host_cost.csv [--profile DIR] [--models a,b] [--tokens 1,16]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from experiments.common import ResultWriter, load_config, provenance_fields, require_gpu
from experiments.e7_grouped_skew import Vllm
from experiments.e8_moe_layer import cell_inputs, torch_pipeline, vllm_contender
from experiments.harness.runner import cpu_cost_us
from experiments.harness.timing import GraphTimer, launch_samples
from moegemm.grouped import grouped_mm, moe_ffn, permute, route, sorted_weights, unpermute
from moegemm.grouped.ffn import gate_up_act

MODELS = "qwen3-30b-a3b,olmoe-1b-7b,gpt-oss-20b,deepseek-v3"
TOKENS = "1,16,64"
CALLS = 100  # calls per cpu_us run (the GPU's queue holds them all)


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < 0:  # never true: a launch that does no work
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32), mask=tl.arange(0, BLOCK) < n)


def steps(x, ids, wts, w_gu, w_dn, e: int) -> dict:
    """{name: zero-argument call}: moe_ffn and each of its steps on intermediates made once here."""
    plan = route(ids, e)
    xs = permute(x, plan)
    act = gate_up_act(xs, w_gu, plan.group_offsets, "nk")
    sw = sorted_weights(wts, plan)
    ys = grouped_mm(act, w_dn, plan.group_offsets, w_layout="nk", row_scale=sw, validate=False)
    return {
        "moe_ffn": lambda: moe_ffn(x, ids, wts, w_gu, w_dn),
        "step:route": lambda: route(ids, e),
        "step:permute": lambda: permute(x, plan),
        "step:gate_up_act": lambda: gate_up_act(xs, w_gu, plan.group_offsets, "nk"),
        "step:sorted_weights": lambda: sorted_weights(wts, plan),
        "step:down": lambda: grouped_mm(
            act, w_dn, plan.group_offsets, w_layout="nk", row_scale=sw, validate=False
        ),
        "step:unpermute": lambda: unpermute(ys, plan, None),
    }


@contextlib.contextmanager
def triton_launch():
    """Inside: no grouped plan, and the small kernels through Triton's own launch."""
    from moegemm.grouped import contiguous, pointwise, routing_kernels

    saved = contiguous._plan_key, pointwise.launch, routing_kernels.launch

    def jit(kernel, grid, args, kwargs):
        kernel[grid](*args, **kwargs)

    contiguous._plan_key, pointwise.launch, routing_kernels.launch = (lambda *a: None), jit, jit
    try:
        yield
    finally:
        contiguous._plan_key, pointwise.launch, routing_kernels.launch = saved


def in_triton_launch(fn):
    def call():
        with triton_launch():
            return fn()

    return call


def paired_cpu_us(fn, rounds: int = 7) -> dict:
    """{"moe_ffn": us, "moe_ffn:triton-launch": us}: medians over ``rounds`` of cpu_cost_us of ``fn`` as it is
    and inside triton_launch (entered once per run of calls), the two taking turns in each round."""
    got: dict = {"moe_ffn": [], "moe_ffn:triton-launch": []}
    for _ in range(rounds):
        got["moe_ffn"].append(cpu_cost_us([fn], CALLS, repeats=1))
        with triton_launch():
            got["moe_ffn:triton-launch"].append(cpu_cost_us([fn], CALLS, repeats=1))
    return {k: statistics.median(v) for k, v in got.items()}


def profile_text(fn, calls: int = 200, top: int = 30) -> str:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def graph_us(fn) -> float:
    timer = GraphTimer([fn], calls_per_graph=10)
    return statistics.median(timer.sample(7))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--tokens", default=TOKENS)
    args = ap.parse_args()
    require_gpu()
    cfg = load_config()
    g = cfg["grouped"]
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("model", "tokens", "contender"))
    vllm = Vllm()
    vllm.load()
    weights: dict = {}
    buf = torch.zeros(16, device="cuda")
    scale = {
        "triton:empty-kernel": lambda: _empty_kernel[(1,)](buf, 16, BLOCK=16),
        "torch.add": lambda: torch.add(buf, buf),
    }
    for fn in scale.values():
        fn()
    lines = []
    for model in args.models.split(","):
        for t in (int(v) for v in args.tokens.split(",")):
            m, e, top_k, h, i, ids, x, wts, ref, active, sets = cell_inputs(g, model, t, "uniform", weights)
            w_gu, w_dn = sets[0]
            calls = steps(x, ids, wts, w_gu, w_dn, e)
            calls["torch._grouped_mm pipeline"] = lambda: torch_pipeline(x, ids, wts, w_gu, w_dn, e)
            if vllm.kernel is not None:
                calls["vllm:fused_experts"] = vllm_contender(vllm.kernel, x, ids, wts, e, h, i, t).bind(
                    sets[0]
                )
            calls["moe_ffn:triton-launch"] = in_triton_launch(calls["moe_ffn"])
            calls.update(scale)
            for fn in calls.values():  # compiles, first-call timing
                fn()
            torch.cuda.synchronize()
            rows = []
            pair = ("moe_ffn", "moe_ffn:triton-launch")
            paired = paired_cpu_us(calls["moe_ffn"])
            for name, fn in calls.items():
                r = {
                    "model": model,
                    "split": m["split"],
                    "tokens": t,
                    "load": "uniform",
                    "experts": e,
                    "top_k": top_k,
                    "hidden": h,
                    "intermediate": i,
                    "contender": name,
                    "cpu_us": paired[name] if name in pair else cpu_cost_us([fn], CALLS, repeats=5),
                }
                if not name.startswith("step:") and name not in scale:
                    r["graph_us"] = graph_us(fn)
                    r["launch_us"] = statistics.median(launch_samples(fn, rep_ms=50))
                if name in pair:
                    got = fn().float()
                    r["rel_err"] = ((got - ref).norm() / ref.norm()).item()
                rows.append({**r, **prov})
            writer.add(rows)
            by = {r["contender"]: r for r in rows}
            lines.append(
                f"{model:>16} T={t:<4} moe_ffn cpu {by['moe_ffn']['cpu_us']:6.1f} (triton-launch "
                f"{by['moe_ffn:triton-launch']['cpu_us']:6.1f}) gpu "
                f"{by['moe_ffn']['graph_us']:7.1f} launch {by['moe_ffn']['launch_us']:7.1f} | vllm cpu "
                f"{by.get('vllm:fused_experts', {}).get('cpu_us', float('nan')):6.1f} | steps "
                + " ".join(f"{k[5:]}={v['cpu_us']:.0f}" for k, v in by.items() if k.startswith("step:"))
            )
            if args.profile:
                d = Path(args.profile)
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{model}-T{t}.txt").write_text(profile_text(calls["moe_ffn"]))
    writer.finish()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
