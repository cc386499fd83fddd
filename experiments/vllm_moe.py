"""vLLM's fused-MoE Triton kernel as an E7 contender, where vLLM's source is at hand (optional).

The kernel is vLLM's own ``fused_moe_kernel``, called the way vLLM calls it for unquantized bf16 weights
laid out [E, N, K]: it gathers its rows through a list of row ids grouped by expert, each expert's list
padded to a multiple of the tile height (BLOCK_SIZE_M), and one expert id per row tile; rows come from
the tokens' activations (gate/up: row id // top_k) and results go to the rows' (token, k) slots. Where
the (token, k) slots are at most a quarter of the experts, vLLM skips the grouping and gives every slot a
row tile of its own (``naive_block_assignment``); this contender does the same.

Where the kernel comes from, in this order:

1. an installed ``vllm`` (``vllm.model_executor.layers.fused_moe.fused_moe``);
2. else ``MOEGEMM_VLLM_SOURCE``: the path of a vLLM wheel (``.whl``) or of its ``fused_moe.py`` (named
   by its hash, and by the version of the unpacked tree it sits in, if any). The
   kernel and the ``@triton.jit`` helper it calls are read out of that file (``ast``) into a module of their
   own under ``~/.cache/moegemm`` (``MOEGEMM_CACHE``), so that vLLM's other imports (its compiled ops, its
   config system) are not needed; its tuned configs (``fused_moe/configs/*.json``) are read from the same
   wheel or folder.

Nothing of vLLM is in this repository. The row-id lists are built here, with torch ops, from our routing
plan (vLLM builds them with a CUDA op of its own, ``moe_align_block_size``); they are made before timing,
as our kernel's group offsets are.

Tile configs: vLLM's own choice (its tuned table for this GPU, E and the intermediate size, at the entry
nearest the token count, else its ``get_default_config``, read from the same source) and a light search
of our own (``candidates``), timed on the tuner's inputs (not E7's); the fastest is E7's contender.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import zipfile
from pathlib import Path

import torch

from moegemm.grouped.routing import row_positions

KERNEL = "fused_moe_kernel"
HELPERS = ("write_zeros_to_output",)  # @triton.jit functions the kernel calls
MODULE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
CONFIGS = "vllm/model_executor/layers/fused_moe/configs/"
# the kernel arguments this contender passes (by name); a vLLM whose kernel lacks one is refused clearly
ARGS = ("a_ptr", "b_ptr", "c_ptr", "b_bias_ptr", "a_scale_ptr", "b_scale_ptr", "topk_weights_ptr",
        "sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr", "N", "K", "EM",
        "num_valid_tokens", "stride_am", "stride_ak", "stride_be", "stride_bk", "stride_bn", "stride_cm",
        "stride_cn", "naive_block_assignment", "BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
        "MUL_ROUTED_WEIGHT", "top_k", "compute_type")


@dataclasses.dataclass
class VllmKernel:
    kernel: object  # the triton JITFunction
    origin: str  # "vllm <version> (installed)", the wheel's file name, or "[vllm <version> ]fused_moe.py sha256:<hex>"
    configs: dict  # json file name -> {tokens: config}
    default_config: object | None  # vLLM's get_default_config, or None where it could not be read


def _segments(source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The source text (decorators included) of the top-level functions ``names`` in ``source``."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = "".join(lines[first - 1:node.end_lineno])
    return out


def _cache_dir() -> Path:
    return Path(os.environ.get("MOEGEMM_CACHE", Path.home() / ".cache" / "moegemm"))


def kernel_module(source: str, origin: str):
    """A module holding vLLM's kernel and its helpers read out of ``source`` (the text of fused_moe.py),
    written under the cache dir (Triton reads a kernel's source from its file)."""
    seg = _segments(source, (KERNEL, *HELPERS))
    missing = [n for n in (KERNEL, *HELPERS) if n not in seg]
    if missing:
        raise ValueError(f"MOEGEMM_VLLM_SOURCE: {origin} has no top-level {', '.join(missing)}")
    text = (f"# Read at run time from {origin} (vLLM, Apache-2.0); not part of moegemm.\n"
            "import triton\nimport triton.language as tl\n\n\n"
            + "\n\n".join(seg[n] for n in (*HELPERS, KERNEL)))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = _cache_dir() / f"vllm_fused_moe_{digest}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    name = f"moegemm_vllm_fused_moe_{digest}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def default_config_fn(source: str):
    """vLLM's ``get_default_config`` read out of ``source``, with what it reads of vLLM stood in for: its
    batch-invariant switch off, a CUDA (not ROCm) platform, next_power_of_2. None where it is absent."""
    seg = _segments(source, ("get_default_config",))
    if "get_default_config" not in seg:
        return None

    class _Envs:
        VLLM_BATCH_INVARIANT = False

    class _Platform:
        @staticmethod
        def is_rocm():
            return False

    ns = {"envs": _Envs, "current_platform": _Platform, "torch": torch,
          "next_power_of_2": lambda n: 1 << max(int(n) - 1, 0).bit_length()}
    exec(compile(seg["get_default_config"], "<vllm get_default_config>", "exec"), ns)
    return ns["get_default_config"]


def _check_args(kernel, origin: str) -> None:
    names = set(getattr(kernel, "arg_names", ()))
    missing = [a for a in ARGS if a not in names]
    if missing:
        raise ValueError(f"vLLM kernel from {origin}: its {KERNEL} has no argument(s) {', '.join(missing)}; "
                         "this contender was written against vLLM 0.33's signature")


def _tables(folder: Path) -> dict:
    """vLLM's tuned-config tables in ``folder`` (file name -> its JSON); none where there is no folder."""
    return {p.name: json.loads(p.read_text()) for p in folder.glob("*.json")} if folder.is_dir() else {}


def tree_version(path: Path) -> str | None:
    """The version of the vLLM source tree holding ``path``: ``__version__`` in the nearest enclosing
    ``vllm/_version.py`` (as a wheel unpacks), else None."""
    for parent in path.resolve().parents:
        f = parent / "_version.py"
        if parent.name == "vllm" and f.is_file():
            for node in ast.parse(f.read_text()).body:
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                        and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)):
                    return str(node.value.value)
    return None


