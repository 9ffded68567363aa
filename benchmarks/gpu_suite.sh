#!/bin/bash
# The whole speed suite on one GPU, split into words that each fit the lent machine's 10 minutes
# per command (run them on one warm machine, then join them with `python -m benchmarks.speed
# --merge`).  Each word's timeout is its upper bound; groups that fit one 600-s command:
# `checks decode512`, `decode128 decode32`, `prefill512`, `prefill128 prefill32`, `offline`,
# `int8`, `llama2`, `e2e`, `ttft`, `followup` (one length per kernel word: with the hierarchical rows at every sparsity, 32K
# and 128K in one word outran its deadline; prefill512 took 394 s on an H100 and 397 s on an H200;
# offline's four builds outran 320 s on an H100, where three took 317 s; llama2's builds take ~130 s
# on an H100, and at 330 s its prefill rows were cut).
# Every word measures its dense baselines in its own process.
#
#   bash benchmarks/gpu_suite.sh WORD [WORD ...]     ($OUT: where results go; carry .scratch)
#
#   checks      compiled-vs-reference checks of every kernel (benchmarks.gpu_kernels --checks-only)
#   decode512   decode at 512K, sparsity 0.7/0.8/0.9, Llama-3-8B shape (32/8)
#   decode128   decode at 128K, same
#   decode32    decode at 32K, same
#   prefill512  prefill of 1K and 4K tokens over 512K, 0.7/0.8/0.9, 32/8
#   prefill128  prefill at 128K, same
#   prefill32   prefill at 32K, same
#   int8        prefill over 512K at 0.9 with the opt-in int8 block lookup (Squeezed.lookup_int8)
#   llama2      Llama-2-7B shape (32/32): decode and prefill at 512K, 0.9
#   offline     clustering + calibration of 128K x 32 layers x 8 KV heads (1-level and hierarchical)
#   e2e         FixedContext.ask / ask_many of a Llama-3-8B-shaped model over a 128K context
#   ttft        the same model and context: ask's time to first token for 512- and 2048-token questions
#               (what a follow-up with that many tokens of earlier turns costs; 288 s on an H200)
#   followup    the same model and context: a follow-up's time to first token after a 2048-token first
#               turn, the turns' K/V kept (Conversation) against prefilled again
#   followup8k  the same after an 8192-token first turn (both lengths in one word outran 550 s on an H200)
#
# Keys: .scratch/captured/smollm2_qkv.npz (python -m benchmarks.capture_keys, on the CPU);
# the commit: .scratch/commit (the device copy has no .git).  TAR=1 packs each word's folder
# into one file (the machine returns at most 8 files).  SMOKE=1 checks the plumbing on a CPU
# (every command with --cpu-smoke and the CPU plan's tiny lengths and shapes, interpret mode).
# PY: the Python to run (default `python`; `.venv/bin/python` here).
export SQJAX_GIT_COMMIT=$(cat .scratch/commit 2>/dev/null)
export PYTHONUNBUFFERED=1
# the hierarchical rows at every sparsity of #8 (70/80/90%); the targets (90%, the 4K prefill) run
# first in each word, so a deadline cuts only the extra rows
HIER="--hier-sparsities 0.7,0.8,0.9"
[ -n "$SMOKE" ] || nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total --format=csv,noheader
speed() {  # speed WORD TIMEOUT_S ARGS...: one speed-suite process into $OUT/WORD
  local w=$1 t=$2 a=(); shift 2
  while [ $# -gt 0 ]; do  # SMOKE: the CPU plan's own tiny lengths and shapes
    case "$1" in --lengths|--shapes|--sparsities) [ -n "$SMOKE" ] && { shift 2; continue; } ;; esac
    a+=("$1"); shift
  done
  timeout "$t" ${PY:-python} -m benchmarks.speed ${SMOKE:+--cpu-smoke} --budget-s $((t - 40)) --out "$OUT/$w" "${a[@]}" > "$OUT/$w/log.txt" 2>&1
  echo "$w rc $? ($SECONDS s)"
  grep -hE "^\| 32/(8|32) \| [0-9]+ \| (decode|prefill)|^\[e2e\] (ask|follow-up)|offline\]|ERROR|Traceback" \
    "$OUT/$w/speed.md" "$OUT/$w/log.txt" 2>/dev/null | cut -c1-260 | head -40
}
for w in "$@"; do
  mkdir -p "$OUT/$w"
  case $w in
    checks)
      timeout 330 ${PY:-python} -m benchmarks.gpu_kernels ${SMOKE:+--cpu-smoke} --checks-only --out "$OUT/$w" > "$OUT/$w/log.txt" 2>&1
      echo "checks rc $? ($SECONDS s): $(grep -c '| PASS' "$OUT/$w/gpu_kernels.md") PASS"
      grep -E "\| (FAIL|ERROR)" "$OUT/$w/gpu_kernels.md" ;;
    decode512)  speed $w 330 --only-kernels --phases decode --lengths 524288 --shapes 32x8 $HIER ;;
    decode128)  speed $w 280 --only-kernels --phases decode --lengths 131072 --shapes 32x8 $HIER ;;
    decode32)   speed $w 240 --only-kernels --phases decode --lengths 32768 --shapes 32x8 $HIER ;;
    prefill512) speed $w 440 --only-kernels --phases prefill --lengths 524288 --shapes 32x8 $HIER ;;
    prefill128) speed $w 300 --only-kernels --phases prefill --lengths 131072 --shapes 32x8 $HIER ;;
    prefill32)  speed $w 260 --only-kernels --phases prefill --lengths 32768 --shapes 32x8 $HIER ;;
    int8)       speed $w 240 --only-kernels --phases prefill --lengths 524288 --sparsities 0.9 --shapes 32x8 --lookup-int8 ;;
    llama2)     speed $w 500 --only-kernels --lengths 524288 --sparsities 0.9 --shapes 32x32 ;;
    offline)    speed $w 460 --skip kernels,e2e ;;
    e2e)        speed $w 520 --skip offline,kernels --e2e-ask-only --e2e-batches 4,8 --e2e-question-tokens 0 ;;
    ttft)       speed $w 400 --skip offline,kernels --e2e-ask-only --e2e-batches 0 --e2e-question-tokens 512,2048 ;;
    followup)   speed $w 450 --skip offline,kernels --e2e-ask-only --e2e-batches 0 --e2e-question-tokens 0 \
                  --e2e-follow-up-tokens 2048 ;;
    followup8k) speed $w 500 --skip offline,kernels --e2e-ask-only --e2e-batches 0 --e2e-question-tokens 0 \
                  --e2e-follow-up-tokens 8192 ;;
    *) echo "unknown word: $w"; continue ;;
  esac
  [ -n "$TAR" ] && tar czf "$OUT/$w.tgz" -C "$OUT" "$w" && rm -rf "${OUT:?}/$w"
done
