#!/usr/bin/env bash
# Snakemake's GPU steps on a lent GPU machine that has torch and Triton but no Snakemake (its wheels are
# carried in .whl/), and on which no call may run past 10 minutes: the steps of one run are spread over
# several calls, each given the Snakemake targets still to run, in pipeline order.
#   MOEGEMM_COMMIT=<sha> MOEGEMM_DIRTY=0 bash experiments/device_pipeline.sh TARGET[:SECONDS][+]...
# <sha>: the commit of the code shipped, `python -m experiments.code_commit` where it was committed (the
# newest commit that changed code: a run spread over checkouts that differ only in results or write-up
# records one commit).
# TARGET: what `snakemake` takes: a rule without wildcards (e.g. verify, tune) or an output file (e.g.
# results/<gpu>/grouped_skew.csv), or a measurement step's name (grouped_skew: its CSV). Each target is one
# `snakemake --cores 1 --force` run of the rule that makes it, and of that rule only (--allowed-rules): what
# it needs was made by an earlier target of this run or is committed. It starts only if SECONDS (its
# estimate, default 0) fits before DEADLINE (default 540 s); it and the targets after it are otherwise left
# for the next call. With PACK_S (seconds, default 0: off), a step that does not fit starts anyway where at
# least PACK_S seconds are left, if its rule keeps its finished rows (a measurement or a tuner): it runs to
# the deadline, and the next call's TARGET+ goes on from its rows, so no device time is left idle (verify,
# a test run, and the rules that keep no rows are never started so).
# TARGET+ resumes the rows an earlier call of this run finished (<output>.partial); without +, the target
# measures afresh. Snakemake records each
# step's wall time in results/<gpu>/benchmarks/<step>.tsv; this adds one line per call to <step>.calls (a
# step resumed over several calls; experiments.pipeline.run_times sums them). Snakemake runs without its
# lock and reruns what a killed call left incomplete: one call at a time runs on the machine, and a call
# stopped at its deadline otherwise leaves a lock and incomplete-file marks that the next call's dry run
# trips over (it then finds no job for the target).
# On a host with several GPUs, `--` between targets splits them into lanes, one per GPU (the first lane on
# the first GPU of CUDA_VISIBLE_DEVICES, else of nvidia-smi, and so on): the lanes run at once, each its
# targets in order under the same DEADLINE, each Snakemake seeing its one GPU. A lane's targets may need
# only what is committed, made earlier in the same lane, or made by an earlier call (put a tuner and the
# experiments that read its table in one lane); and no lane may remake what another lane's targets read
# while they run (Snakemake deletes a forced job's outputs first: run verify, which every tuner and
# experiment reads, in a call of its own or at the head of the one lane that needs it). A target in two
# lanes, or more lanes than GPUs, is refused before any target runs; an empty lane is dropped.
# Each call's checkout replaces the tracked files, the tuned tables and the results of earlier calls among
# them, so every call saves what the run has produced in $STATE (outside the checkout; the machine keeps it
# while warm) and the next call puts it back first. A machine idle for half a minute is handed back, and the
# next call gets a fresh one without $STATE: carry the last call's results.tgz as .run-state/results.tgz
# (git-ignored), which a call without $STATE puts back instead. Figures, numbers and the paper are then
# built on any machine. The archive leaves out the superseded runs (runs/ and runs.tar.xz), which no GPU step
# writes and every checkout holds, so that it fits in the carry beside the Triton bundle and the peers.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${MOEGEMM_COMMIT+set}" ] && [ -z "$MOEGEMM_COMMIT" ]; then
  echo "MOEGEMM_COMMIT is set but empty (did python -m experiments.code_commit fail?)"; exit 2
