#!/bin/bash
# `run.sh ablations|candidates`: ab_limits.py (ablations of the prefill lookup passes | the candidates; `limits` at 293dd38 ran the
# ablations and `pairs`); `run.sh ncu`: run_ncu.sh (Nsight Compute on the hierarchical lookup's passes); `run.sh checks`: the compiled
# checks; `run.sh int8|bf16`: the #8 prefill rows at 512K through the library path (`speed`, with `--lookup-int8` for
# int8), cuDNN measured in the same run.  Several words run in order; `int8_2` etc. repeat a word into its own folder.
# TAR=1: each word's folder comes back as one tarball (the machine returns at most 8 files).
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
for w in "$@"; do
  mkdir -p $OUT/$w
  case ${w%_[0-9]} in
    ablations|candidates|rows_wait|no_fma)
      timeout 400 env PYTHONPATH=. python benchmarks/results/gpu_h100_lookup_limits/ab_limits.py $OUT/$w ${w%_[0-9]} > $OUT/$w/log.txt 2>&1
      echo "$w rc $?"; grep -E "^\[|checks" $OUT/$w/log.txt | cut -c1-330 ;;
    int8|bf16)
      flag=$([ ${w%_[0-9]} = int8 ] && echo --lookup-int8)
      timeout 280 python -m benchmarks.speed --only-kernels --lengths 524288 --phases prefill --sparsities 0.9 --shapes 32x8 --budget-s 240 $flag --out $OUT/$w > $OUT/$w/log.txt 2>&1
      echo "$w rc $?"; grep -E "^\| 32/8 \| 524288 \| prefill_4k \| hsqueezed|\[dense" $OUT/$w/speed.md $OUT/$w/log.txt | grep -v '^--' | tail -12 ;;
    loop)
      for cb in default off; do
        flags=$([ $cb = off ] && echo "--xla_gpu_enable_command_buffer=")
        timeout 250 env PYTHONPATH=. XLA_FLAGS="$flags" python benchmarks/results/gpu_h100_lookup_limits/loop_probe.py $OUT/$w/loop_$cb.json > $OUT/$w/log_$cb.txt 2>&1
        echo "$w $cb rc $?"; grep -E "^per call|gaps" $OUT/$w/log_$cb.txt | cut -c1-400
      done ;;
    ncu)
      bash benchmarks/results/gpu_h100_lookup_limits/run_ncu.sh $OUT/$w ;;
    checks)
      timeout 240 python -m benchmarks.gpu_kernels --checks-only --out $OUT/checks > $OUT/checks/log.txt 2>&1; echo checks rc $?
      grep -c "| PASS" $OUT/checks/gpu_kernels.md; grep -E "FAIL|ERROR" $OUT/checks/gpu_kernels.md ;;
  esac
  [ -n "$TAR" ] && tar czf $OUT/$w.tgz -C $OUT $w && rm -rf $OUT/$w
done
