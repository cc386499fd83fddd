"""E8 moe-layer: the expert FFN of an MoE layer end to end, routing in, combined [T, H] out.

Per zoo model (config.yaml's grouped.models of the run's splits, gate and up fused: up = [H, 2I]; Mixtral
8x7B's tuned up projection is its gate alone, so E8 takes 2I = 2 x its up width), token count and load (the
pipeline's run, moe_layer.run, a selection of the zoo's E8 cells: run_selection), one float64
reference of the whole FFN, then side by side on both clocks, three interleaved rounds, and each contender's
host cost per call (moe_layer.host_calls, the cpu_us column):
- ``ours:moe_ffn``: moegemm.grouped.moe_ffn (SwiGLU fused into the gate/up GEMM; the default path);
- ``ours:unfused-swiglu``: our grouped GEMMs with SwiGLU as a separate op (what the fusion saves);
- ``ours:moe_ffn:no-gather``: moe_ffn with its gate/up form that reads x's rows by token id switched off
  (what leaving out the permuted copy saves);
- ``ours:moe_ffn:no-graph``: moe_ffn with its decode graphs switched off (what replaying a decode step
  saves the host; under the GPU clock's own capture both run the same kernels);
- ``ours:hf-backend``: the same through transformers' experts interface (moegemm.integrations.transformers),
  on a transformers-style experts module; ``...:compiled`` under torch.compile(fullgraph=True) at the
  compiled token counts;
- ``hf:grouped_mm``: transformers' own grouped_mm experts backend (torch._grouped_mm), eager and compiled;
- ``torch._grouped_mm pipeline``: our routing, torch._grouped_mm for gate/up, SiLU * up, torch._grouped_mm for
  down, the gating weights and the combine as torch ops;
- ``vllm:fused_experts``: vLLM's fused-MoE Triton kernel as vLLM's fused_experts runs it (the expert
  assignment, gate/up gathering the tokens' rows, silu_and_mul, down with the routing weights applied inside
  the kernel, moe_sum), with vLLM's flags and one config for the layer, as vLLM takes it: the faster of its
  own (its tuned table for this GPU, else its default) and a light search of ours (vllm_moe.candidates),
  each checked and timed on the cell's own inputs before the cell is measured (vllm_layer_search; as E7
  searches per projection), where its source is at hand (MOEGEMM_VLLM_SOURCE, as E7); vLLM's CUDA glue
  ops are stood in for by one-kernel Triton equivalents, named in the ``glue`` column
  (experiments/vllm_moe.py);
- ``tk:matmul_ogs``: OpenAI's triton_kernels as vLLM runs it for gpt-oss (its routing, matmul_ogs with the
  gather and the fused SwiGLU, then matmul_ogs with the scatter, the top-k sum and the routing weights
  fused), where its source is at hand (MOEGEMM_TRITON_KERNELS_SOURCE; experiments/triton_kernels_moe.py);
- ``per-expert-loop``: transformers' eager experts (its experts class's own loop over the experts hit,
  host syncs: launch clock only).
The transformers contenders run transformers' own experts module (Qwen3-MoE's class) over the cell's
weights.
Every contender is checked against the float64 reference first. A contender that needs transformers 5.x
or vLLM's source, where they are missing, is recorded as an error, not timed.

    python -m experiments.e8_moe_layer --out results/<slug>/moe_layer.csv
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import torch

from experiments import triton_kernels_moe, vllm_moe
from experiments.common import (
    Progress,
    check_and_time,
    check_models,
    raise_recompile_limit,
    selected,
    shard_cells,
)
from experiments.e7_grouped_skew import (
    Vllm,
    failed_contender,
    fastest_config,
    floor_us,
    graph_rates,
    start,
)
from experiments.harness.moe_loads import sample_topk
from experiments.harness.runner import Contender, measure
from experiments.harness.timing import input_sets_for
from moegemm.grouped import moe_ffn, route_and_permute, unpermute
from moegemm.grouped.baselines import torch_grouped_mm

CELL_KEYS = ("model", "tokens", "load")  # a cell of E8 and of the probes that run its cells


def layer_sizes(m: dict) -> tuple[int, int]:
    """(hidden H, intermediate I) of a zoo model: up = [H, 2I] (gate and up fused), down = [I, H]."""
    return m["down"][1], m["down"][0]


def ffn_weights(seed: int, e: int, h: int, i: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) bf16, scaled by 1/sqrt of their inner dimension; fixed seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    gu = (torch.randn(e, 2 * i, h, device=device, generator=g) / math.sqrt(h)).to(torch.bfloat16)
    dn = (torch.randn(e, h, i, device=device, generator=g) / math.sqrt(i)).to(torch.bfloat16)
    return gu, dn


def ref_ffn(x, ids, wts, w_gu, w_dn) -> torch.Tensor:
    """float64 [T, H]: sum_j wts[t, j] * down_e(silu(gate_e x_t) * up_e x_t), expert by expert."""
    i = w_gu.shape[1] // 2
    out = torch.zeros(x.shape[0], w_dn.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        gu = x[tok].double() @ w_gu[e].double().T
        act = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        out.index_add_(0, tok, wts[tok, j].double()[:, None] * (act @ w_dn[e].double().T))
    return out


def hf_experts(w_gu: torch.Tensor, w_dn: torch.Tensor, impl: str) -> torch.nn.Module:
    """transformers' own experts module (Qwen3-MoE's: gate and up concatenated, SiLU) over the given weights,
    set to ``impl`` of its ExpertsInterface ("eager": the class's own loop over the experts hit). Built on
    the meta device, so that no weights are allocated beside the given ones."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import moegemm.integrations.transformers  # noqa: F401  (registers "moegemm")

    e, two_i, h = w_gu.shape
    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e, hidden_act="silu")
    config._experts_implementation = impl
    with torch.device("meta"):
        mod = Qwen3MoeExperts(config)
    mod.gate_up_proj = torch.nn.Parameter(w_gu, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w_dn, requires_grad=False)
    return mod


