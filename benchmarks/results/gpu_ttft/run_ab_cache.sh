#!/bin/bash
# H100: `ask` with its empty cache made by its own dispatch (shipped) or inside the prefill, alternating.
# Ran at f1fe363 (the probe's --ab-cache mode was removed once ask made its cache inside the prefill).
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 540 python -m benchmarks.ttft_probe --ab-cache --skip offline,kernels --e2e-ask-only --e2e-batches 0 --out $OUT/res > $OUT/res/log.txt 2>&1; echo "ab-cache rc $?"
grep -E "^\[(abc|e2e)\]" $OUT/res/log.txt | cut -c1-900 | head -40
