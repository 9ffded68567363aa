#!/bin/bash
# int8 logits in the prefill lookup: the A/B (4K tokens over 512K) and every compiled-vs-reference check, one command.
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
mkdir -p $OUT/res/ab $OUT/res/checks
timeout 330 env PYTHONPATH=. python benchmarks/results/gpu_h100_int8_lookup/ab_int8.py $OUT/res/ab > $OUT/res/ab/log.txt 2>&1; echo "ab rc $?"
grep -v "^WARNING" $OUT/res/ab/log.txt | grep -E "^\[|checks|Error|error" | tail -24
timeout 240 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -c "| PASS" $OUT/res/checks/gpu_kernels.md; grep -E "FAIL|ERROR|int8" $OUT/res/checks/gpu_kernels.md
