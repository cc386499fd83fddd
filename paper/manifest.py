"""What the committed figures, numbers and PDF were built from: the pipeline's build record.

A reader gets ``paper/paper.pdf`` and ``figures/<gpu>/*.pdf|png`` without running anything; these records say,
by sha256, which CSV/JSON inputs and which code each was built from, so that a test
(tests/test_build_record.py) fails when a committed output is older than what it is drawn from.

    python -m paper.manifest trace --record R.json -- paper.figures.e5_decompose_k_grid --results .. --out ..
        runs the module as ``python -m`` would and records every file of the checkout it read (its inputs),
        the checkout's modules it imported (its code) and the files it wrote (its outputs), with their sha256
    python -m paper.manifest figures --out figures/<gpu>/MANIFEST.json R1.json R2.json ...
        one manifest for the figures of a GPU, from their records
    python -m paper.manifest pages --build paper/build/<gpu>
        the pages of the labels mainend, appstart and paperend (from paper.aux after latexmk) and the PDF's
        page count and sha256, into paper/build/<gpu>/pages.json
    python -m paper.manifest paper --build paper/build/<gpu> --results results/<gpu> --numbers R.json \\
        --figures figures/<gpu> --out paper
        the PDF copied to paper/paper.pdf with paper/pages.json beside it, and paper/MANIFEST.json: the PDF's
        sources as latexmk read them (its .fls: paper.tex, the figures, the generated numbers) and the record
        of the numbers

Everything is named relative to the checkout's root (the working directory), sorted, so that the same build
writes the same bytes. Inputs leave out what is not the checkout's own (the interpreter and its packages,
hidden folders such as .venv, caches) and the superseded runs unpacked from results/<gpu>/runs.tar.xz (the
archive itself is recorded).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import posixpath
import re
import runpy
import shutil
import sys
import sysconfig
import zlib
from pathlib import Path

LABELS = ("mainend", "appstart", "paperend")
# The limits the page-count test holds the paper to: main text and appendix pages
MAX_MAIN_PAGES, MAX_APPENDIX_PAGES = 8, 8
# Written by the build itself (not inputs): logs, Snakemake's records, the paper's build folder, and the runs
# unpacked from results/<gpu>/runs.tar.xz (the archive is the input)
_NOT_INPUTS = (re.compile(r"^(logs|paper/build)/"), re.compile(r"^results/[^/]+/runs/"))


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dump(path: Path, obj) -> None:
    """``obj`` as JSON into ``path``, atomically (a temporary file beside it, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


class _Checkout:
    """Names files relative to the checkout's root and says which are its own."""

    def __init__(self, root: Path):
        self.root = os.path.normpath(os.path.abspath(root))
        # the interpreter's own folders (a .venv inside the checkout among them)
        self.outside = {
            os.path.normpath(os.path.abspath(p)) + os.sep
            for p in [sys.prefix, sys.base_prefix, *sysconfig.get_paths().values()]
            if p
        }

    def rel(self, path) -> str | None:
        """``path`` relative to the root, or None where it is not the checkout's own file."""
        if isinstance(path, int) or path is None:
            return None
        p = os.path.normpath(os.path.abspath(os.fsdecode(path)))
        if not p.startswith(self.root + os.sep) or any(p.startswith(o) for o in self.outside):
            return None
        rel = os.path.relpath(p, self.root).replace(os.sep, "/")
        if rel.startswith(".") or "/." in rel or "__pycache__" in rel:  # hidden folders (.venv, .git), caches
            return None
        return rel


def trace(module: str, argv: list[str], record: Path, root: Path | None = None) -> dict:
    """Run ``module`` as ``python -m module argv`` would, in this process, recording what it read, imported
    and wrote inside the checkout; the record (each file's sha256) goes to ``record`` once it succeeds."""
    co = _Checkout(root or Path.cwd())
    reads: set[str] = set()
    writes: set[str] = set()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            rel = co.rel(path)
            if rel is None:
                return
            wrote = (
                any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & write_flags)
            )
            (writes if wrote else reads).add(rel)
        elif event == "os.rename":  # os.rename and os.replace: an atomic write's final name
            rel = co.rel(args[1])
            if rel is not None:
                writes.add(rel)

    before = set(sys.modules)
    sys.addaudithook(hook)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    # its code: the module itself, what it imported and the packages above those (this recorder's excepted)
    names = {module} | (set(sys.modules) - before)
    names |= {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
    files = {getattr(sys.modules.get(n), "__file__", None) for n in names}
    files.add(importlib.util.find_spec(module).origin)
    code = {c for c in map(co.rel, files) if c and c.endswith(".py") and Path(co.root, c).is_file()}
    outputs = {w for w in writes if Path(co.root, w).is_file()} - {co.rel(record)}
    inputs = {
        r
        for r in reads - writes - code
        if Path(co.root, r).is_file()
        and not r.endswith((".py", ".pyc"))
        and not any(x.match(r) for x in _NOT_INPUTS)
    }
    rec = {
        "command": ["python", "-m", module, *argv],
        "inputs": {p: sha256(Path(co.root, p)) for p in sorted(inputs)},
        "code": {p: sha256(Path(co.root, p)) for p in sorted(code)},
        "outputs": {p: sha256(Path(co.root, p)) for p in sorted(outputs)},
    }
    _dump(Path(record), rec)
    return rec


# -- the static side, for Snakemake: a module's code and what an earlier build recorded ---------------------


def code_closure(module: str, roots: tuple[str, ...] = (".", "src")) -> list[str]:
    """The checkout's Python files ``module`` imports, at any depth (imports inside functions included; the
    packages' __init__.py with them), found by reading the source: what Snakemake should rerun a step on."""
    found: dict[str, str] = {}

    def path_of(name: str) -> str | None:
        parts = name.split(".")
        for root in roots:
            base = Path(root, *parts)
            for p in (base.with_suffix(".py"), base / "__init__.py"):
                if p.is_file():
                    return os.path.normpath(p).replace(os.sep, "/")
        return None

    def visit(name: str) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # the packages above it run first
            sub = ".".join(parts[:i])
            p = path_of(sub)
            if p is None or sub in found:
                continue
            found[sub] = p
            package = sub if p.endswith("__init__.py") else ".".join(sub.split(".")[:-1])
            for node in ast.walk(ast.parse(Path(p).read_text(), p)):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        visit(alias.name)
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                        target = ".".join([*anchor, node.module] if node.module else anchor)
                    else:
                        target = node.module or ""
                    if target:
                        visit(target)
                        for alias in node.names:  # `from pkg import submodule`
                            if path_of(f"{target}.{alias.name}"):
                                visit(f"{target}.{alias.name}")

    visit(module)
    return sorted(set(found.values()))


def recorded_inputs(
    manifest: str | os.PathLike, key: str | None = None, results: str | None = None
) -> list[str]:
    """The inputs an earlier build recorded that still exist: of figure ``key`` in a figures manifest, or
    (``key`` None) of the numbers in the paper's manifest, where that was built from ``results``. That is data
    a step was seen to read beyond what the Snakefile names, so that Snakemake reruns the step when it
    changes."""
    try:
        m = json.loads(Path(manifest).read_text())
        if key is None and results is not None and m.get("results") != results:
            return []
        rec = m["figures"][key] if key is not None else m["numbers"]
        return sorted(p for p in rec["inputs"] if Path(p).is_file())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


# -- the PDF: its labels' pages and its page count --------------------------------------------------------


def label_pages(aux: str) -> dict[str, int | None]:
    """The page of each of LABELS in a LaTeX .aux (None where absent or not an arabic number)."""
    pages = {}
    for name in LABELS:
        m = re.search(r"\\newlabel\{" + re.escape(name) + r"\}\{\{[^{}]*\}\{([^{}]*)\}", aux)
        pages[name] = int(m.group(1)) if m and m.group(1).strip().isdigit() else None
    return pages


def pdf_page_count(path: str | os.PathLike) -> int:
    """Pages of a PDF, read without a PDF library: the largest /Count of a /Type /Pages dictionary, in the
    file or in its compressed object streams."""
    data = Path(path).read_bytes()
    chunks = [data]
    for m in re.finditer(rb"stream\r?\n", data):
        end = data.find(b"endstream", m.end())
        if end < 0:
            continue
        try:
            chunks.append(zlib.decompress(data[m.end() : end]))
        except zlib.error:
            continue
    counts = [
        int(c)
        for chunk in chunks
        for d in re.findall(rb"<<(?:(?!>>).)*?/Type\s*/Pages\b(?:(?!>>).)*?>>", chunk, flags=re.S)
        for c in re.findall(rb"/Count\s+(\d+)", d)
    ]
    if not counts:
        raise ValueError(f"{path}: no /Type /Pages dictionary with a /Count")
    return max(counts)


def pages(build: Path) -> dict:
    """pages.json of the PDF in ``build``: its sha256, page count, the LABELS' pages, the main text's pages
    (up to mainend's) and the appendix's (appstart's to paperend's)."""
    build = Path(build)
    pdf = build / "paper.pdf"
    aux = (build / "paper.aux").read_text(errors="replace") if (build / "paper.aux").exists() else ""
    at = label_pages(aux)
    main = at["mainend"]
    appendix = at["paperend"] - at["appstart"] + 1 if at["paperend"] and at["appstart"] else None
    return {
        "pdf_sha256": sha256(pdf),
        "pages": pdf_page_count(pdf),
        "labels": at,
        "main_pages": main,
        "appendix_pages": appendix,
        "limits": {"main_pages": MAX_MAIN_PAGES, "appendix_pages": MAX_APPENDIX_PAGES},
    }


# -- the manifests ------------------------------------------------------------------------------------------


def figures_manifest(records: list[Path]) -> dict:
    """{"figures": {name: its record}} from the figures' trace records (a record's module names it)."""
    out = {}
    for r in sorted(records):
        rec = json.loads(Path(r).read_text())
        out[rec["command"][2].rsplit(".", 1)[-1]] = rec
    return {"figures": out}


def latex_sources(build: Path, figures: str) -> dict[str, str]:
    """What latexmk read from the build folder (its -recorder .fls), named by where each came from:
    paper.tex and the bibliography from paper/, the figures from ``figures`` (copied in by the paper
    rule); the generated numbers and tables as they are in the build folder."""
    build = Path(build)
    fls = (build / "paper.fls").read_text(errors="replace")
    out = {}
    for line in fls.splitlines():
        if not line.startswith("INPUT "):
            continue
        name = posixpath.normpath(line[len("INPUT ") :].strip())  # ./figures/x.pdf, figures//x.pdf: one name
        if os.path.isabs(name) or not (build / name).is_file():
            continue
        if name == "paper.tex":
            src = "paper/paper.tex"
        elif name.startswith("figures/"):
            src = f"{figures}/{name.removeprefix('figures/')}"
        elif name.startswith("generated/"):
            src = f"{build.as_posix()}/{name}"
        else:  # LaTeX's own files of this build (.aux, .bbl, .out, ...)
            continue
        out[src] = sha256(build / name)
    bib = build / "references.bib"
    if bib.exists():
        out["paper/references.bib"] = sha256(bib)
    return dict(sorted(out.items()))


def publish_paper(build: Path, results: str, numbers: Path, figures: str, out: Path) -> dict:
    """paper/paper.pdf (a copy of the build's), paper/pages.json and paper/MANIFEST.json."""
    build, out = Path(build), Path(out)
    pdf = out / "paper.pdf"
    tmp = out / ".paper.pdf.tmp"
    shutil.copyfile(build / "paper.pdf", tmp)
    os.replace(tmp, pdf)
    pg = {"pdf": pdf.as_posix(), **pages(build)}
    _dump(out / "pages.json", pg)
    manifest = {
        "results": results,
        "pdf": {"path": pdf.as_posix(), "sha256": sha256(pdf), "pages": pg["pages"]},
        "sources": latex_sources(build, figures),
        "numbers": json.loads(Path(numbers).read_text()),
    }
    _dump(out / "MANIFEST.json", manifest)
    return manifest


# -- the checks (tests/test_build_record.py): a committed output against what it was built from ------------


def _mismatches(files: dict[str, str], what: str, root: Path) -> list[str]:
    """One line per file of ``files`` ({path: sha256 when built}) that is missing or changed since."""
    out = []
    for path, digest in sorted(files.items()):
        f = Path(root, path)
        if not f.is_file():
            out.append(f"{what} {path}: missing")
        elif sha256(f) != digest:
            out.append(
                f"{what} {path}: changed since the build (sha256 {digest[:12]} then, {sha256(f)[:12]} now)"
            )
    return out


def check_figures(manifest: str | os.PathLike, root: str | os.PathLike = ".") -> list[str]:
    """What is stale or unaccounted for in a figures manifest's folder: a figure file that differs from the
    one built, an input or code file changed since, a PDF or PNG in the folder that no record wrote. Paths
    are relative to ``root``, the checkout."""
    root = Path(root).resolve()
    path = root / manifest
    if not path.is_file():
        return [f"{manifest}: missing (snakemake --cores 1 writes it)"]
    problems, written = [], set()
    for name, rec in sorted(json.loads(path.read_text())["figures"].items()):
        problems += _mismatches(rec["outputs"], f"{name}: output", root)
        problems += _mismatches(rec["inputs"], f"{name}: input", root)
        problems += _mismatches(rec["code"], f"{name}: code", root)
        written |= set(rec["outputs"])
    for f in sorted(path.parent.glob("*.p[dn][fg]")):
        rel = f.relative_to(root).as_posix()
        if rel not in written:
            problems.append(f"{rel}: no build record wrote it")
    return problems


def check_paper(manifest: str | os.PathLike, root: str | os.PathLike = ".") -> list[str]:
    """What is stale in the paper's manifest: the PDF differs from the one built, one of its sources
    (paper.tex, the bibliography, a figure) changed since, an input or code file of its numbers changed
    since, or the numbers the PDF read are not the ones the numbers' record wrote."""
    manifest = Path(root, manifest)
    if not manifest.is_file():
        return [f"{manifest}: missing (snakemake --cores 1 writes it)"]
    m = json.loads(manifest.read_text())
    problems = _mismatches({m["pdf"]["path"]: m["pdf"]["sha256"]}, "the PDF", root)
    numbers = m["numbers"]
    built = {k: v for k, v in m["sources"].items() if k.startswith("paper/build/")}
    problems += _mismatches({k: v for k, v in m["sources"].items() if k not in built}, "PDF source", root)
    for path, digest in sorted(built.items()):
        if numbers["outputs"].get(path) != digest:
            problems.append(f"PDF source {path}: not what the numbers' record wrote")
    problems += _mismatches(numbers["inputs"], "numbers: input", root)
    problems += _mismatches(numbers["code"], "numbers: code", root)
    return problems


def check_pages(pages_json: str | os.PathLike, root: str | os.PathLike = ".") -> list[str]:
    """What is wrong with pages.json: missing, not of the committed PDF (sha256, page count), a label
    missing, or the main text or the appendix over its limit."""
    pj = Path(root, pages_json)
    if not pj.is_file():
        return [f"{pj}: missing (snakemake --cores 1 writes it beside the PDF)"]
    pg = json.loads(pj.read_text())
    pdf = Path(root, pg["pdf"])
    if not pdf.is_file():
        return [f"{pg['pdf']}: missing (snakemake --cores 1 builds it; commit it with {pj.name})"]
    problems = []
    if sha256(pdf) != pg["pdf_sha256"]:
        problems.append(f"{pj.name} is not of {pg['pdf']} (sha256 differs): rebuild both")
    if pdf_page_count(pdf) != pg["pages"]:
        problems.append(f"{pj.name} says {pg['pages']} pages, {pg['pdf']} has {pdf_page_count(pdf)}")
    missing = [k for k, v in pg["labels"].items() if v is None]
    if missing:
        problems.append(f"labels not in the PDF's .aux: {', '.join(missing)} (\\label{{...}} in paper.tex)")
    if pg["main_pages"] is not None and pg["main_pages"] > MAX_MAIN_PAGES:
        problems.append(f"the main text takes {pg['main_pages']} pages, over {MAX_MAIN_PAGES}")
    if pg["appendix_pages"] is not None and pg["appendix_pages"] > MAX_APPENDIX_PAGES:
        problems.append(f"the appendix takes {pg['appendix_pages']} pages, over {MAX_APPENDIX_PAGES}")
    return problems


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "trace":  # trace --record R -- module args: the module's arguments untouched
        if "--" not in argv:
            raise SystemExit("trace: expected --record FILE -- MODULE [ARGS...]")
        cut = argv.index("--")
        ap = argparse.ArgumentParser(prog="paper.manifest trace")
        ap.add_argument("--record", required=True)
        a = ap.parse_args(argv[1:cut])
        module, *rest = argv[cut + 1 :]
        trace(module, rest, Path(a.record))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("figures")
    f.add_argument("--out", required=True)
    f.add_argument("records", nargs="+")
    p = sub.add_parser("pages")
    p.add_argument("--build", required=True)
    q = sub.add_parser("paper")
    for name in ("--build", "--results", "--numbers", "--figures", "--out"):
        q.add_argument(name, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "figures":
        _dump(Path(a.out), figures_manifest([Path(r) for r in a.records]))
    elif a.cmd == "pages":
        _dump(
            Path(a.build) / "pages.json",
            {"pdf": f"{Path(a.build).as_posix()}/paper.pdf", **pages(Path(a.build))},
        )
    else:
        publish_paper(Path(a.build), a.results, Path(a.numbers), a.figures, Path(a.out))


if __name__ == "__main__":
    main()
