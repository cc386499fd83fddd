"""Decompose-K contenders and shapes shared by the experiments E1-E6 and the tuner."""

from __future__ import annotations

import torch
import triton

from experiments.harness.runner import Contender
from moegemm.decompose_k import DecomposeKConfig, matmul
from moegemm.decompose_k.configs import KERNELS, choose
from moegemm.decompose_k.reference import decompose_k
from moegemm.epilogue import Epilogue


def grid_shapes(cfg: dict, ks: str = "grid_k") -> list[tuple[int, int, int]]:
    """The M=N x K grid; ``ks`` names the config list of K (E3 and E4 use their own, ``fusion_grid_k``, with
    M = N from ``fusion_grid_mn`` where the config has it)."""
    d = cfg["decompose_k"]
    mns = d.get("fusion_grid_mn", d["grid_mn"]) if ks == "fusion_grid_k" else d["grid_mn"]
    return [(mn, mn, k) for mn in mns for k in d.get(ks, d["grid_k"])]


def router_shapes(cfg: dict, key: str = "tokens") -> list[tuple[int, int, int]]:
    """The router shapes of E6 (``tokens``) or of the tuner (``tune_tokens``, default: E6's)."""
    r = cfg["decompose_k"]["router"]
    return [(t, r["n"], r["k"]) for t in r.get(key, r["tokens"])]


def make_inputs(m, n, k, dtype, seed: int, n_sets: int = 1, bias: bool = False) -> list[tuple]:
    """Fresh random operand sets (never zeros). B is [K, N] row-major like the seed's; bias optional."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        b = (torch.randn(k, n, device="cuda", generator=g) / 4).to(dtype)
        bb = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
        sets.append((a, b, bb))
    return sets


def ours(
    kernel: str,
    epilogue: str,
    config: DecomposeKConfig | None = None,
    fused: bool = True,
    name: str | None = None,
    **fields,
) -> Contender:
    epi = Epilogue.parse(epilogue)

    def bind(inp):
        a, b, bias = inp
        if fused:
            return lambda: matmul(a, b, kernel=kernel, epilogue=epilogue, bias=bias, config=config)
        return lambda: epi.torch_apply(matmul(a, b, kernel=kernel, bias=bias, config=config))

    label = name or (f"ours:{kernel}" + ("" if fused or epi is Epilogue.NONE else "+unfused"))
    return Contender(
        label, bind, config=config.as_dict() if config else "auto", fields=fields, parallel_compile=True
    )


def eager(epilogue: str, **fields) -> Contender:
    epi = Epilogue.parse(epilogue)

    def bind(inp):
        a, b, bias = inp
        if bias is None:
            return lambda: epi.torch_apply(a @ b)
        return lambda: epi.torch_apply(torch.addmm(bias, a, b))

    return Contender("eager", bind, config="torch.mm", fields=fields)


def seed_decompose_k(split: int, epilogue: str, **fields) -> Contender:
    """The seed's PyTorch decomposeK (bmm to fp32, sum, cast) with the epilogue as a separate op."""
    epi = Epilogue.parse(epilogue)

    def bind(inp):
        a, b, bias = inp
        assert bias is None
        return lambda: epi.torch_apply(decompose_k(a, b, split))

    return Contender("pytorch:decompose_k", bind, config={"split_k": split}, fields=fields)


