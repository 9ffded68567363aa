# Diagnostic (commit 994a427): hierarchical prefill lookup, 4K tokens, 512K-shaped synthetic tree (lookup_sweep.decode_inputs, parents sorted as then), statistics x scoring splits; output in splits.txt.
"""Hierarchical prefill lookup: statistics / scoring splits (throwaway diagnostic)."""
import jax, jax.numpy as jnp, numpy as np
from benchmarks.lookup_sweep import DecodePlan, decode_inputs
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms
from pallas_kernels import hierarchical_lookup_prefill, hierarchical_lookup_reference, CentroidLookupConfig
from pallas_kernels.centroid_lookup import DEFAULT_PREFILL
import dataclasses
x = decode_inputs(DecodePlan())
q = jax.random.normal(jax.random.key(5), (32, 4096, 128), jnp.float32).astype(jnp.bfloat16)
t1, t2 = jnp.float32(x["t1"]), jnp.float32(x["t2"])
args = (q, x["c1"], x["n1"], x["c2"], x["n2"], x["parent"], t1, t2)
_, ref, rt = hierarchical_lookup_reference(q[:, :128], *args[1:], scale=x["scale"])
for ss, sc in ((1, None), (2, None), (4, None), (2, 2), (2, 8), (4, 8), (8, 8)):
  cfg = dataclasses.replace(DEFAULT_PREFILL, stats_splits=ss, score_splits=sc)
  f = jax.jit(lambda *a, cfg=cfg: hierarchical_lookup_prefill(*a, scale=x["scale"], config=cfg))
  _, got, gt = f(q[:, :128], *args[1:])
  err = float(np.max(np.abs(np.asarray(got) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))
  ms = time_ms(f, [args], reps=5)
  tr = kernel_time_per_call(f, [args], n=3, top=6)
  print(f"stats_splits {ss} score_splits {sc}: {ms:.3f} ms wall, {tr['busy_ms_per_call']:.3f} busy, err {err:.1e}, touched diff {int(np.max(np.abs(np.asarray(gt)-np.asarray(rt))))}; "
        + "; ".join(f"{k['name'][:26]} {k['ms_per_call']:.3f}" for k in tr["kernels"][:5]), flush=True)
