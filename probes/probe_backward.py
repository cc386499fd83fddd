"""The MoE layer's backward kernel by kernel, on the tune split's models (not a pipeline step).

Per (model, T) of the tune split at the uniform load (E9's weights and inputs: e9_moe_train.cell_inputs),
each GEMM of the backward timed alone (GPU time, CUDA-graph replay), with its TFLOP/s and its error against
torch._grouped_mm's result on the same operands (CUTLASS, bf16; the yardstick rows):

- ``recompute``: the gate/up product again, the forward's grouped GEMM (its own config choice);
- ``dswiglu``: the down projection's dX product P and the SwiGLU backward: the fused TMA kernel
  (probes/dswiglu_fused.py, the SwiGLU backward in P's epilogue) at each of DSWIGLU_CONFIGS; ``separate``,
  the library's (backward.swiglu_grad: P through the forward's grouped GEMM, then the pointwise pass);
  ``dswiglu:pointer``, the pointer kernel (dY's rows gathered in-kernel); and ``dswiglu:gemm-only``, P alone
  through the forward's grouped GEMM;
- ``dw_down``, ``dw_gate_up``: the weight gradients, the TMA kernel at each of DW_CONFIGS, and
  ``...:pointer``, the pointer kernel with its in-kernel gather and scale;
- ``dx``: dX through the gate/up weights (the forward's grouped GEMM in the other layout);

then the whole step (forward + backward, and the forward alone) of moe_ffn (the gate/up product recomputed,
and kept) and of the torch._grouped_mm pipeline, with peak memory (E9's Step and step_memory); with
--steps also the default step with the fused SwiGLU backward. The tiles the library keeps
(moegemm.grouped.backward's DW_TMA_TILES) and the fused kernel's (dswiglu_fused.FUSED_TILES) are those of
least geometric-mean time over these cells, which the summary prints.

    python -m probes.probe_backward --out results/<slug>/probe_backward.csv
    python -m probes.probe_backward --pieces dswiglu --steps --configs separate 128x256x64/w8s3e4 auto \
        --out results/<slug>/probe_dswiglu_separate.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time

import torch

from experiments._io import atomic_path
from experiments.common import load_config, provenance_fields, require_gpu
from experiments.e9_moe_train import Step, cell_inputs, step_memory, torch_pipeline_train
from experiments.harness.timing import GraphTimer
from moegemm.grouped import backward as bw
from moegemm.grouped import grouped_mm as grouped_mm_forward  # (detached operands: the forward alone)
from moegemm.grouped import moe_ffn, route
from moegemm.grouped.pointwise import silu_mul
from probes.dswiglu_fused import fused_swiglu_grad

CELLS = [
    ("mixtral-8x7b", 4096),
    ("mixtral-8x7b", 16384),
    ("qwen3-30b-a3b", 4096),
    ("qwen3-30b-a3b", 16384),
    ("deepseek-v3", 4096),
]


def _dw(bm, bk, bn, warps, stages):
    return dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, GROUP_K=8, num_warps=warps, num_stages=stages)


def _ds(bm, bn, bk, warps, stages, split=1):
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return cfg if split == 1 else dict(cfg, EPI_SPLIT=split)


DW_CONFIGS = [
    _dw(64, 128, 128, 8, 4),
    _dw(64, 128, 128, 8, 3),
    _dw(64, 128, 256, 8, 3),
    _dw(64, 256, 128, 8, 3),
    _dw(64, 128, 128, 4, 4),
    _dw(32, 128, 128, 4, 5),
    _dw(64, 128, 64, 4, 4),
    _dw(128, 128, 128, 8, 3),
]
DSWIGLU_CONFIGS = [
    _ds(128, 64, 64, 8, 4),
    _ds(128, 64, 64, 4, 4),
    _ds(128, 128, 64, 8, 3),
    _ds(64, 128, 64, 4, 4),
    _ds(64, 64, 64, 4, 4),
    _ds(128, 64, 128, 8, 3),
    _ds(128, 128, 64, 8, 4),
    # tiles whose compile for sm_90 spills no register (ptxas -v; the ones above all spill)
    _ds(64, 64, 64, 8, 4),
    _ds(128, 32, 64, 8, 4),
    _ds(64, 32, 64, 4, 4),
    _ds(64, 64, 128, 8, 3),
    # the epilogue through the accumulator's column halves or quarters (EPI_SPLIT): larger tiles without
    # spills (128x128x64 with 8 warps and quarters: 230 registers, none spilled; whole, 1720 bytes spilled)
    _ds(128, 128, 64, 8, 3, 4),
    _ds(128, 128, 64, 8, 4, 4),
    _ds(128, 128, 64, 8, 3, 2),
    _ds(64, 128, 64, 4, 4, 4),
    _ds(128, 64, 64, 4, 4, 2),
    _ds(128, 64, 64, 8, 4, 2),
    _ds(128, 256, 64, 8, 3, 4),
]
# Two more knobs of the kernel are not offered, as neither won a cell at its fastest tiles: its persistent
# loop flattened with the K loop (one program per SM), and G, U brought in by TMA boxes
# (results/nvidia-h200/probe_dswiglu_flatten.csv).


def gpu_us(fn, replays: int = 5) -> float:
    """us per call of ``fn`` from a CUDA graph of enough calls for about 3 ms a replay."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    n = int(max(1, min(20, math.ceil(3.0 / max(a.elapsed_time(b), 1e-3)))))
    timer = GraphTimer([fn], n)
    us = statistics.median(timer.sample(replays))
    del timer
    return us


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return math.nan
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pieces(x, ids, wts, w_gu, w_dn, dy, e):
    """[(piece, config label, tiles or None, call, flops, the yardstick's output or None)] of one cell."""
    plan = route(ids, e, validate=False)
    offs, tok = plan.group_offsets, plan.sorted_token_ids
    rows = tok.numel()
    h, i = w_dn.shape[1], w_dn.shape[2]
    with torch.no_grad():
        xs = x.detach().index_select(0, tok)
        dys = dy.index_select(0, tok)
        ws = wts.detach().reshape(-1).index_select(0, plan.sorted_slot)
        gu = grouped_mm_forward(xs, w_gu.detach(), offs, validate=False)
        dgu, sact, _ = bw.swiglu_grad(
            offs, dys, gu.clone(), w_dn.detach(), "nk", scale=ws, rowdot=True, store_act=True, in_place=True
        )
        o32 = offs[1:].to(torch.int32)
        wg, wd = w_gu.detach(), w_dn.detach()
        ref = {
            "recompute": torch._grouped_mm(xs, wg.transpose(1, 2), offs=o32),
            "dw_down": torch._grouped_mm(dys.t(), sact, offs=o32),  # [E, H, I], down's "nk" layout
            "dw_gate_up": torch._grouped_mm(dgu.t(), xs, offs=o32),  # [E, 2I, H], gate/up's "nk"
            "dx": torch._grouped_mm(dgu, wg, offs=o32),
            "dswiglu:gemm-only": torch._grouped_mm(dys, wd, offs=o32),  # P, the product before SwiGLU's
        }
    f_gu, f_dn = 2.0 * rows * h * 2 * i, 2.0 * rows * h * i
    out = [("recompute", "auto", None, lambda: grouped_mm_forward(xs, wg, offs, validate=False), f_gu)]
    for cfg in DSWIGLU_CONFIGS:
        out.append(
            (
                "dswiglu",
                label(cfg),
                cfg,
                lambda cfg=cfg: fused_swiglu_grad(
                    offs, dys, gu, wd, "nk", scale=ws, rowdot=True, store_act=True, in_place=False, tiles=cfg
                )[0],
                f_dn,
            )
        )
    out.append(
        (
            "dswiglu",
            "separate",
            None,
            lambda: bw.swiglu_grad(
                offs, dys, gu, wd, "nk", scale=ws, rowdot=True, store_act=True, in_place=False
            )[0],
            f_dn,
        )
    )
    out.append(
        (
            "dswiglu:gemm-only",
            "auto",
            None,
            lambda: grouped_mm_forward(dys, wd, offs, w_layout="kn", validate=False),
            f_dn,
        )
    )
    out.append(
        (
            "dswiglu:pointer",
            "pointer",
            None,
            lambda: bw.swiglu_backward(
                offs,
                rows,
                dy,
                x=None,
                w_gate_up=None,
                w_layout="nk",
                gu=gu,
                w_down=wd,
                dy_idx=tok,
                scale=ws,
                rowdot=True,
                store_act=True,
            )[0],
            f_dn,
        )
    )
    for cfg in DW_CONFIGS:
        out.append(
            (
                "dw_down",
                label(cfg),
                cfg,
                lambda c=cfg: bw.grouped_dw(sact, dys, offs, wd, "nk", tiles=c),
                f_dn,
            )
        )
        out.append(
            (
                "dw_gate_up",
                label(cfg),
                cfg,
                lambda c=cfg: bw.grouped_dw(xs, dgu, offs, wg, "nk", tiles=c),
                f_gu,
            )
        )
    act = silu_mul(gu)  # the previous path's unscaled activation, scaled in the weight gradient's kernel
    out.append(
        (
            "dw_down:pointer",
            "pointer",
            None,
            lambda: bw.grouped_dw(act, dy, offs, wd, "nk", b_idx=tok, scale=ws),
            f_dn,
        )
    )
    out.append(
        (
            "dw_gate_up:pointer",
            "pointer",
            None,
            lambda: bw.grouped_dw(x.detach(), dgu, offs, wg, "nk", a_idx=tok),
            f_gu,
        )
    )
    out.append(
        ("dx", "auto", None, lambda: grouped_mm_forward(dgu, wg, offs, w_layout="kn", validate=False), f_gu)
    )
    out += [
        (
            "recompute",
            "torch._grouped_mm",
            None,
            lambda: torch._grouped_mm(xs, wg.transpose(1, 2), offs=o32),
            f_gu,
        ),
        ("dswiglu", "torch._grouped_mm", None, lambda: torch._grouped_mm(dys, wd, offs=o32), f_dn),
        ("dw_down", "torch._grouped_mm", None, lambda: torch._grouped_mm(dys.t(), sact, offs=o32), f_dn),
        ("dw_gate_up", "torch._grouped_mm", None, lambda: torch._grouped_mm(dgu.t(), xs, offs=o32), f_gu),
        ("dx", "torch._grouped_mm", None, lambda: torch._grouped_mm(dgu, wg, offs=o32), f_gu),
    ]
    return out, ref, dgu


