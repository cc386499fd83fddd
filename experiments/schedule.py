"""The pipeline's predicted wall time on a host of G GPUs, before running it there.

The DAG is the Snakefile's own for such a host (``snakemake --dag --forceall`` with G GPUs of this kind
faked, so no GPU is needed). Each GPU job takes the wall time the committed 1-GPU run's benchmark files give
its step (``experiments.pipeline.run_times``; a step resumed over several device calls, their sum), scaled
to the current config's cells (experiments/budget.py; ``--as-measured``: not scaled); a
shard of an experiment split over G GPUs takes 1/G of it, as the shards deal about as many cells each (a
shard's own compiles and warm-up are not in that share, so it errs low). CPU jobs take ``--cpu-job-s`` each.
Jobs are started greedily, longest remaining path first, one GPU job per GPU (as ``gpu_slot`` pins them).

    python -m experiments.schedule --gpus 4 [--gpu "NVIDIA H200"] [--cpu-job-s 10] [--times-from RUN]
        [--calls 560 [--remeasure] [--step-overhead 8]]

Prints the predicted makespan, the critical path (unlimited GPUs), each GPU job's start and end, and the
makespan of a re-measurement, which reuses the committed outputs of the tuners (experiments/budget.py's
TUNERS: the library's tuned tables and the configs the peers' own searches chose); with
``--calls DEADLINE``, also the one-GPU run (``--remeasure``: the re-measurement) as the argument lists of
experiments/device_pipeline.sh, on a machine where no call may run longer than the deadline.
"""

from __future__ import annotations

import argparse
import heapq
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_RULES = (
    "verify",
    "floors",
    "tune",
    "tune_grouped",
    "tune_seed",
    "tune_unsloth",
    "measure",
    "measure_shard",
)


