#!/bin/bash
# the ncu probe of the 512K decode kernels (probe.py), one call on the lent H200
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
mkdir -p $OUT/res
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu=$NCU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader; uname -r
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 420 $NCU --profile-from-start off --clock-control none --set full \
  -o $OUT/res/probe -f python benchmarks/results/gpu_h200_ncu/probe.py > $OUT/res/log.txt 2>&1; echo "probe rc $?"
grep -v "^WARNING" $OUT/res/log.txt | tail -25
$NCU --import $OUT/res/probe.ncu-rep --page details --csv > $OUT/res/details.csv 2>&1
$NCU --import $OUT/res/probe.ncu-rep --page details > $OUT/res/details.txt 2>&1
grep -E "^  [a-zA-Z_]|Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit (Registers|Shared)|DRAM Throughput|Dynamic Shared|Warp Cycles Per Issued|Grid Size|Memory Throughput" $OUT/res/details.txt | head -200
cd $OUT && tar czf res.tgz res
