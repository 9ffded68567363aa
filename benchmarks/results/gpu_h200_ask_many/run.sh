#!/bin/bash
# The speed suite's end-to-end section (Llama-3-8B-shaped model, random bf16 weights, 128K fixed
# context): batch-1 decode of every variant, `ask`, and now `ask_many` with 4 and 8 questions.
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 560 python -m benchmarks.speed --skip offline,kernels --out $OUT/res > $OUT/res/log.txt 2>&1; echo "rc $?"
grep -E "^\[e2e\] (ask|squeezed:|full:|no-attention:)" $OUT/res/log.txt | cut -c1-260
tar czf $OUT/res.tgz -C $OUT res && rm -rf $OUT/res