def unfused_ours(x, ids, wts, w_gu, w_dn, e: int):
    """Our kernels with SwiGLU as a separate op: the [rows, 2I] gate/up product written, SiLU(gate) * up,
    then the down GEMM with the gating weights fused (what the fused gate/up saves)."""
    from moegemm.grouped import grouped_mm

    plan, xs, ws = route_and_permute(x, ids, wts, e, validate=False)  # moe_ffn's routing and permutation
    gu = grouped_mm(xs, w_gu, plan.group_offsets, w_layout="nk", validate=False)
    i = gu.shape[1] // 2
    act = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).contiguous()
    ys = grouped_mm(act, w_dn, plan.group_offsets, w_layout="nk", row_scale=ws, validate=False)
    return unpermute(ys, plan, None)


def without_gather(x, ids, wts, w_gu, w_dn):
    """moe_ffn with its gathering gate/up form switched off (moegemm.grouped.ffn.GATHER): every gate/up on
    the permuted copy of x (what reading x's rows inside the GEMM saves), as a zero-argument call."""
    from moegemm.grouped import ffn

    def call():
        ffn.GATHER = False
        try:
            return moe_ffn(x, ids, wts, w_gu, w_dn)
        finally:
            ffn.GATHER = True

    return call


def without_graphs(x, ids, wts, w_gu, w_dn):
    """moe_ffn with its decode graphs switched off (MOEGEMM_LAYER_GRAPHS=0, moegemm.grouped.layer_graphs):
    every decode step launched eagerly (what the replay saves the host), as a zero-argument call."""
    from moegemm.grouped import layer_graphs

    def call():
        before = os.environ.get(layer_graphs.ENV)
        os.environ[layer_graphs.ENV] = "0"
        try:
            return moe_ffn(x, ids, wts, w_gu, w_dn)
        finally:
            if before is None:
                del os.environ[layer_graphs.ENV]
            else:
                os.environ[layer_graphs.ENV] = before

    return call


def torch_pipeline(x, ids, wts, w_gu, w_dn, e: int):
    """The same FFN on torch._grouped_mm (our routing and permutation, as moe_ffn's; no host sync)."""
    plan, xs, _ = route_and_permute(x, ids, wts, e, validate=False)
    gu = torch_grouped_mm(xs, w_gu, plan.group_offsets, w_layout="nk")
    i = gu.shape[1] // 2
    act = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    return unpermute(torch_grouped_mm(act.contiguous(), w_dn, plan.group_offsets, w_layout="nk"), plan, wts)


