#!/usr/bin/env bash
# On the lent GPU machine, from the repository root: the end-to-end A/B of the KV cache layout.
set -uo pipefail
export SQJAX_GIT_COMMIT=$(cat .scratch/commit)
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "$OUT/ab"
python benchmarks/results/gpu_h200_e2e_kvcache/ab_kvcache.py "$OUT/ab" > "$OUT/ab/log.txt" 2>&1
echo "rc $?"
grep -v "^\[e2e\]" "$OUT/ab/log.txt" | tail -30
