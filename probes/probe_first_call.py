"""Probe (not a pipeline step): the wall time of ``moe_ffn``'s first call on a shape it has never seen, with
the shortlists' compiles side by side (the library's default: moegemm.autotune.compile_side_by_side)
and one after another (``MOEGEMM_COMPILE_THREADS=1``).

Why: E8's ``setup_s`` (a contender's first call, checked) was 0.4-15 s for ``moe_ffn`` on the held-out
models, most of it compiling the distilled shortlist's candidates of each GEMM one at a time before timing
them. A user pays this once per shape (rows bucket), and the pipeline pays it in every cell.

Each measurement is its own process, with an empty Triton cache and an empty autotune cache, so its first
call compiles and times every candidate as a new user's first call does. The two settings alternate, the
first of each pair rotating, ``--repeats`` pairs per cell. A row gives the first call's wall time (synced:
the compiles, the shortlists' timing and the call), the second call's (nothing left to compile), the
pool's size limit (``threads``: a shortlist of n distinct kernels takes at most n of them) and the configs
kept; its inputs are E8's (experiments.e8_moe_layer.cell_inputs, uniform load). A child that fails or
outlasts ``--timeout-s`` is recorded as an error row.

    python -m probes.probe_first_call --out probe_first_call.csv [--cells dbrx:4096,olmoe-1b-7b:16]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CELLS = "dbrx:4096,olmoe-1b-7b:256"
SETTINGS = (("side by side", None), ("one after another", "1"))


def child(model: str, t: int) -> dict:
    """One fresh process's first and second call of moe_ffn on the cell (model, t)."""
    import torch

    from experiments.common import load_config
    from experiments.e8_moe_layer import cell_inputs
    from moegemm import autotune
    from moegemm._runtime import compile_threads, gpu_slug
    from moegemm.grouped import moe_ffn

    g = load_config()["grouped"]
    _, e, top_k, h, i, ids, x, wts, _, _, sets = cell_inputs(g, model, t, "uniform", {})
    w_gu, w_dn = sets[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    moe_ffn(x, ids, wts, w_gu, w_dn)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    moe_ffn(x, ids, wts, w_gu, w_dn)
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    path = autotune.cache_file(gpu_slug(x))
    kept = json.loads(path.read_text())["entries"] if path is not None and path.exists() else []
    return {
        "first_call_s": round(first, 3),
        "second_call_s": round(second, 4),
        "threads": compile_threads(8),
        "experts": e,
        "top_k": top_k,
        "hidden": h,
        "intermediate": i,
        "kept": json.dumps([{"key": k["key"], "config": k["config"]} for k in kept]),
    }


def run_child(model: str, t: int, threads: str | None, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as tune_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "MOEGEMM_CACHE_DIR": tune_cache}
        env.pop("MOEGEMM_COMPILE_THREADS", None)
        if threads is not None:
            env["MOEGEMM_COMPILE_THREADS"] = threads
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, "-m", "probes.probe_first_call", "--child", f"{model}:{t}"],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "note": f"no result within {timeout_s:g} s"}
        wall = time.perf_counter() - t0
    if p.returncode != 0:
        why = p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else f"exit status {p.returncode}"
        return {"status": "error", "note": why}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return {"status": "ok", "process_s": round(wall, 2), **out}


def parse_cells(text: str) -> list[tuple[str, int]]:
    cells = []
    for item in text.split(","):
        model, _, t = item.partition(":")
        if not model or not t.isdigit():
            raise SystemExit(f"--cells: expected model:T items, got {item!r}")
        cells.append((model, int(t)))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, _, t = args.child.partition(":")
        print(json.dumps(child(model, int(t))))
        return
    if not args.out:
        raise SystemExit("--out: required")
    if args.repeats < 1:
        raise SystemExit(f"--repeats: expected at least 1, got {args.repeats}")
    from experiments.common import ResultWriter, provenance_fields, require_gpu

    require_gpu()
    cells = parse_cells(args.cells)
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("model", "tokens", "repeat", "setting"))
    for model, t in cells:
        for r in range(args.repeats):
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
            for setting, threads in order:
                if writer.done(model=model, tokens=t, repeat=r, setting=setting):
                    continue
                row = {"model": model, "tokens": t, "repeat": r, "setting": setting}
                row.update(run_child(model, t, threads, args.timeout_s))
                print(
                    f"{model} T={t} #{r} {setting:17s} {row['status']} first {row.get('first_call_s')} s "
                    f"second {row.get('second_call_s')} s threads {row.get('threads')}",
                    flush=True,
                )
                writer.add([{**row, **prov}])
    writer.finish()
    print(f"wrote {Path(args.out)}")


if __name__ == "__main__":
    main()
