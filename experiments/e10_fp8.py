"""E10 fp8-grouped: block-scaled FP8 experts (e4m3 with DeepSeek-V3's scales: one per token and 128 channels
of the activations, one per 128 x 128 block of the weights) against the peers that serve them, and against
our bf16 path.

Per model of config.yaml's ``fp8`` section (DeepSeek-V3, whose experts are served in this format, and the
held-out models E7 and E8 run; each row's ``split`` is the zoo's), token count (``phase``: decode T <= 256,
prefill T >= 1024), load (uniform, Zipf 1.2) and projection:
- ``up`` and ``down``: one grouped GEMM alone, on E7's weights and rows (expert_weights, cell_tokens), each
  contender on its own FP8 operands, quantised before timing (experiments/fp8_cells.py, fp8_peers.py): ours
  (contiguous; masked at decode; bf16), vLLM's block-FP8 fused_moe_kernel (the faster of its own config and
  a light search, once per (model, projection, T) on the tuner's seeds, as E7 searches), torch's
  _scaled_grouped_mm (row-wise scales: the nearest it takes), triton_kernels' matmul_ogs (flexpoint scales:
  the nearest it takes), DeepGEMM's contiguous GEMM and, at decode, its masked one;
- ``ffn``: the whole expert FFN on E8's weights and inputs (cell_inputs), routing in, combined [T, H] out:
  ``ours:moe_ffn-fp8`` (moe_ffn with e4m3 weights and their scales), ``ours:moe_ffn-bf16`` (moe_ffn on the
  bf16 weights), ``vllm:fused_experts-fp8`` (experiments/vllm_fp8.py's layer at one config for both GEMMs,
  as vLLM takes it: the faster of its own and a light search, once per (model, T) on the first load).

Every contender is checked before it is timed: the FP8 ones against float64 on their own operands
dequantised (experiments/fp8_refs.py; the layer's against the dequantised weights, with the bound of one
e4m3 rounding of each activation it quantises), the bf16 ones against E7's and E8's float64 references;
NaN never passes, and each output is poisoned with NaN first. Both clocks (GPU time under CUDA graphs,
launch-inclusive), E7's columns (the floor here counts e4m3 operands, fp32 scales and a bf16 output, at
Hopper's dense FP8 rate, twice its bf16 rate), and ``quant`` (the operand format; where a peer takes another
than the block scales, the note says what it takes instead), ``origin`` (the peer's source and revision),
``timing_scope``. A peer that cannot run here is one row per cell, status "not runnable", with why.

    python -m experiments.e10_fp8 --out results/<slug>/fp8_grouped.csv
"""

from __future__ import annotations

import math
import sys
import time

import torch

from experiments import vllm_fp8, vllm_moe
from experiments.common import Progress, check_and_time, check_models, shard_cells, timing_settings
from experiments.e7_grouped_skew import (
    SCOPE_GATHER,
    SCOPE_PERMUTED,
    cell_tokens,
    expert_weights,
    fastest_config,
    graph_rates,
    ref_rows,
    start,
    tuner_tokens,
)
from experiments.fp8_cells import BLOCK_NOTE, GemmCell, Unrunnable, Weights, poison_pool
from experiments.fp8_peers import DG_CONTIGUOUS, DG_MASKED, TK, VLLM, Peers, gemm_contenders, vllm_search
from experiments.fp8_refs import ffn_reference, quantize_weights, rel_budget, weights64
from experiments.harness.correctness import check, check_bounded
from experiments.harness.floors import datasheet
from experiments.harness.moe_loads import skew_stats
from experiments.harness.runner import Contender, measure
from experiments.harness.timing import input_sets_for
from moegemm.grouped import moe_ffn, permute, route

CELL_KEYS = ("model", "proj", "tokens", "load")
PROJECTIONS = ("up", "down", "ffn")
LAYER_VLLM = "vllm:fused_experts-fp8"


