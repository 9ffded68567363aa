#!/bin/bash
# The #8 prefill rows at 512K through the library path, twice in one command: Squeezed(lookup_int8=True)
# (`speed --lookup-int8`) and the default (bf16 logits), each with cuDNN measured in its own run.
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
for v in int8 bf16; do
  mkdir -p $OUT/res/prefill_$v
  flag=$([ $v = int8 ] && echo --lookup-int8)
  timeout 280 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 240 $flag --out $OUT/res/prefill_$v > $OUT/res/prefill_$v/log.txt 2>&1; echo "$v rc $?"
  grep -E "^\| 32/8 \| 524288 \| prefill_4k \| hsqueezed" $OUT/res/prefill_$v/speed.md
done
