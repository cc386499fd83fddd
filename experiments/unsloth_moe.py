"""Unsloth's Triton grouped-GEMM MoE kernels (unsloth/kernels/moe/grouped_gemm: forward, dX and dW kernels
behind one autograd Function), loaded at run time from a checkout of Unsloth's source named by
``MOEGEMM_UNSLOTH_SOURCE`` (the repository's root, or any folder holding ``unsloth/kernels/moe``). Nothing
of Unsloth is part of this project.

Only the grouped-GEMM package is imported: ``unsloth`` and its parents are set up as bare namespace
packages (Unsloth's own ``__init__`` imports its whole training stack), with the one name the kernels'
interface reads from it (``DEVICE_TYPE = "cuda"``). The revision recorded in the rows: the checkout's git
commit where it is a git repository, else ``MOEGEMM_UNSLOTH_REVISION``, else "unknown".

The layer as Unsloth's training runs it when its Triton backend is chosen (``UNSLOTH_MOE_BACKEND=
unsloth_triton``; unsloth_zoo's ``forward_triton_grouped_gemm``, unslothai/unsloth-zoo
unsloth_zoo/temporary_patches/moe_utils.py at 00351ea; Unsloth's default MoE backend is torch._grouped_mm,
E9's torch pipeline): the kernel configs of each GEMM from Unsloth's own ``get_or_autotune_moe_kernels``
(unsloth/kernels/moe/autotune_cache.py: its autotuning of the forward, dX and dW kernels once per layer
shape at 4096 tokens, cached in memory and under ~/.cache/unsloth), with the dimensions unsloth_zoo passes;
its routing (a bincount of the expert ids and their stable argsort); the gate/up grouped GEMM with the
permutation fused into its prologue (permute_x), SiLU(gate) * up as torch ops, the down grouped GEMM with
the un-permutation fused into its epilogue (permute_y), both with ``autotune=False`` and the tuned configs;
then the gating weights and the sum over top_k as torch ops. One difference: unsloth_zoo also installs a
persistent Triton allocator for the TMA descriptors' scratch; Triton's allocator is global to the process
and the other contenders' TMA kernels install their own, so here Unsloth's interface allocates that
scratch per call as it does without unsloth_zoo (a host cost on the launch clock, none on the GPU clock).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import torch

from experiments.common import DTYPES

ENV = "MOEGEMM_UNSLOTH_SOURCE"
# The repository and revision E9's rows were measured at (the Dockerfile clones them)
UNSLOTH_REPO = "unslothai/unsloth"
UNSLOTH_COMMIT = "015bdef0d94a241bcd94eec7a405b1700632180d"
PACKAGE = Path("unsloth") / "kernels" / "moe" / "grouped_gemm"


@dataclasses.dataclass
class Unsloth:
    grouped_gemm: object  # interface.grouped_gemm
    tune: object  # autotune_cache.get_or_autotune_moe_kernels
    config_types: tuple  # tuning.KernelConfigForward, KernelConfigBackward_dX, KernelConfigBackward_dW
    revision: str
    origin: str
    # one layer shape's configs, as unsloth_zoo keeps them on the experts module after its first call
    configs: dict = dataclasses.field(default_factory=dict)


def _root(source: str) -> Path:
    p = Path(source).expanduser().resolve()
    for cand in (p, p.parent, p.parent.parent, p.parent.parent.parent, p.parent.parent.parent.parent):
        if (cand / PACKAGE / "interface.py").is_file():
            return cand
    raise ValueError(f"{ENV}={source}: no {PACKAGE}/interface.py under it")


def revision_of(root: Path) -> str:
    """The commit of the git repository whose top is ``root`` (not of a repository it merely sits in), else
    MOEGEMM_UNSLOTH_REVISION, else "unknown"."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == root.resolve():
            return lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("MOEGEMM_UNSLOTH_REVISION", "unknown")


