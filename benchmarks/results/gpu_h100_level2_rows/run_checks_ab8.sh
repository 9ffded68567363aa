#!/bin/bash
# Every compiled-vs-reference kernel check at this commit, then the level-2 layout A/B again with
# level2_rows=8 (two rows' heads per program) against the default, B = 4, 8.
mkdir -p $OUT/res/checks $OUT/res/ab8
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 220 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -E "PASS|FAIL" $OUT/res/checks/gpu_kernels.md | grep -c PASS; grep -E "FAIL" $OUT/res/checks/gpu_kernels.md
timeout 330 python -m benchmarks.batch_decode --method hierarchical --batches 4,8 --ab-level2-rows 8 \
  --out $OUT/res/ab8 > $OUT/res/ab8/log.txt 2>&1; echo "ab8 rc $?"
grep -v "^WARNING" $OUT/res/ab8/log.txt | grep -E "^\[L=|ERROR|Error" | tail -8; tail -8 $OUT/res/ab8/batch_decode.md
