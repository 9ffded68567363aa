#!/bin/bash
mkdir -p $OUT/res/checks $OUT/res/prefill
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 200 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -E "PASS|FAIL|ERROR" $OUT/res/checks/log.txt | tail -30
timeout 370 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 330 --out $OUT/res/prefill > $OUT/res/prefill/log.txt 2>&1; echo speed rc $?
grep -v "^WARNING" $OUT/res/prefill/log.txt | tail -25
cd $OUT && tar czf res.tgz res