def label(cfg: dict) -> str:
    """e.g. 128x256x64/w8s3e4: tiles, warps, stages, epilogue split."""
    split = f"e{cfg['EPI_SPLIT']}" if cfg.get("EPI_SPLIT", 1) > 1 else ""
    return (
        "x".join(str(cfg[k]) for k in cfg if k.startswith("BLOCK"))
        + f"/w{cfg['num_warps']}s{cfg['num_stages']}{split}"
    )


def steps(x, ids, wts, w_gu, w_dn, dy, e, variants: bool = False):
    """{name: (forward, what stands in for backward.swiglu_grad in the step or None)} of the steps timed
    whole: moe_ffn recomputing the gate/up product ("ours:moe_ffn", the name its rows carry) and keeping it
    ("ours:moe_ffn:save-gate-up", the default), the
    torch._grouped_mm pipeline, and with ``variants`` the default step with the fused kernel for the SwiGLU
    backward (dswiglu_fused.fused_swiglu_grad at its tiles, "ours:moe_ffn:save-gate-up:fused")."""

    def ours(save):
        return lambda: moe_ffn(x, ids, wts, w_gu, w_dn, w_layout="nk", validate=False, save_gate_up=save)

    out = {
        "ours:moe_ffn": (ours(False), None),
        "ours:moe_ffn:save-gate-up": (ours(True), None),
        "torch._grouped_mm pipeline": (lambda: torch_pipeline_train(x, ids, wts, w_gu, w_dn, e), None),
    }
    if variants:
        out["ours:moe_ffn:save-gate-up:fused"] = (ours(True), fused_swiglu_grad)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pieces", nargs="+", help="time only these pieces (and their yardsticks), no steps")
    ap.add_argument(
        "--steps",
        action="store_true",
        help="time the steps also with --pieces, and the default step with the fused SwiGLU backward",
    )
    ap.add_argument("--cells", type=int, help="only the first N cells")
    ap.add_argument("--configs", nargs="+", help="time only the tiles of these labels (and the yardsticks)")
    args = ap.parse_args()
    require_gpu()
    g = load_config()["grouped"]
    prov = provenance_fields()
    rows, weights = [], {}
    t_all = time.perf_counter()
    for model, t in CELLS[: args.cells]:
        assert g["models"][model]["split"] == "tune", model  # the tiles learn from the tune split only
        t0 = time.perf_counter()
        m, e, top_k, h, i, ids, x, wts, dy = cell_inputs(g, model, t, "uniform", weights)
        w_gu, w_dn = weights[model]
        ps, ref, dgu = pieces(x, ids, wts, w_gu, w_dn, dy, e)
        for piece, cfg_label, _, call, flops in ps:
            if args.pieces and piece.split(":")[0] not in args.pieces:
                continue
            if args.configs and cfg_label not in args.configs and cfg_label != "torch._grouped_mm":
                continue
            row = dict(model=model, tokens=t, piece=piece, config=cfg_label, **prov)
            try:
                got = call()
                if cfg_label != "torch._grouped_mm":  # (the yardstick is the reference; its dswiglu is P)
                    base = piece.split(":")[0]
                    want = ref.get(piece, ref.get(base, dgu))
                    row["rel_err"] = rel(got, want)
                row["status"] = "ok" if row.get("rel_err", 0.0) < 2e-2 else "WRONG"
                del got
                us = gpu_us(call)
                row.update(graph_us=us, tflops=flops / us / 1e6)
            except Exception as ex:  # noqa: BLE001 - recorded
                row.update(status="error", note=f"{type(ex).__name__}: {str(ex)[:160]}")
            rows.append(row)
        del ps, ref, dgu
        torch.cuda.empty_cache()
        todo = {} if args.pieces and not args.steps else steps(x, ids, wts, w_gu, w_dn, dy, e, args.steps)
        for name, (fwd, grad) in todo.items():
            for phase in ("fwd+bwd", "fwd"):
                if grad is not None and phase == "fwd":  # (it stands in for the backward's)
                    continue
                row = dict(model=model, tokens=t, piece="step:" + phase, config=name, **prov)
                kept = bw.swiglu_grad
                if grad is not None:
                    bw.swiglu_grad = grad  # (captured into the step's graph)
                try:
                    st = Step(fwd, (x, wts, w_gu, w_dn), (), dy, phase)
                    st()
                    row["graph_us"] = gpu_us(st, replays=3)
                    row["peak_mem_bytes"], row["step_mem_bytes"] = step_memory(st)
                    row["status"] = "ok"
                except Exception as ex:  # noqa: BLE001 - recorded
                    row.update(status="error", note=f"{type(ex).__name__}: {str(ex)[:160]}")
                finally:
                    bw.swiglu_grad = kept
                rows.append(row)
        torch.cuda.empty_cache()
        write(args.out, rows)  # after every cell, so that a run stopped at a time limit keeps its cells
        print(f"{model} T={t}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    summary(rows)
    print(f"{len(rows)} rows, {time.perf_counter() - t_all:.0f} s", flush=True)


def write(path: str, rows: list[dict]) -> None:
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def summary(rows: list[dict]) -> None:
    """Per piece: each config's geometric-mean time over the cells relative to torch._grouped_mm (>1: ours
    faster); then each step's time and memory."""
    cells = sorted({(r["model"], r["tokens"]) for r in rows})
    for piece in ("recompute", "dswiglu", "dw_down", "dw_gate_up", "dx"):
        torch_us = {
            (r["model"], r["tokens"]): r["graph_us"]
            for r in rows
            if r["piece"] == piece and r["config"] == "torch._grouped_mm" and r.get("status") == "ok"
        }
        cfgs = sorted(
            {
                r["config"]
                for r in rows
                if r["piece"].split(":")[0] == piece and r["config"] != "torch._grouped_mm"
            }
        )
        print(f"\n{piece}: torch._grouped_mm's time / ours, geomean over {len(cells)} cells; worst; TFLOP/s")
        for c in cfgs:
            rs = [r for r in rows if r["piece"].split(":")[0] == piece and r["config"] == c]
            ok = [r for r in rs if r.get("status") == "ok" and (r["model"], r["tokens"]) in torch_us]
            if len(ok) < len(cells):
                print(f"  {c:28s} {len(ok)}/{len(cells)} ok: {[r.get('status') for r in rs]}")
                continue
            x = [torch_us[(r["model"], r["tokens"])] / r["graph_us"] for r in ok]
            gm = math.exp(sum(map(math.log, x)) / len(x))
            rate = statistics.median(r["tflops"] for r in ok)
            print(f"  {c:28s} {gm:6.3f}x  worst {min(x):6.3f}x  {rate:6.0f}")
    print("\nsteps: GPU time ms (fwd+bwd / fwd), step memory MiB")
    for model, t in cells:
        for r in rows:
            if (r["model"], r["tokens"]) == (model, t) and r["piece"] == "step:fwd+bwd":
                f = next(
                    (
                        q
                        for q in rows
                        if (q["model"], q["tokens"]) == (model, t)
                        and q["piece"] == "step:fwd"
                        and q["config"] == r["config"]
                    ),
                    {},
                )
                both = r.get("graph_us", math.nan) / 1e3, f.get("graph_us", math.nan) / 1e3
                mib = r.get("step_mem_bytes", 0) / 2**20
                print(f"  {model:16s} {t:6d} {r['config']:28s} {both[0]:8.2f} / {both[1]:7.2f}  {mib:8.0f}")


if __name__ == "__main__":
    main()
