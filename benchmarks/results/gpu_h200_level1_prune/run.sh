#!/bin/bash
# The hierarchical rows at 512K with level 1 ruling out 90% of the keys (the paper's kernel
# Table 9 setting) and 75%, beside the 1-level rows of the same runs.
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/res/gpu.txt 2>&1
for spec in "decode 0.9" "prefill 0.9" "prefill 0.75"; do
  set -- $spec
  d=$OUT/res/${1}_prune$2; mkdir -p $d
  timeout 200 python -m benchmarks.speed --only-kernels --lengths 524288 --phases $1 --sparsities 0.9 --shapes 32x8 \
    --level1-prune $2 --budget-s 170 --out $d > $d/log.txt 2>&1; echo "$1 prune $2 rc $?"
  grep -v "^WARNING" $d/log.txt | grep -E "^\| 32/8|ERROR" | head -14
done