def load(source: str | None = None) -> tuple[Unsloth | None, str]:
    """(Unsloth's kernels, "") or (None, why not)."""
    source = source or os.environ.get(ENV)
    if not source:
        return None, f"not available ({ENV} not set)"
    try:
        root = _root(source)
    except ValueError as ex:
        return None, str(ex)
    if "unsloth" in sys.modules and not hasattr(sys.modules["unsloth"], "__path__"):
        return None, "a module named unsloth is already imported and is not a package"
    for name, sub in (
        ("unsloth", "unsloth"),
        ("unsloth.kernels", "unsloth/kernels"),
        ("unsloth.kernels.moe", "unsloth/kernels/moe"),
    ):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(root / sub)]
            sys.modules[name] = mod
    if not hasattr(sys.modules["unsloth"], "DEVICE_TYPE"):
        sys.modules["unsloth"].DEVICE_TYPE = "cuda"
    try:
        interface = importlib.import_module("unsloth.kernels.moe.grouped_gemm.interface")
        cache = importlib.import_module("unsloth.kernels.moe.autotune_cache")
        tuning = importlib.import_module("unsloth.kernels.moe.grouped_gemm.kernels.tuning")
        types_ = (tuning.KernelConfigForward, tuning.KernelConfigBackward_dX, tuning.KernelConfigBackward_dW)
    except Exception as ex:  # noqa: BLE001 - an optional peer: recorded, not fatal
        return None, f"import failed: {type(ex).__name__}: {str(ex)[:200]}"
    rev = revision_of(root)
    origin = f"unsloth {rev[:12]} ({root})"
    return Unsloth(interface.grouped_gemm, cache.get_or_autotune_moe_kernels, types_, rev, origin), ""


class _Warnings(logging.Handler):
    """What Unsloth's tuner logs at WARNING and above (a failed autotuning falls back to default configs
    with only a log line)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage()[:160])


def gemm_dims(h: int, i: int) -> dict[str, tuple[int, int]]:
    """{GEMM: (hidden_dim, intermediate_dim)} as unsloth_zoo passes them to Unsloth's tuner: gate/up hidden H,
    intermediate 2I; down hidden I, intermediate H."""
    return {"gate_up": (h, 2 * i), "down": (i, h)}


def tune_gemm(
    uk: Unsloth, e: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, force: bool
) -> tuple:
    """((forward, dX, dW) configs, what the tuner warned of): Unsloth's own tuner for one GEMM (``force``: it
    tunes even where its cache under ~/.cache/unsloth holds the shape, as on a machine's first run)."""
    log = logging.getLogger("unsloth.kernels.moe.autotune_cache")
    warned = _Warnings()
    log.addHandler(warned)
    try:
        configs = uk.tune(
            num_experts=e,
            hidden_dim=hidden,
            intermediate_dim=inter,
            top_k=top_k,
            dtype=dtype,
            force_autotune=force,
        )
    finally:
        log.removeHandler(warned)
    return tuple(configs), "; ".join(warned.lines)


def layer_configs(uk: Unsloth, e: int, h: int, i: int, top_k: int, dtype: torch.dtype) -> tuple:
    """((forward, dX, dW) configs of the gate/up GEMM, those of the down GEMM, what the tuner warned of):
    those ``seed_configs`` put in place (Unsloth's tuner run once before, as its disk cache keeps them for a
    machine's later runs), else Unsloth's own tuner once per GEMM with the dimensions unsloth_zoo gives it
    (gemm_dims), kept per layer shape."""
    key = (e, h, i, top_k, dtype)
    if key not in uk.configs:
        dims = gemm_dims(h, i)
        up, w_up = tune_gemm(uk, e, *dims["gate_up"], top_k, dtype, force=False)
        down, w_down = tune_gemm(uk, e, *dims["down"], top_k, dtype, force=False)
        torch.cuda.empty_cache()  # (as unsloth_zoo does after its tuning)
        uk.configs[key] = (up, down, "; ".join(w for w in (w_up, w_down) if w))
    return uk.configs[key]


def plain_config(c) -> dict | str:
    """One Unsloth kernel config as plain data (its dataclass fields; what Unsloth's disk cache stores)."""
    if not dataclasses.is_dataclass(c):
        return repr(c)
    simple = (bool, int, float, str, type(None))
    return {k: v if isinstance(v, simple) else str(v) for k, v in dataclasses.asdict(c).items()}


