"""Compiles the hierarchical prefill lookup (int8 and bf16, 4K tokens over 512K) once so that XLA dumps its PTX
(run with XLA_FLAGS=--xla_dump_to=DIR); ``run.sh regs`` then reads each lookup kernel's registers and spills
with ``ptxas -v``.

    XLA_FLAGS=--xla_dump_to=DIR python benchmarks/results/gpu_h100_lookup_limits/regs.py
"""
import jax

from benchmarks.lookup_engines import ab_inputs, prefill_ab_calls
from pallas_kernels import centroid_lookup as cl

x = ab_inputs(False)
calls, _, _ = prefill_ab_calls(x)
for cfg in (cl.INT8_PREFILL, cl.DEFAULT_PREFILL):
  fn, args = calls["hierarchical"](cfg)
  jax.block_until_ready(fn(*args))
print("compiled")
