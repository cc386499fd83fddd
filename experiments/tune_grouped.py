"""Tune the contiguous grouped GEMM: for each model of the tune split, projection and token count, time the
candidate tile configs on the GPU clock (CUDA-graph replay) under each tuning load (config.yaml's
grouped.tune_loads: uniform and Zipf 1.2) and keep the config of the least geometric-mean time over the
loads. The library picks a config from the mean rows per expert alone (it cannot see the load without a
host sync), so the table's choice has to serve skewed loads as well as the uniform one. The few fastest of
a cell's screen are timed again side by side before the choice (FINALISTS). Writes the per-GPU table the
library reads (src/moegemm/tuned/grouped/<slug>.json) and every timed candidate as a CSV (column stage:
"screen", or "final" for the second timing of the finalists).

    python -m experiments.tune_grouped --out results/<slug>/tune_grouped.csv
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from experiments.common import (
    Progress,
    ResultWriter,
    check_call,
    cli,
    config_cell,
    load_config,
    provenance_fields,
    require_gpu,
    timing_settings,
    weight_sets,
    write_table,
)
from experiments.e7_grouped_skew import expert_weights, ref_rows, tuner_tokens
from experiments.harness.runner import Settings, prewarm
from moegemm._runtime import slugify
from moegemm.grouped import GroupedConfig, grouped_mm, permute, route
from moegemm.grouped.config import rows_bucket


def candidates(mean_rows: float) -> list[GroupedConfig]:
    """Tile configs by regime of the mean rows per expert, on the plain and the persistent grid; the row
    tiles of an expert are walked together (group_m = 8) so that they share its weights in L2.

    - decode (<= 16 rows): the weights are streamed once; 16-row tiles, N tiles of 64/128 (32 with TMA
      loads), deep K steps, several stages, for many loads in flight per multiprocessor; also 32-row TMA
      tiles (an expert of up to 32 rows in one row tile), and 64-row TMA tiles with 16-row tail tiles (a
      skewed load's hot expert in one row tile, the others in 16-row tiles); 16-row tiles on the flattened
      persistent loop (flatten) too, for many short tiles.
    - middle (<= 64 rows): 64-row tiles, N tiles of 64/128, TMA loads, and 32-row tail tiles (an expert of
      at most 32 rows costs a 32-row tile), also merged into the row tile before them; 128 x 128 tiles
      with 32-row tails (hot experts in fewer row tiles).
    - prefill: 128 x 128/256 and 64 x 256 tiles on the tensor cores (wgmma), 8 warps, TMA loads; also
      the persistent loop with Triton's warp_specialize flag (on sm_90: flattened, see GroupedConfig), and
      tail tiles on either loop: an expert's last row tile holding at most tail_m rows computed as a
      transposed tail_m-row tile (at about BLOCK_M rows per expert, half the experts end in a row tile of
      a few rows). Merged tails (computed by the program of the row tile before them, from its weight
      tiles): with 64-row tiles, and with 128 x 256 tiles and 32-row tails on the loop without warp
      specialization. Those run slower wherever an expert holds several row tiles (0.75-1.03x the tuned
      configs' rate), but where an expert holds about one row tile (DeepSeek-V3 at T=4096: 128
      rows per expert) the hardware counters of probes/probe_prefill_counters.py show
      the separate tail tiles streaming each expert's weights through L2 a second time (41 GB of L2
      traffic against 31 GB merged, L2 at 97% of its peak) and the merged ones 1.11x faster side by side.
    Options measured and then removed from the kernels, as they never won a cell (docs/grouped.md):
    K split inside each tile (pointer and TMA loads), the last waves of tiles dealt out by K steps
    (Stream-K), TMA stores, and row tiles with extra rows. The mixed tile order (``mix``) is tried on each
    cell's best few configs (see MIX_TRIES).
    The set is what a wider search's table (a tune_grouped.csv over more configs, in the runs archive) kept:
    in the regime where they were tried, these came within 3% of a cell's best somewhere, and the configs left
    out never did (the 16 x 32 pointer-load tiles, split-K in four, 32-row and pointer-load middle tiles, 64 x
    128 and 3-stage 128 x 128 prefill tiles); that keeps tune_grouped inside the run's 20 minutes.
    Configs whose stages need more than 200 KB of shared memory are left out, and those that need more
    than the 227 KB an H100/H200 block may have (smem_bytes)."""
    raw = []  # (block_m, block_n, block_k, warps, stages, tma, warp_specialize[, tail_m, merge])
    if mean_rows <= 16:
        raw += [(16, bn, bk, 4, st, False, False) for bn in (64, 128) for bk in (128, 256) for st in (3, 5)]
        raw += [(16, bn, bk, 4, 4, True, False) for bn in (32, 64, 128) for bk in (128, 256)]
        # 32-row TMA tiles: an expert of up to 32 rows in one row tile
        raw += [(32, 128, 128, 4, 4, True, False), (32, 64, 256, 4, 4, True, False)]
        # 64-row TMA tiles with 16-row tails: an expert of up to 64 rows (a hot one) in one row tile, one of
        # at most 16 in a transposed 16-row tile: the tile count, and so each expert's weight traffic, does
        # not grow with the skew
        raw += [(64, 128, 128, 4, 4, True, False, 16), (64, 64, 256, 4, 3, True, False, 16)]
        # the flattened persistent loop (warp_specialize on sm_90): many short tiles (a few rows of many
        # experts, a short K) with the next tile's loads overlapping this one's epilogue
        raw += [(16, 128, 128, 4, 4, True, True), (16, 64, 256, 4, 4, True, True)]
    elif mean_rows <= 64:
        raw += [(64, 128, 64, 4, 4, tma, False) for tma in (False, True)]
        raw += [(64, 64, 64, 4, 4, True, False), (64, 128, 128, 4, 3, True, False)]
        raw += [(64, 128, bk, 4, 4 if bk == 64 else 3, True, False, 32) for bk in (64, 128)]
        raw += [(64, 128, bk, 4, 4 if bk == 64 else 3, True, False, 32, True) for bk in (64, 128)]
        # 128-row tiles with 32-row tails: a skewed load's hot experts in fewer row tiles
        raw += [(128, 128, 64, 8, 4, True, False, 32)]
    else:
        raw += [(128, 256, 64, 8, st, True, ws) for st in (3, 4) for ws in (False, True)]
        raw += [
            (128, 256, 64, 8, st, True, ws, tail)
            for st in (3, 4)
            for tail in (32, 64)
            for ws in (False, True)
        ]
        raw += [(128, 256, 64, 8, 4, True, False, 32, True)]  # merged 32-row tails
        raw += [(128, 128, 64, 8, 4, True, False, tail) for tail in (0, 32, 64)]
        raw += [(64, 256, 64, 8, 4, True, False)]
        # 256 x 128 tiles (an expert of up to 256 rows in one row tile: its weights read by one program)
        raw += [(256, 128, 64, 8, st, True, False, tail) for st, tail in ((4, 0), (3, 64))]
    out = []
    for bm, bn, bk, warps, stages, tma, ws, *more in raw:
        tail_m, merge = [*more, *(0, False)[len(more) :]]  # defaults: no tails, no merged tails
        if (bm * bk + bk * bn) * 2 * stages > 200 * 1024 or smem_bytes(
            bm, bn, bk, stages, ws, tail_m if merge else 0
        ) > SMEM:
            continue
        for persistent in (False, True) if not ws else (True,):
            out.append(
                GroupedConfig(
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    num_warps=warps,
                    num_stages=stages,
                    persistent=persistent,
                    tma=tma,
                    flatten=ws,
                    tail_m=tail_m,
                    merge_tail=merge,
                )
            )
    return out


SMEM = 227 * 1024  # shared memory one block may have on an H100/H200


def smem_bytes(
    bm: int, bn: int, bk: int, stages: int, warp_specialize: bool = False, merged_tail: int = 0
) -> int:
    """Shared memory of a 16-bit TMA tile config as Triton 3.6 lays it out for sm_90 (within 32 bytes of
    the compiled kernels' metadata for the prefill configs below, compiled without a GPU): the stages of A
    and W tiles (a separate tail tile's stages reuse them), the stages of a merged tail's rows beside them
    (``merged_tail``), and 4 KB more in the flattened (warp_specialize) loop."""
    return (bm * bk + bn * bk + merged_tail * bk) * 2 * stages + (4128 if warp_specialize else 0)


PERSISTENT_TRIES = 3  # the best plain-grid tile configs of a cell that are also timed on the persistent grid
# The screen takes 3 samples per config. Under a power cap that is not enough: timing DeepSeek-V3 at
# T=4096, the H200 drew its 700 W cap and its SM clock swung between 855 and 1980 MHz from one 100 ms
# sample to the next (probes/probe_prefill_counters.py), so which of two configs within
# ~10% of each other wins the screen is partly the clock's doing. The FINALISTS fastest of a cell (by the
# screen's geometric mean over the loads) are therefore timed again side by side, in FINAL_ROUNDS
# interleaved rounds of FINAL_REPLAYS graph replays each (who goes first rotating), and the table keeps
# the best of that final.
FINALISTS = 8
# The screen itself times a cell's configs side by side, SCREEN_BATCH at a time (each holds a CUDA graph and
# its outputs; fewer where the GPU's free memory would not hold that many, see screen_batch) over
# SCREEN_ROUNDS rounds of one replay, one batch holding every config of a load's screen (at most 22 of
# them, past decode): timed one after another, or in batches of 8, configs met different clocks, and the
# merged tails of DeepSeek-V3 gate/up at T=4096 (1.11x faster side by side) ranked twelfth and missed
# that cell's final.
SCREEN_BATCH, SCREEN_ROUNDS = 40, 3
SCREEN_MEMORY = 0.5  # the part of the GPU's free memory one screen batch's graphs may take
# The best few configs of a cell past decode (by the screen's geometric mean over the loads, both grids)
# are also timed with the tiles of the experts of at least MIX row tiles dealt out in proportion among the
# others' (GroupedConfig.mix): under a skewed load, expert order runs a hot expert's tensor-bound tiles
# together and then the cold experts' memory-bound ones. probes/probe_mixed_order.py:
# 1.07-1.10x faster on DeepSeek-V3 down at T=4096 under Zipf 1.2-1.5, within the clock's noise elsewhere.
MIX_TRIES, MIX = 3, 2
FINAL_ROUNDS, FINAL_REPLAYS = 4, 3


def config_calls(config: GroupedConfig, xs, ws, offsets) -> list:
    """One call of the grouped kernel with ``config`` per rotated weight set of ``ws``."""
    return [
        lambda wi=wi: grouped_mm(xs, wi, offsets, w_layout="nk", config=config, validate=False) for wi in ws
    ]


def time_configs(configs, writer, base: dict, xs, ws, offsets, ref, settings=None) -> list[dict]:
    """One row per config not yet in ``writer``: checked against float64, then the right ones timed on the
    GPU clock side by side (``settings``: config.yaml's grouped timing, whose calls_per_graph and
    min_graph_us apply; default 10 calls per graph): screen_batch graphs at a time, SCREEN_ROUNDS rounds over
    them, one replay each per round (see side_by_side)."""
    import statistics

    settings = settings or Settings(calls_per_graph=10)
    k = xs.shape[1]
    todo = [
        c
        for c in configs
        if not writer.done(
            model=base["model"],
            proj=base["proj"],
            tokens=base["tokens"],
            load=base.get("load"),
            config=dataclasses.asdict(c),
            stage=base.get("stage"),
        )
    ]
    prewarm([config_calls(c, xs, ws[:1], offsets)[0] for c in todo])
    rows, right = [], []
    for c in todo:
        calls = config_calls(c, xs, ws, offsets)
        rows.append({**base, "config": dataclasses.asdict(c), **check_call(calls, ref, k)})
        if rows[-1]["status"] == "ok":
            right.append((rows[-1], calls))
    size = screen_batch(xs.shape[0] * ws[0].shape[1] * xs.element_size())
    for i in range(0, len(right), size):
        batch = right[i : i + size]
        for (row, _), (n, samples) in zip(
            batch, side_by_side([calls for _, calls in batch], settings, SCREEN_ROUNDS, 1)
        ):
            row.update(graph_us=statistics.median(samples), graph_calls=n)
    return rows


def screen_batch(out_bytes: int, free_bytes: int | None = None) -> int:
    """Configs per screen batch: SCREEN_BATCH, or fewer (at least 2) where their graphs would take more than
    SCREEN_MEMORY of the GPU's free memory (``free_bytes``; asked of the GPU when None, none on the CPU).
    A graph holds one call's output at a time (its calls free theirs, and the graph's pool reuses it),
    counted twice, plus 64 MiB for a kernel's own buffers."""
    if free_bytes is None:
        if not torch.cuda.is_available():
            return SCREEN_BATCH
        free_bytes = torch.cuda.mem_get_info()[0]
    return max(2, min(SCREEN_BATCH, int(SCREEN_MEMORY * free_bytes // (2 * out_bytes + (64 << 20)))))


def side_by_side(
    calls_of: list[list], settings: Settings, rounds: int, replays: int
) -> list[tuple[int, list]]:
    """(calls per graph, samples in us) per candidate: one CUDA graph each (its calls, one per rotated input
    set), then ``rounds`` rounds over them, who goes first rotating, ``replays`` replays each per round. The
    clock swings under the power cap (see FINALISTS); timed side by side, every candidate meets the same
    swings, which timing one after another would hand to whichever ran at the wrong moment."""
    from experiments.harness.runner import graph_timer

    timers = []
    for calls in calls_of:
        timer = graph_timer(calls, settings)
        timers.append((timer.n, timer))
    samples: list[list[float]] = [[] for _ in timers]
    for r in range(rounds):
        for i in [(r + j) % len(timers) for j in range(len(timers))]:
            samples[i] += timers[i][1].sample(replays)
    return [(n, s) for (n, _), s in zip(timers, samples)]


def final_round(configs, base: dict, xs, ws, offsets, settings=None) -> list[dict]:
    """The finalists of a cell under one load, timed again side by side (see FINALISTS): FINAL_ROUNDS rounds
    of FINAL_REPLAYS replays per config (side_by_side); one row per config (stage "final") with the median.
    They passed the float64 check in the screen."""
    import statistics

    settings = settings or Settings(calls_per_graph=10)
    timed = side_by_side(
        [config_calls(c, xs, ws, offsets) for c in configs], settings, FINAL_ROUNDS, FINAL_REPLAYS
    )
    return [
        {
            **base,
            "stage": "final",
            "config": dataclasses.asdict(c),
            "status": "ok",
            "rel_err": float("nan"),
            "note": "timed again side by side; checked in the screen",
            "graph_us": statistics.median(s),
            "graph_calls": n,
            "graph_samples": len(s),
        }
        for c, (n, s) in zip(configs, timed)
    ]


def tune_models(g: dict) -> list[str]:
    """config.yaml's grouped models of the tune split, in its order."""
    return [m for m, v in g["models"].items() if v["split"] == "tune"]


def tune_loads(g: dict, tokens: int) -> tuple[str, ...]:
    """The loads a cell is tuned on: config.yaml's tune_loads (uniform first); one token's top-k experts hold
    a row each whatever the load, so T=1 is tuned on the uniform load alone."""
    loads = tuple(g.get("tune_loads", ["uniform"]))
    if not loads or loads[0] != "uniform":
        raise ValueError(f"grouped.tune_loads: expected a list starting with 'uniform', got {list(loads)!r}")
    return loads[:1] if tokens == 1 else loads


def config_key(row: dict) -> str:
    """A row's config as canonical JSON (rows resumed from the .partial log hold dicts), in the current
    fields where GroupedConfig.from_dict reads it (rows written before hold fields since renamed or fixed)."""
    raw = config_cell(row["config"])
    try:
        raw = dataclasses.asdict(GroupedConfig.from_dict(raw))
    except (TypeError, ValueError):  # an option since removed, at a value the kernels no longer take
        pass
    return json.dumps(raw, sort_keys=True)


def robust_order(rows: list[dict], loads: tuple[str, ...]) -> list[tuple[float, str]]:
    """(geometric-mean time over ``loads``, config JSON) of every config right and timed under all of them,
    fastest first: the tuner's ranking of one cell. A row without a load (resumed from a tuner log written
    when the tuner timed the uniform load alone) counts as uniform."""
    times: dict = {}
    for r in rows:
        if r["status"] == "ok":
            times.setdefault(config_key(r), {})[r.get("load") or "uniform"] = float(r["graph_us"])
    out = [
        (math.exp(sum(math.log(t[ld]) for ld in loads) / len(loads)), c)
        for c, t in times.items()
        if all(ld in t for ld in loads)
    ]
    return sorted(out)


def cell_choice(rows: list[dict], loads: tuple[str, ...]):
    """(geometric-mean time, config JSON, {load: time}) of the config a cell's table entry keeps: the best of
    the final (rows of stage "final", see FINALISTS) where the cell had one, else of the screen; None where
    no config was right and timed under every load."""
    final = [r for r in rows if r.get("stage") == "final"]
    rows = final or rows
    order = robust_order(rows, loads)
    if not order:
        return None
    best_us, best = order[0]
    by_load = {
        r.get("load") or "uniform": float(r["graph_us"])
        for r in rows
        if r["status"] == "ok" and config_key(r) == best
    }
    return best_us, best, by_load


def cell_inputs(g: dict, t: int, load: str, e: int, top_k: int, k: int, w: torch.Tensor):
    """(x_sorted, group offsets, float64 reference, active experts) of one tuning cell and load. The routing
    seed is the tuner's own (E7 draws its loads from other seeds: the tuner does not see E7's inputs)."""
    ids, x = tuner_tokens(g, t, e, top_k, k, load)
    plan = route(ids, e)
    xs = permute(x, plan)
    return xs, plan.group_offsets, ref_rows(xs, w, plan.group_offsets), int((plan.group_sizes > 0).sum())


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    g = cfg["grouped"]
    settings = timing_settings(cfg, "grouped")
    slug = slugify(torch.cuda.get_device_name(0))
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("model", "proj", "tokens", "load", "config", "stage"))
    # the tune set only: the held-out models are what the distilled default is judged on (E7)
    cells = [
        (model, proj, t) for model in tune_models(g) for proj in ("up", "down") for t in g["tune_tokens"]
    ]
    bar = Progress(len(cells), "tune-grouped")
    weights: dict = {}
    for model, proj, t in cells:
        m = g["models"][model]
        e, top_k = m["experts"], m["top_k"]
        k, n = m[proj]
        if (model, proj) not in weights:
            weights.clear()  # one projection's weights on the GPU at a time
            weights[model, proj] = expert_weights(g["seed"], e, n, k)
        w = weights[model, proj]
        loads = tune_loads(g, t)
        inputs = {ld: cell_inputs(g, t, ld, e, top_k, k, w) for ld in loads}
        # enough weight copies for the load with the fewest active experts (the least bytes per pass)
        ws = weight_sets(w, min(a for *_, a in inputs.values()), t * top_k, k, n)
        base = {
            "model": model,
            "proj": proj,
            "tokens": t,
            "experts": e,
            "k": k,
            "n": n,
            "rows_bucket": rows_bucket(t * top_k, e),
            "input_sets": len(ws),
            "stage": "screen",
            **prov,
        }
        # The grid is not part of the compiled kernel, only of the launch: every tile config is timed on the
        # plain grid (the warp-specialized ones exist only on the persistent one), then the best few (by
        # the geometric mean over the loads) also on the persistent grid -- half the timing of both grids.
        cands = candidates(t * top_k / e)
        rows = []
        for ld, (xs, offsets, ref, _) in inputs.items():
            rows += time_configs(
                [c for c in cands if not c.persistent or c.flatten],
                writer,
                {**base, "load": ld},
                xs,
                ws,
                offsets,
                ref,
                settings,
            )
        here = [
            r for r in writer.rows + rows if (r["model"], r["proj"], int(r["tokens"])) == (model, proj, t)
        ]
        plain = [c for _, c in robust_order(here, loads) if not json.loads(c)["persistent"]]
        for ld, (xs, offsets, ref, _) in inputs.items():
            rows += time_configs(
                [
                    dataclasses.replace(GroupedConfig.from_dict(json.loads(c)), persistent=True)
                    for c in plain[:PERSISTENT_TRIES]
                ],
                writer,
                {**base, "load": ld},
                xs,
                ws,
                offsets,
                ref,
                settings,
            )
        if t * top_k / e > 16:  # past decode: the best few also in the mixed tile order (see MIX_TRIES)
            here = [
                r
                for r in writer.rows + rows
                if (r["model"], r["proj"], int(r["tokens"])) == (model, proj, t)
                and r.get("stage", "screen") == "screen"
            ]
            mixed = [
                dataclasses.replace(c, mix=MIX)
                for c in (GroupedConfig.from_dict(json.loads(c)) for _, c in robust_order(here, loads))
                if c.tma and not c.mix
            ][:MIX_TRIES]
            for ld, (xs, offsets, ref, _) in inputs.items():
                rows += time_configs(mixed, writer, {**base, "load": ld}, xs, ws, offsets, ref, settings)
        here = [
            r
            for r in writer.rows + rows
            if (r["model"], r["proj"], int(r["tokens"])) == (model, proj, t)
            and r.get("stage", "screen") == "screen"
        ]
        finalists = [GroupedConfig.from_dict(json.loads(c)) for _, c in robust_order(here, loads)[:FINALISTS]]
        for ld, (xs, offsets, ref, _) in inputs.items():
            if len(finalists) > 1 and not writer.done(
                model=model,
                proj=proj,
                tokens=t,
                load=ld,
                config=dataclasses.asdict(finalists[0]),
                stage="final",
            ):
                rows += final_round(finalists, {**base, "load": ld}, xs, ws, offsets, settings)
        del ws, inputs
        writer.add(rows)
        bar.update()
    bar.close()
    writer.finish()
    entries: dict = {}
    for model, proj, t in cells:
        m = g["models"][model]
        k, n = m[proj]
        here = [r for r in writer.rows if (r["model"], r["proj"], int(r["tokens"])) == (model, proj, t)]
        choice = cell_choice(here, tune_loads(g, t))
        if choice is None:
            continue
        best_us, best, by_load = choice
        key = (m["experts"], k, n, rows_bucket(t * m["top_k"], m["experts"]))
        if key in entries and entries[key]["graph_us"] <= best_us:
            continue  # two token counts in one rows bucket (not so in config.yaml): the faster cell's choice
        entries[key] = {
            "dtype": "bfloat16",
            "experts": key[0],
            "k": k,
            "n": n,
            "w_layout": "nk",
            "rows_bucket": key[3],
            "graph_us": best_us,
            "graph_us_by_load": by_load,
            "config": json.loads(best),
        }
    write_table("grouped", slug, [entries[key] for key in sorted(entries)])


if __name__ == "__main__":
    main()
