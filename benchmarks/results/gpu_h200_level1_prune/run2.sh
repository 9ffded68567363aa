#!/bin/bash
# Prefill 4K over 512K, hierarchical, level 1 ruling out 90% of the keys (the paper's kernel Table 9
# setting), then the default 50% in the same command as the control; results in one tarball (the
# machine returns at most 8 files).
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
for spec in "prefill 0.9" "prefill 0.5"; do
  set -- $spec
  d=$OUT/res/${1}_prune$2; mkdir -p $d
  timeout 220 python -m benchmarks.speed --only-kernels --lengths 524288 --phases $1 --sparsities 0.9 --shapes 32x8 \
    --level1-prune $2 --budget-s 190 --out $d > $d/log.txt 2>&1; echo "$1 prune $2 rc $?"
  grep -v "^WARNING" $d/log.txt | grep -E "^\| 32/8 \| 524288 \| prefill_4k|ERROR" | head -8
done
cd $OUT && tar czf res.tgz res && rm -rf res
