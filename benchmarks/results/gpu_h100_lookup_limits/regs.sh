#!/bin/bash
# The lookup kernels' registers, spills and SASS: regs.py pulls the cubins out of jax's compilation cache,
# cuobjdump reads them.  usage: regs.sh OUT_DIR
out=$1; mkdir -p $out
env PYTHONPATH=. python benchmarks/results/gpu_h100_lookup_limits/regs.py $out > $out/compile.txt 2>&1; grep -v -i warn $out/compile.txt | tail -30
bin=$(dirname $(find / -name cuobjdump -type f 2>/dev/null | head -1))
rm -rf $out/cache
for f in $out/k*.cubin; do
  [ -f "$f" ] || continue
  $bin/cuobjdump -res-usage $f > ${f%.cubin}.res.txt 2>&1
  $bin/cuobjdump -sass $f > ${f%.cubin}.sass 2>&1
  grep -A1 -E "Function .*lookup" ${f%.cubin}.res.txt
  rm $f
done
cd $out && tar czf sass.tgz *.sass *.res.txt 2>/dev/null && rm -f *.sass *.res.txt
