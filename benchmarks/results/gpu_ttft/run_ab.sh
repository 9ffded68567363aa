#!/bin/bash
# H100: `ask` with the question's prefill without / with XLA command buffers, alternating.
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 540 python -m benchmarks.ttft_probe --ab --skip offline,kernels --e2e-ask-only --e2e-batches 0 --out $OUT/res > $OUT/res/log.txt 2>&1; echo "ab rc $?"
grep -E "^\[(ab|e2e)\]" $OUT/res/log.txt | cut -c1-900 | head -40
