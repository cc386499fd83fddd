# The setup every stage shares: the container, the configuration (validated), and the plan for this machine
# (workflow/plan.py: its GPUs, where it verifies and measures into, which results the write-up is built from,
# the figures drawn), said at every start.

import shutil
import sys
from pathlib import Path

from snakemake.utils import validate

from experiments.pipeline import local_gpus
from paper.manifest import code_closure, recorded_inputs
from workflow.plan import EXPERIMENTS, FIGURE_INPUTS, GROUPED_EXPERIMENTS, SEED_EXPERIMENTS, plan, source_files

# The container every rule runs in when Snakemake is asked to use one (--sdm apptainer); the Dockerfile
# builds the same image with the project installed.
container: "docker://ghcr.io/pytorch/pytorch-nightly:2.12.0.dev20260408-cuda12.8-cudnn9-devel"

configfile: "experiments/config.yaml"
validate(config, "../../experiments/config.schema.yaml")  # a schema is named from this file's folder

PY = sys.executable  # the interpreter running Snakemake, so a venv need not be activated
PLAN = plan(local_gpus(), config["committed_results"])
GPUS = PLAN.gpus
HERE = PLAN.here  # what this machine verifies (and, with a GPU, measures) into
RES = PLAN.res  # what the write-up is built from
SRC = source_files()  # what the verify step tests
TEX = shutil.which("latexmk") is not None
# the tuners wait for verify; with keep_tuned a newer verify does not make them run again (their committed
# outputs are reused: the re-measurement the budget times), with it off (the default) it does
TUNER_VERIFY = (ancient if config.get("keep_tuned") else str)(f"results/{HERE}/verify.json")
SLOT = f"{PY} -m experiments.gpu_slot --"  # pins each GPU job to a free GPU of this host
# With several GPUs the longest experiments run as one shard per GPU, merged on the CPU (rules measure_shard,
# merge_shards); with one, as one job like the others.
SHARDS = PLAN.shards
SHARDED = PLAN.sharded
# The write-up reads every experiment measured for RES (on a GPU: all of them; without one, those whose
# committed CSV exists, so that a GPU with a partial set of results still builds).
WRITEUP = PLAN.writeup
FIGURES = PLAN.figures()
NUMBERS_CODE = sorted(set(["paper/make_numbers.py"]
                           + [str(p) for p in Path("paper/numbers").glob("*.py")]
                           + code_closure("paper.make_numbers")))

# What each build step of the write-up read and wrote, with sha256s (paper/manifest.py trace): gathered into
# figures/<gpu>/MANIFEST.json and paper/MANIFEST.json, so that a test can tell a committed output from a stale one
RECORDS = "paper/build/{res}/records"
TRACE = f"{PY} -m paper.manifest trace"

# Said at every start (a dry run included), so that nobody mistakes which GPU the write-up shows.
for line in PLAN.banner(TEX):
    print(line, file=sys.stderr)
