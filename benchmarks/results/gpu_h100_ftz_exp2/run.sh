#!/bin/bash
# `run.sh ab`: ab_ftz.py; `run.sh clamp|contiguous`: ab_score_kernel.py (clamp ran as ab_clamp.py); `run.sh checks`: the compiled checks; `run.sh int8|bf16`: the #8 prefill rows at 512K through
# the library path (`speed`, with `--lookup-int8` for int8), cuDNN measured in the same run. Several words run in order;
# `int8_2` etc. repeat a word into its own folder. TAR=1: each word's folder comes back as one tarball.
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
for w in "$@"; do
  mkdir -p $OUT/$w
  case ${w%_[0-9]} in
    ab)
      timeout 330 env PYTHONPATH=. python benchmarks/results/gpu_h100_ftz_exp2/ab_ftz.py $OUT/ab > $OUT/ab/log.txt 2>&1
      echo "ab rc $?"; grep -E "^\[|checks" $OUT/ab/log.txt | cut -c1-400 ;;
    clamp|contiguous)
      timeout 200 env PYTHONPATH=. python benchmarks/results/gpu_h100_ftz_exp2/ab_score_kernel.py $OUT/$w $w > $OUT/$w/log.txt 2>&1
      echo "$w rc $?"; grep -E "^\[|checks" $OUT/$w/log.txt | cut -c1-300 ;;
    int8|bf16)
      flag=$([ ${w%_[0-9]} = int8 ] && echo --lookup-int8)
      timeout 280 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 240 $flag --out $OUT/$w > $OUT/$w/log.txt 2>&1
      echo "$w rc $?"; grep -E "^\| 32/8 \| 524288 \| prefill_4k \| hsqueezed|\[dense" $OUT/$w/speed.md $OUT/$w/log.txt | grep -v '^--' | tail -12 ;;
    checks)
      timeout 240 python -m benchmarks.gpu_kernels --checks-only --out $OUT/checks > $OUT/checks/log.txt 2>&1; echo checks rc $?
      grep -c "| PASS" $OUT/checks/gpu_kernels.md; grep -E "FAIL|ERROR" $OUT/checks/gpu_kernels.md ;;
  esac
  [ -n "$TAR" ] && tar czf $OUT/$w.tgz -C $OUT $w && rm -rf $OUT/$w   # the machine returns at most 8 files
done
