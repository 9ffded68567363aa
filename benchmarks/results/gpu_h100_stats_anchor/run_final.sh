#!/bin/bash
# The anchored statistics pass as the default: every compiled-vs-reference check, then the speed suite's
# prefill rows at 512K (1K and 4K tokens, 1-level and hierarchical, 90%) with cuDNN in the same run.
mkdir -p $OUT/res/checks $OUT/res/prefill
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 220 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -c "| PASS" $OUT/res/checks/gpu_kernels.md; grep -E "FAIL|ERROR" $OUT/res/checks/gpu_kernels.md
timeout 370 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 330 --out $OUT/res/prefill > $OUT/res/prefill/log.txt 2>&1; echo speed rc $?
grep -v "^WARNING" $OUT/res/prefill/log.txt | grep -E "prefill|kept|ERROR" | tail -25
