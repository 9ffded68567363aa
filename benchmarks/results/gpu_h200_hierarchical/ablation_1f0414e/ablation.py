# Diagnostic (commit 1f0414e): the level-2 decode kernel with its row selection swapped; output in ablation.txt.
"""Ablation of the level-2 decode kernel (throwaway diagnostic, not committed)."""
import sys, jax, jax.numpy as jnp, numpy as np
from benchmarks.lookup_sweep import DecodePlan, decode_inputs
from benchmarks._profile import kernel_time_per_call
import pallas_kernels.centroid_lookup as CL
from pallas_kernels import hierarchical_lookup_decode, centroid_lookup_decode, CentroidLookupConfig
from pallas_kernels import _common as cm
from jax.experimental.pallas import triton as plgpu

orig = CL._level2_live
def v_all(refs, stats, *, kv, j, num_c, **k):
  return j < num_c
def v_parent(refs, stats, *, kv, j, num_c, num_p, **k):
  cv = j < num_c
  par = cm.gather_vec(refs[0], kv * num_c + j, cv, other=-1)
  return cv & (par >= 0) & (cm.krem(par, 10) < 3)      # ~30% of rows, parent chain only
def v_none(refs, stats, **k):
  live = orig(refs, stats, **k)
  return live & (jnp.max(stats[2]) > 1e30)                    # full level-1 work, no row loaded
def v_nogather(refs, stats, *, kv, j, num_c, **k):
  return (j < num_c) & (cm.krem(j, 10) < 3)             # ~30% of rows, no dependent chain
variants = {"current": orig, "all_rows": v_all, "parent_only_30pct": v_parent, "no_rows_loaded": v_none,
            "affine_30pct": v_nogather}
x = decode_inputs(DecodePlan())
t1, t2 = jnp.float32(x["t1"]), jnp.float32(x["t2"])
args = (x["q"], x["c1"], x["n1"], x["c2"], x["n2"], x["parent"], t1, t2)
for name, fn in variants.items():
  CL._level2_live = fn; jax.clear_caches()
  for cfg in (CentroidLookupConfig(), CentroidLookupConfig(num_warps=2, block_c=64)):
    f = jax.jit(lambda *a, cfg=cfg: hierarchical_lookup_decode(*a, scale=x["scale"], config=cfg))
    jax.block_until_ready(f(*args))
    tr = kernel_time_per_call(f, [args], top=3)
    print(name, cfg.block_c, cfg.num_warps, f"{tr['busy_ms_per_call']:.4f}", "; ".join(f"{k['name'][:30]} {k['ms_per_call']:.4f}" for k in tr["kernels"]), flush=True)
CL._level2_live = orig
f = jax.jit(lambda q, c, n, t: centroid_lookup_decode(q, c, n, t, scale=x["scale"]))
tr = kernel_time_per_call(f, [(x["q"], x["c2"], x["n2"], t2)], top=3)
print("one_level", f"{tr['busy_ms_per_call']:.4f}", "; ".join(f"{k['name'][:30]} {k['ms_per_call']:.4f}" for k in tr["kernels"]))
