"""Test setup: without a CUDA GPU every kernel runs under Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before Triton decorates any kernel, i.e. before moegemm is imported, so it
is decided here, at collection start.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):  # the worker processes already share the CPUs: no Inductor compile
    # pool inside each, and the library's side-by-side compiles (moegemm.autotune) on each one's share
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    from moegemm._runtime import usable_cpus  # (after TRITON_INTERPRET is decided, above)

    _share = usable_cpus() // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("MOEGEMM_COMPILE_THREADS", str(max(1, _share)))

ROOT = Path(__file__).resolve().parent
# Tests that run Snakemake: under pytest-xdist (`--dist loadgroup`) all of them go to one worker, in order,
# so that the last one can check what the others left behind in the checkout.
SNAKEMAKE_GROUP = "snakemake"

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which tags the xdist groups
def pytest_collection_modifyitems(config, items):
    check_groups_tagged(config, items)
    stray = [
        it.nodeid
        for it in items
        if "checkout_before" in getattr(it, "fixturenames", ())
        and (
            it.get_closest_marker("xdist_group") is None
            or it.get_closest_marker("xdist_group").args != (SNAKEMAKE_GROUP,)
        )
    ]
    if stray:  # the checkout snapshot runs `snakemake -n` in the checkout: on another worker it would race
        raise pytest.UsageError(
            f"tests that take the checkout snapshot outside xdist group {SNAKEMAKE_GROUP!r}: {stray}"
        )
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    # in a worker, pytest-xdist has set --dist to "no" and kept only whether it was loadgroup
    if getattr(config.option, "loadgroup", False) or config.getoption("dist", "no") in (
        "loadscope",
        "loadfile",
    ):
        long_first(items, workers)
    else:
        spread_long_tests(items, workers)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def check_groups_tagged(config, items):
    """Under `--dist loadgroup` a pytest-xdist worker tags each test of an xdist group by appending
    "@<group>" to its node id, and the controller deals the tests by that tag. Where the pytest release
    ignores the tag (pytest 9.2 builds node ids from a structured id that pytest-xdist 3.8 does not set), the
    Snakemake tests are dealt to any worker, and their `snakemake -n` in the checkout races another's
    snapshot of it: refuse to run rather than fail at random."""
    if not getattr(config.option, "loadgroup", False):
        return
    untagged = [
        it.nodeid for it in items if it.get_closest_marker("xdist_group") is not None and "@" not in it.nodeid
    ]
    if untagged:
        why = (
            f"pytest-xdist's loadgroup did not tag {len(untagged)} xdist_group tests (e.g. {untagged[0]}) "
            f"with pytest {pytest.__version__}: install the pytest that the `test` extra pins"
        )
        print(f"\n{why}", file=sys.__stderr__, flush=True)  # a worker's exit message is not shown
        pytest.exit(why, returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """On a GPU, where pytest-xdist's workers share its memory: a real-shape test (marker ``gpu``) hands what
    PyTorch's allocator cached back to the driver when it ends, so that a worker idle or on small tests does
    not sit on tens of GB; one that holds tens of GB itself (marker ``gpu_memory``) also runs one at a time
    across the workers, under an exclusive lock on a file in the temporary folder (any --dist mode; a group
    would serialise them only under --dist loadgroup)."""
    if not HAS_CUDA or request.node.get_closest_marker("gpu") is None:
        yield
        return
    lock = None
    if request.node.get_closest_marker("gpu_memory") is not None:
        import fcntl
        import tempfile

        lock = open(Path(tempfile.gettempdir()) / "moegemm-gpu-memory.lock", "w")  # noqa: SIM115
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        finally:
            if lock is not None:
                lock.close()  # (releases the lock)


def spread_long_tests(items: list, workers: int) -> None:
    """Under pytest-xdist's work stealing each worker is first dealt a contiguous 1/workers of the
    collection, and the others steal from the end of a worker's queue: long tests in one chunk run one after
    the other, and one deep in a chunk starts late (the S4 runs' verify: the six compile-check shards were all
    dealt to one worker, and five of them and a 75 s test were among the last to finish). So the tests
    marked ``long`` go to the heads of the chunks, one each (every worker collects in the same order, so all
    agree). The tests marked ``gpu_memory`` run one at a time whatever the worker (a lock, _gpu_memory): they
    head the first chunk together, so that one worker runs them in series from the start instead of leaving
    the chain to start late in a chunk, or other workers to wait on the lock. Without xdist: no change."""
    big = [_marked(it, "gpu_memory") for it in items]
    chain = [it for it, b in zip(items, big) if b]
    long_items = [it for it, b in zip(items, big) if not b and "long" in it.keywords]
    if workers < 2 or not (long_items or chain):
        return
    rest = [it for it, b in zip(items, big) if not b and "long" not in it.keywords]
    per = len(items) / workers
    heads = dict(enumerate(chain))
    starts = range(1 if chain else 0, workers)
    spill = long_items[len(starts) :]
    for j, it in zip(starts, long_items):
        pos = max(round(j * per), len(chain))
        while pos in heads:
            pos += 1
        if pos < len(items):
            heads[pos] = it
        else:
            spill.insert(0, it)
    out, r = [], iter(spill + rest)
    for pos in range(len(items)):
        out.append(heads[pos] if pos in heads else next(r))
    items[:] = out


def _marked(item, name: str) -> bool:
    get = getattr(item, "get_closest_marker", None)
    return get is not None and get(name) is not None


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (-p no:xdist) it is not called
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per CPU this process may use; with a GPU at most 8 and one per two CPUs (the
    real-shape grouped tests hold up to ~10 GB of GPU memory each, as in experiments/verify.py).
    MOEGEMM_TEST_WORKERS overrides."""
    if os.environ.get("MOEGEMM_TEST_WORKERS"):
        return max(1, int(os.environ["MOEGEMM_TEST_WORKERS"]))
    from moegemm._runtime import usable_cpus

    cpus = usable_cpus()
    return max(1, min(8, cpus // 2)) if HAS_CUDA else cpus


def long_first(items: list, workers: int) -> None:
    """Under pytest-xdist's scope schedulers (`--dist loadgroup`) the work units are handed out in collection
    order, two to a worker and one more each time one finishes: the long tests and the Snakemake group go
    first (longest processing time first), the rest keep their order. Without xdist: no change."""
    if workers < 2:
        return
    first = [it for it in items if "long" in it.keywords or it.get_closest_marker("xdist_group")]
    rest = [it for it in items if not ("long" in it.keywords or it.get_closest_marker("xdist_group"))]
    items[:] = first + rest


def copy_checkout(dest: Path) -> Path:
    """A copy of this checkout's files as they are in the working tree (tracked, and untracked but not
    ignored; without git, the tree less what .gitignore names), modification times kept: Snakemake run there
    leaves the user's outputs and its records (.snakemake/) in the checkout as they were."""
    dest.mkdir(parents=True, exist_ok=True)
    listed = None
    if (ROOT / ".git").exists() and shutil.which("git"):
        res = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=False,
        )
        if res.returncode == 0:
            listed = [f for f in res.stdout.decode().split("\0") if f]
    if listed is None:  # e.g. a source tree without .git
        skip = shutil.ignore_patterns(".git", ".venv", ".snakemake", "__pycache__", "logs", "build", ".cache")
        for child in ROOT.iterdir():
            if child.name in (".git", ".venv", ".snakemake", "logs", ".cache"):
                continue
            if child.is_dir():
                shutil.copytree(child, dest / child.name, ignore=skip, symlinks=True)
            else:
                shutil.copy2(child, dest / child.name)
        for generated in ("paper/build", "results/cpu-interpreter"):
            shutil.rmtree(dest / generated, ignore_errors=True)
        for fig in (dest / "figures").glob("*/"):
            shutil.rmtree(fig, ignore_errors=True)
        return dest
    for rel in listed:
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel, follow_symlinks=False)
    return dest


