#!/bin/bash
# H100: where a question's prefill spends its host time; command buffers on stable buffers.
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 540 python -m benchmarks.ttft_probe --skip offline,kernels --e2e-ask-only --e2e-batches 0 --out $OUT/res > $OUT/res/log.txt 2>&1; echo "probe rc $?"
grep -E "^\[(probe|e2e)\]" $OUT/res/log.txt | cut -c1-900 | head -60
