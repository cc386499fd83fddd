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

Flags as vLLM 0.33's ``invoke_fused_moe_triton_kernel`` sets them (``vllm_flags``): ``SWAP_AB`` only for
fp8 w8a8 weights (``enable_swap_ab``: sm_90, BLOCK_SIZE_M < 64, BLOCK_SIZE_N >= 64), so off for bf16;
``USE_TD`` (tensor-descriptor gather) off unless ``VLLM_TRITON_USE_TD`` is set, and by default on XPU only
(``resolve_moe_use_td``), and off for quantized weights; its ``tile::gather4`` needs sm_100, so it cannot run
on Hopper at all. Block-FP8 weights (E10; experiments/vllm_fp8.py): ``use_fp8_w8a8`` on, the scales'
``group_n`` and ``group_k`` 128, BLOCK_SIZE_K at most 128, and vLLM's ``fp8_utils.py`` read from the same
source (``VllmKernel.fp8_utils``) for its activation quantisation.

The whole layer as vLLM's ``fused_experts`` runs it (``layer``): the expert assignment
(``moe_align_block_size``, a CUDA op of vLLM's, here ``AlignTriton``: two Triton kernels of ours doing the
same, since vLLM's compiled ops do not load beside our torch and vLLM has no Triton or torch fallback for it;
on the naive path, one fill),
gate/up with the rows gathered inside the kernel, ``silu_and_mul`` (vLLM's CUDA op; here our one-kernel
Triton ``moegemm.grouped.pointwise.silu_mul``), down with the routing weights applied inside the kernel
(``MUL_ROUTED_WEIGHT``), and ``moe_sum`` (vLLM's CUDA op; here ``moe_sum``, one Triton kernel of ours).
``GLUE`` names these stand-ins for the result rows.
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
import triton
import triton.language as tl

from moegemm.grouped.routing import row_positions

KERNEL = "fused_moe_kernel"
HELPERS = ("write_zeros_to_output",)  # @triton.jit functions the kernel calls
MODULE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
FP8_UTILS = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"  # its block-FP8 activation quant
CONFIGS = "vllm/model_executor/layers/fused_moe/configs/"
# the kernel arguments this contender passes (by name); a vLLM whose kernel lacks one is refused clearly
ARGS = (
    "a_ptr",
    "b_ptr",
    "c_ptr",
    "b_bias_ptr",
    "a_scale_ptr",
    "b_scale_ptr",
    "topk_weights_ptr",
    "sorted_token_ids_ptr",
    "expert_ids_ptr",
    "num_tokens_post_padded_ptr",
    "N",
    "K",
    "EM",
    "num_valid_tokens",
    "stride_am",
    "stride_ak",
    "stride_be",
    "stride_bk",
    "stride_bn",
    "stride_cm",
    "stride_cn",
    "naive_block_assignment",
    "BLOCK_SIZE_M",
    "BLOCK_SIZE_N",
    "BLOCK_SIZE_K",
    "GROUP_SIZE_M",
    "MUL_ROUTED_WEIGHT",
    "top_k",
    "compute_type",
)
# what stands in for vLLM's CUDA ops around its kernel (they do not load beside our torch): named in the rows
GLUE = (
    "align: align_triton (2 Triton kernels); silu_and_mul: moegemm silu_mul (1 Triton kernel); "
    "moe_sum: moe_sum (1 Triton kernel)"
)


@dataclasses.dataclass
class VllmKernel:
    kernel: object  # the triton JITFunction
    # "vllm <version> (installed)", the wheel's file name, or "[vllm <version> ]fused_moe.py sha256:<hex>"
    origin: str
    configs: dict  # json file name -> {tokens: config}
    default_config: object | None  # vLLM's get_default_config, or None where it could not be read
    fp8_utils: str | None = None  # the text of vLLM's fp8_utils.py from the same source, where it has one


def _segments(source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The source text (decorators included) of the top-level functions ``names`` in ``source``."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = "".join(lines[first - 1 : node.end_lineno])
    return out


def _cache_dir() -> Path:
    return Path(os.environ.get("MOEGEMM_CACHE", Path.home() / ".cache" / "moegemm"))


def kernel_module(
    source: str, origin: str, names: tuple[str, ...] = (*HELPERS, KERNEL), stem="vllm_fused_moe"
):
    """A module holding the top-level functions ``names`` of vLLM's source text ``source`` (by default
    fused_moe.py's kernel and its helpers), written under the cache dir as ``<stem>_<hash>.py`` (Triton reads
    a kernel's source from its file)."""
    seg = _segments(source, names)
    missing = [n for n in names if n not in seg]
    if missing:
        raise ValueError(f"MOEGEMM_VLLM_SOURCE: {origin} has no top-level {', '.join(missing)}")
    text = (
        f"# Read at run time from {origin} (vLLM, Apache-2.0); not part of moegemm.\n"
        "import triton\nimport triton.language as tl\n\n\n" + "\n\n".join(seg[n] for n in names)
    )
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = _cache_dir() / f"{stem}_{digest}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    name = f"moegemm_{stem}_{digest}"
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

    ns = {
        "envs": _Envs,
        "current_platform": _Platform,
        "torch": torch,
        "next_power_of_2": lambda n: 1 << max(int(n) - 1, 0).bit_length(),
    }
    exec(compile(seg["get_default_config"], "<vllm get_default_config>", "exec"), ns)
    return ns["get_default_config"]


def _check_args(kernel, origin: str) -> None:
    names = set(getattr(kernel, "arg_names", ()))
    missing = [a for a in ARGS if a not in names]
    if missing:
        raise ValueError(
            f"vLLM kernel from {origin}: its {KERNEL} has no argument(s) {', '.join(missing)}; "
            "this contender was written against vLLM 0.33's signature"
        )


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
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Constant)
                    and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
                ):
                    return str(node.value.value)
    return None


