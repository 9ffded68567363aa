#!/bin/bash
# tree-order level-2 kernel: compiled checks, then the decode lookup sweep (random tree, 512K)
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
mkdir -p $OUT/res/checks $OUT/res/sweep
timeout 200 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -E "PASS|FAIL|ERROR" $OUT/res/checks/log.txt | grep -v "^WARNING" | tail -32
timeout 330 python -m benchmarks.lookup_sweep --decode --out $OUT/res/sweep > $OUT/res/sweep/log.txt 2>&1; echo sweep rc $?
grep -E "^block_c|Fastest" $OUT/res/sweep/log.txt | tail -30
cd $OUT && tar czf res.tgz res