def compiled(
    fn, mode: str, name: str, config="", inspect_mn: tuple[int, int] | None = None, **fields
) -> Contender:
    """torch.compile(fn, mode). The first call (the correctness check) compiles; its wall time is recorded
    as ``compile_s`` and, with ``inspect_mn``, what Inductor emitted (see moegemm.inductor.codegen)."""
    import time

    from moegemm.inductor.codegen import inspect, run_and_get_code

    cf = torch.compile(fn, mode=mode, dynamic=False)
    graph = mode in ("default", "max-autotune-no-cudagraphs")
    contender = Contender(name, None, config=config or mode, graph=graph, fields=fields)
    state = {"compiled": False}

    def bind(inp):
        a, b, bias = inp

        def call():
            if state["compiled"]:
                return cf(a, b)
            state["compiled"] = True
            t0 = time.perf_counter()
            if inspect_mn is None:
                out = cf(a, b)
            else:
                out, code, _ = run_and_get_code(cf, a, b)
                info = inspect(code, *inspect_mn)
                contender.fields.update(
                    inductor_kernels=" ".join(info["kernels"]),
                    inductor_externs=" ".join(info["extern_calls"]),
                    inductor_decompose_k=info["decompose_k"],
                    inductor_split_k=info["split_k"],
                    inductor_relu=info["relu"],
                    inductor_launches=info["n_kernel_launches"],
                )
            torch.cuda.synchronize()
            contender.fields["compile_s"] = round(time.perf_counter() - t0, 2)
            return out

        return call

    contender.bind = bind
    return contender


def epilogue_fn(epilogue: str):
    epi = Epilogue.parse(epilogue)
    return lambda a, b: epi.torch_apply(a @ b)


def tuned_or_heuristic(a: torch.Tensor, n: int, epilogue: str, kernel: str) -> tuple[DecomposeKConfig, str]:
    _, cfg, source = choose(a, n, Epilogue.parse(epilogue), kernel)
    return cfg, source


def _blocks(dim: int) -> list[int]:
    """The block that covers a small dimension in one tile (16/32/64), or two choices for large ones."""
    return [min(64, max(16, 1 << (dim - 1).bit_length()))] if dim <= 64 else [64, 128]


def wide_candidates(
    m: int, n: int, k: int, dtype: torch.dtype, sm_count: int, stages=(3, 4), max_waves: int = 4
) -> list[DecomposeKConfig]:
    """The single-launch kernel's space: 16-wide tiles beside the covering ones, 1 warp or 4 on small tiles,
    BLOCK_K 64-256, S a power of two from 8 with at most ``max_waves`` programs per SM."""
    bks = [32, 64, 128] if dtype == torch.float32 else [64, 128, 256]
    elt = 4 if dtype == torch.float32 else 2
    cover = lambda d: min(64, max(16, 1 << (d - 1).bit_length())) if d <= 64 else 64  # noqa: E731
    out = []
    for bm in sorted({16, cover(m)}):
        for bn in sorted({16, 32, cover(n)} if n >= 32 else {16}):
            if bn > max(16, cover(n)) or bm > max(16, cover(m)):
                continue
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            for warps in (1, 4) if bm * bn <= 256 else (4,):
                for bk in bks:
                    for st in stages:
                        if (bm * bk + bk * bn) * elt * st > 160 * 1024:
                            continue
                        for s in (8, 16, 32, 64, 128, 256):
                            if k // s < bk or tiles * s > max_waves * sm_count:
                                continue
                            out.append(
                                DecomposeKConfig(
                                    split_k=s,
                                    block_m=bm,
                                    block_n=bn,
                                    block_k=bk,
                                    num_warps=warps,
                                    num_stages=st,
                                )
                            )
    return out


def candidates(
    m: int, n: int, k: int, dtype: torch.dtype, kernel: str, sm_count: int
) -> list[DecomposeKConfig]:
    """The tuner's search space for one shape and kernel: about a dozen configs for the two-launch kernels on
    the skinny shapes; for the single-launch kernel (the default) on 16-bit inputs ``wide_candidates`` at 3
    stages and at most one program per SM (the fastest configs of a wider probe all were), plus S = 1 (no
    split) on the covering tiles."""
    if kernel == "single_launch" and dtype != torch.float32:
        wide = wide_candidates(m, n, k, dtype, sm_count, stages=(3,), max_waves=1)
        return wide + [c for c in _covering(m, n, k, dtype, kernel, sm_count) if c.split_k == 1]
    return _covering(m, n, k, dtype, kernel, sm_count)