def load(source: str | os.PathLike | None = None) -> VllmKernel | None:
    """vLLM's kernel from an installed vllm, else from ``source`` (default: $MOEGEMM_VLLM_SOURCE), else
    None."""
    if source is None:
        try:
            from vllm.model_executor.layers.fused_moe import fused_moe as fm  # type: ignore
        except Exception:  # not installed, or not importable here (its compiled ops, its torch pin)
            fm = None
        if fm is not None:
            import vllm  # type: ignore

            text = Path(fm.__file__).read_text()
            vk = VllmKernel(
                fm.fused_moe_kernel,
                f"vllm {vllm.__version__} (installed)",
                _tables(Path(fm.__file__).parent / "configs"),
                default_config_fn(text),
                _read(Path(fm.__file__).parents[1] / "quantization" / "utils" / "fp8_utils.py"),
            )
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
            fp8 = z.read(FP8_UTILS).decode() if FP8_UTILS in z.namelist() else None
            for name in z.namelist():
                if name.startswith(CONFIGS) and name.endswith(".json"):
                    configs[name[len(CONFIGS) :]] = json.loads(z.read(name))
        origin = path.name
    else:  # a fused_moe.py (its tuned tables beside it, in configs/), named by its content's hash
        text = path.read_text()
        configs = _tables(path.parent / "configs")
        fp8 = _read(path.parent.parent / "quantization" / "utils" / "fp8_utils.py")
        version = tree_version(path)
        origin = (
            f"vllm {version} " if version else ""
        ) + f"{path.name} sha256:{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    mod = kernel_module(text, origin)
    vk = VllmKernel(getattr(mod, KERNEL), origin, configs, default_config_fn(text), fp8)
    _check_args(vk.kernel, vk.origin)
    return vk


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def device_file_name(gpu_name: str) -> str:
    """The device part of vLLM's tuned-config file names: spaces as underscores, any H200 as NVIDIA_H200."""
    name = gpu_name.replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def own_choice(
    vk: VllmKernel,
    gpu_name: str,
    e: int,
    inter: int,
    hidden: int,
    n: int,
    top_k: int,
    tokens: int,
    dtype: str | None = None,
    block_shape: list[int] | None = None,
) -> tuple[dict, str] | None:
    """(config, source) vLLM itself would take for a layer of ``e`` experts, intermediate size ``inter`` and
    hidden size ``hidden`` at ``tokens`` tokens (one config for both projections, as vLLM takes it), with
    bf16 weights, or with ``dtype="fp8_w8a8"`` and ``block_shape=[128, 128]`` block-FP8 ones: its tuned
    table's entry nearest ``tokens``, else its default config."""
    suffix = (f",dtype={dtype}" if dtype else "") + (
        f",block_shape={list(block_shape)}".replace(" ", "") if block_shape else ""
    )
    table = vk.configs.get(f"E={e},N={inter},device_name={device_file_name(gpu_name)}{suffix}.json")
    if table:
        entries = {int(key): val for key, val in table.items() if key.isdigit()}
        if entries:
            near = min(entries, key=lambda m: abs(m - tokens))
            return dict(entries[near]), f"vllm-table(E={e},N={inter}{suffix},M={near})"
    if vk.default_config is not None:
        return dict(vk.default_config(tokens, e, inter, hidden, top_k, dtype, block_shape)), "vllm-default"
    return None


