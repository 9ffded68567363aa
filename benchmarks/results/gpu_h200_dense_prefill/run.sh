#!/bin/bash
# Compiled checks (the new dense flash prefill check included), then the dense prefill routes.
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 200 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks_log.txt 2>&1; echo "checks rc $?"
grep -E "PASS|FAIL|ERROR" $OUT/res/checks/gpu_kernels.md | awk -F'|' '{print $3}' | sort | uniq -c
grep -E "FAIL|ERROR|flash" $OUT/res/checks/gpu_kernels.md | head
OUT=$OUT/res timeout 300 python benchmarks/results/gpu_h200_dense_prefill/bench.py > $OUT/res/bench_log.txt 2>&1; echo "bench rc $?"
grep -E "^\{|done" $OUT/res/bench_log.txt
tar czf $OUT/res.tgz -C $OUT res && rm -rf $OUT/res