def dag(gpus: int, gpu_name: str) -> tuple[dict[int, dict], list[tuple[int, int]]]:
    """({node: {"rule", "wildcards"}}, [(before, after)]) of the Snakefile's DAG on a host of ``gpus``
    GPUs."""
    env = {**os.environ, "MOEGEMM_FAKE_GPUS": ",".join([gpu_name] * gpus)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--dag",
            "--forceall",
            "--cores",
            "32",
            "--resources",
            f"gpu={gpus}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    nodes, edges = {}, []
    for m in re.finditer(r'^\s*(\d+)\[label = "([^"]*)"', out, re.M):
        rule, *wc = m.group(2).split("\\n")
        nodes[int(m.group(1))] = {"rule": rule, "wildcards": dict(w.split(": ", 1) for w in wc)}
    for m in re.finditer(r"^\s*(\d+) -> (\d+)", out, re.M):
        edges.append((int(m.group(1)), int(m.group(2))))
    return nodes, edges


def durations(
    nodes: dict, gpus: int, step_s: dict[str, float], cpu_job_s: float, unmeasured: set | None = None
) -> dict[int, float]:
    """Each job's seconds. A GPU step with no committed time is ``unmeasured``: it takes 0 s and its name
    goes into that set (where given; else it is an error), so the prediction can say what it leaves out."""
    out = {}
    for i, n in nodes.items():
        rule, wc = n["rule"], n["wildcards"]
        if rule in ("measure", "measure_shard"):
            step = wc["experiment"]
        elif rule in GPU_RULES:
            step = rule
        else:
            out[i] = cpu_job_s if rule != "all" else 0.0
            continue
        if step not in step_s:
            if unmeasured is None:
                raise SystemExit(f"no benchmark file for step {step!r} in the committed results")
            unmeasured.add(step)
            out[i] = 0.0
            continue
        out[i] = step_s[step] / (gpus if rule == "measure_shard" else 1)
    return out


def schedule(nodes: dict, edges: list, dur: dict, gpus: int) -> tuple[float, float, list[tuple]]:
    """(makespan, critical path, [(start, end, label)] of the GPU jobs) by list scheduling."""
    succ: dict = {i: [] for i in nodes}
    preds: dict = {i: 0 for i in nodes}
    for a, b in edges:
        succ[a].append(b)
        preds[b] += 1
    tail: dict = {}

    def longest(i):  # the longest path from i's start to the end
        if i not in tail:
            tail[i] = dur[i] + max((longest(j) for j in succ[i]), default=0.0)
        return tail[i]

    critical = max(longest(i) for i in nodes)
    ready = [i for i in nodes if preds[i] == 0]
    running: list = []  # (end, node)
    free_gpus, t, done_at, log = gpus, 0.0, {}, []
    while ready or running:
        waiting = []
        for i in sorted(ready, key=lambda i: (-longest(i), i)):  # longest remaining path first
            is_gpu = nodes[i]["rule"] in GPU_RULES
            if is_gpu and free_gpus == 0:
                waiting.append(i)
                continue
            free_gpus -= is_gpu
            heapq.heappush(running, (t + dur[i], i))
            if is_gpu:
                wc = nodes[i]["wildcards"]
                log.append((t, t + dur[i], nodes[i]["rule"] + (" " + " ".join(wc.values()) if wc else "")))
        ready = waiting
        if not running:
            break
        t, i = heapq.heappop(running)
        done_at[i] = t
        free_gpus += nodes[i]["rule"] in GPU_RULES
        for j in succ[i]:
            preds[j] -= 1
            if preds[j] == 0:
                ready.append(j)
    return max(done_at.values()), critical, sorted(log)


# The one-GPU run's steps in the order device calls take them (experiments.pipeline.STEP_ORDER, with the CPU
# step between the grouped tuner and the experiments that read its table)
CALL_ORDER_CPU = {"distill_grouped": "tune_grouped"}  # {CPU step: the step it follows}


def call_plan(
    step_s: dict[str, float], deadline: float, order: list[str], step_overhead: float = 0.0
) -> list[list[tuple[str, float]]]:
    """The steps of ``order`` (each with its estimate from ``step_s``, 0 where it has none) packed, in order,
    into device calls of at most ``deadline`` seconds each (experiments/device_pipeline.sh's DEADLINE): a
    call takes the next step while its estimate plus ``step_overhead`` (Snakemake's start and dry run per
    target, which the benchmark files do not time) fits; a step longer than the deadline gets a call of its
    own (a measurement step then resumes in the next call, and pays its start again)."""
    calls: list[list[tuple[str, float]]] = []
    used = 0.0
    for step in order:
        est = float(step_s.get(step, 0.0))
        if not calls or used + est + step_overhead > deadline:
            calls.append([])
            used = 0.0
        calls[-1].append((step, est))
        used += est + step_overhead
    return calls


def call_order(remeasure: bool = False) -> list[str]:
    """The one-GPU run's steps in call order; with ``remeasure``, without the tuners and their CPU step
    (a re-measurement reuses their committed outputs)."""
    from experiments.budget import TUNERS
    from experiments.pipeline import STEP_ORDER

    out = []
    for step in STEP_ORDER:
        out.append(step)
        out += [cpu for cpu, after in CALL_ORDER_CPU.items() if after == step]
    skip = (
        set(TUNERS) | {cpu for cpu, after in CALL_ORDER_CPU.items() if after in TUNERS}
        if remeasure
        else set()
    )
    return [s for s in out if s not in skip]


def superseded_times(results: Path, run: str) -> dict[str, float]:
    """{step: seconds} of the steps that the superseded run ``run`` (results/<gpu>/runs/<run>/benchmarks,
    unpacked from runs.tar.xz) timed, as experiments.pipeline.run_times reads them."""
    from experiments.pipeline import run_times
    from experiments.runs_archive import runs_dir

    folder = runs_dir(results) / run
    times = run_times(folder) if (folder / "benchmarks").is_dir() else None
    if times is None:
        raise SystemExit(f"--times-from: {run!r} has no benchmark files under {folder}")
    return dict(zip(times.step, times.seconds))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--gpu", default="NVIDIA H200", help="the GPU kind whose committed results time the jobs")
    ap.add_argument(
        "--cpu-job-s", type=float, default=10.0, help="seconds per CPU job (figure, numbers, ...)"
    )
    ap.add_argument(
        "--as-measured",
        action="store_true",
        help="the committed step times as measured, not scaled to the current config",
    )
    ap.add_argument(
        "--times-from",
        metavar="RUN",
        help="a superseded run of results/<gpu>/runs/ (runs.tar.xz, as RUNS.md names it) whose step "
        "times replace the committed ones for the steps it timed: a what-if for a change the committed run "
        "predates",
    )
    ap.add_argument(
        "--calls",
        type=float,
        metavar="DEADLINE",
        help="also print the one-GPU run as device calls of at most DEADLINE seconds of estimates each "
        "(the argument lists of experiments/device_pipeline.sh)",
    )
    ap.add_argument(
        "--remeasure",
        action="store_true",
        help="with --calls: the re-measurement's calls (the tuners' committed outputs reused)",
    )
    ap.add_argument(
        "--step-overhead",
        type=float,
        default=8.0,
        help="with --calls: seconds per step that a call spends beyond the step's benchmark time "
        "(Snakemake's start and dry run)",
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from experiments.pipeline import run_times
    from moegemm._runtime import slugify

    times = run_times(ROOT / "results" / slugify(args.gpu))
    if times is None:
        raise SystemExit(f"no benchmark files for {args.gpu}")
    step_s = dict(zip(times.step, times.seconds))
    if args.times_from:
        step_s.update(superseded_times(ROOT / "results" / slugify(args.gpu), args.times_from))
    from experiments.budget import harness_estimates, scaled_step_times
    from experiments.common import load_config

    cfg = load_config(ROOT / "experiments" / "config.yaml")
    if not args.as_measured:  # the committed times scaled to the config's cells (experiments/budget.py)
        step_s = scaled_step_times(step_s, cfg)
    # steps with no benchmark file, priced from a run's own record (experiments/budget.py)
    records = harness_estimates(ROOT / "results" / slugify(args.gpu), cfg)
    estimated = {s: v for s, v in records.items() if s not in step_s}
    step_s.update({s: sec for s, (sec, _) in estimated.items()})
    nodes, edges = dag(args.gpus, args.gpu)
    unmeasured: set = set()
    dur = durations(nodes, args.gpus, step_s, args.cpu_job_s, unmeasured)
    makespan, critical, log = schedule(nodes, edges, dur, args.gpus)
    for start, end, label in log:
        print(f"{start:7.0f} {end:7.0f}  {label}")
    gpu_work = sum(d for i, d in dur.items() if nodes[i]["rule"] in GPU_RULES)
    print(
        f"{args.gpus} x {args.gpu}: predicted {makespan:.0f} s ({makespan / 60:.1f} min); critical path "
        f"{critical:.0f} s; GPU work {gpu_work:.0f} s ({gpu_work / args.gpus:.0f} s per GPU); CPU jobs "
        f"{args.cpu_job_s:.0f} s each"
    )
    # a re-measurement: the tuners' outputs committed and reused (budget.TUNERS), the rest as above
    from experiments.budget import TUNERS

    reuse = set(TUNERS) | set(CALL_ORDER_CPU)
    kept = {i: 0.0 if nodes[i]["rule"] in reuse else d for i, d in dur.items()}
    again, _, _ = schedule(nodes, edges, kept, args.gpus)
    tuners_s = sum(d for i, d in dur.items() if nodes[i]["rule"] in TUNERS)
    print(
        f"re-measurement (the tuners' outputs committed and reused: {', '.join(TUNERS)}, {tuners_s:.0f} s of "
        f"GPU work): predicted {again:.0f} s ({again / 60:.1f} min)"
    )
    for s, (sec, record) in sorted(estimated.items()):
        print(f"{s}: {sec:.0f} s estimated from its run's own record ({record}), not a benchmark file")
    if unmeasured:
        print(f"not in the prediction (no committed run yet): {', '.join(sorted(unmeasured))}")
    if args.calls:
        plan_s = {**{cpu: args.cpu_job_s for cpu in CALL_ORDER_CPU}, **step_s}
        order = call_order(args.remeasure)
        for n, call in enumerate(call_plan(plan_s, args.calls, order, args.step_overhead), 1):
            total = sum(est for _, est in call)
            steps = " ".join(f"{step}:{est:.0f}" for step, est in call)
            run = f"DEADLINE={args.calls:.0f} bash experiments/device_pipeline.sh {steps}"
            print(f"call {n} (~{total:.0f} s): {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
