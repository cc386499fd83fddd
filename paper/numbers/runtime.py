"""The pipeline's run times, from Snakemake's benchmark files (README and paper): the GPU run's steps, and
on a CPU the README's commands as a new user runs them (results/cpu/, written by .ci/record-cpu-times)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments.pipeline import STEP_ORDER, run_times

from .common import Numbers, commits_of


def runtime(n: Numbers, results: Path, gen: Path) -> None:
    """FullRunText: how long the GPU steps behind ``results`` took, from Snakemake's benchmark files."""
    df = run_times(results)
    if df is None:
        n.add("FullRunText", "were not timed (no benchmark files)")
        return
    missing = missing_steps(df)
    n.add(
        "FullRunText",
        (
            f"with a timing ({len(df)} of {len(STEP_ORDER)}; none yet for {', '.join(missing)})"
            if missing
            else ""
        )
        + f" took {df.seconds.sum() / 60:.1f} minutes",
    )


def runtime_block(results: Path, cpu: Path | None = None) -> str:
    """The README's run-time lines: the README's commands on a CPU (from ``cpu``, default results/cpu beside
    ``results``), then this GPU's run."""
    return cpu_paragraph(results.parent / "cpu" if cpu is None else cpu) + "\n\n" + gpu_paragraph(results)


def gpu_paragraph(results: Path) -> str:
    """The README's run-time line for this GPU."""
    df = run_times(results)
    if df is None:
        return "GPU run time: not recorded for these results (no benchmark files)."
    steps = ", ".join(
        f"{r.step} {r.seconds:.0f} s"
        + (f" over {r.calls} device calls, by device_pipeline.sh's clock" if r.calls > 1 else "")
        + (f" in {r.shards} shards on as many GPUs, summed" if r.shards > 1 else "")
        for r in df.itertuples()
    )
    missing = missing_steps(df)
    what = (
        f"the {len(df)} of {len(STEP_ORDER)} GPU steps with a benchmark file (none yet for "
        f"{', '.join(missing)})"
        if missing
        else "GPU steps"
    )
    from experiments.budget import TUNERS

    minutes = df.seconds.sum() / 60
    tuned = df[df.step.isin(TUNERS)]
    again = minutes - tuned.seconds.sum() / 60
    commits = step_commits(results)
    rest = {commits.get(s) for s in df.step if s not in TUNERS}
    where = (
        f" (every step but the tuners in one run at {next(iter(rest))[:7]}, the tuners where they last ran: "
        "RUNS.md)"
        if len(rest) == 1 and None not in rest
        else " where it last ran (not all in one run: RUNS.md)"
    )
    return (
        f"The GPU steps of `snakemake --cores 1` on one {gpu_name(results)}, each as Snakemake timed it"
        f"{where}: **{minutes:.1f} minutes** in sum for {what}; "
        f"without the tuners ({', '.join(tuned.step)}), whose committed outputs a re-measurement reuses, "
        f"**{again:.1f} minutes**; from the benchmark files in `results/{results.name}/benchmarks/` "
        f"({steps}; a step run after others on one machine found their compile caches warm, so a cold run "
        "takes longer)."
    )


# the file each GPU step writes whose rows (or provenance) name the commit it ran at
STEP_OUTPUT = {"verify": "verify.json", "floors": "floors.json", "tune": "tune_decompose_k.csv"}


def step_commits(results: Path) -> dict[str, str]:
    """{step: the commit its output was measured at} for the steps of STEP_ORDER whose output in ``results``
    names one (a CSV's git_commit column as :func:`common.commits_of` reads it, corrections applied; a JSON's
    provenance); a step whose rows name several commits maps to none of them and is left out."""
    out = {}
    for step in STEP_ORDER:
        f = results / STEP_OUTPUT.get(step, f"{step}.csv")
        if not f.exists() or not f.stat().st_size:
            continue
        if f.suffix == ".json":
            got = {(json.loads(f.read_text()).get("provenance") or {}).get("git_commit")}
        else:
            commits = commits_of(f)
            if commits is None:
                continue
            got = set(commits)
        # a row that names no commit (left empty, or "unknown" where the run had no git) names no run
        if len(got) == 1 and not got & {None, "", "nan", "unknown"}:
            out[step] = got.pop()
    return out


CPU_STEPS = ("install", "pipeline", "tests", "pipeline_warm", "tests_warm")  # .ci/record-cpu-times' steps