def candidates(mean_rows: float, block_k: int | None = None) -> list[dict]:
    """Our light search over vLLM's kernel (added to its own choice): by regime of the mean rows per expert,
    the tile shapes one would try first on Hopper; stages that fit the shared memory. ``block_k``:
    BLOCK_SIZE_K capped at it (block-FP8 weights: 128, as vLLM caps it at the scale block), repeats
    dropped."""
    if mean_rows <= 16:
        raw = [(16, bn, bk, 4, st, 1) for bn in (64, 128) for bk in (128, 256) for st in (3, 4)]
    elif mean_rows <= 64:
        raw = [
            (32, 64, 128, 4, 3, 1),
            (32, 128, 128, 4, 3, 1),
            (64, 64, 64, 4, 4, 1),
            (64, 128, 64, 4, 4, 1),
            (64, 128, 128, 4, 3, 1),
        ]
    else:
        raw = [
            (64, 128, 64, 4, 4, 16),
            (64, 256, 64, 8, 3, 16),
            (128, 128, 64, 4, 3, 16),
            (128, 128, 64, 8, 4, 16),
            (128, 256, 64, 8, 3, 16),
            (128, 256, 64, 8, 4, 16),
        ]
    if block_k:
        raw = list(dict.fromkeys((bm, bn, min(bk, block_k), w, st, gm) for bm, bn, bk, w, st, gm in raw))
    return [
        {
            "BLOCK_SIZE_M": bm,
            "BLOCK_SIZE_N": bn,
            "BLOCK_SIZE_K": bk,
            "GROUP_SIZE_M": gm,
            "num_warps": w,
            "num_stages": st,
        }
        for bm, bn, bk, w, st, gm in raw
        if (bm * bk + bk * bn) * 2 * st <= 200 * 1024
    ]


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


