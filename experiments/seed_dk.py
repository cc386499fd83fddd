"""The seed author's Triton Decompose-K kernels as contenders, loaded at run time from their own source.

``MOEGEMM_SEED_SOURCE`` names the ``decompose-k`` folder of a clone of shreyansh26/MLSys-Experiments (the
commit we measured: ``SEED_COMMIT``). Two kernels are read from it:

- ``seed: original`` - ``kernels/decompose_k_triton_kernel.py``: partial GEMMs into fp32 ``[S, M, N]``, then
  a tile-shaped reducer that loops over S;
- ``seed: optimized`` - ``kernels/decompose_k_triton_kernel_optimized.py``: the same partials, then a flat
  vector reduction over S.

Both take M, N and K as compile-time constants, need S to divide K, and fuse ReLU (no other epilogue): a
sigmoid or a bias is applied after them with torch ops, and such rows say ``epilogue_fused=False``.

Each kernel gets a config search over its own candidates (``candidate_configs``) and splits
(``inductor_like_splits``, the original's with the seed's default limit of 10), timed on the GPU clock by our
harness. The full cross product is hundreds of configs per shape, each its own compile; the search walks it
by coordinate descent instead: every candidate tile at the seed's first split, every split at the best
tile, the four best tiles at the best split (``search``). Nothing of the seed's code is in this repository.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import sys
from pathlib import Path

import torch

from experiments.harness.runner import Contender
from moegemm.epilogue import Epilogue

SEED_REPO = "shreyansh26/MLSys-Experiments"
SEED_COMMIT = "b63fb8c71bc0019205404d1b979a519ee8a748d0"
FILES = {
    "original": "kernels/decompose_k_triton_kernel.py",
    "optimized": "kernels/decompose_k_triton_kernel_optimized.py",
}
SPLIT_LIMIT = 10  # the seed's benchmark default (--split-limit)
VARIANTS = ("original", "optimized")


@dataclasses.dataclass
class SeedKernels:
    modules: dict  # variant -> module
    origin: str  # folder, and the files' sha256


def source_dir() -> Path | None:
    path = os.environ.get("MOEGEMM_SEED_SOURCE")
    return Path(path) if path else None


def load() -> SeedKernels | None:
    """The seed's two kernel modules from ``MOEGEMM_SEED_SOURCE``, or None where it is unset. A set path
    that does not hold the files raises, naming it."""
    root = source_dir()
    if root is None:
        return None
    missing = [f for f in FILES.values() if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"MOEGEMM_SEED_SOURCE={root}: missing {', '.join(missing)} (expected the "
            f"decompose-k folder of a clone of {SEED_REPO} at {SEED_COMMIT})"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # the seed's modules import each other as ``kernels.*``
    mods = {v: importlib.import_module(f.removesuffix(".py").replace("/", ".")) for v, f in FILES.items()}
    digest = hashlib.sha256(b"".join((root / f).read_bytes() for f in FILES.values())).hexdigest()[:16]
    return SeedKernels(mods, f"{root} sha256:{digest}")


def splits(mod, variant: str, m: int, n: int, k: int) -> list[int]:
    return list(mod.inductor_like_splits(m, n, k, SPLIT_LIMIT))


def runner(mod, a: torch.Tensor, b: torch.Tensor, config, epilogue: str, bias=None):
    """A zero-argument call: the seed's kernel into preallocated C and partials, then what it cannot fuse."""
    epi = Epilogue.parse(epilogue)
    m, n = a.shape[0], b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    partials = torch.empty((config.split_k, m, n), dtype=torch.float32, device=a.device)
    fuse = epi is Epilogue.RELU and bias is None
    if fuse:
        return lambda: mod.decompose_k_relu_out(a, b, c, partials, config, fuse_relu=True)

    def call():
        out = mod.decompose_k_relu_out(a, b, c, partials, config, fuse_relu=False)
        if bias is not None:
            out = out + bias
        return epi.torch_apply(out)

    return call


def config_dict(config) -> dict:
    return dataclasses.asdict(config)


def search(
    mod,
    variant: str,
    sets: list[tuple],
    ref: torch.Tensor,
    k: int,
    epilogue: str,
    settings,
    log: list | None = None,
    top: int = 4,
):
    """(best config, its graph_us, configs timed) by coordinate descent over the seed's candidates:
    every tile at the first split, every split at the best tile, the ``top`` best tiles at the best split.
    Each config is checked against the float64 reference before it is timed; ``log`` collects one row per
    config tried."""
    from experiments.common import check_and_time
    from experiments.harness.runner import prewarm

    m, n = sets[0][0].shape[0], sets[0][1].shape[1]
    split_list = splits(mod, variant, m, n, k)
    if not split_list:
        return None, float("nan"), 0
    tiles = [dataclasses.replace(c, split_k=0) for c in mod.candidate_configs([split_list[0]])]
    timed: dict = {}

    def time_all(configs):
        todo = [c for c in configs if c not in timed]
        a0, b0, bias0 = sets[0]
        prewarm([runner(mod, a0, b0, c, epilogue, bias0) for c in todo])
        for c in todo:
            calls = [runner(mod, a, b, c, epilogue, bias) for a, b, bias in sets]
            row = check_and_time(calls, ref, k, settings)
            timed[c] = row.get("graph_us", float("inf")) if row["status"] == "ok" else float("inf")
            if log is not None:
                log.append({"variant": variant, **config_dict(c), **row})

    def best_of(configs):
        return min(configs, key=lambda c: timed[c])

    with_split = lambda s, ts: [dataclasses.replace(t, split_k=s) for t in ts]  # noqa: E731
    first = with_split(split_list[0], tiles)
    time_all(first)
    ranked = sorted(first, key=lambda c: timed[c])
    by_split = [dataclasses.replace(ranked[0], split_k=s) for s in split_list]
    time_all(by_split)
    s_best = best_of(by_split).split_k
    time_all(with_split(s_best, [dataclasses.replace(c, split_k=0) for c in ranked[:top]]))
    best = best_of(list(timed))
    return best, timed[best], len(timed)


def contender(mod, variant: str, config, epilogue: str, **fields) -> Contender:
    """The seed's kernel at one config, as a contender ("seed: original" / "seed: optimized")."""
    epi = Epilogue.parse(epilogue)

    def bind(inp):
        a, b, bias = inp
        return runner(mod, a, b, config, epilogue, bias)

    fused = epi is Epilogue.NONE or epi is Epilogue.RELU
    return Contender(
        f"seed: {variant}",
        bind,
        config=config_dict(config),
        fields={"variant": f"seed:{variant}", "split_k": config.split_k, "epilogue_fused": fused, **fields},
        parallel_compile=True,
    )


def from_dict(mod, d: dict):
    return mod.KernelConfig(**{f.name: int(d[f.name]) for f in dataclasses.fields(mod.KernelConfig)})
