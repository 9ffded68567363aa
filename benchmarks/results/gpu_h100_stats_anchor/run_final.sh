#!/bin/bash
# The anchored statistics pass as the default, two commands: `run_final.sh checks` (every compiled-vs-
# reference check) and `run_final.sh prefill` (the speed suite's prefill rows at 512K: 1K and 4K tokens,
# 1-level and hierarchical, 90%, cuDNN in the same run; the gpu_h100_kernels/run_b.sh settings).
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
if [ "$1" = checks ]; then
  mkdir -p $OUT/res/checks
  timeout 250 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
  grep -c "| PASS" $OUT/res/checks/gpu_kernels.md; grep -E "FAIL|ERROR" $OUT/res/checks/gpu_kernels.md
else
  mkdir -p $OUT/res/prefill
  timeout 560 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 500 --out $OUT/res/prefill > $OUT/res/prefill/log.txt 2>&1; echo speed rc $?
  grep -v "^WARNING" $OUT/res/prefill/log.txt | tail -25
fi
