# Write-up: the figures (paper/figures/, drawn into figures/<gpu>/ with their build record), every number
# and table (paper/make_numbers.py), the PDF (latexmk) and what a reader gets without running anything
# (paper/paper.pdf, figures/hero.png), all from the results the plan names (RES).


rule readme_figure:
    """The README's hero figure (committed, so that the README shows it), from the write-up's results."""
    input:
        f"figures/{RES}/hero.png",
    output:
        "figures/hero.png",
    log:
        "logs/figures/hero.log",
    shell:
        "cp {input} {output} 2> {log}"



rule figure:
    """One figure per question (and the two diagrams), PDF for the paper and PNG for the README, with the record
    of what it was drawn from."""
    input:
        data=lambda w: PLAN.figure_data(w.res, w.fig),
        # its code, as its imports reach (paper/numbers/ where it shares an analysis with the numbers, the
        # library for the grouped diagram), and whatever else its last build was seen to read
        code=lambda w: code_closure(f"paper.figures.{w.fig}"),
        seen=lambda w: [p for p in recorded_inputs(f"figures/{w.res}/MANIFEST.json", w.fig)
                        if p not in PLAN.figure_data(w.res, w.fig)],
    output:
        pdf="figures/{res}/{fig}.pdf",
        png="figures/{res}/{fig}.png",
        record=f"{RECORDS}/figure_{{fig}}.json",
    wildcard_constraints:
        fig="|".join(FIGURE_INPUTS),
    log:
        "logs/figures/{res}/{fig}.log",
    benchmark:
        "logs/benchmarks/{res}/figure_{fig}.tsv"
    params:
        trace=TRACE,
    shell:
        "{params.trace} --record {output.record} -- paper.figures.{wildcards.fig} --results results/{wildcards.res} "
        "--out figures/{wildcards.res}/{wildcards.fig} > {log} 2>&1"


rule figure_manifest:
    """figures/<gpu>/MANIFEST.json: for each figure, the sha256 of every input and code file it was drawn from
    and of the PDF and PNG it wrote."""
    input:
        figures=expand("figures/{{res}}/{fig}.{ext}", fig=FIGURES, ext=["pdf", "png"]),
        records=expand("paper/build/{{res}}/records/figure_{fig}.json", fig=FIGURES),
    output:
        "figures/{res}/MANIFEST.json",
    log:
        "logs/figures/{res}/manifest.log",
    params:
        py=PY,
    shell:
        "{params.py} -m paper.manifest figures --out {output} {input.records} > {log} 2>&1"


rule numbers:
    """Every number and table the paper quotes, generated from the results."""
    input:
        [f"results/{{res}}/{name}.csv" for name in WRITEUP] + NUMBERS_CODE,
        # documented provenance corrections, earlier versions, committed probes (not pipeline steps) and
        # superseded runs, where present
        extra=lambda w: [str(p) for p in sorted(Path(f"results/{w.res}").glob("provenance_corrections.csv"))
                         + sorted(Path(f"results/{w.res}/history").glob("*.csv"))
                         + sorted(Path(f"results/{w.res}").glob("probe_*.csv"))
                         + sorted(Path(f"results/{w.res}").glob("runs.tar.xz"))],
        floors="results/{res}/floors.json",
        verify="results/{res}/verify.json",
        # whatever else the last build of the numbers was seen to read
        seen=lambda w: recorded_inputs("paper/MANIFEST.json", results=f"results/{w.res}"),
    output:
        "paper/build/{res}/generated/numbers.tex",
        expand("paper/build/{{res}}/generated/table_{t}.tex", t=["e1", "e2", "e3", "e5", "e5_shapes", "e6"]),
        record=f"{RECORDS}/numbers.json",
    log:
        "logs/paper/{res}/numbers.log",
    benchmark:
        "logs/benchmarks/{res}/numbers.tsv"
    params:
        trace=TRACE,
    shell:
        "{params.trace} --record {output.record} -- paper.make_numbers --results results/{wildcards.res} "
        "--out paper/build/{wildcards.res}/generated > {log} 2>&1"


rule paper:
    """The write-up: LaTeX with generated numbers, tables and figures, built with latexmk (no dates or IDs in
    the PDF: the same sources give the same bytes); then the pages of its labels mainend, appstart and
    paperend (pages.json)."""
    input:
        tex="paper/paper.tex",
        bib="paper/references.bib",
        numbers="paper/build/{res}/generated/numbers.tex",
        figures=expand("figures/{{res}}/{fig}.pdf", fig=FIGURES),
    output:
        pdf="paper/build/{res}/paper.pdf",
        pages="paper/build/{res}/pages.json",
    log:
        "logs/paper/{res}/latexmk.log",
    benchmark:
        "logs/benchmarks/{res}/paper.tsv"
    params:
        build=lambda w: f"paper/build/{w.res}",
        pretex=r"\pdfinfoomitdate=1\pdftrailerid{}\pdfsuppressptexinfo=-1",
        py=PY,
    shell:
        "mkdir -p {params.build}/figures && cp {input.figures} {params.build}/figures/ && "
        "cp {input.tex} {params.build}/paper.tex && cp {input.bib} {params.build}/references.bib && "
        "(cd {params.build} && latexmk -pdf -interaction=nonstopmode -halt-on-error "
        "-usepretex='{params.pretex}' paper.tex) > {log} 2>&1 && "
        "{params.py} -m paper.manifest pages --build {params.build} >> {log} 2>&1"


rule publish_paper:
    """The PDF a reader gets without running anything: paper/paper.pdf, with paper/pages.json (its labels'
    pages) and paper/MANIFEST.json (the sha256 of its sources, the figures among them, and of every input
    and code file of its numbers), from the results the write-up shows."""
    input:
        pdf=f"paper/build/{RES}/paper.pdf",
        pages=f"paper/build/{RES}/pages.json",
        numbers=f"paper/build/{RES}/records/numbers.json",
        figures=f"figures/{RES}/MANIFEST.json",
    output:
        pdf="paper/paper.pdf",
        pages="paper/pages.json",
        manifest="paper/MANIFEST.json",
    log:
        "logs/paper/publish.log",
    params:
        py=PY,
        build=lambda w, input: Path(input.pdf).parent.as_posix(),
        results=f"results/{RES}",
        figures=lambda w, input: Path(input.figures).parent.as_posix(),
    shell:
        "{params.py} -m paper.manifest paper --build {params.build} --results {params.results} "
        "--numbers {input.numbers} --figures {params.figures} --out paper > {log} 2>&1"
