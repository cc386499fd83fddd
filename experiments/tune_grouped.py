"""Tune the contiguous grouped GEMM: for each configured model, projection and token count (uniform load),
time the candidate tile configs on the GPU clock (CUDA-graph replay) and keep the best. Writes the per-GPU
table the library reads (src/moegemm/tuned/grouped/<slug>.json) and every timed candidate as a CSV.

    python -m experiments.tune_grouped --out results/<slug>/tune_grouped.csv
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from experiments.common import (Progress, ResultWriter, best_rows, cli, config_cell, load_config,
                                provenance_fields, require_gpu, write_table)
from moegemm._runtime import slugify
from moegemm.bench.correctness import check
from moegemm.bench.moe_loads import sample_topk
from moegemm.bench.timing import GraphTimer
from moegemm.grouped import GroupedConfig, grouped_mm, permute, route
from moegemm.grouped.api import rows_bucket


def candidates(mean_rows: float) -> list[GroupedConfig]:
    """Row tiles around the mean rows per expert, wide N tiles, two K depths, both grid kinds."""
    bms = [b for b in (16, 32, 64, 128) if b <= max(16, 4 * mean_rows)][-2:]
    out = []
    for bm in bms:
        for bn in (64, 128, 256):
            for bk in (64, 128):
                if (bm * bk + bk * bn) * 2 * 3 > 200 * 1024:
                    continue
                for warps in (4, 8):
                    for persistent in (False, True):
                        out.append(GroupedConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                                 num_stages=3 if bk == 64 else 2, persistent=persistent))
    return out


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    g = cfg["grouped"]
    slug = slugify(torch.cuda.get_device_name(0))
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("model", "proj", "tokens", "config"))
    cells = [(model, proj, t) for model in g["models"] for proj in ("up", "down")
             for t in g["decode_tokens"] + [g["prefill_all_loads_at"]]]
    if args.quick:
        cells = cells[:1]
    bar = Progress(len(cells), "tune-grouped")
    for model, proj, t in cells:
        m = g["models"][model]
        e, top_k = m["experts"], m["top_k"]
        k, n = m[proj]
        gw = torch.Generator(device="cuda").manual_seed(g["seed"])
        w = (torch.randn(e, n, k, device="cuda", generator=gw) / math.sqrt(k)).to(torch.bfloat16)
        plan = route(sample_topk(t, e, top_k, "uniform", g["seed"] + t), e)
        xs = permute(torch.randn(t, k, device="cuda", generator=gw).to(torch.bfloat16), plan)
        off = plan.group_offsets.tolist()
        ref = torch.empty(xs.shape[0], n, dtype=torch.float64, device="cuda")
        for ex in range(e):
            if off[ex + 1] > off[ex]:
                ref[off[ex]:off[ex + 1]] = xs[off[ex]:off[ex + 1]].double() @ w[ex].double().T
        rows = []
        for c in candidates(xs.shape[0] / e):
            if writer.done(model=model, proj=proj, tokens=t, config=dataclasses.asdict(c)):
                continue
            call = lambda c=c: grouped_mm(xs, w, plan.group_offsets, w_layout="nk", config=c, validate=False)  # noqa: E731
            try:
                ok, rel, why = check(call(), ref, k)
            except Exception as ex:  # e.g. a tile that needs more shared memory than the GPU has
                ok, rel, why = False, float("nan"), f"error: {type(ex).__name__}: {str(ex)[:160]}"
            row = {"model": model, "proj": proj, "tokens": t, "experts": e, "k": k, "n": n,
                   "rows_bucket": rows_bucket(xs.shape[0], e), "config": dataclasses.asdict(c),
                   "status": "ok" if ok else "wrong", "rel_err": rel, "note": why}
            if ok:
                row["graph_us"] = statistics.median(GraphTimer([call], 10).sample(3))
            rows.append({**row, **prov})
        writer.add(rows)
        bar.update()
    bar.close()
    writer.finish()
    best = best_rows(writer.rows, lambda r: ("bfloat16", int(r["experts"]), int(r["k"]), int(r["n"]), "nk",
                                             int(r["rows_bucket"])))
    write_table("grouped", slug, [
        {"dtype": d, "experts": e, "k": k, "n": n, "w_layout": lay, "rows_bucket": b,
         "graph_us": float(r["graph_us"]), "config": config_cell(r["config"])}
        for (d, e, k, n, lay, b), r in sorted(best.items())])



if __name__ == "__main__":
    main()
