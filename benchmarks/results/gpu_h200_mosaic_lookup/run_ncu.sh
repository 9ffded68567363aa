#!/bin/bash
# Nsight Compute sections of the prefill lookup kernels (ncu_probe.py) on one H200; writes $1/ncu.csv
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --clock-control none -k regex:"lookup|centroid" -c 8 --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats --csv --page details \
  python "$(dirname "$0")/ncu_probe.py" > "$1/ncu.csv" 2> "$1/ncu.err"
echo "ncu rc $?"; wc -l "$1/ncu.csv"; tail -3 "$1/ncu.err"