def load(source: str | os.PathLike | None = None) -> VllmKernel | None:
    """vLLM's kernel from an installed vllm, else from ``source`` (default: $MOEGEMM_VLLM_SOURCE), else None."""
    if source is None:
        try:
            from vllm.model_executor.layers.fused_moe import fused_moe as fm  # type: ignore
        except Exception:  # not installed, or not importable here (its compiled ops, its torch pin)
            fm = None
        if fm is not None:
            import vllm  # type: ignore

            text = Path(fm.__file__).read_text()
            vk = VllmKernel(fm.fused_moe_kernel, f"vllm {vllm.__version__} (installed)",
                            _tables(Path(fm.__file__).parent / "configs"), default_config_fn(text))
            _check_args(vk.kernel, vk.origin)
            return vk
        source = os.environ.get("MOEGEMM_VLLM_SOURCE")
        if not source:
            return None
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"MOEGEMM_VLLM_SOURCE: no file at {path}")
    configs = {}
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            try:
                text = z.read(MODULE).decode()
            except KeyError:
                raise ValueError(f"MOEGEMM_VLLM_SOURCE: {path.name} holds no {MODULE}") from None
            for name in z.namelist():
                if name.startswith(CONFIGS) and name.endswith(".json"):
                    configs[name[len(CONFIGS):]] = json.loads(z.read(name))
        origin = path.name
    else:  # a fused_moe.py (its tuned tables beside it, in configs/), named by its content's hash
        text = path.read_text()
        configs = _tables(path.parent / "configs")
        version = tree_version(path)
        origin = ((f"vllm {version} " if version else "")
                  + f"{path.name} sha256:{hashlib.sha256(text.encode()).hexdigest()[:12]}")
    mod = kernel_module(text, origin)
    vk = VllmKernel(getattr(mod, KERNEL), origin, configs, default_config_fn(text))
    _check_args(vk.kernel, vk.origin)
    return vk


def device_file_name(gpu_name: str) -> str:
    """The device part of vLLM's tuned-config file names: spaces as underscores, any H200 as NVIDIA_H200."""
    name = gpu_name.replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def own_choice(vk: VllmKernel, gpu_name: str, e: int, inter: int, hidden: int, n: int, top_k: int,
               tokens: int) -> tuple[dict, str] | None:
    """(config, source) vLLM itself would take for a bf16 layer of ``e`` experts, intermediate size ``inter``
    and hidden size ``hidden`` at ``tokens`` tokens (one config for both projections, as vLLM takes it): its
    tuned table's entry nearest ``tokens``, else its default config."""
    table = vk.configs.get(f"E={e},N={inter},device_name={device_file_name(gpu_name)}.json")
    if table:
        entries = {int(key): val for key, val in table.items() if key.isdigit()}
        if entries:
            near = min(entries, key=lambda m: abs(m - tokens))
            return dict(entries[near]), f"vllm-table(E={e},N={inter},M={near})"
    if vk.default_config is not None:
        return dict(vk.default_config(tokens, e, inter, hidden, top_k, None)), "vllm-default"
    return None


def candidates(mean_rows: float) -> list[dict]:
    """Our light search over vLLM's kernel (added to its own choice): by regime of the mean rows per expert,
    the tile shapes one would try first on Hopper; stages that fit the shared memory."""
    if mean_rows <= 16:
        raw = [(16, bn, bk, 4, st, 1) for bn in (64, 128) for bk in (128, 256) for st in (3, 4)]
    elif mean_rows <= 64:
        raw = [(32, 64, 128, 4, 3, 1), (32, 128, 128, 4, 3, 1), (64, 64, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1),
               (64, 128, 128, 4, 3, 1)]
    else:
        raw = [(64, 128, 64, 4, 4, 16), (64, 256, 64, 8, 3, 16), (128, 128, 64, 4, 3, 16), (128, 128, 64, 8, 4, 16),
               (128, 256, 64, 8, 3, 16), (128, 256, 64, 8, 4, 16)]
    return [{"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": gm, "num_warps": w,
             "num_stages": st}
            for bm, bn, bk, w, st, gm in raw if (bm * bk + bk * bn) * 2 * st <= 200 * 1024]