def _covering(m, n, k, dtype, kernel, sm_count) -> list[DecomposeKConfig]:
    bks = [64, 128] if dtype == torch.float32 else [128, 256]
    elt = 4 if dtype == torch.float32 else 2
    bns = _blocks(n)
    out = []
    for bm in _blocks(m):
        for bn in bns:
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            warps = 8 if bm * bn >= 64 * 128 else 4
            for bk in bks:
                stages = 3 if bk <= 128 else 2
                if (bm * bk + bk * bn) * elt * stages > 160 * 1024:  # leave shared memory headroom
                    continue
                for s in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                    if k // s < bk or tiles * s > 8 * sm_count or (s == 1 and kernel != "single_launch"):
                        continue
                    xb = 32 if m * n <= 4096 else 128
                    out.append(
                        DecomposeKConfig(
                            split_k=s,
                            block_m=bm,
                            block_n=bn,
                            block_k=bk,
                            num_warps=warps,
                            num_stages=stages,
                            xblock=xb,
                            rblock=min(32, triton.next_power_of_2(s)),
                        )
                    )
    return out


__all__ = [
    "KERNELS",
    "grid_shapes",
    "router_shapes",
    "make_inputs",
    "ours",
    "eager",
    "seed_decompose_k",
    "compiled",
    "candidates",
    "tuned_or_heuristic",
    "epilogue_fn",
    "seed_kernels",
]


def tiny_kernel_us() -> float:
    """One tiny kernel's GPU time inside a CUDA graph, measured now (the launch floor of any contender)."""
    from experiments.harness.timing import GraphTimer

    x = torch.ones(1, device="cuda")
    t = GraphTimer([lambda: x.add_(1)], calls_per_graph=200)
    return sorted(t.sample(11))[5]


def run_shape(
    experiment: str,
    contenders: list[Contender],
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    epilogue: str,
    settings,
    prov: dict,
    tiny_us: float,
    seed: int,
    bias: bool = False,
    **fields,
) -> list[dict]:
    """Measure the contenders of one shape; rows carry shape, floor and provenance."""
    from experiments.common import ref64
    from experiments.harness.floors import gemm_bytes, gemm_floor_us
    from experiments.harness.runner import measure
    from experiments.harness.timing import input_sets_for
    from moegemm._runtime import slugify

    elt = torch.tensor([], dtype=dtype).element_size()
    sets = make_inputs(m, n, k, dtype, seed, n_sets=input_sets_for((m * k + k * n) * elt), bias=bias)
    ref = ref64(sets[0][0], sets[0][1], epilogue, sets[0][2])
    rows = measure(contenders, sets, ref, k, settings)
    slug = slugify(prov["gpu"])
    floor = gemm_floor_us(m, n, k, elt, slug, tiny_us, fp32=dtype == torch.float32)
    for r in rows:
        r.update(
            experiment=experiment,
            m=m,
            n=n,
            k=k,
            dtype=str(dtype).replace("torch.", ""),
            epilogue=epilogue,
            bytes=gemm_bytes(m, n, k, elt),
            flops=2 * m * n * k,
            floor_us=floor,
            tiny_kernel_us=tiny_us,
            **fields,
            **prov,
        )
    return rows


def run_grid(
    experiment: str,
    description: str,
    epilogue: str,
    contenders_for,
    seed,
    reset_dynamo: bool,
    ks: str = "grid_k",
) -> None:
    """The CLI body of a bf16 experiment over the M=N x K grid: one measured unit per shape, resumable.

    contenders_for(probe, n, k, cfg, results_dir) -> contenders, where probe is an empty [M, K] bf16 tensor
    (for config lookup) and results_dir the output's folder (where tune_seed.csv is); seed(m, k) -> the
    shape's input seed."""
    from pathlib import Path

    from experiments.common import (
        Progress,
        ResultWriter,
        cli,
        load_config,
        provenance_fields,
        require_gpu,
        timing_settings,
    )

    args = cli(description)
    require_gpu()
    cfg = load_config(args.config)
    settings = timing_settings(cfg)
    prov = provenance_fields()
    tiny = tiny_kernel_us()
    writer = ResultWriter(args.out, ("m", "n", "k"))
    shapes = grid_shapes(cfg, ks)
    bar = Progress(len(shapes), experiment)
    for m, n, k in shapes:
        if not writer.done(m=m, n=n, k=k):
            if reset_dynamo:
                # a fresh compile per exact shape (the recompile limit degrades later ones)
                torch._dynamo.reset()
            probe = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
            writer.add(
                run_shape(
                    experiment,
                    contenders_for(probe, n, k, cfg, str(Path(args.out).parent)),
                    m,
                    n,
                    k,
                    torch.bfloat16,
                    epilogue,
                    settings,
                    prov,
                    tiny,
                    seed=seed(m, k),
                )
            )
        bar.update()
    bar.close()
    writer.finish()


