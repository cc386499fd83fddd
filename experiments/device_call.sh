#!/usr/bin/env bash
# One call on a lent GPU machine that has torch/triton but no Snakemake: run the given steps with the
# Triton and Inductor caches kept under .cache/ (carried between calls), and bring the results back.
#   bash experiments/device_call.sh STEP...      STEP in: tests gputests smoke floors tune e1 .. e7
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p .cache "${OUT:=/tmp/out}"
SLUG=$(python3 -c "import torch; from moegemm._runtime import slugify; print(slugify(torch.cuda.get_device_name(0)))")
R=results/$SLUG
mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
mkdir -p /tmp/logs
# Each step's full output goes to a log that comes back; the reply shows only its last lines.
# Steps stop at DEADLINE seconds (default 540) so that what was measured (resumable .partial files
# included) is packed and comes back before the call's limit.
DEADLINE=${DEADLINE:-540}
step() { local name=$1; shift; local t0=$SECONDS left=$((DEADLINE - SECONDS)); echo "=== $name: $*"
         if [ $left -le 10 ]; then echo "=== $name skipped: deadline"; return; fi
         timeout -s INT $left "$@" > /tmp/logs/$name.log 2>&1; local rc=$?
         grep -v "it/s]" /tmp/logs/$name.log | tail -4; echo "=== $name rc=$rc $((SECONDS-t0))s"; }
for s in "$@"; do
  case $s in
    tests) step tests python3 -m experiments.verify --out "$R/verify.json" -- -q -p no:cacheprovider ;;
    gputests) step gputests python3 -m experiments.verify --out "$R/verify.json" -- -m gpu -p no:cacheprovider ;;
    smoke) for e in e1_compile_modes e2_inductor_codegen e3_epilogue_fusion e4_split_sweep e5_decompose_k_grid e6_router_gemm e7_grouped_skew tune_decompose_k; do
             step "smoke-$e" python3 -m experiments.$e --quick --out "/tmp/smoke/$e.csv"; done ;;
    floors) step floors python3 -m experiments.floors --out "$R/floors.json" ;;
    tune) step tune python3 -m experiments.tune_decompose_k --out "$R/tune_decompose_k.csv" ;;
    tunegrouped) step tunegrouped python3 -m experiments.tune_grouped --out "$R/tune_grouped.csv" ;;
    e1) step e1 python3 -m experiments.e1_compile_modes --out "$R/compile_modes.csv" ;;
    e2) step e2 python3 -m experiments.e2_inductor_codegen --out "$R/inductor_codegen.csv" ;;
    e3) step e3 python3 -m experiments.e3_epilogue_fusion --out "$R/epilogue_fusion.csv" ;;
    e4) step e4 python3 -m experiments.e4_split_sweep --out "$R/split_sweep.csv" ;;
    e5) step e5 python3 -m experiments.e5_decompose_k_grid --out "$R/decompose_k_grid.csv" ;;
    e6) step e6 python3 -m experiments.e6_router_gemm --out "$R/router_gemm.csv" ;;
    e7) step e7 python3 -m experiments.e7_grouped_skew --out "$R/grouped_skew.csv" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
# Bring back: results (one tarball), smoke CSVs, caches (if small enough).
tar czf "$OUT/results.tgz" results src/moegemm/tuned 2>/dev/null
[ -d /tmp/smoke ] && tar czf "$OUT/smoke.tgz" -C /tmp smoke
tar czf "$OUT/logs.tgz" -C /tmp logs
tar czf /tmp/cache.tgz .cache 2>/dev/null && split -b 15M -d /tmp/cache.tgz "$OUT/cache.tgz.part"; ls -la "$OUT"