def hf_contender(name: str, impl: str, x, ids, wts, compiled: bool, graph: bool = True) -> Contender:
    """``impl`` of transformers' ExpertsInterface on a module over an input set's weights (compiled: under
    torch.compile(fullgraph=True)); an error row where transformers 5.x is missing."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
    except ImportError as ex:
        return failed_contender(name, f"transformers 5.x (ExpertsInterface) not importable: {ex}")

    def bind(inp):
        mod = hf_experts(inp[0], inp[1], impl)
        fn = torch.compile(mod, fullgraph=True, dynamic=False) if compiled else mod  # per T: its best code
        return lambda: fn(x, ids, wts)

    return Contender(
        name, bind, graph=graph, fields={"config_source": impl + (", compiled" if compiled else "")}
    )


def vllm_layer_search(vk, x, ids, wts, e: int, h: int, i: int, sets, ref, settings, gpu_name: str) -> dict:
    """vLLM's whole layer (vllm_moe.layer, one config for both GEMMs, as vLLM takes it) at its own config
    (own_choice) and at each of our light search's (vllm_moe.candidates for the cell's mean rows per expert),
    each checked against the float64 reference and timed on the GPU clock over the cell's input sets, as a
    tuner times a candidate (e7_grouped_skew.fastest_config, E7's search for its kernel). Returns the fastest
    right one: {config, source, graph_us, tried, own}; a RuntimeError where none is right."""
    t, top_k = ids.shape
    return fastest_config(
        vllm_moe.own_choice(vk, gpu_name, e, i, h, 2 * i, top_k, t),
        vllm_moe.candidates(t * top_k / e),
        lambda config: vllm_moe.layer(vk, x, ids, wts, e, config),
        sets,
        ref,
        h + i,
        settings,
        check_and_time_fn=check_and_time,
    )


def vllm_contender(vk, x, ids, wts, e: int, h: int, i: int, t: int, choice=None) -> Contender:
    """vLLM's kernel as fused_experts runs it (vllm_moe.layer: the expert assignment in the call, gate/up
    gathering its rows, silu_and_mul, down with the routing weights inside, moe_sum; vLLM's CUDA glue ops
    stood in for by one-kernel Triton equivalents, named in ``glue``), at the config ``choice`` of
    vllm_layer_search (a str: why the search failed, recorded as an error; None: vLLM's own choice, no
    search, as the probes that reuse this contender take it) and its own flags (vllm_flags)."""
    top_k = ids.shape[1]
    if choice is None:
        own = vllm_moe.own_choice(vk, torch.cuda.get_device_name(0), e, i, h, 2 * i, top_k, t)
        if own is None:
            choice = "vLLM's source has neither a table nor a default config"
        else:
            choice = {"config": own[0], "source": own[1], "graph_us": math.nan, "tried": 1, "own": None}
    if not isinstance(choice, dict):
        return failed_contender("vllm:fused_experts", f"config search failed: {choice}")
    config = choice["config"]
    bind = vllm_moe.layer(vk, x, ids, wts, e, config)
    _, flags = vllm_moe.vllm_flags(set(vk.kernel.arg_names), x.dtype, vllm_moe.capability_of(x))
    own = choice["own"]
    return Contender(
        "vllm:fused_experts",
        lambda inp: bind(inp[0], inp[1]),
        config=config,
        fields={
            "config_source": f"{choice['source']}; best of {choice['tried']} ({vk.origin})",
            "vllm_own_config": own[0] if own else "",
            "vllm_own_search_us": own[1] if own else math.nan,
            "vllm_search_us": choice["graph_us"],
            "vllm_flags": flags,
            "glue": vllm_moe.GLUE,
            "naive_block_assignment": vllm_moe.naive_assignment(t, top_k, e),
        },
        parallel_compile=True,
    )


def tk_contender(tk, x, ids, wts, e: int) -> Contender:
    """OpenAI's triton_kernels as vLLM runs it for gpt-oss (triton_kernels_moe.layer), its own choices."""
    bind = triton_kernels_moe.layer(tk, x, ids, wts, e)
    return Contender(
        triton_kernels_moe.NAME,
        lambda inp: bind(inp[0], inp[1]),
        fields={
            "config_source": f"its own opt_flags ({tk.origin})",
            "glue": "routing: its routing(); SwiGLU fused (swiglu_fn, alpha 1, up bias -1); "
            "scatter, gammas and top-k sum fused",
        },
    )


