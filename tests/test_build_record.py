"""The committed outputs a reader gets without running anything (paper/paper.pdf, figures/<gpu>/*.pdf|png) are
the ones built from the committed inputs: each build record's sha256s (paper/manifest.py) match the files
now, and the PDF's pages are within budget. Then the record's machinery itself: trace, the manifests'
checks, the page count and the labels' pages, on files made here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paper import manifest as mf

ROOT = Path(__file__).resolve().parent.parent
GPU = re.search(
    r"^committed_results:\s*(\S+)", (ROOT / "experiments" / "config.yaml").read_text(), re.M
).group(1)
FIGURES = f"figures/{GPU}"
REBUILD = "rebuild with `snakemake --cores 1` and commit what it writes"


def snakefile_figures() -> set[str]:
    """The figures the pipeline draws from the committed results (workflow.plan: those whose CSVs exist)."""
    from workflow.plan import plan

    return set(plan([], GPU, ROOT).figures())


# -- the committed outputs -----------------------------------------------------------------------------------


@pytest.mark.outputs
def test_committed_figures_are_built_from_the_committed_inputs():
    """figures/<gpu>/MANIFEST.json: every figure the Snakefile draws is there, and each one's PDF and PNG,
    every CSV/JSON it read and every code file it ran are as they were when it was drawn; nothing else is in
    the folder; the README's figures/hero.png is a copy of the committed one."""
    problems = mf.check_figures(f"{FIGURES}/MANIFEST.json", ROOT)
    assert not problems, f"stale or unrecorded figures ({REBUILD}):\n" + "\n".join(problems)
    recorded = json.loads((ROOT / FIGURES / "MANIFEST.json").read_text())["figures"]
    assert snakefile_figures() <= set(recorded), sorted(snakefile_figures() - set(recorded))
    for name, rec in recorded.items():
        assert {f"{FIGURES}/{name}.pdf", f"{FIGURES}/{name}.png"} <= set(rec["outputs"]), name
        assert f"paper/figures/{name}.py" in rec["code"], name
    hero = ROOT / "figures" / "hero.png"
    assert mf.sha256(hero) == mf.sha256(ROOT / FIGURES / "hero.png"), (
        f"figures/hero.png is not {FIGURES}/hero.png"
    )


@pytest.mark.outputs
def test_committed_pdf_and_numbers_are_built_from_the_committed_inputs():
    """paper/MANIFEST.json: paper/paper.pdf is the PDF built, and its sources (paper.tex, the bibliography,
    the figures), the numbers it printed and every input and code file of those numbers are as they were then.
    Fails while paper/paper.pdf is not committed."""
    assert (ROOT / "paper" / "paper.pdf").is_file(), f"paper/paper.pdf is not committed: {REBUILD}"
    problems = mf.check_paper("paper/MANIFEST.json", ROOT)
    assert not problems, f"the committed PDF is stale ({REBUILD}):\n" + "\n".join(problems)
    m = json.loads((ROOT / "paper" / "MANIFEST.json").read_text())
    assert m["pdf"]["path"] == "paper/paper.pdf"
    assert any(p.startswith("results/") and p.endswith(".csv") for p in m["numbers"]["inputs"])
    figures = {p for p in m["sources"] if p.startswith("figures/")}
    assert figures, "the PDF's manifest names no figure"
    recorded = json.loads((ROOT / FIGURES / "MANIFEST.json").read_text())["figures"]
    built = {p for rec in recorded.values() for p in rec["outputs"]}
    assert figures <= built, f"figures the PDF read that no figure record wrote: {sorted(figures - built)}"


def test_paper_fits_its_page_budget():
    """paper/pages.json is of the committed paper/paper.pdf (sha256, page count) and says, from the pages
    of \\label{mainend}, \\label{appstart} and \\label{paperend}, that the main text and the appendix take
    at most 8 pages each. Fails while paper/paper.pdf is not committed."""
    problems = mf.check_pages("paper/pages.json", ROOT)
    assert not problems, "\n".join(problems)
    pg = json.loads((ROOT / "paper" / "pages.json").read_text())
    assert pg["main_pages"] <= mf.MAX_MAIN_PAGES and pg["appendix_pages"] <= mf.MAX_APPENDIX_PAGES, pg
    if shutil.which("pdfinfo"):  # poppler's count agrees with the one read here
        info = subprocess.run(
            ["pdfinfo", ROOT / "paper" / "paper.pdf"], capture_output=True, text=True
        ).stdout
        assert int(re.search(r"^Pages:\s+(\d+)", info, re.M).group(1)) == pg["pages"], info


# -- the machinery, on files made here -----------------------------------------------------------------------


