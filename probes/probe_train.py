"""A quick GPU check of the MoE layer's training step (not a pipeline step; about two minutes on an H200).

1. Gradients at real shapes against float64: moe_ffn (bf16, both weight layouts, the gate/up product
   recomputed and saved) on Qwen3-30B-A3B at T=4096 under a Zipf 1.2 load, every gradient's relative
   Frobenius error beside the torch._grouped_mm pipeline's (what bf16 gives on the same inputs); two backward
   passes bitwise equal; the step captured in a CUDA graph and replayed to the same gradients.
2. Time per step, forward alone and forward + backward (the backward: their difference), GPU time through a
   CUDA graph (median of replays, launch-free) and peak memory of one step, ours against the torch._grouped_mm
   pipeline (eager; ``--compiled`` also under torch.compile) on three models at T=4096 and 16384.

    python -m probes.probe_train [--compiled] [--out results/<slug>/probe_train.csv]
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time

import torch

from experiments.e9_moe_train import torch_pipeline_train
from experiments.harness.moe_loads import sample_topk
from moegemm.grouped import autograd as ag
from moegemm.grouped import moe_ffn

MODELS = {  # name: (E, H, I, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}


def inputs(e, h, i, k, t, w_layout, seed=0, load="zipf1.2"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = sample_topk(t, e, k, load, seed).to(torch.int64).cuda()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16().requires_grad_()
    tw = torch.softmax(torch.randn(t, k, device="cuda", generator=g), -1).requires_grad_()
    gu = torch.randn(e, 2 * i, h, device="cuda", generator=g) / math.sqrt(h)
    dn = torch.randn(e, h, i, device="cuda", generator=g) / math.sqrt(i)
    if w_layout == "kn":
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    dy = (torch.randn(t, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    return ids, x, tw, gu.bfloat16().requires_grad_(), dn.bfloat16().requires_grad_(), dy


@torch.no_grad()
def grads64(x, ids, tw, wgu, wd, dy, w_layout):
    """float64 (dx, dtw, dwgu, dwd) of the layer, expert by expert, in the weights' layout."""
    i = (wgu.shape[1] if w_layout == "nk" else wgu.shape[2]) // 2
    dx = torch.zeros(x.shape, dtype=torch.float64, device="cuda")
    dtw = torch.zeros(tw.shape, dtype=torch.float64, device="cuda")
    dwgu = torch.zeros(wgu.shape, dtype=torch.float64, device="cuda")
    dwd = torch.zeros(wd.shape, dtype=torch.float64, device="cuda")
    for e in torch.unique(ids).tolist():
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        g_w = wgu[e].double() if w_layout == "nk" else wgu[e].double().T  # [2I, H]
        d_w = wd[e].double() if w_layout == "nk" else wd[e].double().T  # [H, I]
        xe, dye, s = x[tok].double(), dy[tok].double(), tw[tok, j].double()[:, None]
        h = xe @ g_w.T
        gate, up = h[:, :i], h[:, i:]
        sg = torch.sigmoid(gate)
        act = gate * sg * up
        p = dye @ d_w
        dtw[tok, j] = (p * act).sum(1)
        da = s * p
        dgu = torch.cat([da * up * sg * (1 + gate * (1 - sg)), da * gate * sg], 1)
        dx.index_add_(0, tok, dgu @ g_w)
        dwg = dgu.T @ xe  # [2I, H]
        dwdn = dye.T @ (s * act)  # [H, I]
        dwgu[e] = dwg if w_layout == "nk" else dwg.T
        dwd[e] = dwdn if w_layout == "nk" else dwdn.T
    return dx, dtw, dwgu, dwd


