"""A/B of the clustered decode's merge kernel tiling (head-dim columns per program, warps), 1-level
fused decode at 512K and 128K, speed-suite inputs; variants patched into the module, caches cleared
between them.  busy_us: profiler kernel time per call (6 calls); loop_ms: 300 decodes, median of 5."""
import functools, json, math, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped, metadata
from pallas_kernels import cluster_sort_layout, _common as cm
from pallas_kernels import clustered_attention as clat
from pallas_kernels._dispatch import pallas_call
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
orig = clat._merge_pallas

def variant(cols, warps):
  def merge(o, m, l, *, d, out_dtype, backend):
    hkv, n_prog, g, dp = o.shape
    clat.MERGE_COLS = cols
    kern = functools.partial(clat._merge_kernel, n_prog=n_prog, p2=max(16, cm.next_pow2(n_prog)), d=d)
    return pallas_call(kern, backend=backend, num_warps=warps, num_stages=1, grid=(hkv, g, cm.cdiv(dp, cols)),
                       out_shape=[jax.ShapeDtypeStruct((hkv, g, d), out_dtype), jax.ShapeDtypeStruct((hkv, g), jnp.float32)],
                       name="clustered_merge")(o, m, l)
  return merge

plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
out = {"meta": {**metadata(), "timing": "busy_us: profiler trace of 6 calls; loop_ms: 300 decodes, median of 5"}, "results": {}}
for L in (524288, 131072):
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  scale = 1.0 / math.sqrt(128)
  with dispatch.using("auto"):
    index = Squeezed(sparsity=0.9, n_sink=1).build(ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale))[0]
  ks, vs, off = cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                    num_clusters=index.layers.counts.shape[-1])[:3]
  del k, v
  cent = index.layer(0).centroids.astype(jnp.bfloat16)
  thr = jnp.float32(index.threshold)
  kn, vn = src.kv(1024, seed=7, n_heads=8)
  kvp = (L + jnp.arange(1024)).astype(jnp.int32); qp = jnp.asarray([L + 1023], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
  fixed = (ks, vs, cent, off, thr, kn, vn, qp, kvp)
  ref = None
  for name, cols, warps in (("c32_w4", 32, 4), ("c16_w4", 16, 4), ("c32_w2", 32, 2), ("c64_w4", 64, 4),
                            ("c16_w2", 16, 2), ("c32_w4_2", 32, 4), ("c128_w4", 128, 4)):
    clat._merge_pallas = variant(cols, warps)
    jax.clear_caches()
    f = jax.jit(functools.partial(clat.clustered_decode_attention, scale=scale, vote="kv", backend="pallas"))
    o = np.asarray(f(qs[0], *fixed), np.float32)
    ref = o if ref is None else ref
    tr = kernel_time_per_call(f, [(qq, *fixed) for qq in qs], n=6, top=4)
    loop = time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=fixed, n_iter=300, reps=5)
    r = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4), max_abs_diff=float(np.max(np.abs(o - ref))),
             kernels={x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]})
    out["results"][f"{L}/{name}"] = r
    print(L, name, r, flush=True)
    json.dump(out, open(f"{OUT}/ab_merge.json", "w"), indent=1)
clat._merge_pallas = orig
print("done", flush=True)
