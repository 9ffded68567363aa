#!/bin/bash
# The hierarchical and 1-level prefill lookups (4K over 512K): running max vs anchored statistics, A/B in one process.
mkdir -p $OUT/res/ab
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 env PYTHONPATH=. python benchmarks/results/gpu_h100_stats_anchor/ab_anchor.py $OUT/res/ab > $OUT/res/ab/log.txt 2>&1; echo "ab rc $?"
grep -v "^WARNING" $OUT/res/ab/log.txt | grep -E "^\[|checks|Error" | tail -16
