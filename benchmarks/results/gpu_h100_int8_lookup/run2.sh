#!/bin/bash
# `run2.sh sweep`: int8 tilings (ab_int8.py --sweep); `run2.sh prefill JSON`: the #8 prefill rows at 512K with the
# int8 logits as the default (speed_int8.py; the run_final.sh settings of gpu_h100_stats_anchor).
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
if [ "$1" = sweep ] || [ "$1" = sweep2 ]; then
  mkdir -p $OUT/res/$1
  timeout 400 env PYTHONPATH=. python benchmarks/results/gpu_h100_int8_lookup/ab_int8.py $OUT/res/$1 --$1 > $OUT/res/$1/log.txt 2>&1; echo "$1 rc $?"
  grep -v "^WARNING" $OUT/res/$1/log.txt | grep -E "^\[|checks|Error|error" | tail -24
  if [ "$2" = checks ]; then
    mkdir -p $OUT/res/checks
    timeout 180 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
    grep -c "| PASS" $OUT/res/checks/gpu_kernels.md; grep -E "FAIL|ERROR" $OUT/res/checks/gpu_kernels.md
  fi
else
  mkdir -p $OUT/res/prefill
  timeout 560 env PYTHONPATH=. python benchmarks/results/gpu_h100_int8_lookup/speed_int8.py "$2" --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 500 --out $OUT/res/prefill > $OUT/res/prefill/log.txt 2>&1; echo speed rc $?
  grep -v "^WARNING" $OUT/res/prefill/log.txt | tail -25
fi