def vllm_flags(
    names, dtype: torch.dtype, capability: tuple[int, int], fp8_tile: tuple[int, int] | None = None
) -> tuple[dict, str]:
    """(the kernel's flag arguments, why) as vLLM 0.33's invoke_fused_moe_triton_kernel sets them for
    unquantized weights with ``dtype`` activations on a GPU of ``capability``: every quantization flag and
    HAS_BIAS off; SWAP_AB only for fp8 w8a8 (enable_swap_ab); USE_TD off (resolve_moe_use_td: opt-in, by
    default XPU only; its gather needs sm_100). ``fp8_tile`` (BLOCK_SIZE_M, BLOCK_SIZE_N): block-FP8 weights
    (``dtype`` is then the output's): use_fp8_w8a8 on, SWAP_AB as enable_swap_ab sets it (sm_90,
    BLOCK_SIZE_M < 64, BLOCK_SIZE_N >= 64), USE_TD off (vLLM keeps it off for quantized weights). Flags the
    kernel at hand lacks are left out."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype: vLLM's unquantized path takes bf16, fp16 or fp32, got {dtype}")
    if fp8_tile is not None:
        swap = capability == (9, 0) and fp8_tile[0] < 64 and fp8_tile[1] >= 64
        flags = {
            f: False for f in ("use_int8_w8a8", "use_int8_w8a16", "per_channel_quant", "HAS_BIAS", "USE_TD")
        }
        flags.update(use_fp8_w8a8=True, SWAP_AB=swap)
        why = (
            f"use_fp8_w8a8=1 (block [128, 128]); SWAP_AB={int(swap)} (enable_swap_ab: sm_90, "
            f"BLOCK_SIZE_M < 64, BLOCK_SIZE_N >= 64; this GPU is sm_{capability[0]}{capability[1]}); "
            "USE_TD=0 (off for quantized weights)"
        )
        return {f: v for f, v in flags.items() if f in names}, why
    flags = {
        f: False
        for f in (
            "use_fp8_w8a8",
            "use_int8_w8a8",
            "use_int8_w8a16",
            "per_channel_quant",
            "HAS_BIAS",
            "SWAP_AB",
            "USE_TD",
        )
        if f in names
    }
    why = (
        "SWAP_AB=0 (vLLM swaps A/B for fp8 w8a8 only); USE_TD=0 (vLLM's default off CUDA-XPU; "
        f"its tile::gather4 needs sm_100, this GPU is sm_{capability[0]}{capability[1]})"
    )
    return flags, why


@triton.jit
def _align_offsets_kernel(
    ids_ptr,
    offs_ptr,
    cursor_ptr,
    expert_ids_ptr,
    post_ptr,
    sorted_ptr,
    SLOTS,
    E,
    LENGTH,
    TILES,
    BM: tl.constexpr,
    EB: tl.constexpr,
    CHUNK: tl.constexpr,
    TCHUNK: tl.constexpr,
):
    """One program: each expert's slot count, padded to BM; the padded lists' starts (offs), their total
    (post), each row tile's expert, the row-id list filled with SLOTS (the kernel masks it), cursors
    zeroed."""
    ex = tl.arange(0, EB)
    counts = tl.zeros((EB,), dtype=tl.int32)
    for start in range(0, SLOTS, CHUNK):
        o = start + tl.arange(0, CHUNK)
        live = o < SLOTS
        e = tl.load(ids_ptr + o, mask=live, other=0).to(tl.int32)
        counts += tl.histogram(e, EB, mask=live)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    tl.store(offs_ptr + ex, ends - padded, mask=ex < E)
    tl.store(cursor_ptr + ex, tl.zeros((EB,), dtype=tl.int32), mask=ex < E)
    total = tl.sum(padded, 0)
    tl.store(post_ptr, total)
    tile_ends = tl.where(ex < E, ends // BM, 2147483647)
    for start in range(0, TILES, TCHUNK):
        j = start + tl.arange(0, TCHUNK)
        owner = tl.sum((tile_ends[None, :] <= j[:, None]).to(tl.int32), 1)
        tl.store(expert_ids_ptr + j, tl.minimum(owner, E - 1), mask=j < TILES)
    for start in range(0, LENGTH, CHUNK):
        o = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + o, tl.full((CHUNK,), 0, tl.int32) + SLOTS, mask=o < LENGTH)


@triton.jit
def _align_place_kernel(ids_ptr, offs_ptr, cursor_ptr, sorted_ptr, SLOTS, CHUNK: tl.constexpr):
    """Each slot's id into its expert's padded list, at the next free place (order within an expert is
    arbitrary, as in vLLM's op)."""
    o = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    live = o < SLOTS
    e = tl.load(ids_ptr + o, mask=live, other=0)
    place = tl.atomic_add(cursor_ptr + e, tl.full((CHUNK,), 1, tl.int32), mask=live)
    tl.store(sorted_ptr + tl.load(offs_ptr + e, mask=live, other=0) + place, o.to(tl.int32), mask=live)


class AlignTriton:
    """vLLM's moe_align_block_size as two Triton kernels, into buffers made once (sync-free, capturable):
    ``__call__(topk_ids)`` -> (row ids [L], expert per row tile, rows after padding [1]), sized as vLLM sizes
    them (L = slots + E (bm - 1), at most slots x bm where the slots are fewer than the experts)."""

    def __init__(self, slots: int, e: int, bm: int, device):
        if slots < 1 or e < 1 or bm < 1:
            raise ValueError(f"slots, e, bm: need >= 1, got {slots}, {e}, {bm}")
        length = slots + e * (bm - 1)
        if slots < e:
            length = min(length, slots * bm)
        self.slots, self.e, self.bm, self.length = slots, e, bm, length
        self.tiles = -(-length // bm)
        self.ids = torch.empty(length, dtype=torch.int32, device=device)
        self.expert_ids = torch.empty(self.tiles, dtype=torch.int32, device=device)
        self.post = torch.empty(1, dtype=torch.int32, device=device)
        self.offs = torch.empty(e, dtype=torch.int32, device=device)
        self.cursor = torch.empty(e, dtype=torch.int32, device=device)

    def __call__(self, topk_ids: torch.Tensor):
        flat = topk_ids.reshape(-1)
        if flat.numel() != self.slots:
            raise ValueError(f"topk_ids: expected {self.slots} slots, got {flat.numel()}")
        eb = triton.next_power_of_2(self.e)
        _align_offsets_kernel[(1,)](
            flat,
            self.offs,
            self.cursor,
            self.expert_ids,
            self.post,
            self.ids,
            self.slots,
            self.e,
            self.length,
            self.tiles,
            BM=self.bm,
            EB=eb,
            CHUNK=1024,
            TCHUNK=max(16, 8192 // eb),
            num_warps=8,
        )
        _align_place_kernel[(triton.cdiv(self.slots, 1024),)](
            flat, self.offs, self.cursor, self.ids, self.slots, CHUNK=1024
        )
        return self.ids, self.expert_ids, self.post


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, block] = sum_j y[t, j, block], in fp32, rounded once (vLLM's moe_sum)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, N]: the sum over k of y [T, top_k, N] (contiguous), one Triton kernel, as vLLM's moe_sum op."""
    if y.ndim != 3 or not y.is_contiguous():
        raise ValueError(f"y: expected a contiguous [T, top_k, N] tensor, got shape {tuple(y.shape)}")
    t, k, n = y.shape
    out = torch.empty(t, n, dtype=y.dtype, device=y.device) if out is None else out
    if t and n:
        block = min(triton.next_power_of_2(n), 1024)
        _moe_sum_kernel[(t, triton.cdiv(n, block))](
            y, out, n, TOP_K=k, BLOCK=block, num_warps=4 if block >= 512 else 2
        )
    return out


def _split_config(config: dict):
    cfg = dict(config)
    bm, bn, bk = cfg.pop("BLOCK_SIZE_M"), cfg.pop("BLOCK_SIZE_N"), cfg.pop("BLOCK_SIZE_K")
    gm, warps, stages = cfg.pop("GROUP_SIZE_M"), cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    cfg.pop("SPLIT_K", None)
    if cfg:
        raise ValueError(f"config: keys {sorted(cfg)} are not ones this contender passes on")
    return bm, bn, bk, gm, warps, stages


def kernel_call(
    vk: VllmKernel,
    a,
    w,
    y,
    topk_weights,
    assign,
    n: int,
    slots: int,
    top_k: int,
    config: dict,
    naive: bool,
    capability: tuple[int, int] = (9, 0),
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One launch of vLLM's kernel as invoke_fused_moe_triton_kernel makes it: y [slots, N] (row s: slot s)
    from a [rows, K] (read at row id // top_k) and w [E, N, K]; ``assign`` = (row ids or None on the naive
    path, expert per row tile, rows after padding); ``topk_weights`` [slots] fp32 or None: applied inside
    (MUL_ROUTED_WEIGHT). ``scales`` (a_scale [rows, K/128], w_scale [E, N/128, K/128], fp32): a and w are
    e4m3 with block [128, 128] scales (its block-FP8 path; y's dtype is the compute type)."""
    bm, bn, bk, gm, warps, stages = _split_config(config)
    ids, expert_ids, post = assign
    if naive:
        em = slots * bm
    else:
        em = ids.numel()
        if a.shape[0] < bm:  # vLLM's bound on the row tiles launched for a small batch
            em = min(em, a.shape[0] * top_k * bm)
    compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[y.dtype]
    names = set(vk.kernel.arg_names)
    flags, _ = vllm_flags(names, y.dtype, capability, (bm, bn) if scales is not None else None)
    zeros = {
        s: 0
        for s in (
            "stride_asm",
            "stride_ask",
            "stride_bse",
            "stride_bsk",
            "stride_bsn",
            "stride_bbe",
            "stride_bbn",
            "group_n",
            "group_k",
        )
        if s in names
    }
    if "SPLIT_K" in names:
        zeros["SPLIT_K"] = 1
    a_scale = w_scale = None
    if scales is not None:
        a_scale, w_scale = scales
        bk = min(bk, 128)  # as vLLM caps it at the scale block
        zeros.update(
            stride_asm=a_scale.stride(0),
            stride_ask=a_scale.stride(1),
            stride_bse=w_scale.stride(0),
            stride_bsk=w_scale.stride(2),
            stride_bsn=w_scale.stride(1),
            group_n=128,
            group_k=128,
        )
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    vk.kernel[grid](
        a,
        w,
        y,
        None,
        a_scale,
        w_scale,
        topk_weights,
        ids,
        expert_ids,
        post,
        n,
        a.shape[1],
        em,
        slots,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_be=w.stride(0),
        stride_bk=w.stride(2),
        stride_bn=w.stride(1),
        stride_cm=y.stride(0),
        stride_cn=y.stride(1),
        **zeros,
        naive_block_assignment=naive,
        BLOCK_SIZE_M=bm,
        BLOCK_SIZE_N=bn,
        BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=gm,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        top_k=top_k,
        compute_type=compute,
        **flags,
        num_warps=warps,
        num_stages=stages,
    )


def capability_of(t: torch.Tensor) -> tuple[int, int]:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else (9, 0)


def launcher(
    vk: VllmKernel,
    a: torch.Tensor,
    top_k: int,
    plan,
    topk_ids: torch.Tensor,
    n: int,
    config: dict,
    naive: bool,
):
    """bind(w) -> a call of vLLM's kernel with ``config`` writing y [slots, N] (row s: slot s) for weights
    w [E, N, K] and the slots of ``plan`` (a RoutingPlan of ``topk_ids``); ``a`` [rows, K] is read at row
    id // top_k (gate/up: a holds the tokens and top_k is the model's; down: a holds the slots and top_k is
    1). ``naive``: one row tile per slot (see naive_assignment; vLLM decides it once per layer, for both
    projections). The row-id lists are made here, before timing (E7 times the GEMM alone)."""
    bm = _split_config(config)[0]  # refuses keys this contender does not pass on
    slots = plan.sorted_slot.numel()
    if naive:  # vLLM's naive path: slot s is row tile s, of expert topk_ids.flat[s]
        assign = (
            None,
            topk_ids.reshape(-1).to(torch.int32),
            torch.full((1,), slots * bm, dtype=torch.int32, device=a.device),
        )
    else:
        assign = align(plan, bm)
    cap = capability_of(a)

    def bind(w: torch.Tensor):
        y = torch.empty(slots, n, dtype=a.dtype, device=a.device)

        def call():
            kernel_call(vk, a, w, y, None, assign, n, slots, top_k, config, naive, cap)
            return y

        return call

    return bind


def layer_assignment(naive: bool, aligner, ids32: torch.Tensor, slots: int, bm: int) -> tuple:
    """The layer's (row ids, expert ids, rows after padding) for one call, made inside the timed call as
    vLLM's fused_experts makes them: on the naive path slot s is row tile s (of expert ids32.flat[s]),
    else ``aligner``'s grouping of the slots by expert (moe_align_block_size's stand-in)."""
    if naive:
        post = torch.full((1,), slots * bm, dtype=torch.int32, device=ids32.device)
        return None, ids32.view(-1), post
    return aligner(ids32)


def layer(
    vk: VllmKernel, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, e: int, config: dict
):
    """bind(w_gu [E, 2I, H], w_dn [E, H, I]) -> a call of the whole expert FFN as vLLM's fused_experts runs it
    for bf16 (one config for both GEMMs; see the module's docstring for the glue kernels), returning [T, H].
    The expert assignment is made inside the call, as vLLM makes it per forward."""
    t, top_k = topk_ids.shape
    slots = t * top_k
    naive = naive_assignment(t, top_k, e)
    bm = _split_config(config)[0]
    ids32 = topk_ids.to(torch.int32)  # as vLLM's routers give them
    w_flat = topk_weights.reshape(-1).float().contiguous()
    aligner = None if naive else AlignTriton(slots, e, bm, x.device)
    cap = capability_of(x)

    def bind(w_gu: torch.Tensor, w_dn: torch.Tensor):
        from moegemm.grouped.pointwise import silu_mul

        two_i, h = w_gu.shape[1], w_dn.shape[1]
        y1 = torch.empty(slots, two_i, dtype=x.dtype, device=x.device)
        y2 = torch.empty(t, top_k, h, dtype=x.dtype, device=x.device)

        def call():
            assign = layer_assignment(naive, aligner, ids32, slots, bm)
            kernel_call(vk, x, w_gu, y1, None, assign, two_i, slots, top_k, config, naive, cap)
            act = silu_mul(y1)
            kernel_call(vk, act, w_dn, y2.view(slots, h), w_flat, assign, h, slots, 1, config, naive, cap)
            return moe_sum(y2)

        return call

    return bind