def contenders(
    x, ids, wts, e: int, h: int, i: int, t: int, compiled: bool, vk, tk=None, vllm_choice=None
) -> list[Contender]:
    """The contenders of one cell; ``vllm_choice``: vllm_layer_search's result for it (where vk is given)."""
    cs = [
        Contender("ours:moe_ffn", lambda inp: lambda: moe_ffn(x, ids, wts, inp[0], inp[1])),
        Contender("ours:unfused-swiglu", lambda inp: lambda: unfused_ours(x, ids, wts, inp[0], inp[1], e)),
        Contender("ours:moe_ffn:no-gather", lambda inp: without_gather(x, ids, wts, inp[0], inp[1])),
        Contender("ours:moe_ffn:no-graph", lambda inp: without_graphs(x, ids, wts, inp[0], inp[1])),
        hf_contender("ours:hf-backend", "moegemm", x, ids, wts, False),
        hf_contender("hf:grouped_mm", "grouped_mm", x, ids, wts, False),
        Contender(
            "torch._grouped_mm pipeline", lambda inp: lambda: torch_pipeline(x, ids, wts, inp[0], inp[1], e)
        ),
    ]
    if compiled:
        cs += [
            hf_contender("ours:hf-backend:compiled", "moegemm", x, ids, wts, True),
            hf_contender("hf:grouped_mm:compiled", "grouped_mm", x, ids, wts, True),
        ]
    if vk is not None:
        cs.append(vllm_contender(vk, x, ids, wts, e, h, i, t, vllm_choice))
    if tk is not None:
        cs.append(tk_contender(tk, x, ids, wts, e))
    cs.append(hf_contender("per-expert-loop", "eager", x, ids, wts, False, graph=False))
    return cs


def cell_inputs(g: dict, model: str, t: int, load: str, weights: dict):
    """(zoo entry, E, top_k, H, I, ids, x, gating weights, float64 reference, active experts, input sets) of
    one E8 cell, from fixed seeds. ``weights`` holds one model's weights at a time: a new model clears it and
    Dynamo's compiled graphs."""
    m = g["models"][model]
    e, top_k = m["experts"], m["top_k"]
    h, i = layer_sizes(m)
    if model not in weights:
        weights.clear()  # one model's weights on the GPU at a time
        torch._dynamo.reset()  # and its compiled graphs
        weights[model] = ffn_weights(g["seed"] + 8, e, h, i)
    w_gu, w_dn = weights[model]
    seed = g["seed"] + 8 * 1009 + t * 7 + sum(map(ord, load))
    ids = sample_topk(t, e, top_k, load, seed).to(torch.int64)  # as transformers' routers give them
    gx = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(t, h, device="cuda", generator=gx).to(torch.bfloat16)
    wts = torch.softmax(torch.randn(t, top_k, device="cuda", generator=gx), -1)
    ref = ref_ffn(x, ids, wts, w_gu, w_dn)
    active = int(torch.unique(ids).numel())
    n_sets = input_sets_for(2 * active * 3 * h * i + 2 * t * top_k * (h + 2 * i))
    sets = [(w_gu, w_dn)] + [(w_gu.clone(), w_dn.clone()) for _ in range(n_sets - 1)]
    return m, e, top_k, h, i, ids, x, wts, ref, active, sets


def annotate(
    rows: list[dict],
    experiment: str,
    m: dict,
    model: str,
    t: int,
    load: str,
    h: int,
    i: int,
    active: int,
    input_sets: int,
    slug: str,
    prov: dict,
) -> None:
    """Give an FFN cell's result rows the cell's columns: the zoo entry ``m``'s split, experts and top_k, the
    sizes, the floor, bytes and FLOPs of its two GEMMs together, each row's rates and the provenance."""
    rows_in = t * m["top_k"]
    fl_up, b_up, f_up = floor_us(rows_in, h, 2 * i, active, slug)
    fl_dn, b_dn, f_dn = floor_us(rows_in, i, h, active, slug)
    fl = fl_up + fl_dn
    for r in rows:
        r.update(
            experiment=experiment,
            model=model,
            split=m["split"],
            tokens=t,
            load=load,
            experts=m["experts"],
            top_k=m["top_k"],
            hidden=h,
            intermediate=i,
            active_experts=active,
            bytes=b_up + b_dn,
            flops=f_up + f_dn,
            floor_us=fl,
            input_sets=input_sets,
            **graph_rates(r.get("graph_us", math.nan), f_up + f_dn, fl),
            **prov,
        )