fi
t_start=$SECONDS
python3 -m snakemake --version > /dev/null 2>&1 \
  || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SLUG=$(python3 -c "import torch; from moegemm._runtime import slugify
print(slugify(torch.cuda.get_device_name(0)))")
R=results/$SLUG
DEADLINE=${DEADLINE:-540}
PACK_S=${PACK_S:-0}
[[ $PACK_S =~ ^[0-9]+$ ]] || { echo "PACK_S: expected a whole number of seconds, got '$PACK_S'"; exit 2; }
OUT=${OUT:-/tmp/out}
STATE=${STATE:-/tmp/moegemm-run-${MOEGEMM_COMMIT:-nocommit}}  # one per run (per commit)
mkdir -p "$OUT" "$R/benchmarks"
if [ -d "$STATE/results" ]; then
  cp -a "$STATE/results/." results/ && cp -a "$STATE/tuned/." src/moegemm/tuned/ \
    && echo "restored this run's results and tuned tables from $STATE"
elif [ -f .run-state/results.tgz ]; then
  tar xzf .run-state/results.tgz \
    && echo "restored this run's results and tuned tables from the carried .run-state"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
echo "setup $((SECONDS - t_start))s"
# "rule|benchmark|output, output..." of the job that makes $1, from Snakemake's dry run
job() { python3 -m snakemake -n --cores 1 --force --nolock --rerun-incomplete -- "$1" 2>/dev/null | awk -v t="$1" '
  /^(local)?rule [^ ]+:$/ { r = $2; sub(/:$/, "", r); o = ""; b = "" }
  /^    output: / { o = substr($0, 13) }
  /^    benchmark: / { b = substr($0, 16) }
  /^    reason: / && o != "" && (r == t || index(", " o ", ", ", " t ", ")) { print r "|" b "|" o; exit }'; }
run_lane() {  # the targets of one lane, in order
  for spec in "$@"; do
    target=${spec%%:*}; est=0; [ "$target" = "$spec" ] || est=${spec##*:}
    resume=0; case $spec in *+) resume=1; target=${target%+}; est=${est%+} ;; esac
    left=$((DEADLINE - SECONDS))
    packed=0
    if [ "$est" -gt "$left" ]; then
      if [ "$PACK_S" -gt 0 ] && [ "$left" -ge "$PACK_S" ]; then
        packed=1
      else
        echo "=== $target and the targets after it not started: estimate ${est}s > ${left}s left"; break
      fi
    fi
    IFS='|' read -r rule bench outputs <<< "$(job "$target")"
    if [ -z "$rule" ] && [ "${target#*/}" = "$target" ]; then  # a measurement step by name: its CSV
      IFS='|' read -r rule bench outputs <<< "$(job "$R/$target.csv")" && [ -n "$rule" ] && target=$R/$target.csv
    fi
    if [ -z "$rule" ]; then echo "=== $target: no Snakemake job makes it"; continue; fi
    if [ $packed = 1 ]; then
      case $rule in
        measure|measure_shard|tune|tune_grouped|tune_seed|tune_unsloth)  # their finished rows are kept
          echo "=== $target started with $((DEADLINE - SECONDS))s left (estimate ${est}s): it stops at the deadline, its rows kept" ;;
        *) echo "=== $target and the targets after it not started: estimate ${est}s > ${left}s left (rule $rule keeps no rows)"; break ;;
      esac
    fi
    if [ $((DEADLINE - SECONDS)) -lt 1 ]; then  # timeout 0 would not limit it
      echo "=== $target and the targets after it not started: no time left"; break
    fi
    t0=$SECONDS
    step=$(basename "${bench:-$rule}" .tsv)
    for f in ${outputs//,/ }; do [ $resume = 1 ] || rm -f "$f.partial"; done
    [ $resume = 1 ] || rm -f "$R/benchmarks/$step.calls"
    MOEGEMM_KEEP_PARTIAL=1 timeout -s INT "$((DEADLINE - SECONDS))" python3 -m snakemake --cores 1 --force --nolock --rerun-incomplete --allowed-rules "$rule" \
      -- "$target" > "/tmp/smk-$step.log" 2>&1
    rc=$?
    # the step is recorded done: its rows' log goes (kept until now, MOEGEMM_KEEP_PARTIAL, so that a step
    # stopped after writing its CSV, which Snakemake then removes, resumes from its rows)
    [ $rc = 0 ] && for f in ${outputs//,/ }; do rm -f "$f.partial"; done
    grep -v "it/s]" "/tmp/smk-$step.log" | tail -3
    echo "=== $target rc=$rc $((SECONDS - t0))s (estimate ${est}s)"
    [ -f "$R/benchmarks/$step.calls" ] || printf 'seconds\trc\n' > "$R/benchmarks/$step.calls"
    printf '%s\t%s\n' "$((SECONDS - t0))" "$rc" >> "$R/benchmarks/$step.calls"
  done
}
# the lanes: the arguments split at each `--`, one newline-separated list per lane
lanes=(); cur=""
for a in "$@" --; do
  if [ "$a" = "--" ]; then [ -z "$cur" ] || lanes+=("$cur"); cur=""; else cur+="${cur:+$'\n'}$a"; fi
done
if [ ${#lanes[@]} -le 1 ]; then
  specs=(); [ ${#lanes[@]} = 0 ] || mapfile -t specs <<< "${lanes[0]}"
  run_lane ${specs[@]+"${specs[@]}"}
else
  twice=$(printf '%s\n' "${lanes[@]}" | sed 's/:.*//; s/+$//' | sort | uniq -d | head -1)
  if [ -n "$twice" ]; then echo "target $twice is in two lanes"; exit 2; fi
  gpus=()
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=',' read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
  else mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' '); fi
  if [ ${#lanes[@]} -gt ${#gpus[@]} ]; then
    echo "${#lanes[@]} lanes but ${#gpus[@]} GPUs (${gpus[*]:-}): one lane per GPU"; exit 2
  fi
  for i in "${!lanes[@]}"; do
    (
      export CUDA_VISIBLE_DEVICES=${gpus[$i]}
      mapfile -t specs <<< "${lanes[$i]}"
      run_lane "${specs[@]}"
    ) 2>&1 | while IFS= read -r line; do printf '[gpu%s] %s\n' "${gpus[$i]}" "$line"; done &
  done
  wait
fi
rm -rf "$STATE" && mkdir -p "$STATE" && cp -a results "$STATE/results" \
  && cp -a src/moegemm/tuned "$STATE/tuned"
tar czf "$OUT/results.tgz" --exclude='results/*/runs' --exclude='results/*/runs.tar.xz' results src/moegemm/tuned 2>/dev/null
tar czf "$OUT/logs.tgz" logs /tmp/smk-*.log .snakemake/log 2>/dev/null
echo "call total $((SECONDS - t_start))s"
