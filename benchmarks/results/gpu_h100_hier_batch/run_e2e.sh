#!/bin/bash
# The speed suite's end-to-end `ask` / `ask_many` rows with the two-level (hierarchical) index: ask_many's
# decode steps now go through clustered_decode_hierarchical_batched.
mkdir -p $OUT/res/e2e_hier
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 560 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches 4 --e2e-method hierarchical \
  --out $OUT/res/e2e_hier > $OUT/res/e2e_hier/log.txt 2>&1; echo "e2e rc $?"
grep -E "^\[e2e\]" $OUT/res/e2e_hier/log.txt | cut -c1-700