def step(fn, leaves, dy):
    for p in leaves:
        p.grad = None
    fn().backward(dy)
    return [p.grad for p in leaves]


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_grads() -> bool:
    e, h, i, k = MODELS["qwen3-30b-a3b"]
    ok = True
    for w_layout in ("nk", "kn"):
        ids, x, tw, wgu, wd, dy = inputs(e, h, i, k, 4096, w_layout, seed=1)
        leaves = [x, tw, wgu, wd]
        ref = grads64(x, ids, tw, wgu, wd, dy, w_layout)
        rows = {}
        for save in (False, True):
            ag.SAVE_GATE_UP = save

            def f():
                return moe_ffn(x, ids, tw, wgu, wd, w_layout=w_layout)

            a = [g.clone() for g in step(f, leaves, dy)]
            b = [g.clone() for g in step(f, leaves, dy)]
            det = all(torch.equal(u, v) for u, v in zip(a, b))
            rows["ours:" + ("save" if save else "recompute")] = ([rel(u, r) for u, r in zip(a, ref)], det)
            ok &= det
        ag.SAVE_GATE_UP = False
        if w_layout == "nk":

            def pipe():
                return torch_pipeline_train(x, ids, tw, wgu, wd, e)

            rows["torch pipeline"] = ([rel(u, r) for u, r in zip(step(pipe, leaves, dy), ref)], None)
        print(
            f"\nGradients vs float64, qwen3-30b-a3b T=4096 zipf1.2, w_layout={w_layout} "
            "(relative Frobenius error: dx, d topk_weights, d w_gate_up, d w_down; bitwise repeatable)"
        )
        for name, (errs, det) in rows.items():
            print(f"  {name:22s} " + "  ".join(f"{v:.2e}" for v in errs) + f"  {'' if det is None else det}")
            ok &= all(v < 2e-2 for v in errs)
        # CUDA-graph capture of the whole step (no host sync with default arguments)
        want = [g.clone() for g in step(f, leaves, dy)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(f, leaves, dy)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step(f, leaves, dy)
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(u, v) for u, v in zip(want, got))
        print(f"  CUDA graph capture and replay: {'same gradients' if same else 'DIFFERENT gradients'}")
        ok &= same
        del graph, got, want
    return ok


def graph_ms(fn, reps: int = 10, rounds: int = 3) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (NaN where it does not capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as ex:  # noqa: BLE001 - reported in the table
        print(f"    (no capture: {type(ex).__name__}: {str(ex)[:100]})", file=sys.stderr)
        return math.nan
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    del graph
    return statistics.median(times)


def peak_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def time_steps(compiled: bool) -> list[dict]:
    rows = []
    for model, (e, h, i, k) in MODELS.items():
        for t in (4096, 16384):
            rows += time_cell(model, e, h, i, k, t, compiled)
            torch.cuda.empty_cache()
    return rows


def time_cell(model: str, e: int, h: int, i: int, k: int, t: int, compiled: bool) -> list[dict]:
    ids, x, tw, wgu, wd, dy = inputs(e, h, i, k, t, "nk", seed=2)
    leaves = [x, tw, wgu, wd]

    def ours():
        return moe_ffn(x, ids, tw, wgu, wd, w_layout="nk", validate=False)

    def pipeline():
        return torch_pipeline_train(x, ids, tw, wgu, wd, e)

    fns = {"ours": (ours, False), "ours:save-gate-up": (ours, True), "torch pipeline": (pipeline, False)}
    if compiled:
        comp = torch.compile(torch_pipeline_train)
        fns["torch pipeline:compiled"] = (lambda: comp(x, ids, tw, wgu, wd, e), False)
    rows = []
    for name, (fn, save) in fns.items():
        ag.SAVE_GATE_UP = save

        def fwd(fn=fn):
            for p in leaves:
                p.grad = None
            return fn()

        def full(fn=fn):
            return step(fn, leaves, dy)

        t0 = time.perf_counter()
        full()
        f_ms, s_ms = graph_ms(fwd), graph_ms(full)
        mb = peak_mb(full)
        ag.SAVE_GATE_UP = False
        rows.append(
            dict(
                model=model,
                tokens=t,
                contender=name,
                fwd_ms=f_ms,
                step_ms=s_ms,
                bwd_ms=s_ms - f_ms,
                peak_mb=mb,
                wall_s=time.perf_counter() - t0,
            )
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compiled", action="store_true", help="also the torch pipeline under torch.compile")
    ap.add_argument("--out", help="also write the timing rows to this CSV")
    ap.add_argument("--skip-grads", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ok = True if args.skip_grads else check_grads()
    rows = time_steps(args.compiled)
    print(
        "\nPer step, GPU time via CUDA graph (ms), peak memory over the step (MiB, beyond what was "
        "allocated before it); speed-up: torch pipeline's time / ours"
    )
    print(
        f"  {'model':16s} {'T':>6s} {'contender':24s} {'fwd':>8s} {'fwd+bwd':>8s} {'bwd':>8s} "
        f"{'peak MiB':>9s} {'x step':>7s} {'x bwd':>6s}"
    )
    for r in rows:
        base = next(
            b
            for b in rows
            if b["model"] == r["model"] and b["tokens"] == r["tokens"] and b["contender"] == "torch pipeline"
        )
        print(
            f"  {r['model']:16s} {r['tokens']:6d} {r['contender']:24s} {r['fwd_ms']:8.3f} "
            f"{r['step_ms']:8.3f} {r['bwd_ms']:8.3f} {r['peak_mb']:9.0f} "
            f"{base['step_ms'] / r['step_ms']:7.2f} {base['bwd_ms'] / r['bwd_ms']:6.2f}"
        )
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"\n{'PASS' if ok else 'FAIL'} (gradients, determinism, capture); {time.perf_counter() - t0:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
