"""Tune Decompose-K: for every grid and router shape, every dtype and each kernel, time the candidate
configs on the GPU clock (CUDA-graph replay) and keep the best; cuBLAS is timed beside them, and where it
is the fastest the table names it, so that `auto` dispatches to it. Writes the per-GPU table the library reads
(src/moegemm/tuned/decompose_k/<slug>.json) and every timed candidate as a CSV.

    python -m experiments.tune_decompose_k --out results/<slug>/tune_decompose_k.csv
    python -m experiments.tune_decompose_k \\
        --rebuild results/<slug>/tune_decompose_k.csv results/<slug>/floors.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from experiments import dk
from experiments.common import (
    DTYPES,
    Progress,
    ResultWriter,
    best_rows,
    check_and_time,
    cli,
    config_cell,
    load_config,
    provenance_fields,
    require_gpu,
    timing_settings,
    write_table,
)
from experiments.harness.runner import prewarm
from moegemm._runtime import slugify
from moegemm.decompose_k import DecomposeKConfig, matmul

# The kernels tuned; `auto` chooses between the fastest of them and cuBLAS.
TUNED = dk.KERNELS


def shapes(cfg):
    grid = dk.grid_shapes(cfg)
    router = dk.router_shapes(cfg, "tune_tokens")
    # fp16 has bf16's element size and tensor-core rate: the library reuses bf16's entries for it.
    out = [(s, dt) for dt in ("bfloat16", "float32") for s in grid]
    out += [(s, dt) for dt in ("bfloat16",) for s in router]
    return out


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    settings = timing_settings(cfg)  # its calls_per_graph (config.yaml's timing) for every candidate
    slug = slugify(torch.cuda.get_device_name(0))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    writer = ResultWriter(args.out, ("m", "n", "k", "dtype", "kernel", "config"))
    prov = provenance_fields()
    todo = shapes(cfg)
    bar = Progress(len(todo), "tune")
    for (m, n, k), dt in todo:
        dtype = DTYPES[dt]
        sets, ref = dk.shape_inputs(m, n, k, dtype, seed=m * 7 + n * 13 + k)
        rows = []
        todo_c = [
            (kernel, c)
            for kernel in TUNED
            for c in dk.candidates(m, n, k, dtype, kernel, sms)
            if not writer.done(m=m, n=n, k=k, dtype=dt, kernel=kernel, config=c.as_dict())
        ]
        a0, b0, _ = sets[0]
        prewarm(
            [(lambda kernel=kernel, c=c: matmul(a0, b0, kernel=kernel, config=c)) for kernel, c in todo_c]
        )
        for kernel, c in todo_c:
            calls = [(lambda a=a, b=b: matmul(a, b, kernel=kernel, config=c)) for a, b, _ in sets]
            row = {
                "m": m,
                "n": n,
                "k": k,
                "dtype": dt,
                "kernel": kernel,
                "config": c.as_dict(),
                "split_k": c.split_k,
                **check_and_time(calls, ref, k, settings),
            }
            rows.append({**row, **prov})
        if not writer.done(m=m, n=n, k=k, dtype=dt, kernel="cublas", config={}):
            # cuBLAS as a candidate of its own: where it is faster, `auto` dispatches to it
            calls = [(lambda a=a, b=b: matmul(a, b, kernel="cublas")) for a, b, _ in sets]
            rows.append(
                {
                    "m": m,
                    "n": n,
                    "k": k,
                    "dtype": dt,
                    "kernel": "cublas",
                    "config": {},
                    "split_k": 1,
                    **check_and_time(calls, ref, k, settings),
                    **prov,
                }
            )
        writer.add(rows)
        bar.update()
    bar.close()
    writer.finish()

    write_table("decompose_k", slug, table_entries(writer.rows, dk.tiny_kernel_us()))


def table_entries(rows: list[dict], activation_us: float) -> list[dict]:
    """The table from the tuner's rows: for each shape and dtype the best config per kernel, each backend's
    best time (cuBLAS's among them) and the best backend overall; ``activation_us`` (one tiny kernel's GPU
    time on this GPU) is what ``auto`` charges cuBLAS for applying an epilogue after it, a launch of its
    own."""
    best = best_rows(rows, lambda r: (r["dtype"], int(r["m"]), int(r["n"]), int(r["k"]), r["kernel"]))
    by_shape: dict = {}
    for (dt, m, n, k, kernel), r in best.items():
        by_shape.setdefault((dt, m, n, k), {})[kernel] = r
    entries = []
    for (dt, m, n, k), per in sorted(by_shape.items()):
        win = min(per.values(), key=lambda r: float(r["graph_us"]))
        entries.append(
            {
                "dtype": dt,
                "m": m,
                "n": n,
                "k": k,
                "epilogue": "none",
                "kernel": win["kernel"],
                "graph_us": float(win["graph_us"]),
                "backend_us": {kn: round(float(r["graph_us"]), 3) for kn, r in sorted(per.items())},
                "activation_us": round(float(activation_us), 3),
                "per_kernel": {
                    kn: DecomposeKConfig.coerce(config_cell(r["config"])).as_dict()
                    for kn, r in per.items()
                    if kn != "cublas"
                },
            }
        )
    return entries


def rebuild(csv_path: str, floors_json: str) -> None:
    """Write the table again from a committed tuner CSV, on any machine: the activation charge from the same
    GPU's floors (its tiny-kernel time), the provenance that of the run that measured the CSV."""
    import csv
    import json

    from experiments._io import write_json
    from experiments.common import PROVENANCE_KEYS, ROOT

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    act = json.loads(Path(floors_json).read_text())["measured"]["tiny_kernel_graph_us"]
    prov = {k: rows[0][k] for k in PROVENANCE_KEYS}
    prov.update(
        sm_count=int(rows[0]["sm_count"]),
        git_dirty=rows[0]["git_dirty"] == "True",
        utc=max(r["utc"] for r in rows),
    )  # the last row's: when the measuring run wrote its table
    slug = slugify(prov["gpu"])
    table = ROOT / "src" / "moegemm" / "tuned" / "decompose_k" / f"{slug}.json"
    write_json(
        table,
        {
            "gpu": prov["gpu"],
            "clock": "CUDA-graph replay",
            "provenance": prov,
            "rebuilt_from": {"csv": Path(csv_path).name, "activation_us": "floors.json tiny_kernel_graph_us"},
            "entries": table_entries(rows, act),
        },
    )
    print(f"wrote {table} ({len(rows)} rows)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rebuild"]:  # --rebuild <tune_decompose_k.csv> <floors.json>
        rebuild(sys.argv[2], sys.argv[3])
    else:
        main()