def unfused_relu(c: Contender) -> Contender:
    """The same contender with ReLU applied after it as a separate op (E3's unfused side)."""
    inner = c.bind

    def bind(inp):
        call = inner(inp)
        return lambda: torch.relu(call())

    c.bind = bind
    c.name = c.name + "+unfused"
    return c


def auto_choice(a: torch.Tensor, n: int, epilogue: str) -> str:
    """What kernel="auto" runs for this shape, and from where: e.g. "single_launch (tuned)",
    "cublas (heuristic)"."""
    name, _, source = choose(a, n, Epilogue.parse(epilogue), "auto")
    return f"{name} ({source})"


_SEED_CACHE: dict = {}


def _seed_best(results_dir: str) -> tuple[object, dict]:
    """(the seed's kernels or None, {(variant, dtype, m, n, k): best config dict}) from tune_seed.csv."""
    import csv
    from pathlib import Path

    from experiments import seed_dk

    if results_dir in _SEED_CACHE:
        return _SEED_CACHE[results_dir]
    seed = seed_dk.load()
    best: dict = {}
    path = Path(results_dir) / "tune_seed.csv"
    if seed is not None and path.exists():
        with path.open() as f:
            for r in csv.DictReader(f):
                if r.get("best") == "True" and r.get("status") == "ok":
                    cfgd = {
                        fld: int(r[fld])
                        for fld in (
                            "split_k",
                            "block_m",
                            "block_n",
                            "block_k",
                            "group_m",
                            "num_warps",
                            "num_stages",
                        )
                    }
                    best[(r["variant"], r["dtype"], int(r["m"]), int(r["n"]), int(r["k"]))] = cfgd
    _SEED_CACHE[results_dir] = (seed, best)
    return seed, best


def seed_kernels(
    results_dir: str,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    epilogue: str,
    split: int | None = None,
    **fields,
) -> list[Contender]:
    """The seed's two Triton kernels ("seed: original", "seed: optimized") at the configs its own search
    chose for this shape and dtype (tune_seed; fp16 takes bf16's, and so does fp32 where a tune_seed of
    before its fp32 search has none), or at ``split`` with the chosen tile (E4; S must divide K). None
    where the seed's source or search result is missing."""
    import dataclasses

    from experiments import seed_dk

    seed, best = _seed_best(results_dir)
    if seed is None:
        return []
    dt = "bfloat16" if dtype == torch.float16 else str(dtype).replace("torch.", "")
    out = []
    for variant in seed_dk.VARIANTS:
        d = best.get((variant, dt, m, n, k)) or best.get((variant, "bfloat16", m, n, k))
        if d is None or (split is not None and k % split):
            continue
        mod = seed.modules[variant]
        cfg = seed_dk.from_dict(mod, d)
        if split is not None:
            cfg = dataclasses.replace(cfg, split_k=split)
        c = seed_dk.contender(mod, variant, cfg, epilogue, seed_origin=seed.origin, **fields)
        if split is not None:
            c.name = f"seed: {variant}:S{split}"
        out.append(c)
    return out


def shape_inputs(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int, epilogue: str = "none"
) -> tuple[list[tuple], torch.Tensor]:
    """(input sets, float64 reference of the first) for one shape, as many sets as rotate past the L2."""
    from experiments.common import ref64
    from experiments.harness.timing import input_sets_for

    elt = torch.tensor([], dtype=dtype).element_size()
    sets = make_inputs(m, n, k, dtype, seed, n_sets=input_sets_for((m * k + k * n) * elt))
    return sets, ref64(sets[0][0], sets[0][1], epilogue)
