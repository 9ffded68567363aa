#!/bin/bash
# The new-part A/B (ab_new_part.py) on one GPU.
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
mkdir -p $OUT/ab
timeout 400 env PYTHONPATH=. python benchmarks/results/gpu_h100_new_part/ab_new_part.py $OUT/ab 2>&1 | grep -v Warning | tee $OUT/ab/log.txt | tail -40
