#!/bin/bash
# the compiled checks after the hierarchical-decode check fix
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
mkdir -p $OUT/res/checks
timeout 300 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -E "^\| " $OUT/res/checks/gpu_kernels.md | head -40
cd $OUT && tar czf res.tgz res