def config_objects(uk: Unsloth, fwd: dict, dx: dict, dw: dict) -> tuple:
    """(forward, dX, dW) configs rebuilt from plain data, as Unsloth's cache loader rebuilds them."""
    return tuple(t(**d) for t, d in zip(uk.config_types, (fwd, dx, dw)))


def seed_configs(uk: Unsloth, rows: list[dict]) -> int:
    """Put the configs of Unsloth's tuner run (experiments/tune_unsloth.py's rows: model-independent keys
    e, h, i, top_k, dtype, and per GEMM its three configs) in place for layer_configs; returns how many
    layer shapes got both GEMMs."""
    by: dict = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        dims = (int(r[c]) for c in ("experts", "hidden", "intermediate", "top_k"))
        key = (*dims, DTYPES[r["dtype"]])
        cfg = config_objects(uk, *(json.loads(r[c]) for c in ("fwd", "dX", "dW")))
        by.setdefault(key, {})[r["gemm"]] = (cfg, r.get("tuner_warnings") or "")
    n = 0
    for key, gemms in by.items():
        if {"gate_up", "down"} <= set(gemms):
            warned = "; ".join(w for _, w in (gemms["gate_up"], gemms["down"]) if isinstance(w, str) and w)
            uk.configs[key] = (gemms["gate_up"][0], gemms["down"][0], warned)
            n += 1
    return n


def describe(configs: tuple) -> dict:
    """The tuned configs of layer_configs as plain data, for the row's config column."""

    up, down, warned = configs
    names = ("fwd", "dX", "dW")
    out = {f"gate_up.{n}": plain_config(c) for n, c in zip(names, up)}
    out.update({f"down.{n}": plain_config(c) for n, c in zip(names, down)})
    if warned:
        out["tuner_warnings"] = warned
    return out


def routing(ids: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows per expert, int32; the rows in expert order): unsloth_zoo's routing, a bincount of the expert
    ids and their stable argsort."""
    flat = ids.reshape(-1)
    return torch.bincount(flat, minlength=e).to(torch.int32), flat.argsort(stable=True)


def moe_layer(
    uk: Unsloth,
    x: torch.Tensor,
    ids: torch.Tensor,
    wts: torch.Tensor,
    w_gu: torch.Tensor,
    w_dn: torch.Tensor,
    record: dict | None = None,
) -> torch.Tensor:
    """[T, H]: the expert FFN on Unsloth's kernels as its training path runs them (w_gu [E, 2I, H], w_dn
    [E, H, I], as nn.Linear stores them; ids [T, top_k]; wts [T, top_k]); differentiable in x, wts, w_gu
    and w_dn. The first call of a layer shape runs Unsloth's tuner (layer_configs); ``record``, where given,
    receives the configs used (describe)."""
    t, h = x.shape
    top_k = ids.shape[1]
    e, two_i, _ = w_gu.shape
    i = two_i // 2
    configs = layer_configs(uk, e, h, i, top_k, x.dtype)
    if record is not None and not record:
        record.update(describe(configs))
    (fwd1, dx1, dw1), (fwd2, dx2, dw2), _ = configs
    counts, gather = routing(ids, e)
    y = uk.grouped_gemm(
        X=x,
        W=w_gu,
        m_sizes=counts,
        gather_indices=gather,
        topk=top_k,
        permute_x=True,
        permute_y=False,
        autotune=False,
        kernel_config_fwd=fwd1,
        kernel_config_bwd_dX=dx1,
        kernel_config_bwd_dW=dw1,
        is_first_gemm=True,
    )
    act = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    y = uk.grouped_gemm(
        X=act,
        W=w_dn,
        m_sizes=counts,
        gather_indices=gather,
        topk=top_k,
        permute_x=False,
        permute_y=True,
        autotune=False,
        kernel_config_fwd=fwd2,
        kernel_config_bwd_dX=dx2,
        kernel_config_bwd_dW=dw2,
        is_first_gemm=False,
    )
    return (y.view(t, top_k, h) * wts[..., None].to(y.dtype)).sum(1).to(x.dtype)
