#!/bin/bash
# H100: the speed suite's end-to-end ask / ask_many rows (8B-shaped model, 128K, 4 and 8 questions),
# then its offline section (clustering + calibration of 128K x 32 layers x 8 KV heads).
mkdir -p $OUT/res/e2e $OUT/res/offline
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 400 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches 4,8 --out $OUT/res/e2e > $OUT/res/e2e/log.txt 2>&1; echo "e2e rc $?"
grep -E "^\[e2e\] ask" $OUT/res/e2e/log.txt | cut -c1-220
timeout 170 python -m benchmarks.speed --skip kernels,e2e --out $OUT/res/offline > $OUT/res/offline/log.txt 2>&1; echo "offline rc $?"
grep -v "^WARNING" $OUT/res/offline/log.txt | grep -iE "offline|built|calib|cluster" | head -20
cd $OUT && tar czf res.tgz res
