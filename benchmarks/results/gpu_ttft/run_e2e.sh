#!/bin/bash
# The speed suite's end-to-end `ask` / `ask_many` rows after FixedContext's prefills moved onto command buffers.
mkdir -p $OUT/res/e2e
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 560 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches 4 --out $OUT/res/e2e > $OUT/res/e2e/log.txt 2>&1; echo "e2e rc $?"
grep -E "^\[e2e\]" $OUT/res/e2e/log.txt | cut -c1-700
