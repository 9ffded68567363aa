#!/bin/bash
# probe2 with and without the dot merger, then probe3; JSON under $OUT/res
mkdir -p $OUT/res
PYTHONPATH=. timeout 200 python benchmarks/results/gpu_h200_e2e_gemv/probe2.py $OUT/res 2>&1 | grep -v "^WARNING\|^W1123\|^I1123" | tail -12
XLA_FLAGS="--xla_gpu_dot_merger_threshold_mb=0" PYTHONPATH=. timeout 200 python benchmarks/results/gpu_h200_e2e_gemv/probe2.py $OUT/res 2>&1 | grep -v "^WARNING\|^W1123\|^I1123" | grep "three dots"
PYTHONPATH=. timeout 200 python benchmarks/results/gpu_h200_e2e_gemv/probe3.py $OUT/res 2>&1 | grep -v "^WARNING\|^W1123\|^I1123" | tail -4
