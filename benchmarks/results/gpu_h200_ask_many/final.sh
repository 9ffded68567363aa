#!/bin/bash
# Compiled checks of the code as it stands, then the end-to-end ask / ask_many rows (4 and 8 questions).
mkdir -p $OUT/res/e2e
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 170 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks_log.txt 2>&1; echo "checks rc $?"
grep -E "PASS|FAIL|ERROR" $OUT/res/checks/gpu_kernels.md | awk -F'|' '{print $3}' | sort | uniq -c
grep -E "FAIL|ERROR|flash" $OUT/res/checks/gpu_kernels.md | head
timeout 400 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches 4,8 --out $OUT/res/e2e > $OUT/res/e2e_log.txt 2>&1; echo "e2e rc $?"
grep -E "^\[e2e\] ask" $OUT/res/e2e_log.txt | cut -c1-220
tar czf $OUT/res.tgz -C $OUT res && rm -rf $OUT/res
