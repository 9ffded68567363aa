#!/bin/bash
# H100: prefill of 1K and 4K tokens over 512K at 90% (1-level and hierarchical), the H200 runs'
# settings (gpu_h200_capture_keys/run_final_a.sh). Carry .scratch.
mkdir -p $OUT/res/prefill
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 560 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 500 --out $OUT/res/prefill > $OUT/res/prefill/log.txt 2>&1; echo speed rc $?
grep -v "^WARNING" $OUT/res/prefill/log.txt | tail -25
cd $OUT && tar czf res.tgz res
