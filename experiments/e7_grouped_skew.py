"""E7 grouped-skew: grouped GEMM vs its alternatives under skewed expert loads, real MoE shapes.

Per model of the tune split (DeepSeek-V3, Mixtral 8x7B, Qwen3-30B-A3B), projection (gate/up, down; w as [E, N,
K]), token count (decode and prefill) and load (uniform, Zipf(alpha), one hot expert, ...): our contiguous
kernel (plain and persistent grid), our masked kernel (decode; where it takes TMA loads, also the same tiles
on pointer loads), torch._grouped_mm, a per-expert loop of torch.mm, capacity padding + bmm at several
capacity factors (dropped rows recorded: a correctness cost, so those rows are checked only where kept),
a dense GEMM with one expert's weights as a yardstick (at the uniform load only: it depends on the row
count, not on the load), a memory ceiling (``ceiling:stream``, experiments.harness.stream: one kernel that
only moves as many bytes as the floor counts, the best of a few launch shapes), and, where vLLM's source is at
hand (an installed vllm, or MOEGEMM_VLLM_SOURCE: see experiments/vllm_moe.py), vLLM's fused-MoE Triton
kernel with the best of a light config search (vLLM's flags, ``vllm_flags``), OpenAI's triton_kernels'
matmul_ogs where its source is at hand (MOEGEMM_TRITON_KERNELS_SOURCE: experiments/triton_kernels_moe.py),
and, as these gather their rows inside the GEMM, ours with its gather timed (``ours:auto+gather``);
``ours:auto`` (grouped_mm with no config, what the library deploys) is the headline's ours on both splits, and
every row's
``timing_scope`` says what its time covers. Both clocks; TFLOP/s and % of the floor max(bytes / 4.8 TB/s,
FLOPs / 989 TFLOP/s) on every row. Also the whole expert path (route + permute + grouped GEMM with fused
gating + unpermute) against the same path on torch._grouped_mm. Per held-out model (config.yaml's zoo,
split "heldout": shapes the tuner never saw), projection, token count and load, the default path as a user
gets it beside torch._grouped_mm and vLLM's kernel (heldout_contenders). Every row has a ``split`` column.

    python -m experiments.e7_grouped_skew --out results/<slug>/grouped_skew.csv
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import tempfile
import time

import torch

from experiments import triton_kernels_moe, vllm_moe
from experiments.common import (
    Progress,
    ResultWriter,
    check_and_time,
    check_models,
    cli,
    load_config,
    provenance_fields,
    require_gpu,
    selected,
    shard_cells,
    timing_settings,
    weight_sets,
)
from experiments.harness.correctness import check
from experiments.harness.floors import datasheet
from experiments.harness.moe_loads import sample_topk, skew_stats
from experiments.harness.runner import Contender, measure, prewarm
from experiments.harness.stream import CANDIDATES as STREAM_CANDIDATES
from experiments.harness.stream import check_stream, stream_bytes, stream_setup
from experiments.harness.stream import fits as stream_fits
from moegemm._runtime import device_smem_per_block, gpu_slug, slugify
from moegemm.grouped import (
    choose_config,
    grouped_mm,
    grouped_mm_masked,
    permute,
    route,
    sorted_weights,
    unpermute,
)
from moegemm.grouped.baselines import dense_reference, padded_bmm, per_expert_loop, torch_grouped_mm
from moegemm.grouped.config import TIMED_SOURCES, GroupedConfig, fitted_shortlist, masked_config
from moegemm.grouped.routing import gather_rows, row_positions


def loads(cfg: dict, t: int) -> list[str]:
    """The loads of a tune-split cell at T: every load at ``all_loads_at``, the uniform load alone at
    ``uniform_only_tokens`` (one token's top-k experts are the same work under any load), else uniform and
    Zipf 1.2."""
    g = cfg["grouped"]
    every = ["uniform"] + [f"zipf{a}" for a in g["zipf_alphas"]] + [f"hot{f}" for f in g["hot_fractions"]]
    if t in g["all_loads_at"]:
        return every
    if t in g.get("uniform_only_tokens", ()):
        return ["uniform"]
    return ["uniform", "zipf1.2"]


def heldout_loads(g: dict, t: int) -> list[str]:
    """The loads of a held-out cell at T: ``heldout_loads``, the uniform load alone at
    ``uniform_only_tokens``."""
    return ["uniform"] if t in g.get("uniform_only_tokens", ()) else list(g["heldout_loads"])


def floor_us(rows: int, k: int, n: int, active: int, slug: str) -> tuple[float, int, int]:
    d = datasheet(slug)
    nbytes = 2 * (active * k * n + rows * k + rows * n)  # bf16: active experts' weights, x in, y out
    flops = 2 * rows * k * n
    return max(nbytes / (d["hbm_tb_s"] * 1e12), flops / (d["bf16_tflops"] * 1e12)) * 1e6, nbytes, flops


def expert_weights(seed: int, e: int, n: int, k: int) -> torch.Tensor:
    """One projection's expert weights, [E, N, K] bf16 (the nn.Linear layout), scaled by 1/sqrt(K); fixed
    seed."""
    gw = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(e, n, k, device="cuda", generator=gw) / math.sqrt(k)).to(torch.bfloat16)


def cell_tokens(g: dict, t: int, e: int, top_k: int, k: int, load: str):
    """(top-k expert ids [T, top_k], activations x [T, K] bf16, the generator that drew x) of the cell
    (T, load), from seeds fixed per (T, load): the same every run."""
    seed = g["seed"] + t * 1009 + sum(map(ord, load))
    ids = sample_topk(t, e, top_k, load, seed)
    gx = torch.Generator(device="cuda").manual_seed(seed + 1)
    return ids, torch.randn(t, k, device="cuda", generator=gx).to(torch.bfloat16), gx


def tuner_tokens(g: dict, t: int, e: int, top_k: int, k: int, load: str):
    """(top-k expert ids [T, top_k], activations x [T, K] bf16) of a tuning cell: the tuner's own seeds,
    not E7's (cell_tokens), so that what is tuned does not see E7's inputs."""
    ids = sample_topk(t, e, top_k, load, g["seed"] + t)
    gx = torch.Generator(device="cuda").manual_seed(g["seed"] + t)
    return ids, torch.randn(t, k, device="cuda", generator=gx).to(torch.bfloat16)


def in_slot_order(rows: torch.Tensor, plan) -> torch.Tensor:
    """Rows in the plan's sorted order put back in (token, k) slot order (row s: slot s)."""
    out = torch.empty_like(rows)
    out[plan.sorted_slot.long()] = rows
    return out


def masked_inputs(xs, plan, e: int, n: int):
    """The masked layout's view of the same rows: (x [E, m_max, K] with each expert's rows first and zeros
    past them, an output [E, m_max, N], masked_m, and each sorted row's (expert, position) to gather the
    output back into sorted order)."""
    sizes = plan.group_sizes
    m_max = max(1, int(sizes.max()))
    expert, pos = row_positions(plan.group_offsets, xs.shape[0])
    xm = torch.zeros(e, m_max, xs.shape[1], dtype=xs.dtype, device=xs.device)
    xm[expert, pos] = xs
    ym = torch.empty(e, m_max, n, dtype=xs.dtype, device=xs.device)
    return xm, ym, sizes, expert, pos


def start(doc: str, keys: tuple[str, ...] = ("model", "proj", "tokens", "load")):
    """(args, config, its grouped section, timing settings, provenance, GPU slug, a resumable writer keyed by
    cell: ``keys``, E7's by default, E8's without the projection) for a run of E7, E8 or a probe on this
    GPU."""
    args = cli(doc)
    require_gpu()
    # the grouped GEMM's first call of a shape as a new user's: its choices from an empty disk cache, not
    # from one an earlier process on this machine left (MOEGEMM_CACHE_DIR, where set, is kept)
    os.environ.setdefault("MOEGEMM_CACHE_DIR", tempfile.mkdtemp(prefix="moegemm-cache-"))
    cfg = load_config(args.config)
    g = cfg["grouped"]
    settings = timing_settings(cfg, "grouped")
    prov = provenance_fields()
    slug = slugify(prov["gpu"])
    writer = ResultWriter(args.out, keys)
    return args, cfg, g, settings, prov, slug, writer


def run_probe(
    doc: str,
    experiment: str,
    cells: list,
    contenders_of,
    summary,
    rounds: int | None = None,
    measure_cell=None,
    with_sets: bool = False,
) -> None:
    """The loop the probes share (probes/probe_*.py, not pipeline steps): per cell (model, projection,
    tokens, load), E7's weights, routing and activations, the float64 reference and the rotated weight
    sets; ``contenders_of(xs, plan, ref, w, t, e, k, n, g, cell)`` (g: config.yaml's grouped section; cell:
    (model, projection, tokens, load)) gives the contenders, measured side by side with E7's timing
    settings; one row each with the cell's columns, the floor and provenance (resumable, written
    atomically); ``summary(rows)`` returns the line printed per cell. ``rounds``: more interleaved rounds
    than E7's timing settings take. ``measure_cell(contenders, input_sets, ref, k, settings,
    turn)`` (turn: the cell's index), where given, measures a cell instead of harness.runner.measure.
    ``with_sets``: contenders_of also gets the rotated weight sets, the timing settings, the tokens'
    activations and their top-k expert ids (``ws=``, ``settings=``, ``x=``, ``ids=``)."""
    args, cfg, g, settings, prov, slug, writer = start(doc)
    if rounds:
        settings = dataclasses.replace(settings, rounds=rounds)
    bar = Progress(len(cells), "probe")
    for turn, (model, proj, t, load) in enumerate(cells):
        if writer.done(model=model, proj=proj, tokens=t, load=load):
            bar.update()
            continue
        m = g["models"][model]
        e, top_k = m["experts"], m["top_k"]
        k, n = m[proj]
        w = expert_weights(g["seed"], e, n, k)
        ids, x, _ = cell_tokens(g, t, e, top_k, k, load)  # E7's routing and activations for (T, load)
        plan = route(ids, e)
        stats = skew_stats(plan.group_sizes)
        rows = t * top_k
        fl, nbytes, flops = floor_us(rows, k, n, stats["active_experts"], slug)
        xs = permute(x, plan)
        ref = ref_rows(xs, w, plan.group_offsets)
        ws = weight_sets(w, stats["active_experts"], rows, k, n)
        more = {"ws": ws, "settings": settings, "x": x, "ids": ids} if with_sets else {}
        cs, sets = (
            contenders_of(xs, plan, ref, w, t, e, k, n, g, (model, proj, t, load), **more),
            [(xs, wi) for wi in ws],
        )
        out = (
            measure(cs, sets, ref, k, settings)
            if measure_cell is None
            else measure_cell(cs, sets, ref, k, settings, turn)
        )
        del cs, sets
        for r in out:
            r.update(
                experiment=experiment,
                model=model,
                proj=proj,
                tokens=t,
                load=load,
                experts=e,
                top_k=top_k,
                k=k,
                n=n,
                rows=rows,
                **stats,
                bytes=nbytes,
                floor_us=fl,
                flops=flops,
                input_sets=len(ws),
                **graph_rates(r.get("graph_us", math.nan), flops, fl),
                **prov,
            )
        writer.add(out)
        del w, ws, ref
        bar.update()
        print(f"{model} {proj} T={t} {load}: {summary(out)}", flush=True)
    bar.close()
    writer.finish()


def graph_rates(gus: float, flops: float, floor: float) -> dict:
    """A timed row's TFLOP/s and % of the floor on the GPU clock (NaN where it has no time)."""
    ok = gus == gus and gus
    return {
        "tflops_graph": flops / gus / 1e6 if ok else math.nan,
        "pct_floor_graph": 100 * floor / gus if ok else math.nan,
    }


def ours(offsets, config):
    """A contender's binder: our contiguous kernel with ``config`` on an input set (x_sorted, w as [E, N, K])
    with these group offsets."""
    return lambda inp: (
        lambda: grouped_mm(inp[0], inp[1], offsets, w_layout="nk", config=config, validate=False)
    )


def ref_rows(xs, w, offsets) -> torch.Tensor:
    """float64 per-expert reference on the GPU (w as [E, N, K])."""
    out = torch.empty(xs.shape[0], w.shape[1], dtype=torch.float64, device=xs.device)
    off = offsets.tolist()
    for e in range(w.shape[0]):
        if off[e + 1] > off[e]:
            out[off[e] : off[e + 1]] = xs[off[e] : off[e + 1]].double() @ w[e].double().T
    return out


def torch_contender(offsets) -> Contender:
    """torch._grouped_mm on an input set (x_sorted, w as [E, N, K]) with these group offsets."""
    return Contender(
        "torch._grouped_mm", lambda inp: lambda: torch_grouped_mm(inp[0], inp[1], offsets, w_layout="nk")
    )


def dense_contender(e: int) -> Contender:
    """The dense yardstick: one GEMM over all rows with one expert's weights per call, a different expert each
    call (no L2 reuse either); it computes another product by design, so its check only says so."""

    def dense(inp):
        turn = itertools.count()
        return lambda: dense_reference(inp[0], inp[1], w_layout="nk", expert=next(turn) % e)

    return Contender(
        "dense-reference",
        dense,
        check=lambda out: (True, math.nan, "yardstick: one expert's weights, not the grouped result"),
    )


def tuned_contenders(xs, offsets, e: int, n: int) -> list[Contender]:
    """Ours with the config choose_config gives (tuned for this GPU, else heuristic) on both grids:
    ``ours:contiguous`` and ``ours:persistent`` (what the grid choice is worth; not the headline, which is
    ``ours:auto``: auto_contender)."""
    base, source = choose_config(xs, e, n, "nk")
    return [
        Contender(
            f"ours:{grid}",
            ours(offsets, c),
            config=dataclasses.asdict(c),
            fields={"config_source": source},
            parallel_compile=True,
        )
        for grid, c in (
            ("contiguous", dataclasses.replace(base, persistent=False)),
            ("persistent", dataclasses.replace(base, persistent=True)),
        )
    ]


def auto_contender(xs, offsets, e: int, n: int) -> Contender:
    """Ours as the library deploys it, ``ours:auto``: grouped_mm with no config (the tuned table for this GPU,
    else the distilled default), E7's headline on every split."""
    base, source = choose_config(xs, e, n, "nk")
    return Contender(
        "ours:auto",
        lambda inp: lambda: grouped_mm(inp[0], inp[1], offsets, w_layout="nk", validate=False),
        config=dataclasses.asdict(base),
        fields={"config_source": source},
        parallel_compile=True,
    )


def gather_contender(src, index, offsets) -> Contender:
    """``ours:auto+gather``: the same work as the peers' kernels that gather their rows themselves: our gather
    of the rows (one kernel: ``src`` rows by ``index``, the tokens for gate/up, the slots for down) then
    grouped_mm with no config, both timed."""

    def bind(inp):
        return lambda: grouped_mm(gather_rows(src, index), inp[1], offsets, w_layout="nk", validate=False)

    return Contender("ours:auto+gather", bind)


# what each E7 contender's time covers (the ``timing_scope`` column): the peers' kernels read their rows by id
SCOPE_GATHER = "gather fused in the GEMM (rows read by id)"
SCOPE_PERMUTED = "GEMM on rows already permuted"


def timing_scope(contender: str, proj: str) -> str:
    if contender == "ours:auto+gather":
        return "our gather kernel + GEMM"
    if contender == "vllm:fused_moe":
        return SCOPE_GATHER
    if contender == triton_kernels_moe.NAME:
        return SCOPE_GATHER if proj == "up" else "GEMM on rows in its sorted order (no scatter)"
    if contender.startswith("path:"):
        return "route + permute + GEMM + unpermute"
    return SCOPE_PERMUTED


def tk_contender(tk, x, xs, plan, ids, ref, proj: str, k: int) -> Contender:
    """OpenAI's triton_kernels' matmul_ogs on this projection (triton_kernels_moe.projection): gate/up gathers
    the tokens' rows itself, down reads the rows in its own sorted order; its routing made before timing;
    checked row by row against the float64 reference in its order."""
    gather = proj == "up"
    a = x if gather else in_slot_order(xs, plan)
    bind, order = triton_kernels_moe.projection(tk, a, ids, plan.num_experts, gather)
    tk_ref = in_slot_order(ref, plan)[order]
    return Contender(
        triton_kernels_moe.NAME,
        lambda inp: bind(inp[1]),
        fields={"config_source": f"its own opt_flags ({tk.origin})"},
        check=lambda out: check(out, tk_ref, k),
    )


def contenders(
    xs,
    plan,
    ref,
    k,
    decode: bool,
    cfg: dict,
    e: int,
    n: int,
    yardstick: bool = True,
    vllm: Contender | None = None,
    ceiling: Contender | None = None,
    peers: tuple[Contender, ...] = (),
) -> list[Contender]:
    """Every contender binds to an input set (xs, w): the sets share the activations and hold copies of
    the weights, rotated so that back-to-back calls do not find the active experts' weights in L2. The
    dense yardstick depends on the row count only, not on the load: ``yardstick`` False leaves it out.
    ``vllm``: vLLM's kernel (vllm_contender), after torch._grouped_mm; ``ceiling``: the memory ceiling
    (stream_contender), after the dense yardstick; ``peers``: more contenders after vLLM's (ours with the
    gather timed, triton_kernels)."""
    off = plan.group_offsets
    cs = [
        auto_contender(xs, off, e, n),
        *tuned_contenders(xs, off, e, n),
        torch_contender(off),
        *([vllm] if vllm is not None else []),
        *peers,
        Contender(
            "per-expert-loop",
            lambda inp: lambda: per_expert_loop(inp[0], inp[1], off, w_layout="nk"),
            graph=False,
        ),
    ]
    if yardstick:
        cs.append(dense_contender(e))
    if ceiling is not None:
        cs.append(ceiling)
    for cf in cfg["grouped"]["capacity_factors"]:
        dropped_box = {}

        def bind(inp, cf=cf, box=dropped_box):
            def call():
                y, dropped = padded_bmm(inp[0], inp[1], plan, cf, w_layout="nk")
                box["dropped"] = dropped
                return y

            return call

        def check_kept(out, box=dropped_box):
            kept = out.double().abs().sum(1) != 0  # dropped rows come back as exact zeros
            ok, rel, why = check(out[kept], ref[kept], k)
            return ok, rel, f"{int(box['dropped'])} rows dropped; kept rows checked. {why}"

        cs.append(Contender(f"padded-bmm:cf{cf}", bind, config={"capacity_factor": cf}, check=check_kept))
    if decode:
        xm, ym, sizes, expert, pos = masked_inputs(xs, plan, e, n)
        m_max = xm.shape[1]

        def masked(c=None):
            return lambda inp: lambda: grouped_mm_masked(xm, inp[1], sizes, w_layout="nk", out=ym, config=c)

        def check_masked(out):  # the rows below masked_m, gathered back into sorted order (not timed)
            return check(out[expert, pos], ref, k)

        mcfg = masked_config(xm, n, "nk")  # what grouped_mm_masked runs with (TMA where the inputs allow)
        cs.append(
            Contender(
                "ours:masked",
                masked(),
                config={"m_max": m_max, **dataclasses.asdict(mcfg)},
                parallel_compile=True,
                check=check_masked,
            )
        )
        if mcfg.tma:  # the same tiles on pointer loads, side by side: what the TMA loads bring
            ptr = dataclasses.replace(mcfg, tma=False)
            cs.append(
                Contender(
                    "ours:masked-pointer",
                    masked(ptr),
                    config={"m_max": m_max, **dataclasses.asdict(ptr)},
                    parallel_compile=True,
                    check=check_masked,
                )
            )
    return cs


def vllm_operands(x, xs, plan, proj: str, top_k: int):
    """(rows vLLM's kernel reads, the top_k it divides row ids by): gate/up reads the tokens' activations
    x [T, K] (a slot's row is its token's), down the slots' rows (xs scattered back to slot order)."""
    return (x, top_k) if proj == "up" else (in_slot_order(xs, plan), 1)


def vllm_search(vk, g: dict, model: str, proj: str, t: int, w, settings) -> dict:
    """vLLM's kernel for (model, projection, T): its own choice (vllm_moe.own_choice) and our light search
    (vllm_moe.candidates), each checked against float64 and timed on the GPU clock like a tuner candidate, on
    the tuner's uniform-load inputs (tune_grouped's seeds, not E7's). Returns the fastest right one:
    {config, source, graph_us, own (vLLM's choice, its time), tried (configs timed)}."""
    m = g["models"][model]
    e, top_k = m["experts"], m["top_k"]
    k, n = m[proj]
    ids, x = tuner_tokens(g, t, e, top_k, k, "uniform")
    plan = route(ids, e)
    xs = permute(x, plan)
    ref = in_slot_order(ref_rows(xs, w, plan.group_offsets), plan)
    a, tk = vllm_operands(x, xs, plan, proj, top_k)
    ws = weight_sets(w, int((plan.group_sizes > 0).sum()), t * top_k, k, n)
    naive = vllm_moe.naive_assignment(t, top_k, e)
    own = vllm_moe.own_choice(vk, torch.cuda.get_device_name(0), e, m["down"][0], m["up"][0], n, top_k, t)
    try:
        return fastest_config(
            own,
            vllm_moe.candidates(t * top_k / e),
            lambda config: vllm_moe.launcher(vk, a, tk, plan, ids, n, config, naive),
            [(wi,) for wi in ws],
            ref,
            k,
            settings,
        )
    except RuntimeError as ex:
        raise RuntimeError(f"vLLM's kernel: {ex} for {model} {proj} T={t}") from None


def fastest_config(own, candidates, bind_of, sets, ref, k: int, settings, check_and_time_fn=None) -> dict:
    """A peer's config search, as a tuner times a candidate: its own choice ``own`` ((config, source) or
    None) and each of ``candidates`` (each tried once, SPLIT_K aside), bound by ``bind_of(config)`` to a
    function of an input set, compiled side by side, then each checked against float64 (``ref``, reduction
    length ``k``) and timed on the GPU clock over ``sets``. Returns the fastest right one: {config, source,
    graph_us, tried, own (the own choice's source and time)}; a RuntimeError where none is right."""
    timed = check_and_time_fn or check_and_time
    tries = ([own] if own else []) + [(c, "search") for c in candidates]
    seen, todo = set(), []
    for config, source in tries:
        key = json.dumps({kk: v for kk, v in config.items() if kk != "SPLIT_K"}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            todo.append((config, source, bind_of(config)))
    prewarm([bind(*sets[0]) for _, _, bind in todo])  # the compiles, from a thread pool
    rows = [
        {"config": config, "source": source, **timed([bind(*s) for s in sets], ref, k, settings)}
        for config, source, bind in todo
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise RuntimeError(f"no config right ({rows[0]['note'] if rows else 'no config to try'})")
    best = min(ok, key=lambda r: r["graph_us"])
    own_row = rows[0] if own else None
    return {
        "config": best["config"],
        "source": best["source"],
        "graph_us": best["graph_us"],
        "tried": len(rows),
        "own": (own_row["source"], own_row.get("graph_us", math.nan)) if own_row else None,
    }


def load_vllm():
    """(vLLM's kernel or None, why not). A source named in MOEGEMM_VLLM_SOURCE that cannot serve is an error;
    an installed vLLM whose kernel this contender does not fit is left out, with the reason printed."""
    try:
        vk = vllm_moe.load()
    except ValueError as ex:
        if os.environ.get("MOEGEMM_VLLM_SOURCE"):
            raise
        return None, f"left out: {ex}"
    return vk, "not available (no vllm installed, no MOEGEMM_VLLM_SOURCE)"


def failed_contender(name: str, why: str) -> Contender:
    """A contender that could not be set up: its cells record ``why`` as an error (it is not timed)."""

    def bind(inp):
        def call():
            raise RuntimeError(why)

        return call

    return Contender(name, bind)


def vllm_contender(
    vk, choice: dict, x, xs, plan, ids, ref, proj: str, top_k: int, n: int, k: int
) -> Contender:
    """vLLM's kernel with the searched config on an input set (the rows it reads, w); checked in slot
    order."""
    a, tk = vllm_operands(x, xs, plan, proj, top_k)
    naive = vllm_moe.naive_assignment(ids.shape[0], top_k, plan.num_experts)
    bind = vllm_moe.launcher(vk, a, tk, plan, ids, n, choice["config"], naive)
    slot_ref = in_slot_order(ref, plan)
    own = choice["own"]
    fields = {
        "config_source": f"{choice['source']}; best of {choice['tried']} ({vk.origin})",
        "vllm_own_config": own[0] if own else "",
        "vllm_own_search_us": own[1] if own else math.nan,
        "vllm_search_us": choice["graph_us"],
        "vllm_flags": vllm_moe.vllm_flags(set(vk.kernel.arg_names), x.dtype, vllm_moe.capability_of(x))[1],
        "naive_block_assignment": naive,
    }
    return Contender(
        "vllm:fused_moe",
        lambda inp: bind(inp[1]),
        config=choice["config"],
        fields=fields,
        parallel_compile=True,
        check=lambda out: check(out, slot_ref, k),
    )


class Vllm:
    """vLLM's kernel (E7's optional contender): loaded once (load_vllm, at the first ``load`` or
    ``contender``), its light config search (vllm_search) once per (model, projection, T); a search that
    fails is recorded as an error in that (model, projection, T)'s cells, not fatal."""

    def __init__(self):
        self.loaded, self.kernel, self.searched = False, None, {}

    def load(self) -> None:
        if not self.loaded:
            self.kernel, why = load_vllm()
            self.loaded = True
            print(f"vLLM's fused-MoE kernel: {self.kernel.origin if self.kernel else why}", flush=True)

    def contender(
        self, g: dict, cell, w, settings, x, xs, plan, ids, ref, k: int, n: int
    ) -> Contender | None:
        """vLLM's kernel on this cell's rows (cell: (model, projection, T, load)); None where it is not at
        hand."""
        self.load()
        if self.kernel is None:
            return None
        model, proj, t, _ = cell
        if (model, proj, t) not in self.searched:
            try:
                self.searched[model, proj, t] = vllm_search(self.kernel, g, model, proj, t, w, settings)
            except Exception as ex:  # an optional contender: recorded as an error in its cells, not fatal
                self.searched[model, proj, t] = f"{type(ex).__name__}: {str(ex)[:200]}"
        choice = self.searched[model, proj, t]
        if not isinstance(choice, dict):
            return failed_contender("vllm:fused_moe", f"config search failed: {choice}")
        return vllm_contender(
            self.kernel, choice, x, xs, plan, ids, ref, proj, g["models"][model]["top_k"], n, k
        )


def stream_search(ws, xs, plan, settings) -> dict:
    """The memory ceiling's launch shape for a (model, projection, T): each of experiments.harness.stream's
    candidates that fits the weights checked (check_stream: every byte read once, every output written) and
    timed on the GPU clock over the cell's rotated weight sets ``ws`` (weight_sets; ws[0] is w), on the first
    load's rows of that (model, projection, T). Returns {config, graph_us, tried}."""
    w = ws[0]
    rows = []
    for config in [c for c in STREAM_CANDIDATES if stream_fits(w, c)]:
        s = stream_setup(w, plan.group_sizes, xs.shape[0], config)
        s.y.fill_(float("nan"))
        calls = [lambda wi=wi, s=s: stream_bytes(wi, xs, s) for wi in ws]
        verdict = check_and_time(
            calls,
            None,
            0,
            settings,
            check_fn=lambda out, s=s: check_stream(out, w, xs, plan.group_sizes, s.y),
        )
        rows.append({"config": config, **verdict})
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise RuntimeError(f"the memory ceiling: no launch shape passed its check: {rows[0]['note']}")
    best = min(ok, key=lambda r: r["graph_us"])
    return {"config": best["config"], "graph_us": best["graph_us"], "tried": len(rows)}


def stream_contender(choice: dict, w, xs, plan) -> Contender:
    """The memory ceiling with the searched launch shape on an input set (xs, w): as many experts' weights
    as this cell activates, and its rows in and out. Its own check (check_stream: the exact element count,
    every output element written, the sum of what was read right), not the GEMM reference."""
    s = stream_setup(w, plan.group_sizes, xs.shape[0], choice["config"])
    s.y.fill_(float("nan"))
    return Contender(
        "ceiling:stream",
        lambda inp: lambda: stream_bytes(inp[1], inp[0], s),
        config=dataclasses.asdict(choice["config"]),
        fields={"config_source": f"best of {choice['tried']} launch shapes"},
        check=lambda out: check_stream(out, w, xs, plan.group_sizes, s.y),
    )


def heldout_contenders(
    xs, plan, e: int, n: int, vllm: Contender | None = None, peers: tuple[Contender, ...] = ()
) -> list[Contender]:
    """A held-out model's cell (a shape no tuned entry covers): ours as a user gets it, grouped_mm with no
    config (``ours:auto``: the distilled shortlist timed on the first call of the (shape, rows bucket), the
    fastest kept; a later load of the same bucket finds it kept), ours on the distilled shortlist's first
    config alone (``ours:default``: what a call that cannot time gets, e.g. inside a graph capture),
    torch._grouped_mm and, where at hand, vLLM's kernel. ours:auto's row records the first call's wall time
    (``first_call_s``: the timing and the compiles where it timed) and the config it kept."""
    off = plan.group_offsets
    first = fitted_shortlist(xs.shape[0], e, n, gpu_slug(xs), xs.dtype, device_smem_per_block(xs))[0]
    source = choose_config(xs, e, n, "nk")[1]
    fields = {"config_source": source}
    auto = Contender("ours:auto", None, fields=fields)

    def bind(inp):
        def call():
            if "first_call_s" not in fields:
                sync = torch.cuda.synchronize if inp[0].is_cuda else (lambda: None)
                sync()
                t0 = time.perf_counter()
                y = grouped_mm(inp[0], inp[1], off, w_layout="nk", validate=False)
                sync()
                fields["first_call_s"] = time.perf_counter() - t0
                kept, now = choose_config(inp[0], e, n, "nk")
                fields["config_source"] = (
                    "autotuned on this call" if source in TIMED_SOURCES and now == "autotuned" else now
                )
                auto.config = dataclasses.asdict(kept)
                return y
            return grouped_mm(inp[0], inp[1], off, w_layout="nk", validate=False)

        return call

    auto.bind = bind
    return [
        auto,
        hidden_table_contender(off, e, n),
        Contender(
            "ours:default",
            ours(off, first),
            config=dataclasses.asdict(first),
            fields={"config_source": "distilled default, first"},
            parallel_compile=True,
        ),
        torch_contender(off),
        *([vllm] if vllm is not None else []),
        *peers,
    ]


NEAREST = "ours:auto:own-table-hidden"


def hidden_table_contender(off, e: int, n: int) -> Contender:
    """ours:auto as a GPU without a table of its own gets it: this GPU's own tables hidden
    (MOEGEMM_HIDE_TABLES), so that the nearest card's of its architecture serve it (moegemm.tuned.serving)
    or, with none, the generic shortlist. Its first call times that shortlist (its choice kept under that
    table's key, apart from ours:auto's); it then runs at the config kept. The row records the table that
    served, the config and the first call's wall time."""
    fields: dict = {}
    c = Contender(NEAREST, None, fields=fields)

    def bind(inp):
        if "first_call_s" not in fields:
            from moegemm import tuned
            from moegemm.grouped import contiguous

            slug = gpu_slug(inp[0])
            before = os.environ.get("MOEGEMM_HIDE_TABLES")
            os.environ["MOEGEMM_HIDE_TABLES"] = slug
            contiguous._PLANS.clear()  # the plans made with the own tables: met again below, not reused
            try:
                served = tuned.serving("grouped_default", slug)
                sync = torch.cuda.synchronize if inp[0].is_cuda else (lambda: None)
                sync()
                t0 = time.perf_counter()
                grouped_mm(inp[0], inp[1], off, w_layout="nk", validate=False)
                sync()
                fields["first_call_s"] = time.perf_counter() - t0
                kept, source = choose_config(inp[0], e, n, "nk")
            finally:
                if before is None:
                    os.environ.pop("MOEGEMM_HIDE_TABLES", None)
                else:
                    os.environ["MOEGEMM_HIDE_TABLES"] = before
                contiguous._PLANS.clear()
            fields["config_source"] = f"{source}, {served or 'generic'} shortlist ({slug} tables hidden)"
            c.config = dataclasses.asdict(kept)
        return ours(off, GroupedConfig.from_dict(c.config))(inp)

    c.bind = bind
    return c


def path_contenders(ids, wts, e) -> list[Contender]:
    """The whole expert path, ours vs torch._grouped_mm (both sync-free, so both graph-capturable); input
    sets (x, w)."""

    def ours(inp):
        x, w = inp

        def call():
            plan = route(ids, e, validate=False)
            xs = permute(x, plan)
            ys = grouped_mm(
                xs, w, plan.group_offsets, w_layout="nk", row_scale=sorted_weights(wts, plan), validate=False
            )
            return unpermute(ys, plan, None)

        return call

    def theirs(inp):
        x, w = inp

        def call():
            plan = route(ids, e, validate=False)
            ys = torch_grouped_mm(permute(x, plan), w, plan.group_offsets, w_layout="nk")
            return unpermute(ys, plan, wts)

        return call

    return [Contender("path:ours", ours), Contender("path:torch._grouped_mm", theirs)]


def e7_cells(cfg: dict) -> list[tuple[str, str, int, str]]:
    """E7's cells (model, projection, T, load) under ``cfg``: per tune-split model and projection, its decode
    and prefill T at their loads (``loads``), and the whole path at ``path_tokens``; per held-out model and
    projection, ``heldout_tokens`` at their loads (``heldout_loads``); of the held-out models, those of
    ``heldout_models`` where it is given."""
    g = cfg["grouped"]
    chosen = g.get("heldout_models")
    heldout = [m for m, spec in g["models"].items() if spec["split"] == "heldout"]
    check_models(chosen, heldout, "grouped.heldout_models", "held-out zoo models")
    cells = []
    for model, spec in g["models"].items():
        if spec["split"] == "heldout" and not selected(chosen, model):
            continue
        for proj in ("up", "down"):
            if spec["split"] == "heldout":
                cells += [(model, proj, t, load) for t in g["heldout_tokens"] for load in heldout_loads(g, t)]
                continue
            for t in g["decode_tokens"] + g["prefill_tokens"]:
                cells += [(model, proj, t, load) for load in loads(cfg, t)]
            if proj == "up":
                cells += [(model, "path(up)", t, "uniform") for t in g.get("path_tokens", (64, 4096))]
    return cells


def main():
    args, cfg, g, settings, prov, slug, writer = start(__doc__)
    cells = e7_cells(cfg)
    cells = shard_cells(cells, args.shard)
    vllm = Vllm()
    vllm.load()
    tk = triton_kernels_moe.load()
    print(f"triton_kernels: {tk.origin if tk else 'not available, no ' + triton_kernels_moe.ENV}", flush=True)
    streamed: dict = {}
    bar = Progress(len(cells), "E7")
    weights: dict = {}
    for model, proj, t, load in cells:
        if writer.done(model=model, proj=proj, tokens=t, load=load):
            bar.update()
            continue
        t_cell = time.perf_counter()
        m = g["models"][model]
        e, top_k = m["experts"], m["top_k"]
        k, n = m["up"] if proj.startswith("up") or proj.startswith("path") else m["down"]
        key = (model, proj.replace("path(up)", "up"))
        if key not in weights:
            weights.clear()  # one projection's weights on the GPU at a time (DeepSeek-V3 up: 15 GB)
            weights[key] = expert_weights(g["seed"], e, n, k)
        w = weights[key]
        ids, x, gx = cell_tokens(g, t, e, top_k, k, load)
        plan = route(ids, e)
        stats = skew_stats(plan.group_sizes)
        rows = t * top_k
        fl, nbytes, flops = floor_us(rows, k, n, stats["active_experts"], slug)
        ws = weight_sets(w, stats["active_experts"], rows, k, n)
        if proj.startswith("path"):
            wts = torch.rand(t, top_k, device="cuda", generator=gx)
            xs = permute(x, plan)
            ref = torch.zeros(t, n, dtype=torch.float64, device="cuda")
            ys = ref_rows(xs, w, plan.group_offsets) * sorted_weights(wts, plan).double()[:, None]
            ref.index_add_(0, plan.sorted_token_ids.long(), ys)
            cs, sets = path_contenders(ids, wts, e), [(x, wi) for wi in ws]
        else:
            xs = permute(x, plan)
            ref = ref_rows(xs, w, plan.group_offsets)
            vc = vllm.contender(g, (model, proj, t, load), w, settings, x, xs, plan, ids, ref, k, n)
            src, index = (
                (x, plan.sorted_token_ids) if proj == "up" else (in_slot_order(xs, plan), plan.sorted_slot)
            )
            peers = [gather_contender(src, index, plan.group_offsets)]
            if tk is not None:
                try:
                    peers.append(tk_contender(tk, x, xs, plan, ids, ref, proj, k))
                except Exception as ex:  # an optional peer: recorded as an error in its cells, not fatal
                    why = f"{type(ex).__name__}: {str(ex)[:200]}"
                    peers.append(failed_contender(triton_kernels_moe.NAME, why))
            if m["split"] == "heldout":
                cs = heldout_contenders(xs, plan, e, n, vllm=vc, peers=tuple(peers))
            else:
                if (model, proj, t) not in streamed:
                    streamed[(model, proj, t)] = stream_search(ws, xs, plan, settings)
                # the dense yardstick (same rows at every load) once per (model, projection, T): at the
                # uniform load
                cs = contenders(
                    xs,
                    plan,
                    ref,
                    k,
                    t in g["decode_tokens"],
                    cfg,
                    e,
                    n,
                    yardstick=load == "uniform",
                    vllm=vc,
                    ceiling=stream_contender(streamed[(model, proj, t)], w, xs, plan),
                    peers=tuple(peers),
                )
            sets = [(xs, wi) for wi in ws]
        inputs_s = time.perf_counter() - t_cell  # weights (once per projection), routing, reference, peers
        out = measure(cs, sets, ref, k, settings)
        n_sets = len(sets)
        del ws, sets
        cell_s = time.perf_counter() - t_cell
        for r in out:
            r["timing_scope"] = timing_scope(r["contender"], proj)
            r.update(inputs_s=inputs_s, cell_s=cell_s)  # the cell's own cost: its inputs, its whole wall time
            r.update(
                experiment="E7",
                model=model,
                split=m["split"],
                proj=proj,
                tokens=t,
                load=load,
                experts=e,
                top_k=top_k,
                k=k,
                n=n,
                rows=rows,
                **stats,
                bytes=nbytes,
                flops=flops,
                floor_us=fl,
                input_sets=n_sets,
                **graph_rates(r.get("graph_us", math.nan), flops, fl),
                **prov,
            )
        writer.add(out)
        bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
