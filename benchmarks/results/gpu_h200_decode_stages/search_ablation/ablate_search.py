"""The clustered attention kernel with its per-tile row search ablated (512K and 128K, 32/8,
suite inputs, single-query and App. C thresholds): 'affine' loads rows j + delta0 (wrong rows, the
same number of tiles and bytes); 'search_mask' still computes the search but uses it only in the
softmax mask (loads affine). Kernel busy time per call, profiler trace of 10 calls."""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd())
from benchmarks.speed import Plan, KeySource, decode_threshold
from benchmarks._meta import metadata
from benchmarks._profile import kernel_time_per_call
from pallas_kernels import cluster_sort_layout, clustered_decode_attention, ClusteredConfig
from pallas_kernels import clustered_attention as CA
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ["OUT"]
T0 = time.time()
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
res = {"meta": {**metadata(), "keys": src.kind}, "rows": {}}
VARIANTS = [("default", set(), {}), ("affine", {"affine"}, {}), ("search_mask", {"search_mask"}, {}),
            ("affine_bk32", {"affine"}, dict(block_k=32)), ("default_bk32", set(), dict(block_k=32)),
            ("default_again", set(), {})]
for L in [int(x) for x in os.environ.get("AB_L", "524288,131072").split(",")]:
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  with dispatch.using("auto"):
    idx = Squeezed(sparsity=0.9, n_sink=1).build(ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale))[0]
  tdec = decode_threshold(idx, q_obs, scale, "kv", 0.9, "auto")
  ol = idx.layer(0)
  ks, vs, off = cluster_sort_layout(k, v, ol.labels, idx.n_sink, idx.n_tail, num_clusters=ol.counts.shape[-1])[:3]
  kn, vn = src.kv(1024, seed=7, n_heads=8)
  kvp = (L + jnp.arange(1024)).astype(jnp.int32)
  qp = jnp.asarray([L + 1023], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
  cent = ol.centroids.astype(jnp.bfloat16)
  row = {}
  for tname, thr in (("single", tdec), ("app_c", float(idx.threshold))):
    fixed = (ks, vs, cent, off, jnp.float32(thr), kn, vn, qp, kvp)
    for name, abl, kw in VARIANTS:
      CA._ABLATE.clear(); CA._ABLATE.update(abl); jax.clear_caches()
      f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas",
                                    config=ClusteredConfig(**kw)))
      try:
        f(qs[0], *fixed).block_until_ready()
        tr = kernel_time_per_call(f, [(q, *fixed) for q in qs], n=10, top=4)
        r = {"busy_us": round(tr["busy_ms_per_call"] * 1e3, 2),
             "kernels": {x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]}}
      except Exception as e:  # noqa: BLE001
        r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      row[f"{tname}/{name}"] = r
      print(L, tname, name, r, f"{time.time() - T0:.0f}s", flush=True)
  CA._ABLATE.clear()
  res["rows"][str(L)] = row
  json.dump(res, open(f"{OUT}/ablate_search.json", "w"), indent=1)
  del k, v, ks, vs
print("done", flush=True)
