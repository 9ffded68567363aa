#!/bin/bash
# One device call: the prefill-route A/B (probe.py), then the speed suite's end-to-end `ask` rows
# (time to first token and decode of a Llama-3-8B-shaped model over a 128K context).
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
export PYTHONPATH=.
mkdir -p $OUT/probe $OUT/e2e
timeout 200 python benchmarks/results/gpu_prefill_paths/probe.py $OUT/probe > $OUT/probe/log.txt 2>&1; echo "probe rc $?"
grep -E "^\[(A|C)_" $OUT/probe/log.txt | sed -e 's/"kernels_per_call"/k/' | cut -c1-330
timeout 370 python -m benchmarks.speed --skip offline,kernels --e2e-ask-only --e2e-batches 4 --out $OUT/e2e > $OUT/e2e/log.txt 2>&1; echo "e2e rc $?"
grep -E "^\[e2e\]" $OUT/e2e/log.txt | cut -c1-400
