#!/bin/bash
# H100: the kernel benchmark at 512K (sparse decode kernel bytes and TB/s against a measured
# device-to-device copy, the clustered pipeline), then the speed suite's 512K decode again
# (a repeat of run_a.sh's, to see the spread). Carry .scratch.
mkdir -p $OUT/res/kernels $OUT/res/decode512_repeat
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 250 python -m benchmarks.gpu_kernels --skip-checks --no-sweep --lengths 524288 --budget-s 200 --out $OUT/res/kernels > $OUT/res/kernels/log.txt 2>&1; echo kernels rc $?
grep -E "copy|TB/s|^\| 524288" $OUT/res/kernels/gpu_kernels.md | head -20
timeout 280 python -m benchmarks.speed --only-kernels --lengths 524288 --phases decode --sparsities 0.9 --shapes 32x8 --budget-s 240 --out $OUT/res/decode512_repeat > $OUT/res/decode512_repeat/log.txt 2>&1; echo speed rc $?
grep -v "^WARNING" $OUT/res/decode512_repeat/log.txt | grep -E "^\| 32/8|ERROR" | head -20
cd $OUT && tar czf res.tgz res
