#!/bin/bash
# Compile the Mosaic GPU lookup passes once (4K tokens over 512K) with Mosaic's PTX / ptxas dumps on
# (MOSAIC_GPU_DUMP_SASS=1 wrote no SASS file on the H200 of 2026-11-23); count each kernel's PTX
# instructions into $1/ptx_summary.txt and keep the dumps (without the MLIR pass logs) in $1/dump.tgz.
# ptx_26086f4/ came from the first version of this script (same compile and dump flags), which
# tarred the whole dump and tried to summarise SASS that was never written; its PTX, ptxas and
# resource files were copied out of that tarball by hand.
mkdir -p "$1/dump"
MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO="$1/dump" \
  python -c "
import jax, jax.numpy as jnp
from pallas_kernels.lookup_mosaic import DEFAULT_MOSAIC, lookup_prefill_scores_mosaic
q = jnp.ones((32, 4096, 128), jnp.bfloat16); c = jnp.ones((8, 26214, 128), jnp.bfloat16)
n = jnp.ones((8, 26214), jnp.int32)
jax.block_until_ready(lookup_prefill_scores_mosaic(q, c, n, scale=0.088, groups=8, cfg=DEFAULT_MOSAIC))
print('compiled')" > "$1/probe.log" 2>&1
rm -f "$1"/dump/*.mlir-passes.log
for f in "$1"/dump/*.ptx; do
  echo "=== $f"; grep -oE "^\s+(@%p[0-9]+ )?[a-z][a-z0-9_.]+" "$f" | awk '{print $NF}' | sort | uniq -c | sort -rn | head -30
done > "$1/ptx_summary.txt"
cat "$1"/dump/*.ptxas >> "$1/ptx_summary.txt"
tar czf "$1/dump.tgz" -C "$1" dump && rm -rf "$1/dump"
tail -3 "$1/probe.log"; cat "$1/ptx_summary.txt"
