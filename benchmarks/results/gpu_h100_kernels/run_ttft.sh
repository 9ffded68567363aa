#!/bin/bash
# H100: compiled checks (with the left-padded prefill lookups), then the end-to-end ask rows with
# the question's prefill profiled (one question; batches off).
mkdir -p $OUT/res/checks $OUT/res/e2e
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 200 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -E "\| (PASS|FAIL|ERROR)" $OUT/res/checks/gpu_kernels.md | awk -F'|' '{print $3}' | sort | uniq -c
grep -E "FAIL|ERROR|padded" $OUT/res/checks/gpu_kernels.md | head
timeout 330 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches 0 --out $OUT/res/e2e > $OUT/res/e2e/log.txt 2>&1; echo "e2e rc $?"
grep -E "^\[e2e\] ask" $OUT/res/e2e/log.txt | cut -c1-700
