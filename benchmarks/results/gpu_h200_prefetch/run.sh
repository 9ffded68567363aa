#!/bin/bash
# Compiled checks of the code as it stands, then the prefetch A/B at 512K (and 128K if time allows).
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 200 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks_log.txt 2>&1; echo "checks rc $?"
grep -E "PASS|FAIL|ERROR" $OUT/res/checks/gpu_kernels.md | awk -F'|' '{print $3}' | sort | uniq -c
OUT=$OUT/res timeout 330 python benchmarks/results/gpu_h200_prefetch/ab_prefetch.py 524288 > $OUT/res/ab_log.txt 2>&1; echo "ab rc $?"
grep -v "^WARNING" $OUT/res/ab_log.txt | grep -E "^(cudnn|single|app_c|done)" | cut -c1-330
tar czf $OUT/res.tgz -C $OUT res && rm -rf $OUT/res
