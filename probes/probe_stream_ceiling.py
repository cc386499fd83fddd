"""Probe (not a pipeline step): how fast can one kernel stream a slab of expert weights on this GPU? The
launch shapes of E7's memory ceiling (experiments.harness.stream) over a wider grid than E7 searches, beside
torch's own sum, on three slab sizes of E7's cells: Qwen3's down projection at T=1 (8 experts, 25 MB),
Mixtral's gate/up (8 experts, 940 MB) and DeepSeek-V3's gate/up at T=64 (221 experts, 13 GB). Each
checked (every element read once) and timed on the CUDA-graph clock over rotated copies (one pass over
them exceeds twice the L2). Picks which launch shapes E7 searches.

    python -m probes.probe_stream_ceiling --out results/<slug>/probe_stream_ceiling.csv
"""

from __future__ import annotations

import math
import statistics

import torch

from experiments.common import ResultWriter, cli, provenance_fields, require_gpu
from experiments.harness.floors import datasheet
from experiments.harness.stream import StreamConfig, check_stream, fits, stream_bytes, stream_setup
from experiments.harness.timing import GraphTimer, input_sets_for
from moegemm._runtime import slugify

SLABS = {  # name: (experts, N, K, active experts)
    "qwen3-down-T1": (8, 2048, 768, 8),
    "mixtral-up": (8, 14336, 4096, 8),
    "deepseek-v3-up-T64": (224, 4096, 7168, 221),
}


def grid() -> list[StreamConfig]:
    flat = [
        StreamConfig(b, p, nw)
        for b in (8192, 16384, 32768)
        for p in (1, 2, 4, 8)
        for nw in (4, 8)
        if not (b == 8192 and nw == 8 and p == 1)
    ]
    tma = [
        StreamConfig(r, p, 4, "tma", st)
        for r in (16, 32, 64, 128)
        for p in (1, 2, 4)
        for st in (2, 4)
        if r * p <= 256
    ]
    return flat + tma


def main():
    args = cli(__doc__)
    require_gpu()
    prov = provenance_fields()
    peak = datasheet(slugify(prov["gpu"]))["hbm_tb_s"]
    writer = ResultWriter(args.out, ("slab", "contender", "config"))
    configs = grid()
    for slab, (e, n, k, active) in SLABS.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        sizes = torch.zeros(e, dtype=torch.int32, device="cuda")
        sizes[:active] = 1
        x = torch.randn(
            active, k, device="cuda", dtype=torch.bfloat16, generator=g
        )  # one row per active expert
        nbytes = 2 * (active * n * k + 2 * active * k)  # ~ weights + x in + y out (y is active x N)
        sets = [w] + [w.clone() for _ in range(input_sets_for(nbytes) - 1)]
        flat_slabs = [wi.view(-1)[: active * n * k] for wi in sets]
        rows = []
        for c in configs:
            if not fits(w, c) or writer.done(slab=slab, contender="ceiling:stream", config=str(c)):
                continue
            s = stream_setup(w, sizes, active, c)
            s.y.fill_(float("nan"))
            try:
                ok, _, why = check_stream(stream_bytes(w, x, s), w, x, sizes, s.y)
            except Exception as ex:  # noqa: BLE001  a launch shape that does not build is recorded
                ok, why = False, f"error: {type(ex).__name__}: {str(ex)[:160]}"
            row = {
                "slab": slab,
                "contender": "ceiling:stream",
                "config": str(c),
                "status": "ok" if ok else "wrong",
                "note": why,
            }
            if ok:
                calls = [lambda wi=wi, s=s: stream_bytes(wi, x, s) for wi in sets]
                t = GraphTimer(calls, max(len(calls), 10))
                row["graph_us"] = statistics.median(t.sample(7))
            rows.append(row)
        sums = [lambda v=v: v.sum(dtype=torch.float32) for v in flat_slabs]  # the weights only, no x, no y
        t = GraphTimer(sums, max(len(sums), 10))
        rows.append(
            {
                "slab": slab,
                "contender": "torch.sum (weights only)",
                "config": "",
                "status": "ok",
                "graph_us": statistics.median(t.sample(7)),
            }
        )
        for r in rows:
            us = r.get("graph_us", math.nan)
            b = nbytes if r["contender"] != "torch.sum (weights only)" else 2 * active * n * k
            r.update(
                bytes=b,
                tb_s=b / (us * 1e-6) / 1e12,
                pct_peak=100 * b / (us * 1e-6) / 1e12 / peak,
                input_sets=len(sets),
                **prov,
            )
        writer.add(rows)
        best = min((r for r in rows if r["status"] == "ok"), key=lambda r: r["graph_us"])
        print(
            f"{slab}: best {best['contender']} {best['config']} {best['graph_us']:.1f} us "
            f"{best['tb_s']:.2f} TB/s; torch.sum {rows[-1]['tb_s']:.2f} TB/s",
            flush=True,
        )
        del w, sets, flat_slabs
        torch.cuda.empty_cache()
    writer.finish()
    import pandas as pd

    d = pd.read_csv(args.out)
    d = d[d.status == "ok"].sort_values("tb_s", ascending=False)
    print(
        d.groupby("slab").head(5)[["slab", "contender", "config", "graph_us", "tb_s"]].to_string(index=False)
    )


if __name__ == "__main__":
    main()
