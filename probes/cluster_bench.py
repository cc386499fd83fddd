"""The clustered Decompose-K kernel on the GPU: its checks, then its times against the library's default,
cuBLAS and (with ``MOEGEMM_SEED_SOURCE``) the seed's optimized kernel.

    python -m probes.cluster_bench --out-dir results/<gpu>   # MOEGEMM_SEED_SOURCE for the seed's kernels
    python -m probes.cluster_bench --parts grouped --out-dir DIR   # only part 3 (any of checks, dk, grouped)

Each part's rows go to DIR (default: $OUT; neither, nothing is saved) as probe_cluster_checks.csv,
probe_cluster_dk.csv and probe_cluster_grouped.csv, written atomically after every shape.

1. Checks (quick): every dtype x epilogue (+ bias) against float64 on fresh random data, outputs poisoned
   with NaN first; K tails, a single row, b as w.t() (K-contiguous), a strided a, a transposed out; bitwise
   identity over 100 repeats; 20 CUDA-graph replays with new inputs copied in.
2. Times (CUDA-graph replay, 20 calls per graph over rotated input sets, median of 15 replays) on the
   28-shape grid (M = N in {16, 32, 48, 64}, K in {8192, ..., 32768}) and the router [T, 7168] @ [7168, 256],
   T in {1, ..., 256}, bf16 with ReLU: ``ours: auto`` (``moegemm.decompose_k.matmul``), ``cublas``
   (``torch.relu(torch.mm)``), ``seed: optimized`` (its best config from results/<gpu>/tune_seed.csv), and
   the clustered kernel at its heuristic config on every cell, plus a sweep of its knobs (chains, stages,
   S, tiles) on 12 grid cells and 4 router cells. A variant that fails to compile,
   launch or check is recorded as such and the run goes on.

3. The multicast grouped kernel (2-CTA clusters sharing each weight tile), in its plain and its
   warp-specialized persistent form, against the library's grouped_mm and torch._grouped_mm at prefill:
   E = 8, K = 4096, N = 14336, 2048-16384 rows split evenly, w [E, N, K].

Prints a compact table last.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from moegemm.decompose_k import matmul as dk_matmul  # noqa: E402 - after the path set-up
from moegemm.epilogue import Epilogue  # noqa: E402 - after the path set-up
from probes import cluster_dk as C  # noqa: E402 - after the path set-up

# past this many seconds the Decompose-K sweep times only the heuristic config, and past it + 50 the
# grouped part skips its remaining shapes: the whole run stays under 4 minutes
DEADLINE_S = float(os.environ.get("CLUSTER_BENCH_BUDGET_S", "180"))
T0 = time.time()
ROWS: list[dict] = []
CHECKS: list[dict] = []


def elapsed() -> float:
    return time.time() - T0


def ref64(a, b, bias, epi):
    r = a.double() @ b.double()
    if bias is not None:
        r = r + bias.double()
    if epi is Epilogue.RELU:
        r = torch.relu(r)
    elif epi is Epilogue.SIGMOID:
        r = torch.sigmoid(r)
    return r


def rel_err(out, ref) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out.double() - ref).abs().max() / max(ref.abs().max().item(), 1e-6))


TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def check(name, a, b, epi, bias=None, out=None, config=None, allow_tf32=False, clustered=True):
    row = {
        "check": name,
        "dtype": str(a.dtype)[6:],
        "m": a.shape[0],
        "n": b.shape[1],
        "k": a.shape[1],
        "epilogue": epi.name.lower(),
        "bias": bias is not None,
    }
    try:
        if out is not None:
            out.fill_(float("nan"))
        p = C.plan(a, b, epilogue=epi, bias=bias, out=out, config=config, allow_tf32=allow_tf32)
        got = C.matmul(a, b, epilogue=epi, bias=bias, out=out, config=config, allow_tf32=allow_tf32)
        torch.cuda.synchronize()
        err = rel_err(got, ref64(a, b, bias, epi))
        tol = TOL[a.dtype] if not (allow_tf32 and a.dtype == torch.float32) else 5e-3
        ok = not math.isnan(err) and err <= tol and (p is not None) == clustered
        CHECKS.append(
            {
                **row,
                "clustered": p is not None,
                "config": p.config.as_dict() if p is not None else "fallback",
                "rel_err": err,
                "why": ""
                if p is not None
                else str(C.FALLBACK_REASONS.get((a.shape[0], b.shape[1], a.shape[1], config), "")),
                "status": "ok" if ok else "WRONG",
            }
        )
    except Exception as e:  # noqa: BLE001
        CHECKS.append({**row, "status": f"error: {e!r}"[:300]})
        traceback.print_exc()


def run_checks(dev):
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape, dtype):
        return torch.randn(*shape, device=dev, dtype=torch.float32, generator=g).to(dtype)

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for epi in Epilogue:
            for bias_on in (False, True):
                m, n, k = 24, 40, 3000  # K tail (not a multiple of S or BLOCK_K), ragged M and N
                a, b = rnd(m, k, dtype=dtype), rnd(k, n, dtype=dtype)
                bias = rnd(n, dtype=dtype) if bias_on else None
                check("basic", a, b, epi, bias, out=torch.empty(m, n, device=dev, dtype=dtype))
        # one row, b as w.t() (K-contiguous), the router's shape
        w = rnd(256, 7168, dtype=dtype)
        check(
            "router-T1",
            rnd(1, 7168, dtype=dtype),
            w.t(),
            Epilogue.RELU,
            out=torch.empty(1, 256, device=dev, dtype=dtype),
        )
        # strided a (a column slice with an aligned row stride), transposed out
        big = rnd(48, 8192 + 64, dtype=dtype)
        a = big[:, :8192]
        b = rnd(8192, 48, dtype=dtype)
        check("strided-a,out-T", a, b, Epilogue.SIGMOID, out=torch.empty(48, 48, device=dev, dtype=dtype).t())
        for s in (1, 2, 4, 16):
            bk = 32 if dtype == torch.float32 else 64
            for name, cfg in (
                (f"S={s}", C.ClusterConfig(split_k=s, block_m=16, block_n=32, block_k=bk, num_warps=2)),
                (
                    f"S={s},chains=4,ring",
                    C.ClusterConfig(
                        split_k=s, block_m=16, block_n=32, block_k=bk, num_warps=4, stages=4, chains=4
                    ),
                ),
                (
                    f"S={s},chains=2,ring",
                    C.ClusterConfig(
                        split_k=s, block_m=16, block_n=32, block_k=bk, num_warps=2, stages=2, chains=2
                    ),
                ),
            ):
                check(
                    name,
                    rnd(20, 5000, dtype=dtype),
                    rnd(5000, 40, dtype=dtype),
                    Epilogue.RELU,
                    rnd(40, dtype=dtype),
                    out=torch.empty(20, 40, device=dev, dtype=dtype),
                    config=cfg,
                )
        if dtype == torch.float32:
            check(
                "tf32",
                rnd(16, 4096, dtype=dtype),
                rnd(4096, 64, dtype=dtype),
                Epilogue.NONE,
                out=torch.empty(16, 64, device=dev, dtype=dtype),
                allow_tf32=True,
            )
    # an unaligned stride: the fallback serves it
    a = rnd(16, 4099, dtype=torch.bfloat16)
    check(
        "fallback-unaligned",
        a,
        rnd(4099, 16, dtype=torch.bfloat16),
        Epilogue.RELU,
        out=torch.empty(16, 16, device=dev, dtype=torch.bfloat16),
        clustered=False,
    )

    # determinism: bitwise identical over 100 repeats
    a, b = rnd(64, 32768, dtype=torch.bfloat16), rnd(32768, 64, dtype=torch.bfloat16)
    try:
        first = C.matmul(a, b, epilogue="relu")
        same = all(torch.equal(first, C.matmul(a, b, epilogue="relu")) for _ in range(100))
        CHECKS.append(
            {"check": "bitwise-100", "m": 64, "n": 64, "k": 32768, "status": "ok" if same else "WRONG"}
        )
    except Exception as e:  # noqa: BLE001
        CHECKS.append({"check": "bitwise-100", "status": f"error: {e!r}"[:300]})

    # CUDA graph: 20 replays, new inputs copied into the captured buffers each time (the heuristic config,
    # and 16-CTA clusters on 16 x 16 tiles with 4 chains)
    for gcfg in (None, C.ClusterConfig(split_k=16, block_m=16, block_n=16, num_warps=4, chains=4)):
        graph_check(dev, rnd, gcfg)


def graph_check(dev, rnd, cfg):
    try:
        x, w = rnd(7, 7168, dtype=torch.bfloat16), rnd(256, 7168, dtype=torch.bfloat16)
        out = torch.empty(7, 256, device=dev, dtype=torch.bfloat16)
        C.matmul(x, w.t(), epilogue="relu", out=out, config=cfg)  # warm-up (compile, plan) outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            C.matmul(x, w.t(), epilogue="relu", out=out, config=cfg)
        worst = 0.0
        for _ in range(20):
            x.copy_(rnd(7, 7168, dtype=torch.bfloat16))
            w.copy_(rnd(256, 7168, dtype=torch.bfloat16))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            e = rel_err(out, ref64(x, w.t(), None, Epilogue.RELU))
            worst = e if math.isnan(e) else max(worst, e)
        ok = not math.isnan(worst) and worst <= TOL[torch.bfloat16]
        CHECKS.append(
            {
                "check": "graph-20",
                "m": 7,
                "n": 256,
                "k": 7168,
                "rel_err": worst,
                "config": str(cfg),
                "status": "ok" if ok else "WRONG",
            }
        )
    except Exception as e:  # noqa: BLE001
        CHECKS.append({"check": "graph-20", "config": str(cfg), "status": f"error: {e!r}"[:300]})


# ----------------------------------------------------------------------------------------------------


def graph_us(calls, per_graph=20, replays=15) -> float:
    from experiments.harness.timing import GraphTimer

    t = GraphTimer(calls, calls_per_graph=per_graph)
    return statistics.median(t.sample(replays=replays))


def seed_configs():
    """{(m, n, k): the seed's best optimized bf16 config} from the committed tuning rows, with the module."""
    try:
        from experiments import seed_dk

        kern = seed_dk.load()
    except Exception as e:  # noqa: BLE001
        print("seed kernels not loaded:", e)
        return None, {}
    if kern is None:
        return None, {}
    best = {}
    for path in ROOT.glob("results/*/tune_seed.csv"):
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["variant"] == "optimized" and r["dtype"] == "bfloat16" and r["best"] == "True":
                    best[(int(r["m"]), int(r["n"]), int(r["k"]))] = r
    return kern.modules["optimized"], best


SWEEP_CELLS = {("grid", s, s, k) for s in (16, 32, 48, 64) for k in (8192, 20480, 32768)}
SWEEP_CELLS |= {("router", t, 256, 7168) for t in (1, 16, 64, 256)}


def sweep(kind, m, n, k):
    """The heuristic config first; on the sweep's cells (4 M = N x 3 K of the grid, the router at T = 1, 16,
    64, 256) then its knobs one at a time (one accumulator chain; a ring of 4 or 8 slots instead of every
    step in flight, so more CTAs share an SM; the other chain count) and other S and tiles."""
    h = C.heuristic_config(m, n, k, torch.bfloat16, torch.cuda.get_device_properties(0).multi_processor_count)
    out = [h]
    if (kind, m, n, k) not in SWEEP_CELLS:
        return out
    rp = dataclasses.replace
    out += [
        rp(h, chains=1),
        rp(h, stages=4),
        rp(h, stages=8),
        rp(h, chains=2 if h.chains == 4 else 4),
    ]
    for s, bm, bn in (
        (16, 16, 16),
        (16, 16, 8),
        (16, 32, 32),
        (16, 16, 64),
        (16, 16, 32),
        (8, 16, 32),
        (8, 32, 32),
    ):
        if bm // 2 >= max(m, 16) or bn // 2 >= max(n, 8) or k < 2 * s * 64 or (bn == 8 and n > 64):
            continue
        c = C.ClusterConfig(split_k=s, block_m=bm, block_n=bn, block_k=64, num_warps=4, chains=4)
        if c not in out:
            out.append(c)
    return out[:12]


def time_shape(kind, m, n, k, seed_mod, seed_best, dev):
    g = torch.Generator(device=dev).manual_seed(m * 131 + k)
    nbytes = (m * k + k * n) * 2
    from experiments.harness.timing import input_sets_for

    nsets = input_sets_for(nbytes, max_sets=4)
    sets = []
    for _ in range(nsets):
        a = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        b = (torch.randn(k, n, device=dev, generator=g) / 4).to(torch.bfloat16)  # [K, N] row-major, as E5/E6
        sets.append((a, b, torch.empty(m, n, device=dev, dtype=torch.bfloat16)))
    ref = ref64(sets[0][0], sets[0][1], None, Epilogue.RELU)
    base = {"kind": kind, "m": m, "n": n, "k": k, "dtype": "bfloat16", "epilogue": "relu"}

    def measure(name, make_call, config=""):
        row = dict(base, contender=name, config=str(config))
        try:
            calls = [make_call(a, b, c) for a, b, c in sets]
            sets[0][2].fill_(float("nan"))
            got = calls[0]()  # each call returns its output (into the poisoned c where it takes one)
            torch.cuda.synchronize()
            err = rel_err(got, ref)
            row["rel_err"] = err
            if math.isnan(err) or err > 2e-2:
                row["status"] = "wrong"
            else:
                row["graph_us"] = graph_us(calls)
                row["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        ROWS.append(row)
        return row

    measure("ours: auto", lambda a, b, c: lambda: dk_matmul(a, b, epilogue="relu", out=c))
    measure("cublas", lambda a, b, c: lambda: torch.relu(torch.mm(a, b)))
    if seed_mod is not None and (m, n, k) in seed_best:
        r = seed_best[(m, n, k)]
        fields = ("split_k", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
        cfg = seed_mod.KernelConfig(**{f: int(r[f]) for f in fields})

        def seed_call(a, b, c, cfg=cfg):
            partials = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=dev)

            def go():
                seed_mod.decompose_k_relu_out(a, b, c, partials, cfg, fuse_relu=True)
                return c

            return go

        measure("seed: optimized", seed_call, {f: int(r[f]) for f in fields[:4]})
    for i, cfg in enumerate(sweep(kind, m, n, k)):
        if i > 0 and elapsed() > DEADLINE_S:
            ROWS.append(
                dict(base, contender="cluster", config=str(cfg.as_dict()), status="skipped: time budget")
            )
            continue

        def call(a, b, c, cfg=cfg):
            p = C.plan(a, b, epilogue="relu", out=c, config=cfg)
            if p is None:
                raise RuntimeError("no clustered plan (fell back)")
            return lambda: p.run(a, b, None, c)

        measure("cluster: heuristic" if i == 0 else "cluster", call, cfg.as_dict())


GROUPED: list[dict] = []


def time_grouped(dev):
    """The multicast grouped kernel against the library's grouped_mm (its default: tuned, or timed on the
    first call) and torch._grouped_mm, prefill: E = 8, K = 4096, N = 14336, uniform rows, w [E, N, K] bf16."""
    from moegemm.grouped import grouped_mm
    from probes import cluster_grouped as G

    e, k, n = 8, 4096, 14336
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(e, n, k, device=dev, generator=g) / 16).to(torch.bfloat16)
    big = {"block_m": 128, "num_warps": 8}
    configs = [
        G.ClusterGroupedConfig(),
        G.ClusterGroupedConfig(**big, stages=4),
        G.ClusterGroupedConfig(**big, block_n=256, stages=4),
        # the slot hand-over at CTA scope (CUTLASS's barriers), the refill a step later, more slots
        G.ClusterGroupedConfig(**big, block_n=256, stages=4, scope="cta"),
        G.ClusterGroupedConfig(**big, block_n=256, stages=4, scope="cta", lag=2),
        G.ClusterGroupedConfig(**big, stages=6, scope="cta"),
        G.ClusterGroupedConfig(**big, stages=6, lag=2),
        G.ClusterGroupedConfig(**big, stages=6, scope="cta", lag=2),
        G.ClusterGroupedConfig(block_n=256, stages=5, scope="cta", lag=2),
        # the warp-specialized, persistent form
        G.ClusterGroupedConfig(**big, block_n=256, stages=4, ws=True),
        G.ClusterGroupedConfig(**big, block_n=256, stages=4, ws=True, scope="cta"),
        G.ClusterGroupedConfig(**big, stages=6, ws=True, scope="cta"),
    ]
    for rows in (2048, 4096, 8192, 16384):
        if elapsed() > DEADLINE_S + 50:
            GROUPED.append({"rows": rows, "status": "skipped: time budget"})
            continue
        x = torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16)
        offsets = torch.arange(0, e + 1, device=dev, dtype=torch.int32) * (rows // e)
        ref = torch.empty(rows, n, device=dev, dtype=torch.float32)
        for i in range(e):
            r0, r1 = i * (rows // e), (i + 1) * (rows // e)
            ref[r0:r1] = x[r0:r1].float() @ w[i].float().t()
        base = {"E": e, "K": k, "N": n, "rows": rows, "w_layout": "nk", "dtype": "bfloat16"}
        contenders = [
            ("grouped_mm", "", lambda x=x, o=offsets: grouped_mm(x, w, o, w_layout="nk", validate=False))
        ]
        if hasattr(torch, "_grouped_mm"):
            contenders.append(
                (
                    "torch._grouped_mm",
                    "",
                    lambda x=x, o=offsets: torch._grouped_mm(x, w.transpose(-2, -1), offs=o[1:]),
                )
            )
        for cfg in configs:
            contenders.append(
                (
                    "cluster-multicast",
                    dataclasses.asdict(cfg),
                    lambda cfg=cfg, x=x, o=offsets: G.grouped_mm(
                        x, w, o, w_layout="nk", config=cfg, validate=False
                    ),
                )
            )
        for name, cfg, call in contenders:
            row = dict(base, contender=name, config=str(cfg))
            try:
                fallbacks = sum(p is None for p in G._PLANS.values())
                got = call()
                torch.cuda.synchronize()
                err = float((got.float() - ref).abs().max() / ref.abs().max())
                row["rel_err"] = err
                if name == "cluster-multicast" and sum(p is None for p in G._PLANS.values()) > fallbacks:
                    row["status"] = f"fell back: {G.FALLBACK_REASONS}"[:300]
                elif math.isnan(err) or err > 2e-2:
                    row["status"] = "wrong"
                else:
                    row["graph_us"] = graph_us([call], per_graph=5, replays=10)
                    row["tflops"] = 2 * rows * n * k / row["graph_us"] / 1e6
                    row["status"] = "ok"
            except Exception as exc:  # noqa: BLE001
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            GROUPED.append(row)
        write_csv("probe_cluster_grouped.csv", GROUPED)
    time_swiglu(dev, e, k, n)


def time_swiglu(dev, e, k, i, rows=8192):
    """The fused gate/up + SwiGLU: the multicast kernel against the library's grouped_mm_swiglu, one prefill
    shape (w_gate_up [E, 2I, K])."""
    from moegemm.grouped import grouped_mm_swiglu
    from probes import cluster_grouped as G

    if elapsed() > DEADLINE_S + 50:
        GROUPED.append({"rows": rows, "contender": "swiglu", "status": "skipped: time budget"})
        return
    g = torch.Generator(device=dev).manual_seed(1)
    w = (torch.randn(e, 2 * i, k, device=dev, generator=g) / 16).to(torch.bfloat16)
    x = torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16)
    offsets = torch.arange(0, e + 1, device=dev, dtype=torch.int32) * (rows // e)
    ref = torch.empty(rows, i, device=dev, dtype=torch.float32)
    for j in range(e):
        r0, r1 = j * (rows // e), (j + 1) * (rows // e)
        gu = x[r0:r1].float() @ w[j].float().t()
        ref[r0:r1] = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    base = {"E": e, "K": k, "N": 2 * i, "rows": rows, "w_layout": "nk", "dtype": "bfloat16"}
    big = G.ClusterGroupedConfig(block_m=128, num_warps=8, stages=4)
    big_ws = dataclasses.replace(big, ws=True)
    for name, cfg, call in (
        ("grouped_mm_swiglu", "", lambda: grouped_mm_swiglu(x, w, offsets, w_layout="nk", validate=False)),
        (
            "cluster-multicast-swiglu",
            dataclasses.asdict(G.ClusterGroupedConfig()),
            lambda: G.grouped_mm_swiglu(x, w, offsets, w_layout="nk", validate=False),
        ),
        (
            "cluster-multicast-swiglu",
            dataclasses.asdict(big),
            lambda: G.grouped_mm_swiglu(x, w, offsets, w_layout="nk", validate=False, config=big),
        ),
        (
            "cluster-multicast-swiglu",
            dataclasses.asdict(big_ws),
            lambda: G.grouped_mm_swiglu(x, w, offsets, w_layout="nk", validate=False, config=big_ws),
        ),
    ):
        row = dict(base, contender=name, config=str(cfg))
        try:
            got = call()
            torch.cuda.synchronize()
            err = float((got.float() - ref).abs().max() / ref.abs().max())
            row["rel_err"] = err
            if math.isnan(err) or err > 2e-2:
                row["status"] = "wrong"
            else:
                row["graph_us"] = graph_us([call], per_graph=5, replays=10)
                row["tflops"] = 2 * rows * 2 * i * k / row["graph_us"] / 1e6
                row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        GROUPED.append(row)
    write_csv("probe_cluster_grouped.csv", GROUPED)


# where write_csv saves (main's --out-dir, else $OUT)
OUT_DIR: str | None = None


def write_csv(name, rows):
    """``rows`` as OUT_DIR/name (nothing without one), each with the run's provenance (GPU, driver, CUDA,
    torch, Triton, commit, time)."""
    out = OUT_DIR or os.environ.get("OUT")
    if not out or not rows:
        return
    from experiments.common import provenance_fields

    prov = provenance_fields()
    rows = [{**r, **{k: v for k, v in prov.items() if k not in r}} for r in rows]
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    path = Path(out) / name
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    tmp.rename(path)


PARTS = ("checks", "dk", "grouped")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to run: the Decompose-K kernel's checks (1), its times (2), the grouped kernel (3)",
    )
    ap.add_argument("--out-dir", help="the folder of the CSVs (default: $OUT; neither, nothing is saved)")
    args = ap.parse_args(argv)
    parts = set(args.parts)
    global OUT_DIR
    OUT_DIR = args.out_dir
    if OUT_DIR:
        Path(OUT_DIR).mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    import triton

    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("cluster supported:", C.cluster_supported(dev), C.unsupported_reason(0))
    if "checks" in parts:
        run_checks(dev)
        print(f"checks done at {elapsed():.0f}s")
    for r in CHECKS:
        if r["status"] != "ok":
            print("CHECK", r)
    print(f"checks: {sum(r['status'] == 'ok' for r in CHECKS)} ok of {len(CHECKS)}")
    write_csv("probe_cluster_checks.csv", CHECKS)

    seed_mod, seed_best = seed_configs() if "dk" in parts else (None, None)
    shapes = [("grid", s, s, k) for s in (16, 32, 48, 64) for k in range(8192, 32768 + 1, 4096)]
    shapes += [("router", t, 256, 7168) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    if "dk" not in parts:
        shapes = []
    for kind, m, n, k in shapes:
        try:
            time_shape(kind, m, n, k, seed_mod, seed_best, dev)
        except Exception as e:  # noqa: BLE001
            ROWS.append({"kind": kind, "m": m, "n": n, "k": k, "status": f"error: {e!r}"[:300]})
        write_csv("probe_cluster_dk.csv", ROWS)
    print(f"timing done at {elapsed():.0f}s")
    if "grouped" in parts:
        try:
            time_grouped(dev)
        except Exception as exc:  # noqa: BLE001
            GROUPED.append({"status": f"error: {exc!r}"[:300]})
            traceback.print_exc()
        print(f"grouped done at {elapsed():.0f}s")

    # the compact table
    print(
        f"{'shape':>22} {'auto':>6} {'cublas':>6} {'seed':>6} {'clu-h':>6} {'clu-best':>8}  "
        f"{'best/seed':>9} {'best/auto':>9}  best config"
    )
    ratios_seed, ratios_auto = [], []
    for kind, m, n, k in shapes:
        rs = [r for r in ROWS if (r.get("kind"), r.get("m"), r.get("n"), r.get("k")) == (kind, m, n, k)]
        t = {}
        for r in rs:
            if r.get("status") == "ok":
                name = r["contender"]
                key = "cluster" if name.startswith("cluster") else name
                if key not in t or r["graph_us"] < t[key][0]:
                    t[key] = (r["graph_us"], r["config"])
                if name == "cluster: heuristic":
                    t["heur"] = (r["graph_us"], r["config"])

        def f(key, t=t):
            return f"{t[key][0]:6.2f}" if key in t else "     -"

        both = "cluster" in t and "seed: optimized" in t
        rseed = t["seed: optimized"][0] / t["cluster"][0] if both else math.nan
        rauto = t["ours: auto"][0] / t["cluster"][0] if "cluster" in t and "ours: auto" in t else math.nan
        if not math.isnan(rseed):
            ratios_seed.append(rseed)
        if not math.isnan(rauto):
            ratios_auto.append(rauto)
        cfg = t["cluster"][1] if "cluster" in t else ""
        print(
            f"{kind:>6} {m:>4}x{n:<4}x{k:<6} {f('ours: auto')} {f('cublas')} {f('seed: optimized')} "
            f"{f('heur')} {f('cluster'):>8}  {rseed:9.3f} {rauto:9.3f}  {cfg}"
        )

    def gm(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan

    print(
        f"geomean best-cluster speedup: vs seed {gm(ratios_seed):.3f} ({len(ratios_seed)} shapes), "
        f"vs ours:auto {gm(ratios_auto):.3f} ({len(ratios_auto)} shapes); total {elapsed():.0f}s"
    )
    print(f"{'grouped prefill (E=8, K=4096, N=14336, nk)':<44} {'us':>9} {'TFLOP/s':>8}  config / status")
    for r in GROUPED:
        us = f"{r['graph_us']:9.1f} {r['tflops']:8.1f}" if "graph_us" in r else f"{'-':>9} {'-':>8}"
        print(
            f"  rows={r.get('rows', '?'):<6} {r.get('contender', ''):<30} {us}  {r.get('config', '')} "
            f"{'' if r.get('status') == 'ok' else r.get('status')}"
        )
    bad = [r for r in CHECKS if r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
