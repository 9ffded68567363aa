#!/bin/bash
# ncu on the prefill lookup passes (ncu_probe.py).  usage: run_ncu.sh OUT_DIR
out=$1; mkdir -p $out
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu=$NCU"
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 $NCU --profile-from-start off --clock-control none --set full \
  --import-source yes -k regex:centroid_lookup -o $out/lookup -f python benchmarks/results/gpu_h100_lookup_limits/ncu_probe.py \
  > $out/ncu_log.txt 2>&1; echo "ncu rc $?"
grep -v "^WARNING" $out/ncu_log.txt | tail -8
$NCU --import $out/lookup.ncu-rep --page details > $out/details.txt 2>&1
$NCU --import $out/lookup.ncu-rep --page raw --csv > $out/raw.csv 2>&1
$NCU --import $out/lookup.ncu-rep --page source --csv --print-source sass > $out/sass.csv 2>&1
ls -la $out; grep -E "^  [a-zA-Z_]|Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|Executed Ipc Active|L2 Cache Throughput|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|spill" $out/details.txt | head -150