def fp8_cells(cfg: dict) -> list[tuple[str, str, int, str]]:
    """E10's cells (model, projection, T, load): fp8.models and fp8.heldout_models (default: every held-out
    zoo model), each projection of fp8.projections, each decode and prefill T, each load."""
    g, f = cfg["grouped"], cfg["fp8"]
    zoo = g["models"]
    check_models(f["models"], zoo, "fp8.models")
    heldout = [m for m, spec in zoo.items() if spec["split"] == "heldout"]
    chosen = f.get("heldout_models")
    check_models(chosen, heldout, "fp8.heldout_models", "held-out zoo models")
    models = list(dict.fromkeys([*f["models"], *(heldout if chosen is None else chosen)]))
    tokens = [*f["decode_tokens"], *f["prefill_tokens"]]
    return [(m, p, t, load) for m in models for p in f["projections"] for t in tokens for load in f["loads"]]


def phase(t: int) -> str:
    """decode (T <= 256) or prefill (T >= 1024); config.schema.yaml keeps E10's T in those ranges."""
    return "decode" if t <= 256 else "prefill"


def fp8_floor_us(rows: int, k: int, n: int, active: int, slug: str) -> tuple[float, int, int]:
    """(floor in us, bytes, FLOPs) of one FP8 grouped GEMM: the active experts' e4m3 weights and their block
    scales, the rows' e4m3 values and scales in, bf16 out; at the HBM bandwidth or at twice the dense bf16
    rate (Hopper's dense FP8 rate), whichever is longer."""
    d = datasheet(slug)
    kb, nb = -(-k // 128), -(-n // 128)
    nbytes = active * (k * n + 4 * nb * kb) + rows * (k + 4 * kb) + 2 * rows * n
    flops = 2 * rows * k * n
    return max(nbytes / (d["hbm_tb_s"] * 1e12), flops / (2 * d["bf16_tflops"] * 1e12)) * 1e6, nbytes, flops


def timing_scope(contender: str, proj: str) -> str:
    """What a row's time covers."""
    if proj == "ffn":
        return "the whole layer: routing in, combined [T, H] out, activations quantised in the call"
    if contender == VLLM or (contender == TK and proj == "up"):
        scope = SCOPE_GATHER
    elif contender == TK:
        scope = "GEMM on rows in its sorted order (no scatter)"
    elif contender == DG_CONTIGUOUS:
        scope = "GEMM on rows permuted and padded per expert to its alignment"
    elif contender in (DG_MASKED, "ours:fp8-masked"):
        scope = "GEMM on the masked layout [E, m_max, K]"
    else:
        scope = SCOPE_PERMUTED
    return scope + ("" if contender == "ours:bf16" else "; operands quantised before timing")


def annotate(rows: list[dict], cell: dict, prov: dict) -> None:
    """The cell's columns on each row, its rates, and a peer's format in its note where it is not the block
    format."""
    for r in rows:
        fmt, note = r.get("quant", ""), r.get("note", "")
        if fmt not in ("", "bf16", BLOCK_NOTE):
            r["note"] = fmt + (f"; {note}" if note else "")
        r["timing_scope"] = timing_scope(r["contender"], cell["proj"])
        r.update(cell, **graph_rates(r.get("graph_us", math.nan), cell["flops"], cell["floor_us"]), **prov)


def ordered(cs: list, measured: list[dict]) -> list[dict]:
    """The rows of ``cs`` in their order: the measured ones' rows, an Unrunnable's own row."""
    by_name = {r["contender"]: r for r in measured}
    return [c.row() if isinstance(c, Unrunnable) else by_name[c.name] for c in cs]


def gemm_rows(g, f, model, proj, t, load, held, peers, settings, searched, slug, gpu) -> tuple[list, dict]:
    """One projection's cell: its contenders' rows and the cell's columns."""
    m = g["models"][model]
    e, top_k = m["experts"], m["top_k"]
    k, n = m[proj]
    if (model, proj) not in held:
        held.clear()  # one projection's weights (every format) on the GPU at a time
        torch.cuda.empty_cache()
        held[model, proj] = Weights([expert_weights(g["seed"], e, n, k)])
    w = held[model, proj]
    decode = phase(t) == "decode"
    if peers.vllm is not None and (model, proj, t) not in searched:
        if f.get("vllm_search", True):
            ids_s, x_s = tuner_tokens(g, t, e, top_k, k, "uniform")
            plan_s = route(ids_s, e)
            tuner = GemmCell(x_s, ids_s, plan_s, permute(x_s, plan_s), n, proj, decode)
            searched[model, proj, t] = vllm_search(tuner, w, peers, settings, gpu, m)
        else:
            searched[model, proj, t] = own_only(peers, gpu, m, e, n, top_k, t)
    ids, x, _ = cell_tokens(g, t, e, top_k, k, load)
    plan = route(ids, e)
    stats = skew_stats(plan.group_sizes)
    rows = t * top_k
    n_sets = input_sets_for(stats["active_experts"] * k * n + rows * (k + 2 * n))
    w.bf16 += [w.bf16[0].clone() for _ in range(n_sets - len(w.bf16))]
    xs = permute(x, plan)
    cell = GemmCell(x, ids, plan, xs, n, proj, decode)
    cs = gemm_contenders(
        cell,
        w,
        peers,
        searched.get((model, proj, t), "vLLM not loaded"),
        ref_rows(xs, w.bf16[0], plan.group_offsets),
    )
    out = measure(
        [c for c in cs if isinstance(c, Contender)], [(i,) for i in range(n_sets)], None, k, settings
    )
    fl, nbytes, flops = fp8_floor_us(rows, k, n, stats["active_experts"], slug)
    cols = dict(experts=e, top_k=top_k, k=k, n=n, rows=rows, **stats, bytes=nbytes, flops=flops, floor_us=fl)
    return ordered(cs, out), {**cols, "input_sets": n_sets}


def own_only(peers, gpu, m, e, n, top_k, t) -> dict | str:
    """vLLM's own block-FP8 config for a projection, unsearched (fp8.vllm_search off)."""
    own = vllm_moe.own_choice(
        peers.vllm[0], gpu, e, m["down"][0], m["up"][0], n, top_k, t, vllm_fp8.DTYPE, vllm_fp8.BLOCK_SHAPE
    )
    if own is None:
        return "vLLM's source has neither a table nor a default config"
    return {"config": own[0], "source": own[1], "graph_us": math.nan, "tried": 1, "own": None}


def ffn_rows(g, f, model, t, load, held, peers, settings, searched, slug, gpu) -> tuple[list, dict]:
    """One FFN cell: its contenders' rows and the cell's columns."""
    from experiments.e8_moe_layer import cell_inputs

    m, e, top_k, h, i, ids, x, wts, ref16, active, sets = cell_inputs(g, model, t, load, held)
    if ("fp8", model) not in held:
        held["fp8", model] = [
            (*quantize_weights(gu, "block"), *quantize_weights(dn, "block")) for gu, dn in sets
        ]
    q = held["fp8", model]
    ref8: dict = {}

    def fp8_ref():
        if not ref8:
            gq, gs, dq, ds = q[0]
            ref8["v"] = ffn_reference(
                x,
                ids,
                wts,
                lambda ex: weights64("block", gq, gs, ex),
                lambda ex: weights64("block", dq, ds, ex),
            )
        return ref8["v"]

    def fp8_check(out):
        return check_bounded(out, *fp8_ref(), rel_budget(2))

    def ours8(inp):
        gq, gs, dq, ds = q[inp[0]]
        poison_pool(t * h, x.dtype, x.device)
        return lambda: moe_ffn(x, ids, wts, gq, dq, w_gate_up_scale=gs, w_down_scale=ds)

    def ours16(inp):
        poison_pool(t * h, x.dtype, x.device)
        return lambda: moe_ffn(x, ids, wts, *sets[inp[0]])

    cs: list = [
        Contender("ours:moe_ffn-fp8", ours8, fields={"quant": BLOCK_NOTE}, check=fp8_check),
        Contender(
            "ours:moe_ffn-bf16", ours16, fields={"quant": "bf16"}, check=lambda out: check(out, ref16, h + i)
        ),
    ]
    if peers.vllm is None:
        cs.append(Unrunnable(LAYER_VLLM, f"not runnable: {peers.vllm_why}"))
    else:
        vk, qk = peers.vllm
        if (model, "ffn", t) not in searched:
            own = vllm_moe.own_choice(vk, gpu, e, i, h, 2 * i, top_k, t, vllm_fp8.DTYPE, vllm_fp8.BLOCK_SHAPE)
            try:
                searched[model, "ffn", t] = fastest_config(
                    own,
                    vllm_moe.candidates(t * top_k / e, block_k=vllm_fp8.GROUP)
                    if f.get("vllm_search", True)
                    else [],
                    lambda config: vllm_fp8.layer(vk, qk, x, ids, wts, e, config),
                    [q[0]],
                    None,
                    0,
                    settings,
                    check_and_time_fn=lambda calls, ref, k, s: check_and_time(
                        calls, None, 0, s, check_fn=fp8_check
                    ),
                )
            except Exception as ex:  # noqa: BLE001 (recorded in the cells it serves)
                searched[model, "ffn", t] = f"config search failed: {type(ex).__name__}: {str(ex)[:200]}"
        choice = searched[model, "ffn", t]
        if isinstance(choice, dict):
            bind = vllm_fp8.layer(vk, qk, x, ids, wts, e, choice["config"])
            cs.append(
                Contender(
                    LAYER_VLLM,
                    lambda inp: bind(*q[inp[0]]),
                    config=choice["config"],
                    fields={
                        "quant": BLOCK_NOTE,
                        "origin": vk.origin,
                        "config_source": f"{choice['source']}; best of {choice['tried']}",
                        "glue": vllm_fp8.GLUE,
                        "naive_block_assignment": vllm_moe.naive_assignment(t, top_k, e),
                    },
                    parallel_compile=True,
                    check=fp8_check,
                )
            )
        else:
            cs.append(Unrunnable(LAYER_VLLM, f"not runnable: {choice}", {"origin": vk.origin}))
    out = measure(
        [c for c in cs if isinstance(c, Contender)], [(j,) for j in range(len(sets))], None, h + i, settings
    )
    rows = t * top_k
    up, down = fp8_floor_us(rows, h, 2 * i, active, slug), fp8_floor_us(rows, i, h, active, slug)
    stats = skew_stats(torch.bincount(ids.flatten(), minlength=e))
    cols = dict(
        experts=e, top_k=top_k, k=h, n=h, rows=rows, **stats, bytes=up[1] + down[1], flops=up[2] + down[2]
    )
    return ordered(cs, out), {**cols, "floor_us": up[0] + down[0], "intermediate": i, "input_sets": len(sets)}


def main():
    args, cfg, g, settings, prov, slug, writer = start(__doc__, CELL_KEYS)
    f = cfg["fp8"]
    if f.get("timing"):
        settings = timing_settings(cfg, "fp8")
    cells = shard_cells(fp8_cells(cfg), args.shard)
    peers = Peers.load("cuda")
    for name, why in (("vLLM", peers.vllm_why), ("triton_kernels", peers.tk_why), ("DeepGEMM", peers.dg_why)):
        print(f"{name}: {why or 'loaded'}", flush=True)
    print(f"torch._scaled_grouped_mm: {peers.torch_why or 'runs here'}", flush=True)
    gpu = torch.cuda.get_device_name(0)
    searched: dict = {}
    held: dict = {}
    bar = Progress(len(cells), "E10")
    for model, proj, t, load in cells:
        if writer.done(model=model, proj=proj, tokens=t, load=load):
            bar.update()
            continue
        t_cell = time.perf_counter()
        if proj == "ffn":
            out, cols = ffn_rows(g, f, model, t, load, held, peers, settings, searched, slug, gpu)
        else:
            out, cols = gemm_rows(g, f, model, proj, t, load, held, peers, settings, searched, slug, gpu)
        cell = dict(
            experiment="E10",
            model=model,
            split=g["models"][model]["split"],
            proj=proj,
            tokens=t,
            phase=phase(t),
            load=load,
            **cols,
            cell_s=time.perf_counter() - t_cell,
        )
        annotate(out, cell, prov)
        writer.add(out)
        print(f"E10 {model} {proj} T={t} {load}: {cell['cell_s']:.1f} s", file=sys.stderr, flush=True)
        bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
