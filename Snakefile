# moegemm: build and verify the kernels, run every GPU experiment, then rebuild figures, tables and paper.
#
#   snakemake --cores 1
#
# With a CUDA GPU every experiment runs fresh into results/<gpu-slug>/ and the write-up is built from those.
# Without one, the kernels are verified under Triton's interpreter and the write-up is rebuilt from the
# committed results of config["committed_results"]; no GPU number is ever produced on such a machine.

import sys
from pathlib import Path

from snakemake.utils import validate

from experiments.pipeline import local_gpus, machine_slug, results_slug

# The container every rule runs in when Snakemake is asked to use one (--sdm apptainer); the Dockerfile
# builds the same image with the project installed.
container: "docker://ghcr.io/pytorch/pytorch-nightly:2.12.0.dev20260408-cuda12.8-cudnn9-devel"

configfile: "experiments/config.yaml"
validate(config, "experiments/config.schema.yaml")

PY = sys.executable  # the interpreter running Snakemake, so a venv need not be activated
GPUS = local_gpus()
HERE = machine_slug(GPUS)  # what this machine measures/verifies into
SRC = sorted(str(p) for p in Path("src").rglob("*.py")) + sorted(str(p) for p in Path("tests").rglob("*.py"))

onstart:
    if GPUS:
        print(f"moegemm: GPU found ({GPUS[0]}): measuring fresh into results/{HERE}/")
    else:
        print(f"moegemm: no CUDA GPU here: verifying under the Triton interpreter; figures and paper are "
              f"rebuilt from the committed results/{config['committed_results']}/ (measured on that GPU).")


rule all:
    input:
        f"results/{HERE}/verify.json",


rule verify:
    """Run the kernel tests (interpreter on CPU, native on a GPU) and write a machine-readable report."""
    input:
        SRC,
    output:
        f"results/{HERE}/verify.json",
    log:
        f"logs/{HERE}/verify.log",
    params:
        py=PY,
    resources:
        gpu=1 if GPUS else 0,
    shell:
        "{params.py} -m experiments.verify --out {output} > {log} 2>&1"