def run_selection(e8: dict) -> dict:
    """The pipeline's E8 run: config.yaml's ``moe_layer.run`` over ``moe_layer`` (each key it lacks: the
    zoo's), with ``splits`` (default both), ``models`` (default every model of those splits),
    ``compiled_models`` (the models the compiled contenders join at ``compiled_tokens``; default every model)
    and ``uniform_only_tokens`` (default none)."""
    return {
        "splits": ["tune", "heldout"],
        "models": None,
        "compiled_models": None,
        "uniform_only_tokens": [],
        **{k: e8[k] for k in ("tokens", "loads", "compiled_tokens")},
        **e8.get("run", {}),
    }


def compiled_here(run: dict, model: str, t: int) -> bool:
    """Whether the compiled contenders join the cell of ``model`` at ``t`` in the run ``run``
    (``run_selection``)."""
    return t in run["compiled_tokens"] and selected(run["compiled_models"], model)


def layer_cells(g: dict, e8: dict) -> list[tuple[str, int, str]]:
    """E8's run's cells (model, T, load): the models of its splits, each of its T, each of its loads but the
    uniform load alone at its ``uniform_only_tokens`` (run_selection)."""
    run = run_selection(e8)
    check_models(run["models"], g["models"], "moe_layer.run.models")
    check_models(
        run["compiled_models"], run["models"] or g["models"], "moe_layer.run.compiled_models", "E8's models"
    )
    return [
        (model, t, load)
        for model, spec in g["models"].items()
        if spec["split"] in run["splits"] and selected(run["models"], model)
        for t in run["tokens"]
        for load in (["uniform"] if t in run["uniform_only_tokens"] else run["loads"])
    ]


def main():
    args, cfg, g, settings, prov, slug, writer = start(__doc__, CELL_KEYS)
    e8 = cfg["moe_layer"]
    run = run_selection(e8)
    cells = layer_cells(g, e8)
    cells = shard_cells(cells, args.shard)
    if e8.get("host_calls"):  # Python's cost of one call (the cpu_us column): this many calls, no sync
        settings = dataclasses.replace(settings, cpu_calls=e8["host_calls"])
    # the compiled backends: a graph per T (dynamic=False), two backends sharing one forward's code object
    raise_recompile_limit(64)
    vllm = Vllm()
    vllm.load()
    tk = triton_kernels_moe.load()
    print(f"triton_kernels: {tk.origin if tk else 'not available, no ' + triton_kernels_moe.ENV}", flush=True)
    bar = Progress(len(cells), "E8")
    weights: dict = {}
    for model, t, load in cells:
        if writer.done(model=model, tokens=t, load=load):
            bar.update()
            continue
        t_cell = time.perf_counter()
        m, e, top_k, h, i, ids, x, wts, ref, active, sets = cell_inputs(g, model, t, load, weights)
        inputs_s = time.perf_counter() - t_cell  # weights (once per model), routing, reference
        choice = None
        if vllm.kernel is not None:
            try:
                gpu = torch.cuda.get_device_name(0)
                choice = vllm_layer_search(vllm.kernel, x, ids, wts, e, h, i, sets, ref, settings, gpu)
            except Exception as ex:  # an optional contender: its row records why, not fatal
                choice = f"{type(ex).__name__}: {str(ex)[:200]}"
        search_s = time.perf_counter() - t_cell - inputs_s  # vLLM's config search, before the cell
        cs = contenders(x, ids, wts, e, h, i, t, compiled_here(run, model, t), vllm.kernel, tk, choice)
        out = measure(cs, sets, ref, h + i, settings)
        annotate(out, "E8", m, model, t, load, h, i, active, len(sets), slug, prov)
        cell_s = time.perf_counter() - t_cell
        for r in out:  # the cell's own cost: its inputs, vLLM's config search, and its whole wall time
            r.update(inputs_s=inputs_s, vllm_search_s=search_s, cell_s=cell_s)
        writer.add(out)
        print(f"E8 {model} T={t} {load}: {cell_s:.1f} s", file=sys.stderr, flush=True)
        del sets, cs
        bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
