"""The superseded runs a write-up still cites: results/<gpu>/runs.tar.xz, unpacked on first read
(runs_dir), and packed again after a run is added (pack_runs). Read by experiments.schedule and by the
write-up's numbers (paper/numbers/)."""

from __future__ import annotations

import hashlib
import lzma
import shutil
import tarfile
import tempfile
from pathlib import Path

from experiments._io import atomic_path

RUNS_ARCHIVE = "runs.tar.xz"  # results/<gpu>/runs.tar.xz: the superseded runs, one folder per run inside


def runs_dir(results: Path) -> Path:
    """results/<gpu>/runs/: the superseded runs the write-up still cites, one folder per run
    (runs/<run>/<file>, as RUNS.md names them). They are committed compressed, as results/<gpu>/runs.tar.xz;
    the first call unpacks the archive into runs/ (again once the archive changes), so that every reader
    takes plain paths. Without an archive, runs/ is taken as it is (it may not exist). Where results/ cannot
    be written, the archive is unpacked under the system's temporary folder instead."""
    results = Path(results)
    folder, archive = results / "runs", results / RUNS_ARCHIVE
    if not archive.exists():
        return folder
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    for parent in (results, Path(tempfile.gettempdir()) / f"moegemm-runs-{digest[:16]}"):
        try:
            return _unpacked(archive, digest, parent)
        except PermissionError:
            continue
    raise PermissionError(f"cannot unpack {archive}: neither {results} nor the temporary folder is writable")


def _unpacked(archive: Path, digest: str, parent: Path) -> Path:
    """``parent``/runs holding ``archive``'s runs, unpacked unless its stamp already names ``digest``. The
    archive is unpacked beside it and moved in whole, so that concurrent readers never see half of it."""
    folder = parent / "runs"
    stamp = folder / ".unpacked-from"
    if stamp.exists() and stamp.read_text() == digest:
        return folder
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".runs-", dir=parent))
    try:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        (tmp / "runs" / ".unpacked-from").write_text(digest)
        if folder.exists():  # an older unpacking (or a checkout's leftovers): set aside, then removed
            old = Path(tempfile.mkdtemp(prefix=".runs-old-", dir=parent))
            try:
                folder.rename(old / "runs")
            except FileNotFoundError:  # another reader set it aside first
                pass
        try:
            (tmp / "runs").rename(folder)
        except OSError:  # another reader put its copy in first: take it if it is this archive's
            if not (stamp.exists() and stamp.read_text() == digest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for old in parent.glob(".runs-old-*"):
            shutil.rmtree(old, ignore_errors=True)
    return folder


def pack_runs(results: Path) -> Path:
    """Pack results/<gpu>/runs/ (every file but the unpacking stamp) into results/<gpu>/runs.tar.xz, the
    same bytes for the same files: sorted, no owners, no times. Run after adding a run to runs/.

        python -c "from experiments.runs_archive import pack_runs; pack_runs('results/nvidia-h200')"
    """
    results = Path(results)
    files = sorted(p for p in (results / "runs").rglob("*") if p.is_file() and p.name != ".unpacked-from")
    out = results / RUNS_ARCHIVE
    with atomic_path(out) as tmp, tarfile.open(tmp, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for p in files:
            info = tarfile.TarInfo(str(p.relative_to(results)))
            info.size, info.mode = p.stat().st_size, 0o644
            with open(p, "rb") as f:
                tar.addfile(info, f)
    out.chmod(0o644)
    return out
