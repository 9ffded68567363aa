#!/bin/bash
mkdir -p $OUT/res/decode
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 500 python -m benchmarks.speed --only-kernels --lengths 131072,524288 --phases decode --sparsities 0.9 --shapes 32x8 --budget-s 420 --out $OUT/res/decode > $OUT/res/decode/log.txt 2>&1; echo speed rc $?
grep -v "^WARNING" $OUT/res/decode/log.txt | grep -E "^\| 32/8|kept|ERROR" | head -40
cd $OUT && tar czf res.tgz res
