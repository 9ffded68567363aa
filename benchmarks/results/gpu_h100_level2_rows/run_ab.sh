#!/bin/bash
# A/B of the hierarchical level-2 program layout in one process: the batched hierarchical decode with
# CentroidLookupConfig().level2_rows (default: a KV head's rows share each level-2 program) against
# level2_rows=1 (one program per (KV head, row): the layout before 2026-11-25), 128K and 512K, B = 2, 4, 8.
mkdir -p $OUT/res/hier
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 540 python -m benchmarks.batch_decode --method hierarchical --batches 2,4,8 --ab-level2-rows 1 \
  --out $OUT/res/hier > $OUT/res/hier/log.txt 2>&1; echo "hier rc $?"
grep -v "^WARNING" $OUT/res/hier/log.txt | grep -E "^\[L=|ERROR|Error|^\| " | tail -30
