#!/bin/bash
# B decode rows over one shared fixed context (128K, 512K; B = 1, 2, 4, 8): Squeezed row by row vs
# dense row by row vs dense with the rows folded into one call.
mkdir -p $OUT/res
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 560 python -m benchmarks.batch_decode --out $OUT/res > $OUT/res/log.txt 2>&1; echo "rc $?"
grep -v "^WARNING" $OUT/res/log.txt | grep -E "^\[L=|ERROR|Error|^\| " | tail -20
