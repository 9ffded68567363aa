#!/bin/bash
# The anchored statistics pass: the hierarchical and 1-level prefill lookups (4K over 512K) A/B in one
# process, then lookup_sweep's checked sweep of the 1-level lookup over the shipped tiling x stats_anchor.
mkdir -p $OUT/res/ab $OUT/res/sweep
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 300 env PYTHONPATH=. python benchmarks/results/gpu_h100_stats_anchor/ab_anchor.py $OUT/res/ab > $OUT/res/ab/log.txt 2>&1; echo "ab rc $?"
grep -v "^WARNING" $OUT/res/ab/log.txt | grep -E "^\[|checks|Error" | tail -16
timeout 240 python -m benchmarks.lookup_sweep --out $OUT/res/sweep --budget-s 200 --grid '{"block_t": [128, 64], "block_c": [128], "num_warps": [4], "num_stages": [2], "tile_acc": [true], "score_block_t": [64], "score_block_c": [128], "score_warps": [4], "stats_anchor": [null, "rows", "tile"]}' > $OUT/res/sweep/log.txt 2>&1; echo "sweep rc $?"
grep -E "^\| |Fastest|Kernel time" $OUT/res/sweep/lookup_sweep.md | head -20
