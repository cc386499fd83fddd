"""The project's tracked files stay under TREE_LIMIT_BYTES, so that a checkout fits beside a Triton bundle and
the peers' sources in one 64 MiB device call; superseded runs are committed compressed
(results/<gpu>/runs.tar.xz) and read through experiments.runs_archive.runs_dir, checked here on runs made
here."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

import pytest

from experiments.runs_archive import RUNS_ARCHIVE, pack_runs, runs_dir

ROOT = Path(__file__).resolve().parent.parent
TREE_LIMIT_BYTES = 16 * 10**6


def tracked_files(root: Path) -> list[Path]:
    """The files git tracks under ``root`` (those present on disk); outside a git checkout (an unpacked
    source archive, a container), every file on disk that .gitignore does not exclude."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        return [p for p in (root / f for f in out.decode().split("\0") if f) if p.is_file()]
    except (OSError, subprocess.CalledProcessError):
        pass
    ignore = [".git/"]
    if (root / ".gitignore").exists():
        ignore += [
            ln.strip()
            for ln in (root / ".gitignore").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")
        ]

    def matches(parts: list[str], raw: str) -> bool:
        folder, pat = raw.endswith("/"), raw.strip("/")
        if raw.startswith("/") or "/" in pat:  # matched from the root: against the leading paths
            names = ["/".join(parts[:i]) for i in range(1, len(parts) + (0 if folder else 1))]
        else:  # against any one name (of a folder only, for a folder pattern)
            names = parts[:-1] if folder else parts
        return any(fnmatch.fnmatchcase(n, pat) for n in names)

    def ignored(rel: str) -> bool:
        """The last pattern that matches decides; a "!" pattern takes back what one before it ignored."""
        parts, out = rel.split("/"), False
        for raw in ignore:
            if matches(parts, raw.removeprefix("!")):
                out = not raw.startswith("!")
        return out

    return [p for p in root.rglob("*") if p.is_file() and not ignored(p.relative_to(root).as_posix())]


def test_tracked_tree_stays_under_the_limit():
    files = tracked_files(ROOT)
    assert len(files) > 100, "the project's files were not found"
    sizes = sorted(((p.stat().st_size, p.relative_to(ROOT).as_posix()) for p in files), reverse=True)
    total = sum(s for s, _ in sizes)
    biggest = ", ".join(f"{name} {s / 1e6:.1f} MB" for s, name in sizes[:5])
    assert total <= TREE_LIMIT_BYTES, (
        f"the tracked files take {total / 1e6:.1f} MB, over "
        f"{TREE_LIMIT_BYTES / 1e6:.0f} MB; the largest: {biggest}"
    )


def test_ignored_files_do_not_count(tmp_path):
    """Outside git: files .gitignore excludes (folders, name patterns, rooted paths) are left out, less those
    a later "!" pattern takes back."""
    (tmp_path / ".gitignore").write_text(
        "# comment\n__pycache__/\n*.pyc\n/logs/\nresults/*/runs/\nfigures/*/\n!figures/gpu/\n"
    )
    for rel in (
        "a.py",
        "pkg/b.py",
        "pkg/__pycache__/b.cpython.pyc",
        "c.pyc",
        "logs/x.log",
        "sub/logs/kept.txt",
        "results/gpu/runs/S1/x.csv",
        "results/gpu/runs.tar.xz",
        "figures/gpu/e1.pdf",
        "figures/other/e1.pdf",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    got = sorted(p.relative_to(tmp_path).as_posix() for p in tracked_files(tmp_path))
    assert got == [
        ".gitignore",
        "a.py",
        "figures/gpu/e1.pdf",
        "pkg/b.py",
        "results/gpu/runs.tar.xz",
        "sub/logs/kept.txt",
    ]


def _runs(results: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (results / "runs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (results / "runs" / rel).write_text(text)


def test_runs_archive_reads_as_the_folder_it_packed(tmp_path):
    """pack_runs then runs_dir: the same files under runs/<run>/, unpacked on first read, packed to the same
    bytes again; a changed archive is unpacked afresh; without an archive runs/ is taken as it is."""
    import shutil

    res = tmp_path / "gpu"
    assert runs_dir(res) == res / "runs" and not (res / "runs").exists()  # neither: nothing to read
    files = {"S1-1/moe_layer.csv": "a,b\n1,2\n", "S2-10/tune_grouped.csv": "c\n3\n", "S2-10/notes.json": "{}"}
    _runs(res, files)
    assert runs_dir(res) == res / "runs"  # a plain folder, no archive
    archive = pack_runs(res)
    assert archive == res / RUNS_ARCHIVE
    first = archive.read_bytes()
    shutil.rmtree(res / "runs")
    got = runs_dir(res)
    assert got == res / "runs"
    assert {
        p.relative_to(got).as_posix(): p.read_text()
        for p in got.rglob("*")
        if p.is_file() and p.name != ".unpacked-from"
    } == files
    assert sorted(p.parent.name for p in got.glob("*/*.csv")) == ["S1-1", "S2-10"]
    assert pack_runs(res).read_bytes() == first  # no times, owners or order in the archive
    (got / "S1-1" / "moe_layer.csv").write_text("edited\n")
    assert runs_dir(res) == got  # unpacked once: the edit stays
    assert (got / "S1-1" / "moe_layer.csv").read_text() == "edited\n"
    _runs(res, {"S3-1/moe_layer.csv": "new\n"})
    pack_runs(res)  # a new run added: the archive changed, so the next read unpacks it again
    shutil.rmtree(res / "runs" / "S1-1")
    assert (runs_dir(res) / "S3-1" / "moe_layer.csv").read_text() == "new\n"
    assert (res / "runs" / "S1-1" / "moe_layer.csv").read_text() == "edited\n"  # as packed just before
    assert not list(res.glob(".runs-*"))  # no temporary folder left behind


def test_committed_runs_archive_holds_the_runs_the_write_up_cites():
    """results/nvidia-h200/runs.tar.xz unpacks to runs/<run>/ folders holding the CSVs the numbers read."""
    results = ROOT / "results" / "nvidia-h200"
    if not (results / RUNS_ARCHIVE).exists():
        pytest.skip("no committed runs archive here")
    runs = runs_dir(results)
    for rel in (
        "S16-1/moe_layer.csv",
        "S17-2/moe_layer.csv",
        "S18-1/probe_dk_latency.csv",
        "S15-1/grouped_skew.csv",
        "S21-2/grouped_skew.csv",
        "S20-2/moe_layer.csv",
        "S21-3/moe_layer.csv",
    ):
        assert (runs / rel).stat().st_size > 0, rel
    assert list(runs.glob("*/probe_decode_routing.csv")) and list(runs.glob("*/tune_grouped.csv"))