def _tree(tmp_path: Path) -> Path:
    """A small checkout: a package that reads a CSV and a JSON, imports a helper, and writes two outputs."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "helper.py").write_text("SCALE = 2\n")
    (tmp_path / "pkg" / "draw.py").write_text(
        "import json, sys\nfrom pathlib import Path\n\n"
        "from pkg.helper import SCALE\n\n"
        "def main():\n"
        "    src, out = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "    rows = (src / 'data.csv').read_text().splitlines()\n"
        "    meta = json.loads((src / 'meta.json').read_text())\n"
        "    out.mkdir(parents=True, exist_ok=True)\n"
        "    (out / 'a.pdf').write_text(str(len(rows) * SCALE) + meta['name'])\n"
        "    tmp = out / '.b.tmp'\n"
        "    tmp.write_text('b')\n"
        "    tmp.replace(out / 'b.png')\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "data.csv").write_text("x\n1\n2\n")
    (tmp_path / "results" / "meta.json").write_text('{"name": "m"}')
    return tmp_path


def _trace(tree: Path, record: str) -> dict:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "paper.manifest",
            "trace",
            "--record",
            record,
            "--",
            "pkg.draw",
            "results",
            "out",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tree}:{ROOT}", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads((tree / record).read_text())


def test_trace_records_what_a_module_read_ran_and_wrote(tmp_path):
    """trace: the files it read (not its code, not what it wrote), the checkout's modules it ran (itself, its
    package, its imports; not the recorder), the files it wrote (an atomic rename's final name), all with the
    sha256 of the file; the record itself is none of them."""
    tree = _tree(tmp_path)
    rec = _trace(tree, "records/draw.json")
    assert rec["command"] == ["python", "-m", "pkg.draw", "results", "out"]
    assert set(rec["inputs"]) == {"results/data.csv", "results/meta.json"}
    assert set(rec["code"]) == {"pkg/__init__.py", "pkg/helper.py", "pkg/draw.py"}
    assert set(rec["outputs"]) == {"out/a.pdf", "out/b.png"}
    for section in ("inputs", "code", "outputs"):
        for path, digest in rec[section].items():
            assert digest == mf.sha256(tree / path), path
    assert (tree / "out" / "a.pdf").read_text() == "6m"


def test_figure_check_names_each_stale_or_unrecorded_file(tmp_path):
    """check_figures: clean right after the build; then an edited input, an edited code file, an edited output
    and a figure no record wrote are each named."""
    tree = _tree(tmp_path)
    _trace(tree, "records/draw.json")
    (tree / "out" / "MANIFEST.json").write_text(json.dumps(mf.figures_manifest([tree / "records/draw.json"])))
    # a record names its figure by the module's last name
    assert list(json.loads((tree / "out" / "MANIFEST.json").read_text())["figures"]) == ["draw"]
    assert mf.check_figures("out/MANIFEST.json", tree) == []
    (tree / "results" / "data.csv").write_text("x\n1\n2\n3\n")
    (tree / "pkg" / "helper.py").write_text("SCALE = 3\n")
    (tree / "out" / "b.png").write_text("edited")
    (tree / "out" / "c.pdf").write_text("stray")
    problems = "\n".join(mf.check_figures("out/MANIFEST.json", tree))
    for expected in (
        "draw: input results/data.csv: changed",
        "draw: code pkg/helper.py: changed",
        "draw: output out/b.png: changed",
        "out/c.pdf: no build record wrote it",
    ):
        assert expected in problems, problems
    (tree / "results" / "meta.json").unlink()
    assert "draw: input results/meta.json: missing" in "\n".join(mf.check_figures("out/MANIFEST.json", tree))
    assert mf.check_figures("nowhere/MANIFEST.json", tree) == [
        "nowhere/MANIFEST.json: missing (snakemake --cores 1 writes it)"
    ]


def test_paper_check_and_pages_on_a_built_pdf(tmp_path, monkeypatch):
    """publish_paper on a build folder (a 3-page PDF, its .aux and .fls, a generated table): paper.pdf copied,
    pages.json with the labels' pages, MANIFEST.json with the PDF's sources named where they come from;
    check_paper and check_pages clean; then an edited figure, a numbers input, a PDF that is not the
    recorded one and a main text over budget are each named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages

    build = tmp_path / "paper" / "build" / "gpu"
    (build / "generated").mkdir(parents=True)
    (build / "figures").mkdir()
    (tmp_path / "figures" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "e.csv").write_text("a\n1\n")
    (tmp_path / "paper" / "paper.tex").write_text("tex")
    (tmp_path / "paper" / "references.bib").write_text("bib")
    (build / "paper.tex").write_text("tex")
    (build / "references.bib").write_text("bib")
    (build / "generated" / "numbers.tex").write_text("\\newcommand{\\X}{1}")
    (tmp_path / "figures" / "gpu" / "f.pdf").write_text("fig")
    (build / "figures" / "f.pdf").write_text("fig")
    with PdfPages(build / "paper.pdf") as pdf:
        for _ in range(3):
            fig = plt.figure()
            pdf.savefig(fig)
            plt.close(fig)
    (build / "paper.aux").write_text(
        "\\newlabel{mainend}{{5}{2}{Conclusion}{section.5}{}}\n\\newlabel{appstart}{{A}{3}{}{appendix.A}{}}\n"
        "\\newlabel{paperend}{{B}{3}{}{appendix.B}{}}\n"
    )
    (build / "paper.fls").write_text(
        "PWD /x\nINPUT /usr/share/texmf/tex/latex/base/article.cls\nINPUT ./paper.tex\nINPUT paper.aux\n"
        "INPUT ./generated/numbers.tex\nINPUT figures//f.pdf\nINPUT ./figures/f.pdf\nOUTPUT paper.pdf\n"
    )
    numbers = {
        "command": ["python", "-m", "paper.make_numbers"],
        "inputs": {"results/gpu/e.csv": mf.sha256(tmp_path / "results" / "gpu" / "e.csv")},
        "code": {},
        "outputs": {"paper/build/gpu/generated/numbers.tex": mf.sha256(build / "generated" / "numbers.tex")},
    }
    (tmp_path / "numbers.json").write_text(json.dumps(numbers))
    monkeypatch.chdir(tmp_path)
    m = mf.publish_paper(
        Path("paper/build/gpu"), "results/gpu", Path("numbers.json"), "figures/gpu", Path("paper")
    )
    assert set(m["sources"]) == {
        "paper/paper.tex",
        "paper/references.bib",
        "figures/gpu/f.pdf",
        "paper/build/gpu/generated/numbers.tex",
    }
    pg = json.loads((tmp_path / "paper" / "pages.json").read_text())
    assert pg["pages"] == 3 and pg["labels"] == {"mainend": 2, "appstart": 3, "paperend": 3}
    assert pg["main_pages"] == 2 and pg["appendix_pages"] == 1 and pg["pdf"] == "paper/paper.pdf"
    assert mf.check_paper("paper/MANIFEST.json", tmp_path) == []
    assert mf.check_pages("paper/pages.json", tmp_path) == []
    (tmp_path / "figures" / "gpu" / "f.pdf").write_text("redrawn")
    (tmp_path / "results" / "gpu" / "e.csv").write_text("a\n2\n")
    problems = "\n".join(mf.check_paper("paper/MANIFEST.json", tmp_path))
    assert (
        "PDF source figures/gpu/f.pdf: changed" in problems and "numbers: input results/gpu/e.csv" in problems
    )
    (tmp_path / "paper" / "paper.pdf").write_bytes((tmp_path / "paper" / "paper.pdf").read_bytes() + b"\n")
    assert "the PDF paper/paper.pdf: changed" in "\n".join(mf.check_paper("paper/MANIFEST.json", tmp_path))
    assert any("sha256 differs" in p for p in mf.check_pages("paper/pages.json", tmp_path))
    pg.update(pdf_sha256=mf.sha256(tmp_path / "paper" / "paper.pdf"), main_pages=9, appendix_pages=9)
    (tmp_path / "paper" / "pages.json").write_text(json.dumps(pg))
    assert mf.check_pages("paper/pages.json", tmp_path) == [
        "the main text takes 9 pages, over 8",
        "the appendix takes 9 pages, over 8",
    ]
    (tmp_path / "paper" / "paper.pdf").unlink()
    assert "paper/paper.pdf: missing" in mf.check_pages("paper/pages.json", tmp_path)[0]


def test_label_pages_read_from_the_aux():
    """label_pages: the page field of \\newlabel (hyperref's five fields or LaTeX's two); None where a label
    is absent or its page is not a plain number."""
    aux = (
        "\\newlabel{mainend}{{6}{8}{Conclusion}{section.6}{}}\n"
        "\\newlabel{appstart}{{A}{9}}\n"
        "\\newlabel{paperend}{{B}{xii}{}{appendix.B}{}}\n"
        "\\newlabel{mainend-x}{{1}{1}}\n"
    )
    assert mf.label_pages(aux) == {"mainend": 8, "appstart": 9, "paperend": None}
    assert mf.label_pages("") == {"mainend": None, "appstart": None, "paperend": None}


def test_code_closure_follows_imports_inside_functions(tmp_path, monkeypatch):
    """code_closure: absolute, relative and function-level imports, `from pkg import submodule`, and the
    packages' __init__.py; modules outside the checkout (here: json) are not followed."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("import json\nfrom . import b\n\ndef f():\n    from pkg.sub import leaf\n")
    (pkg / "b.py").write_text("from .sub.leaf import X\n")
    (pkg / "unused.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert mf.code_closure("pkg.a", roots=(".",)) == [
        "pkg/__init__.py",
        "pkg/a.py",
        "pkg/b.py",
        "pkg/sub/__init__.py",
        "pkg/sub/leaf.py",
    ]


def test_static_closure_covers_what_each_figure_imports(monkeypatch):
    """What Snakemake reruns a figure on (code_closure) includes every checkout module its last build imported
    (the committed manifest's code)."""
    path = ROOT / FIGURES / "MANIFEST.json"
    if not path.exists():
        pytest.skip(f"{FIGURES}/MANIFEST.json is not built here")
    monkeypatch.chdir(ROOT)
    for name, rec in json.loads(path.read_text())["figures"].items():
        closure = set(mf.code_closure(f"paper.figures.{name}"))
        assert set(rec["code"]) <= closure, (name, sorted(set(rec["code"]) - closure))
