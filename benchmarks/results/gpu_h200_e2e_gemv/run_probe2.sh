#!/bin/bash
PYTHONPATH=. timeout 200 python benchmarks/results/gpu_h200_e2e_gemv/probe2.py 2>&1 | grep -v "^WARNING\|^W1123\|^I1123" | tail -12
XLA_FLAGS="--xla_gpu_dot_merger_threshold_mb=0" PYTHONPATH=. timeout 200 python benchmarks/results/gpu_h200_e2e_gemv/probe2.py 2>&1 | grep -v "^WARNING\|^W1123\|^I1123" | grep "three dots"
