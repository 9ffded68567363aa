"""Hardware counters of the prefill lookup passes (ncu): the hierarchical lookup of ``prefill_ab_calls`` (4K tokens
over 512K, Llama-3-8B attention, the synthetic tree), int8 (``INT8_PREFILL``) then bf16 (``DEFAULT_PREFILL``), each
warmed up, then one call each inside cuProfilerStart/Stop.

    ncu --profile-from-start off ... python benchmarks/results/gpu_h100_lookup_limits/ncu_probe.py
"""
import ctypes

import jax

from benchmarks.lookup_engines import ab_inputs, prefill_ab_calls
from pallas_kernels import centroid_lookup as cl

x = ab_inputs(False)
calls, _, _ = prefill_ab_calls(x)
fns = [calls["hierarchical"](cfg) for cfg in (cl.INT8_PREFILL, cl.DEFAULT_PREFILL)]
for fn, args in fns:
  for _ in range(3):
    jax.block_until_ready(fn(*args))
cuda = ctypes.CDLL("libcuda.so.1")
for fn, args in fns:
  cuda.cuProfilerStart()
  jax.block_until_ready(fn(*args))
  cuda.cuProfilerStop()
print("done", flush=True)