def cpu_times(cpu: Path) -> dict | None:
    """The README's commands timed on a CPU machine (.ci/record-cpu-times): {"steps": {step: wall seconds},
    "cpu_time": {step: CPU seconds of its processes, where recorded}, "jobs": {Snakemake job: seconds} of
    the cold pipeline run, "machine": its machine.json}; None where nothing was recorded."""
    bench = cpu / "benchmarks"
    rows = {
        s: pd.read_csv(bench / f"{s}.tsv", sep="\t").iloc[0]
        for s in CPU_STEPS
        if (bench / f"{s}.tsv").exists()
    }
    steps = {s: float(r["s"]) for s, r in rows.items()}
    if not steps or not (cpu / "machine.json").exists():
        return None
    jobs = {
        f.stem: float(pd.read_csv(f, sep="\t")["s"].iloc[0])
        for f in sorted((bench / "pipeline").glob("*.tsv"))
    }
    return {
        "steps": steps,
        "cpu_time": {s: float(r["cpu_time"]) for s, r in rows.items() if "cpu_time" in r},
        "jobs": jobs,
        "machine": json.loads((cpu / "machine.json").read_text()),
    }


def _took(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.1f} minutes"


def cpu_paragraph(cpu: Path) -> str:
    """The README's line on how long its commands take on a CPU, from the recorded run."""
    rec = cpu_times(cpu)
    if rec is None:
        return "CPU run times: not recorded (`python3 .ci/record-cpu-times --out results/cpu` records them)."
    s, jobs, m = rec["steps"], rec["jobs"], rec["machine"]

    def took(step: str) -> str:  # wall time, and the CPU time of the step's processes where recorded
        c = rec["cpu_time"].get(step)
        return _took(s[step]) + (f" ({_took(c)} of CPU time)" if c is not None else "")

    load = [v["mean"] for v in m.get("load_average_during", {}).values()]
    mach = m["machine"]
    lo, hi = (f"{min(load):.1f}", f"{max(load):.1f}") if load else ("", "")
    spread = lo if lo == hi else f"{lo}-{hi}"
    shared = (
        f", shared with other work (1-minute load average {spread} while it ran, so a machine of your "
        "own is faster)"
        # a step on every core keeps the load near the core count by itself: only well past it was the
        # machine shared
        if load and max(load) > 1.25 * mach["cores"]
        else ""
    )
    where = (
        f"On a CPU (timed by `.ci/record-cpu-times` in a fresh clone at {m['commit'][:7]}, on a "
        f"{mach['cores']}-core {mach['cpu']} machine with {mach['memory_gib']:.0f} GiB{shared}; "
        "`results/cpu/`): "
    )
    parts = []
    if "install" in s:
        parts.append(f"the install took {took('install')}")
    if "pipeline" in s:
        verify = jobs.get("verify")
        rest = sum(v for k, v in jobs.items() if k.startswith("figure_") or k == "numbers")
        detail = []
        if verify is not None:
            detail.append(
                f"the verify step {_took(verify)} of it (the kernels' correctness tests under the "
                "interpreter; the sm_90 compile check is the test command's)"
            )
        if rest:
            detail.append(f"figures and numbers {_took(rest)}")
        detail.append(
            f"the PDF {_took(jobs['paper'])}" if "paper" in jobs else "the PDF not built (no TeX there)"
        )
        warm = f" and {took('pipeline_warm')} again with the caches warm" if "pipeline_warm" in s else ""
        parts.append(
            f"`snakemake --cores 1` {took('pipeline')} from empty Triton and Inductor caches ("
            + "; ".join(detail)
            + ")"
            + warm
        )
    if "tests" in s:
        failed = [
            k
            for k in ("tests", "tests_warm")
            if m.get("load_average_during", {}).get(k, {}).get("exit_status", 0) != 0
        ]
        parts.append(
            f"the test command {took('tests')} from empty caches"
            + (f" and {took('tests_warm')} warm" if "tests_warm" in s else "")
            + f", on {mach['cores']} pytest-xdist workers"
            + (f" (with failures: {', '.join(failed)})" if failed else "")
        )
    labels = {
        "install": "the install",
        "pipeline": "the pipeline",
        "tests": "the test command",
        "pipeline_warm": "the pipeline warm",
        "tests_warm": "the tests warm",
    }
    untimed = [label for step, label in labels.items() if step not in s]
    if untimed:
        parts.append("not timed in that run: " + ", ".join(untimed))
    return where + "; ".join(parts) + "."


def missing_steps(df: pd.DataFrame) -> list[str]:
    return [s for s in STEP_ORDER if s not in set(df.step)]


def gpu_name(results: Path) -> str:
    return str(json.loads((results / "verify.json").read_text())["provenance"]["gpu"])


RUNTIME_START = "<!-- runtime:start (generated by paper/make_numbers.py; do not edit) -->"


RUNTIME_END = "<!-- runtime:end -->"
