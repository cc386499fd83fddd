"""DeepSeek's DeepGEMM (its grouped FP8 GEMMs) as an E10 contender, built and loaded at run time from its
source; nothing of it is in this repository.

Where it comes from: ``MOEGEMM_DEEPGEMM_SOURCE``, a checkout of deepseek-ai/DeepGEMM with its submodules
(third-party/cutlass and third-party/fmt: ``git clone --recursive``, or ``git submodule update --init``).
Its C++ extension is built as its develop.sh builds it (the CUTLASS and CuTe headers linked into
deep_gemm/include, ``python setup.py build``, the built module linked into deep_gemm/), with this machine's
CUDA toolkit and torch, in a copy under ``~/.cache/moegemm`` (``MOEGEMM_CACHE``) named by its revision, torch,
CUDA and Python, so that the checkout is left as it was and a later run reuses the build. Its kernels are
compiled at their first call by its own JIT (nvcc; its cache in ``DG_JIT_CACHE_DIR``, by default
~/.deep_gemm), inside that contender's setup time. A build or import that fails makes the contender not
runnable, with the reason in its rows.

The calls, as vLLM's and SGLang's DeepGEMM paths make them on Hopper: ``m_grouped_fp8_gemm_nt_contiguous((a,
sfa), (w, sfw), d, layout)`` with each expert's rows padded to ``get_mk_alignment_for_contiguous_layout()``
(the padding rows' layout entries -1), and ``m_grouped_fp8_gemm_nt_masked((a, sfa), (w, sfw), d, masked_m,
expected_m)`` on [E, m_max, K] with m_max a multiple of ``MASKED_M_ALIGN``; activations e4m3 with one fp32
scale per token and 128 channels, laid out MN-major and TMA-aligned by its own
``get_mn_major_tma_aligned_tensor`` before the call; weights [E, N, K] e4m3 with [E, N/128, K/128] fp32
scales (DeepSeek-V3's checkpoint format); bf16 out.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ENV = "MOEGEMM_DEEPGEMM_SOURCE"
NAMES = (
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "get_mk_alignment_for_contiguous_layout",
    "get_mn_major_tma_aligned_tensor",
)
BUILD_TIMEOUT_S = 1800
# m_max of the masked layout is a multiple of this: on sm_90 the masked kernel's row tile is 64 or 128, and it
# stores whole tiles through one 2-D view [E * m_max, N] of d, so a tile that ran past m_max would write over
# the next expert's first rows
MASKED_M_ALIGN = 128
# what a checkout must hold: its sources, and the submodules' headers
NEEDED = (
    "setup.py",
    "csrc/python_api.cpp",
    "deep_gemm/__init__.py",
    "third-party/cutlass/include/cute",
    "third-party/cutlass/include/cutlass",
    "third-party/fmt/include",
)


@dataclasses.dataclass
class DeepGemm:
    module: object  # the imported deep_gemm package
    origin: str  # "DeepGEMM <revision>"


def revision(src: Path) -> str:
    """The first line of the checkout's REVISION file (experiments/fetch_peers.sh writes it), else its commit
    where ``src`` is the top of its own git work tree (not a folder inside another repository's), else a hash
    of its csrc/ and deep_gemm/ Python and C++ files."""
    rev = src / "REVISION"
    if rev.is_file() and rev.read_text().strip():
        return rev.read_text().strip().splitlines()[0]
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == src.resolve():
            return lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    h = hashlib.sha256()
    for f in sorted([*src.glob("csrc/**/*"), *src.glob("deep_gemm/**/*.py")]):
        if f.is_file():
            h.update(str(f.relative_to(src)).encode() + b"\0" + f.read_bytes())
    return "sha256:" + h.hexdigest()[:12]


def unfit(src: Path) -> str | None:
    """Why the folder ``src`` cannot be built (None: it can be tried)."""
    if not src.is_dir():
        return f"{ENV}: no folder at {src}"
    missing = [p for p in NEEDED if not (src / p).exists()]
    if missing:
        return (
            f"{ENV}: {src} lacks {', '.join(missing)} (a checkout with its submodules: git clone --recursive)"
        )
    return None


def _build_dir(src: Path, rev: str) -> Path:
    cache = Path(os.environ.get("MOEGEMM_CACHE", Path.home() / ".cache" / "moegemm"))
    key = f"{rev}|{torch.__version__}|{torch.version.cuda}|{sys.version_info[:2]}"
    return cache / f"deepgemm-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _built(build: Path) -> bool:
    return any((build / "deep_gemm").glob("_C*.so"))


def build(src: Path, build: Path) -> None:
    """Build DeepGEMM's extension in ``build`` as its develop.sh does, from the checkout ``src`` (copied: its
    Python package and build script; linked: its C++ sources and submodules). A RuntimeError with the
    build's last output where it fails."""
    tmp = build.with_name(build.name + f".{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("setup.py", "scripts"):
        if (src / name).is_dir():
            shutil.copytree(src / name, tmp / name)
        elif (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    shutil.copytree(src / "deep_gemm", tmp / "deep_gemm", symlinks=True)
    for name in ("csrc", "third-party"):
        (tmp / name).symlink_to((src / name).resolve())
    for name in ("cutlass", "cute"):
        link = tmp / "deep_gemm" / "include" / name
        if not link.exists():
            link.symlink_to((src / "third-party" / "cutlass" / "include" / name).resolve())
    env = {**os.environ, "DG_USE_LOCAL_VERSION": "0"}
    res = subprocess.run(
        [sys.executable, "setup.py", "build"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    so = sorted((tmp / "build").rglob("_C*.so"))
    if res.returncode != 0 or not so:
        tail = (res.stdout + res.stderr).strip().splitlines()[-6:]
        raise RuntimeError(f"python setup.py build failed (rc {res.returncode}): " + " | ".join(tail))
    shutil.copy2(so[0], tmp / "deep_gemm" / so[0].name)  # (develop.sh links it there)
    shutil.rmtree(build, ignore_errors=True)
    os.replace(tmp, build)


def load(source: str | os.PathLike | None = None) -> tuple[DeepGemm | None, str]:
    """(DeepGEMM, "") built and imported from ``source`` (default: $MOEGEMM_DEEPGEMM_SOURCE), or (None, why
    not): no source named, a checkout without its submodules, no CUDA GPU of sm_90 or sm_100, a build or an
    import that failed. Never raises."""
    source = source if source is not None else os.environ.get(ENV)
    if not source:
        return None, f"no {ENV} (a DeepGEMM checkout with its submodules)"
    src = Path(source)
    why = unfit(src)
    if why:
        return None, why
    if not torch.cuda.is_available():
        return None, "needs a CUDA GPU: its kernels are compiled for sm_90 or sm_100 at their first call"
    cap = torch.cuda.get_device_capability()
    if cap[0] not in (9, 10):
        return None, f"its FP8 kernels run on sm_90 and sm_100; this GPU is sm_{cap[0]}{cap[1]}"
    rev = revision(src)
    out = _build_dir(src, rev)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_name(out.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (the shards of a run share the cache)
            if not _built(out):
                build(src, out)
    except Exception as ex:  # noqa: BLE001 (a peer that cannot be built is recorded, not fatal)
        return None, f"build failed: {type(ex).__name__}: {str(ex)[:400]}"
    loaded = sys.modules.get("deep_gemm")
    if loaded is not None and Path(loaded.__file__).resolve().parent != (out / "deep_gemm").resolve():
        return None, f"a deep_gemm from {Path(loaded.__file__).parent} is already imported"
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    try:
        import deep_gemm  # type: ignore
    except Exception as ex:  # noqa: BLE001
        return None, f"import failed: {type(ex).__name__}: {str(ex)[:400]}"
    missing = [n for n in NAMES if not hasattr(deep_gemm, n)]
    if missing:
        return None, f"DeepGEMM {rev[:12]} lacks {', '.join(missing)}"
    return DeepGemm(deep_gemm, f"DeepGEMM {rev[:12]}"), ""


def contiguous_layout(sizes: list[int], align: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(layout int32 [M_pad]: each padded row's expert, -1 on padding rows; dest int64 [M]: where each
    expert-sorted row goes; M_pad) for experts of ``sizes`` rows, each expert's rows padded to ``align``."""
    padded = [-(-s // align) * align for s in sizes]
    m_pad = sum(padded)
    layout = torch.full((m_pad,), -1, dtype=torch.int32)
    dest = torch.empty(sum(sizes), dtype=torch.int64)
    start = row = 0
    for ex, (s, p) in enumerate(zip(sizes, padded)):
        layout[start : start + s] = ex
        dest[row : row + s] = torch.arange(start, start + s)
        start, row = start + p, row + s
    return layout.to(device), dest.to(device), m_pad


def masked_layout(sizes: list[int], m_max: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(masked_m int32 [E], each expert-sorted row's expert and position, int64) of the [E, m_max, K]
    layout."""
    e = len(sizes)
    expert = torch.repeat_interleave(torch.arange(e), torch.tensor(sizes, dtype=torch.int64))
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    pos = torch.arange(sum(sizes)) - offsets[expert]
    if sizes and max(sizes) > m_max:
        raise ValueError(f"m_max: {m_max} is fewer than the largest expert's {max(sizes)} rows")
    return torch.tensor(sizes, dtype=torch.int32, device=device), expert.to(device), pos.to(device)
