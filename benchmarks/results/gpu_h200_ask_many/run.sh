#!/bin/bash
# The speed suite's end-to-end section (Llama-3-8B-shaped model, random bf16 weights, 128K fixed
# context): `ask` (batch 1) and `ask_many` with BATCHES questions (default 4), Squeezed and full attention.
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 570 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches ${BATCHES:-4} --out $OUT/res > $OUT/res/log.txt 2>&1; echo "rc $?"
grep -E "^\[e2e\] (ask|squeezed:|full:|no-attention:)" $OUT/res/log.txt | cut -c1-260
tar czf $OUT/res.tgz -C $OUT res && rm -rf $OUT/res