def naive_assignment(tokens: int, top_k: int, e: int) -> bool:
    """vLLM's choice of one row tile per (token, k) slot: the slots are at most a quarter of the experts."""
    return tokens * top_k * 4 <= e


def align(plan, block_m: int):
    """(row ids [L], expert per row tile, rows after padding [1]) for vLLM's kernel: the (token, k) slots
    grouped by expert in the plan's order (a moegemm.grouped RoutingPlan), each expert's list padded to a
    multiple of block_m with the id ``slots`` (past every valid slot: the kernel masks it); L = slots +
    E (block_m - 1), at most slots x block_m where the slots are fewer than the experts, as vLLM sizes it.
    Row tiles past the padded rows exit at once. Made before timing (one host sync, for the tile list's
    length)."""
    e = plan.num_experts
    slots = plan.sorted_slot.numel()
    length = slots + e * (block_m - 1)
    if slots < e:
        length = min(length, slots * block_m)
    dev = plan.sorted_slot.device
    padded = (plan.group_sizes.to(torch.int64) + block_m - 1) // block_m * block_m
    expert, pos = row_positions(plan.group_offsets, slots)  # of every sorted row
    ids = torch.full((length,), slots, dtype=torch.int32, device=dev)
    ids[(torch.cumsum(padded, 0) - padded)[expert] + pos] = plan.sorted_slot.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(e, device=dev), padded // block_m)
    expert_ids = torch.zeros(-(-length // block_m), dtype=torch.int32, device=dev)
    expert_ids[: tile_expert.numel()] = tile_expert.to(torch.int32)
    return ids, expert_ids, torch.sum(padded).to(torch.int32).reshape(1)


def launcher(vk: VllmKernel, a: torch.Tensor, top_k: int, plan, topk_ids: torch.Tensor, n: int, config: dict,
             naive: bool):
    """bind(w) -> a call of vLLM's kernel with ``config`` writing y [slots, N] (row s: slot s) for weights
    w [E, N, K] and the slots of ``plan`` (a RoutingPlan of ``topk_ids``); ``a`` [rows, K] is read at row id // top_k (gate/up: a holds the tokens and top_k is the
    model's; down: a holds the slots and top_k is 1). ``naive``: one row tile per slot (see
    naive_assignment; vLLM decides it once per layer, for both projections)."""
    import triton
    import triton.language as tl

    cfg = dict(config)
    bm, bn, bk = cfg.pop("BLOCK_SIZE_M"), cfg.pop("BLOCK_SIZE_N"), cfg.pop("BLOCK_SIZE_K")
    gm, warps, stages = cfg.pop("GROUP_SIZE_M"), cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    cfg.pop("SPLIT_K", None)
    if cfg:
        raise ValueError(f"config: keys {sorted(cfg)} are not ones this contender passes on")
    slots = plan.sorted_slot.numel()
    if naive:  # vLLM's naive path: slot s is row tile s, of expert topk_ids.flat[s]
        ids, expert_ids = None, topk_ids.reshape(-1).to(torch.int32)
        post = torch.full((1,), slots * bm, dtype=torch.int32, device=a.device)
        em = slots * bm
    else:
        ids, expert_ids, post = align(plan, bm)
        em = ids.numel()
        if a.shape[0] < bm:  # vLLM's bound on the row tiles launched for a small batch
            em = min(em, a.shape[0] * top_k * bm)
    k = a.shape[1]
    compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[a.dtype]
    names = set(vk.kernel.arg_names)
    flags = {f: False for f in ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "per_channel_quant",
                                "HAS_BIAS", "SWAP_AB", "USE_TD") if f in names}
    zeros = {s: 0 for s in ("stride_asm", "stride_ask", "stride_bse", "stride_bsk", "stride_bsn", "stride_bbe",
                            "stride_bbn", "group_n", "group_k") if s in names}
    if "SPLIT_K" in names:
        zeros["SPLIT_K"] = 1
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)

    def bind(w: torch.Tensor):
        y = torch.empty(slots, n, dtype=a.dtype, device=a.device)

        def call():
            vk.kernel[grid](
                a, w, y, None, None, None, None, ids, expert_ids, post, n, k, em, slots,
                stride_am=a.stride(0), stride_ak=a.stride(1), stride_be=w.stride(0), stride_bk=w.stride(2),
                stride_bn=w.stride(1), stride_cm=y.stride(0), stride_cn=y.stride(1), **zeros,
                naive_block_assignment=naive, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
                GROUP_SIZE_M=gm, MUL_ROUTED_WEIGHT=False, top_k=top_k, compute_type=compute, **flags,
                num_warps=warps, num_stages=stages)
            return y
        return call
    return bind
