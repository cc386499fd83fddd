# moegemm: build and verify the kernels, run every GPU experiment, then rebuild figures, tables and paper.
#
#   snakemake --cores 1                          one machine, one GPU (or none)
#   snakemake --cores 8 --resources gpu=4        experiments spread over 4 GPUs of this host
#   snakemake --profile experiments/profiles/slurm   one job per experiment on a SLURM cluster
#
# With a CUDA GPU every experiment runs into results/<gpu-slug>/ and the write-up is built from those.
# Without one, the kernels are verified under Triton's interpreter and the write-up is rebuilt from the
# committed results of config["committed_results"]; no GPU number is ever produced on such a machine.
# Results already present for this GPU are reused. `snakemake --cores 1 --forcerun measure verify floors
# --config keep_tuned=1` re-measures with the tuners' outputs kept (the budget's re-measurement: without
# keep_tuned, a verify run again runs every tuner again, as they wait for it); `--forcerun measure verify floors
# tune tune_grouped tune_seed tune_unsloth` re-tunes as well, the peers' own searches included.
# What a reader gets without running anything is committed as this builds it: figures/<gpu>/ (PDF, PNG and
# MANIFEST.json) and paper/paper.pdf (with pages.json and MANIFEST.json): each figure and the numbers run
# under paper/manifest.py's trace, which records the sha256 of what they read, ran and wrote, and
# tests/test_build_record.py fails when a committed output no longer matches what it was built from.

import shutil
import sys
from pathlib import Path

from snakemake.utils import validate

from experiments.pipeline import local_gpus, machine_slug, results_slug
from paper.manifest import code_closure, recorded_inputs

# The container every rule runs in when Snakemake is asked to use one (--sdm apptainer); the Dockerfile
# builds the same image with the project installed.
container: "docker://ghcr.io/pytorch/pytorch-nightly:2.12.0.dev20260408-cuda12.8-cudnn9-devel"

configfile: "experiments/config.yaml"
validate(config, "experiments/config.schema.yaml")

PY = sys.executable  # the interpreter running Snakemake, so a venv need not be activated
GPUS = local_gpus()
HERE = machine_slug(GPUS)  # what this machine verifies (and, with a GPU, measures) into
RES = results_slug(GPUS, config["committed_results"])  # what the write-up is built from
SRC = sorted(str(p) for p in Path("src").rglob("*.py")) + sorted(str(p) for p in Path("tests").rglob("*.py"))
TEX = shutil.which("latexmk") is not None
# the tuners wait for verify; with keep_tuned a newer verify does not make them run again (their committed
# outputs are reused: the re-measurement the budget times), with it off (the default) it does
TUNER_VERIFY = (ancient if config.get("keep_tuned") else str)(f"results/{HERE}/verify.json")
SLOT = f"{PY} -m experiments.gpu_slot --"  # pins each GPU job to a free GPU of this host
NUMBERS_CODE = sorted(set(["paper/make_numbers.py"]
                           + [str(p) for p in Path("paper/numbers").glob("*.py")]
                           + code_closure("paper.make_numbers")))

EXPERIMENTS = {  # output CSV -> experiment module (E1..E9)
    "compile_modes": "e1_compile_modes",
    "inductor_codegen": "e2_inductor_codegen",
    "epilogue_fusion": "e3_epilogue_fusion",
    "split_sweep": "e4_split_sweep",
    "decompose_k_grid": "e5_decompose_k_grid",
    "router_gemm": "e6_router_gemm",
    "grouped_skew": "e7_grouped_skew",
    "moe_layer": "e8_moe_layer",
    "moe_train": "e9_moe_train",
}
# With several GPUs the longest experiments run as one shard per GPU, merged on the CPU (rules measure_shard,
# merge_shards); with one, as one job like the others.
SHARDS = max(1, len(GPUS))
SHARDED = ("grouped_skew", "moe_layer", "moe_train") if SHARDS > 1 else ()
# The experiments with the seed's Triton kernels among their contenders (at the configs of tune_seed)
SEED_EXPERIMENTS = ("epilogue_fusion", "split_sweep", "decompose_k_grid", "router_gemm")
# The write-up reads every experiment measured for RES (on a GPU: all of them; without one, those whose
# committed CSV exists, so that a GPU with a partial set of results still builds).
WRITEUP = [e for e in EXPERIMENTS if GPUS or Path(f"results/{RES}/{e}.csv").exists()]
FIGURE_INPUTS = {  # figure script -> the results it draws
    "e1_compile_modes": ["compile_modes"], "e3_epilogue_fusion": ["epilogue_fusion"],
    "e4_split_sweep": ["split_sweep"], "e5_decompose_k_grid": ["decompose_k_grid"],
    "e6_router_gemm": ["router_gemm"], "e7_grouped_skew": ["grouped_skew"],
    "e8_moe_layer": ["moe_layer"],
    "e9_moe_train": ["moe_train"],
    "hero": ["decompose_k_grid"] + (["grouped_skew"] if "grouped_skew" in WRITEUP else []),
    # the two diagrams: what the code does, on no measured data
    "diagram_reduction": [], "diagram_grouped": [],
}
# Figures that also draw the seed's published H100 numbers (results/reference/seed-h100/, as its repository has them)
SEED_REFERENCE = "results/reference/seed-h100"
FIGURE_REFERENCES = {
    "e3_epilogue_fusion": [f"{SEED_REFERENCE}/original_triton/epilogue_relu_bf16.csv"],
    "e5_decompose_k_grid": [f"{SEED_REFERENCE}/optimized_triton_tlx/epilogue_relu_bf16.csv"],
}
FIGURES = [f for f, needs in FIGURE_INPUTS.items() if all(n in WRITEUP for n in needs)]


