#!/bin/bash
mkdir -p $OUT/res/prefill
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 500 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 450 --out $OUT/res/prefill > $OUT/res/prefill/log.txt 2>&1; echo prefill rc $?
grep -v "^WARNING" $OUT/res/prefill/log.txt | grep -E "^\| 32/8|ERROR" | head -20
cd $OUT && tar czf res.tgz res