def snakemake_env(**extra) -> dict:
    env = {**os.environ, **extra}
    env.pop("TRITON_INTERPRET", None)  # Snakemake's own jobs decide (the verify step sets it itself)
    return env


def dry_run_jobs(cwd: Path) -> dict:
    """What `snakemake -n --cores 1` in ``cwd`` would run: {rule: count} from its job stats, and every job's
    outputs. A dry run writes no records, but it does create .snakemake/ and its I/O cache: put back as
    they were, so that the check itself leaves the tree alone."""
    state = cwd / ".snakemake"
    before = None
    if state.exists():
        before = {p: (p.read_bytes() if p.is_file() else None) for p in state.rglob("*")}
    try:
        res = subprocess.run(
            [sys.executable, "-m", "snakemake", "-n", "--cores", "1"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=300,
            env=snakemake_env(),
            check=False,
        )
    finally:
        if before is None:
            shutil.rmtree(state, ignore_errors=True)
        else:
            for p in sorted(state.rglob("*"), reverse=True):
                if p not in before:
                    p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
            for p, data in before.items():
                if data is not None and (not p.exists() or p.read_bytes() != data):
                    p.write_bytes(data)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    outputs = sorted(re.findall(r"^\s+output: (.*)$", out, flags=re.MULTILINE))
    return {"jobs": job_counts(out), "outputs": outputs}


def job_counts(out: str) -> dict[str, int]:
    """{rule: number of jobs} from Snakemake's "Job stats" table ({} where nothing is to be done)."""
    stats = out.split("Job stats:", 1)[1].split("Reasons", 1)[0] if "Job stats:" in out else ""
    counts = {}
    for line in stats.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def checkout_state() -> dict:
    """What a user sees of the checkout: `git status --porcelain`, the jobs `snakemake -n` would run, and the
    modification time and size of every file where the pipeline writes (results/, figures/, paper/build/,
    logs/, Snakemake's records and logs, what .snakemake/ holds)."""
    git = None
    if (ROOT / ".git").exists() and shutil.which("git"):
        git = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    state = ROOT / ".snakemake"
    outputs = {".snakemake/": sorted(p.name for p in state.iterdir()) if state.is_dir() else None}
    for top in (
        "results",
        "figures",
        "paper/build",
        "logs",
        ".snakemake/metadata",
        ".snakemake/incomplete",
        ".snakemake/log",
    ):
        for p in (ROOT / top).rglob("*") if (ROOT / top).is_dir() else ():
            if p.is_file() and "__pycache__" not in p.parts:
                st = p.stat()
                outputs[str(p.relative_to(ROOT))] = (st.st_mtime_ns, st.st_size)
    return {"git status": git, "snakemake -n": dry_run_jobs(ROOT), "outputs": outputs}


@pytest.fixture(scope="session")
def checkout_before():
    """The checkout as the first Snakemake test found it (each test that runs Snakemake asks for this)."""
    pytest.importorskip("snakemake")
    return checkout_state()


@pytest.fixture
def tree_copy(tmp_path, checkout_before):
    """A fresh copy of the checkout to run Snakemake in (see copy_checkout)."""
    return copy_checkout(tmp_path / "tree")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poison_partials(monkeypatch):
    """Make every Decompose-K partial buffer start as NaN, so an element stage 1 forgot shows up."""
    from moegemm.decompose_k import configs

    real = configs.alloc_partials

    def poisoned(*args, **kwargs):
        return real(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(configs, "alloc_partials", poisoned)
