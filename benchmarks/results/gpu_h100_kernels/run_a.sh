#!/bin/bash
# H100 (nvidia-h100-x1): compiled checks, then decode at 128K and 512K (the H200 runs' settings,
# gpu_h200_capture_keys/run_final_b.sh). Carry .scratch (captured keys, commit).
mkdir -p $OUT/res/checks $OUT/res/decode
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total --format=csv
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
timeout 200 python -m benchmarks.gpu_kernels --checks-only --out $OUT/res/checks > $OUT/res/checks/log.txt 2>&1; echo checks rc $?
grep -E "PASS|FAIL|ERROR" $OUT/res/checks/log.txt | tail -40
timeout 370 python -m benchmarks.speed --only-kernels --lengths 131072,524288 --phases decode --sparsities 0.9 --shapes 32x8 --budget-s 320 --out $OUT/res/decode > $OUT/res/decode/log.txt 2>&1; echo speed rc $?
grep -v "^WARNING" $OUT/res/decode/log.txt | grep -E "^\| 32/8|kept|ERROR" | head -40
cd $OUT && tar czf res.tgz res