def figure_data(res, fig):
    """The results (and references) figure ``fig`` draws."""
    return [f"results/{res}/{name}.csv" for name in FIGURE_INPUTS[fig]] + FIGURE_REFERENCES.get(fig, [])


# What each build step of the write-up read and wrote, with sha256s (paper/manifest.py trace): gathered into
# figures/<gpu>/MANIFEST.json and paper/MANIFEST.json, so that a test can tell a committed output from a stale one
RECORDS = "paper/build/{res}/records"
TRACE = f"{PY} -m paper.manifest trace"

# Said at every start (a dry run included), so that nobody mistakes which GPU the write-up shows.
if GPUS:
    print(f"moegemm: {len(GPUS)} GPU(s) found ({GPUS[0]}): results go to results/{HERE}/; "
          "the write-up is built from them.", file=sys.stderr)
else:
    print(f"moegemm: no CUDA GPU here. Verifying the kernels under the Triton interpreter; figures, tables "
          f"and paper are rebuilt from the committed results/{RES}/ (measured on that GPU). No GPU number is "
          "produced on this machine.", file=sys.stderr)
if not TEX:
    print("moegemm: latexmk not found: the paper PDF is skipped (install TeX Live and latexmk, e.g. "
          "apt-get install latexmk texlive-latex-recommended texlive-latex-extra texlive-fonts-recommended); "
          "everything else is built.", file=sys.stderr)


rule all:
    input:
        f"results/{HERE}/verify.json",
        [f"results/{HERE}/grouped_skew.csv"] if GPUS else [],
        expand("figures/{res}/{fig}.pdf", res=RES, fig=FIGURES),
        f"figures/{RES}/MANIFEST.json",
        f"paper/build/{RES}/generated/numbers.tex",
        ["paper/paper.pdf", "paper/pages.json", "paper/MANIFEST.json"] if TEX else [],
        "figures/hero.png",


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


rule verify:
    """Run the kernel tests (interpreter on CPU, native on a GPU) and write a machine-readable report."""
    input:
        SRC,
    output:
        f"results/{HERE}/verify.json",
    log:
        f"logs/{HERE}/verify.log",
    benchmark:
        f"results/{HERE}/benchmarks/verify.tsv"
    params:
        py=PY,
    resources:
        gpu=1 if GPUS else 0,
    shell:
        "{params.py} -m experiments.verify --out {output} > {log} 2>&1"


