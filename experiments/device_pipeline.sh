#!/usr/bin/env bash
# The GPU steps of the pipeline, run by Snakemake itself on a lent GPU machine that has torch and Triton but
# no Snakemake (its wheels are carried in .whl/) and on which no call may run past 10 minutes: the steps are
# spread over several calls, each given the steps still to run, in pipeline order, with an estimate of
# their seconds. A step starts only if its estimate fits before DEADLINE (default 540 s); it and the rest are
# left for the next call. Each step is one Snakemake run on its output files: this GPU's earlier results
# for that step are removed first, so every step measures afresh, and Snakemake records its wall time in
# results/<gpu>/benchmarks/<step>.tsv. Caches (Triton, Inductor) start cold on a fresh machine and are
# shared by the steps of one call, as in one `snakemake --cores 1`.
# Each call's checkout replaces the tracked files, among them the tuned tables and the results of the
# calls before (session 4 found E3-E7 running on the previous session's tables that way). So every call
# saves what the run has produced so far in $STATE (outside the checkout; the same machine keeps it while
# warm) and the next call puts it back before its first step. On a fresh machine $STATE is empty: copy the
# returned results.tgz into the checkout before the next call.
#   MOEGEMM_COMMIT=<sha> MOEGEMM_DIRTY=0 bash experiments/device_pipeline.sh STEP:SECONDS...
#   STEP: verify floors tune tune_grouped tune_seed, or an experiment's CSV name (grouped_skew, router_gemm, ...).
#   STEP+ (an experiment): resume from the cells an earlier call of this run finished (its <csv>.partial),
#   for an experiment longer than one call.
# Figures, numbers and the paper are then built from the results that come back, on any machine.
set -uo pipefail
cd "$(dirname "$0")/.."
t_start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SLUG=$(python3 -c "import torch; from moegemm._runtime import slugify; print(slugify(torch.cuda.get_device_name(0)))")
R=results/$SLUG
DEADLINE=${DEADLINE:-540}
OUT=${OUT:-/tmp/out}
STATE=${STATE:-/tmp/moegemm-run-${MOEGEMM_COMMIT:-nocommit}}  # one per run (per commit)
mkdir -p "$OUT" "$R/benchmarks"
if [ -d "$STATE/results" ]; then
  cp -a "$STATE/results/." results/ && cp -a "$STATE/tuned/." src/moegemm/tuned/ \
    && echo "restored this run's results and tuned tables from $STATE"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
echo "setup $((SECONDS - t_start))s"
outputs() {
  case $1 in
    verify) echo "$R/verify.json" ;;
    floors) echo "$R/floors.json" ;;
    tune) echo "$R/tune_decompose_k.csv src/moegemm/tuned/decompose_k/$SLUG.json" ;;
    tune_grouped) echo "$R/tune_grouped.csv src/moegemm/tuned/grouped/$SLUG.json" ;;
    tune_seed) echo "$R/tune_seed.csv" ;;
    *) echo "$R/$1.csv" ;;
  esac
}
for spec in "$@"; do
  step=${spec%%:*}; est=${spec##*:}
  resume=0; case $step in *+) step=${step%+}; resume=1 ;; esac
  left=$((DEADLINE - SECONDS))
  if [ "$est" -gt "$left" ]; then echo "=== $step and the steps after it not started: estimate ${est}s > ${left}s left"; break; fi
  t0=$SECONDS
  files=$(outputs "$step")
  for f in $files; do rm -f "$f"; [ $resume = 1 ] || rm -f "$f.partial"; done
  rm -f "$R/benchmarks/$step.tsv"
  [ $resume = 1 ] || rm -f "$R/benchmarks/$step.calls"
  case $step in verify|floors|tune|tune_grouped|tune_seed) rule=$step ;; *) rule=measure ;; esac
  # only this step's rule: the steps before it ran in this or an earlier call of the same run
  timeout -s INT "$left" python3 -m snakemake --cores 1 --allowed-rules $rule -- $files > "/tmp/smk-$step.log" 2>&1
  rc=$?
  grep -v "it/s]" "/tmp/smk-$step.log" | tail -3
  echo "=== $step rc=$rc $((SECONDS - t0))s (estimate ${est}s)"
  # this call's wall time for the step (a step resumed over several calls has one line per call; Snakemake's
  # benchmark file only covers the call that finished it)
  [ -f "$R/benchmarks/$step.calls" ] || printf 'seconds\trc\n' > "$R/benchmarks/$step.calls"
  printf '%s\t%s\n' "$((SECONDS - t0))" "$rc" >> "$R/benchmarks/$step.calls"
done
rm -rf "$STATE" && mkdir -p "$STATE" && cp -a results "$STATE/results" && cp -a src/moegemm/tuned "$STATE/tuned"
tar czf "$OUT/results.tgz" results src/moegemm/tuned 2>/dev/null
tar czf "$OUT/logs.tgz" logs /tmp/smk-*.log .snakemake/log 2>/dev/null
echo "call total $((SECONDS - t_start))s"
