"""Where kernels run: the Triton interpreter on CPU, or a CUDA device.

Triton decides at ``@triton.jit`` decoration time whether a kernel is interpreted, from the environment
variable ``TRITON_INTERPRET``. We read it once, at import, the same way, so that the launchers agree with
the kernels they launch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_here(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``t``: on a GPU, or anywhere under Triton's interpreter."""
    return t.device.type == "cuda" or INTERPRET


# The SM count used by heuristics when no GPU is present (the H100/H200 have 132).
DEFAULT_SM_COUNT = 132


def records_grad(*tensors) -> bool:
    """Whether autograd records a gradient through any of ``tensors``: grad mode on and one of them (a tensor)
    requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # (a loop, not any() over a generator: this runs on every call of every op)
        if getattr(t, "requires_grad", False):
            return True
    return False


def check_device(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` lives where our kernels can run."""
    if t.device.type == "cuda":
        if INTERPRET:
            raise ValueError(f"{name}: CUDA tensor given but TRITON_INTERPRET=1 runs kernels on the CPU")
        return
    if t.device.type == "cpu":
        if not INTERPRET:
            raise ValueError(
                f"{name}: CPU tensor given; kernels need a CUDA tensor, or the Triton interpreter "
                "(set TRITON_INTERPRET=1 before importing moegemm)"
            )
        return
    raise ValueError(
        f"{name}: unsupported device {t.device}; expected a CUDA tensor, or a CPU tensor under Triton's "
        "interpreter (TRITON_INTERPRET=1)"
    )


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device_index).multi_processor_count


DEFAULT_SMEM_PER_SM = 228 * 1024  # Hopper (H100/H200); used without a GPU (the interpreter)


@functools.lru_cache(maxsize=None)
def smem_per_sm(device_index: int | None) -> int:
    """Shared memory per multiprocessor in bytes (feature-detected: older torch lacks the property)."""
    if device_index is None or not torch.cuda.is_available():
        return DEFAULT_SMEM_PER_SM
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_multiprocessor", DEFAULT_SMEM_PER_SM))


def device_smem_per_sm(t: torch.Tensor) -> int:
    return smem_per_sm(t.device.index if t.device.type == "cuda" else None)


@functools.lru_cache(maxsize=None)
def smem_per_block(device_index: int) -> int:
    """The most shared memory one program may take on this device, in bytes (the opt-in limit Triton
    launches against; feature-detected, older torch lacks the property)."""
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return int(optin if optin else smem_per_sm(device_index) - 1024)


def device_smem_per_block(t: torch.Tensor) -> int | None:
    """:func:`smem_per_block` of the CUDA device ``t`` lives on; None for any other tensor (under the
    interpreter: no limit)."""
    if t.device.type != "cuda":
        return None
    return smem_per_block(t.device.index if t.device.index is not None else torch.cuda.current_device())


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_threads(jobs: int) -> int:
    """Threads to compile ``jobs`` Triton kernels from at once (1: one after another): Triton's compiler
    drops the GIL in its MLIR passes and in ptxas, so kernels launched for the first time from a pool of
    threads compile side by side. At most 8 and the usable CPUs; MOEGEMM_COMPILE_THREADS overrides (a
    positive integer; 1 turns it off)."""
    env = os.environ.get("MOEGEMM_COMPILE_THREADS")
    if env:
        try:
            workers = int(env)
        except ValueError:
            workers = 0
        if workers < 1:
            raise ValueError(f"MOEGEMM_COMPILE_THREADS: expected a positive integer, got {env!r}")
    else:
        workers = min(8, usable_cpus())
    return max(1, min(workers, jobs))


def launch_side_by_side(calls: list, workers: int | None = None) -> int:
    """Make each of ``calls`` (no arguments) once from a pool of threads, on the caller's CUDA device and
    stream and each in a copy of the caller's context variables (Triton's allocator lives in one), so that
    the Triton kernels they launch for the first time compile side by side. Errors are swallowed: the
    caller's own calls, made afterwards one at a time, meet them again. ``workers``: the pool's size
    (default :func:`compile_threads`). Returns the threads used (0: none, for fewer than two)."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    workers = compile_threads(len(calls)) if workers is None else min(workers, len(calls))
    if workers <= 1:
        return 0
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream()
    contexts = [contextvars.copy_context() for _ in calls]  # one each: a context is entered by one thread

    def on_caller_stream(call) -> None:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            # a runtime call binds the device's context to this thread (entering the caller's device, when
            # the thread's default is that device already, binds none), so that what the launch asks of the
            # driver directly (a TMA descriptor's encoding) finds one
            stream.query()
            call()

    def one(job) -> None:
        ctx, call = job
        try:
            ctx.run(on_caller_stream, call)
        except Exception:  # noqa: BLE001 - met again by the caller's own call
            pass

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, zip(contexts, calls)))
    return workers


def device_sm_count(t: torch.Tensor) -> int:
    return sm_count(t.device.index if t.device.type == "cuda" else None)


def slugify(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the folder name for a GPU's results and tuning tables)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclasses.dataclass(frozen=True)
class GpuTraits:
    """What decides a kernel's config on a GPU, whatever its name: the architecture (compute capability),
    the multiprocessors, the shared memory one program may take, and the memory's size (between cards of
    one architecture and SM count, the nearest stand-in for its bandwidth that the runtime reports)."""

    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int
    memory_gib: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "GpuTraits":
        return cls(
            capability=tuple(int(v) for v in d["capability"]),
            sm_count=int(d["sm_count"]),
            smem_per_block=int(d["smem_per_block"]),
            memory_gib=float(d.get("memory_gib", 0.0)),
        )

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "capability": list(self.capability)}


# The traits of every GPU this process has met, by slug (moegemm.tuned finds a card's table through them)
_TRAITS: dict[str, GpuTraits] = {}


def traits_of(slug: str) -> GpuTraits | None:
    """The traits of the GPU named ``slug``, if this process has met it (or registered it)."""
    return _TRAITS.get(slug)


def register_traits(slug: str, traits: GpuTraits) -> None:
    """Make ``slug`` known as a GPU with ``traits`` (what meeting such a device does; tests simulate a card
    with it)."""
    _TRAITS[slug] = traits


def device_traits(device_index: int) -> GpuTraits:
    props = torch.cuda.get_device_properties(device_index)
    return GpuTraits(
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        smem_per_block=smem_per_block(device_index),
        memory_gib=round(props.total_memory / 2**30, 1),
    )


@functools.lru_cache(maxsize=None)
def _gpu_slug(device_index: int) -> str:
    slug = slugify(torch.cuda.get_device_name(device_index))
    _TRAITS.setdefault(slug, device_traits(device_index))
    return slug


def gpu_slug(t: torch.Tensor) -> str:
    """The slug of the GPU a tensor lives on, or 'cpu-interpreter'."""
    if t.device.type == "cuda":
        return _gpu_slug(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return "cpu-interpreter"
