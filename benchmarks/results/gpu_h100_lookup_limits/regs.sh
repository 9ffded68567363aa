#!/bin/bash
# The lookup kernels' registers, spills and SASS opcode census: XLA dumps the PTX of the hierarchical prefill
# lookup (regs.py, int8 and bf16), ptxas -v compiles every dumped PTX that holds the kernels, cuobjdump lists SASS.
# usage: regs.sh OUT_DIR
out=$1; mkdir -p $out; rm -rf /tmp/xd
env PYTHONPATH=. XLA_FLAGS=--xla_dump_to=/tmp/xd python benchmarks/results/gpu_h100_lookup_limits/regs.py > $out/compile.txt 2>&1
bin=$(dirname $(find / -name ptxas -type f 2>/dev/null | head -1)); echo "toolkit bin: $bin"; ls $bin | tr '\n' ' '; echo
echo "dumped file kinds:"; ls /tmp/xd | sed -E 's/^module_[0-9]+\.//; s/^[^.]*\.//' | sort | uniq -c | sort -rn | head -12
i=0
for f in $(grep -l "centroid_lookup" /tmp/xd/* 2>/dev/null | grep -v -E "\.txt$|\.pbtxt$"); do
  i=$((i+1)); echo "== $f"; cp $f $out/ 2>/dev/null
  case $f in
    *.ptx) $bin/ptxas -arch=sm_90a -v $f -o /tmp/k$i.cubin 2>&1 | grep -A3 "Compiling entry.*lookup" | grep -E "entry|Used|spill" ;
           $bin/cuobjdump -sass /tmp/k$i.cubin > $out/k$i.sass 2>&1; echo "sass lines $(wc -l < $out/k$i.sass)" ;;
  esac
done
