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
#
# The rules live in workflow/rules/, one file per stage, included below in pipeline order: common.smk (the
# configuration and the plan for this machine, workflow/plan.py), verify.smk, tune.smk (with a GPU: the
# tuners), measure.smk (with a GPU: the floors and E1-E9, sharded over several GPUs) and writeup.smk (figures,
# numbers and paper, from the results the plan names).

include: "workflow/rules/common.smk"


rule all:
    input:
        f"results/{HERE}/verify.json",
        [f"results/{HERE}/grouped_skew.csv"] if GPUS else [],
        expand("figures/{res}/{fig}.pdf", res=RES, fig=FIGURES),
        f"figures/{RES}/MANIFEST.json",
        f"paper/build/{RES}/generated/numbers.tex",
        ["paper/paper.pdf", "paper/pages.json", "paper/MANIFEST.json"] if TEX else [],
        "figures/hero.png",


include: "workflow/rules/verify.smk"
include: "workflow/rules/tune.smk"
include: "workflow/rules/measure.smk"
include: "workflow/rules/writeup.smk"