if GPUS:

    rule floors:
        """Tiny-kernel time, copy bandwidth and matmul rate of this GPU."""
        input:
            f"results/{HERE}/verify.json",
        output:
            f"results/{HERE}/floors.json",
        log:
            f"logs/{HERE}/floors.log",
        benchmark:
            f"results/{HERE}/benchmarks/floors.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.floors --out {output} > {log} 2>&1"

    rule tune:
        """Per-GPU Decompose-K config table (data read by the library)."""
        input:
            TUNER_VERIFY,
        output:
            csv=f"results/{HERE}/tune_decompose_k.csv",
            table=f"src/moegemm/tuned/decompose_k/{HERE}.json",
        log:
            f"logs/{HERE}/tune.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_decompose_k --out {output.csv} > {log} 2>&1"

    rule tune_grouped:
        """Per-GPU grouped-GEMM tile table (data read by the library)."""
        input:
            TUNER_VERIFY,
        output:
            csv=f"results/{HERE}/tune_grouped.csv",
            table=f"src/moegemm/tuned/grouped/{HERE}.json",
        log:
            f"logs/{HERE}/tune_grouped.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune_grouped.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_grouped --out {output.csv} > {log} 2>&1"

    rule distill_grouped:
        """The grouped GEMM's default for shapes its table lacks: per regime, a shortlist distilled from the
        tune-set models' tuner rows (the first call of an unseen shape times it), and the leave-one-model-out
        slowdown of that construction."""
        input:
            csv=f"results/{HERE}/tune_grouped.csv",
            config="experiments/config.yaml",
            code="experiments/distill_grouped.py",
        output:
            table=f"src/moegemm/tuned/grouped_default/{HERE}.json",
            loo=f"results/{HERE}/distill_grouped.csv",
        log:
            f"logs/{HERE}/distill_grouped.log",
        params:
            py=PY,
        shell:
            "{params.py} -m experiments.distill_grouped --csv {input.csv} --out {output.table} "
            "--loo {output.loo} > {log} 2>&1"

    rule tune_seed:
        """The seed's own config search for its two Triton kernels (E3-E6's "seed: ..." contenders); a CSV
        that says so where MOEGEMM_SEED_SOURCE is not set."""
        input:
            TUNER_VERIFY,
        output:
            f"results/{HERE}/tune_seed.csv",
        log:
            f"logs/{HERE}/tune_seed.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune_seed.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_seed --out {output} > {log} 2>&1"

    rule tune_unsloth:
        """Unsloth's own config search for its MoE kernels, once per layer shape E9 runs them on (E9's
        "unsloth: ..." contender takes its choices, as Unsloth's disk cache serves a machine's later runs); a
        CSV that says so where MOEGEMM_UNSLOTH_SOURCE is not set."""
        input:
            TUNER_VERIFY,
        output:
            f"results/{HERE}/tune_unsloth.csv",
        log:
            f"logs/{HERE}/tune_unsloth.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune_unsloth.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_unsloth --out {output} > {log} 2>&1"

    # What each experiment reads: the Decompose-K experiments (E1-E6) the Decompose-K table (E3-E6 also the
    # seed's search), the grouped ones (E7, E8) the grouped tables. No experiment reads the floors (the
    # write-up does), so with several GPUs E7 and E8 start once the grouped tuner is done, beside the
    # Decompose-K and seed tuners.
    GROUPED_EXPERIMENTS = ("grouped_skew", "moe_layer", "moe_train")
    MEASURE_INPUT = dict(
        verify=f"results/{HERE}/verify.json",
        seed=lambda w: [f"results/{HERE}/tune_seed.csv"] if w.experiment in SEED_EXPERIMENTS else [],
        unsloth=lambda w: [f"results/{HERE}/tune_unsloth.csv"] if w.experiment == "moe_train" else [],
        tables=lambda w: [f"src/moegemm/tuned/grouped/{HERE}.json", f"src/moegemm/tuned/grouped_default/{HERE}.json"]
        if w.experiment in GROUPED_EXPERIMENTS else [f"src/moegemm/tuned/decompose_k/{HERE}.json"],
        config="experiments/config.yaml",
    )

    rule measure:
        """One experiment E1..E8 on one GPU (independent jobs: they spread over GPUs)."""
        input:
            **MEASURE_INPUT,
        output:
            f"results/{HERE}/{{experiment}}.csv",
        wildcard_constraints:
            experiment="|".join(e for e in EXPERIMENTS if e not in SHARDED),
        log:
            f"logs/{HERE}/{{experiment}}.log",
        benchmark:
            f"results/{HERE}/benchmarks/{{experiment}}.tsv"
        params:
            slot=SLOT,
            py=PY,
            module=lambda w: EXPERIMENTS[w.experiment],
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.{params.module} --out {output} > {log} 2>&1"

    if SHARDED:

        rule measure_shard:
            """With several GPUs, one shard of a long experiment (E7, E8) per GPU: whole models each, about as many
            cells each (experiments.common.shard_cells)."""
            input:
                **MEASURE_INPUT,
            output:
                f"results/{HERE}/shards/{{experiment}}.{{shard}}-of-{SHARDS}.csv",
            wildcard_constraints:
                experiment="|".join(SHARDED),
                shard=r"\d+",
            log:
                f"logs/{HERE}/{{experiment}}.{{shard}}-of-{SHARDS}.log",
            benchmark:
                f"results/{HERE}/benchmarks/{{experiment}}.{{shard}}-of-{SHARDS}.tsv"
            params:
                slot=SLOT,
                py=PY,
                module=lambda w: EXPERIMENTS[w.experiment],
                shards=SHARDS,
            resources:
                gpu=1,
            shell:
                "{params.slot} {params.py} -m experiments.{params.module} --shard {wildcards.shard}/{params.shards} "
                "--out {output} > {log} 2>&1"

        rule merge_shards:
            """A sharded experiment's CSV: its shards' rows, in shard order (on the CPU)."""
            input:
                lambda w: [f"results/{HERE}/shards/{w.experiment}.{i}-of-{SHARDS}.csv" for i in range(SHARDS)],
            output:
                f"results/{HERE}/{{experiment}}.csv",
            wildcard_constraints:
                experiment="|".join(SHARDED),
            params:
                py=PY,
            shell:
                "{params.py} -m experiments.merge_shards --out {output} {input}"


rule figure:
    """One figure per question (and the two diagrams), PDF for the paper and PNG for the README, with the record
    of what it was drawn from."""
    input:
        data=lambda w: figure_data(w.res, w.fig),
        # its code, as its imports reach (paper/numbers/ where it shares an analysis with the numbers, the
        # library for the grouped diagram), and whatever else its last build was seen to read
        code=lambda w: code_closure(f"paper.figures.{w.fig}"),
        seen=lambda w: [p for p in recorded_inputs(f"figures/{w.res}/MANIFEST.json", w.fig)
                        if p not in figure_data(w.res, w.fig)],
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
