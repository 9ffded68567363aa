#!/bin/bash
# On an H200: the batched hierarchical decode at 512K (B = 1, 4, 8), then the speed suite's one-level
# end-to-end ask / ask_many rows at this commit (the H200 had not run the final TTFT code, bff2c79).
mkdir -p $OUT/res/hier512 $OUT/res/e2e
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 170 python -m benchmarks.batch_decode --method hierarchical --lengths 524288 --batches 1,4,8 \
  --out $OUT/res/hier512 > $OUT/res/hier512/log.txt 2>&1; echo "hier rc $?"
grep -v "^WARNING" $OUT/res/hier512/log.txt | grep -E "^\[L=|ERROR|Error|^\| " | tail -8
timeout 400 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches 4 \
  --out $OUT/res/e2e > $OUT/res/e2e/log.txt 2>&1; echo "e2e rc $?"
grep -E "^\[e2e\]" $OUT/res/e2e/log.txt | cut -c1-500
