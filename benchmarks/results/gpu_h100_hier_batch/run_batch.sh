#!/bin/bash
# B hierarchical decode rows over one shared fixed context (128K, 512K; B = 1, 2, 4, 8): B calls of
# clustered_decode_hierarchical (the hook's old lax.map route) vs one clustered_decode_hierarchical_batched
# call vs dense (row by row, rows folded); then the 1-level batched rows of the same run for comparison.
mkdir -p $OUT/res/hier $OUT/res/one_level
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 python -m benchmarks.batch_decode --method hierarchical --out $OUT/res/hier > $OUT/res/hier/log.txt 2>&1; echo "hier rc $?"
grep -v "^WARNING" $OUT/res/hier/log.txt | grep -E "^\[L=|ERROR|Error|^\| " | tail -20
timeout 170 python -m benchmarks.batch_decode --batches 1,4,8 --out $OUT/res/one_level > $OUT/res/one_level/log.txt 2>&1; echo "one-level rc $?"
grep -v "^WARNING" $OUT/res/one_level/log.txt | grep -E "^\[L=|ERROR|Error|^\| " | tail -20
