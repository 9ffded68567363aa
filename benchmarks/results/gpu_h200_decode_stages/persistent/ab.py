"""Persistent cluster programs in the clustered attention kernel (ClusteredConfig.persistent_programs:
P programs per KV head, each attending to every P-th block of 128 clusters and loading the next
block's selection inputs before streaming the current one) against the shipped one-program-per-block
kernel, in one process: 512K and 128K, 32/8, speed-suite inputs, single-query and App. C thresholds.
busy_us: kernel time per call (profiler trace of 10 calls); loop_ms: 300 decodes in a fori_loop,
median of 5; max_abs_diff: output against the shipped kernel's."""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd())
from benchmarks.speed import Plan, KeySource, decode_threshold, _dense_fns_nocat
from benchmarks._meta import metadata, time_ms_looped
from benchmarks._profile import kernel_time_per_call
from pallas_kernels import cluster_sort_layout, clustered_decode_attention, ClusteredConfig
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ["OUT"]
T0 = time.time()
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
res = {"meta": {**metadata(), "keys": src.kind}, "rows": {}}
PS = [int(x) for x in os.environ.get("AB_P", "16,24,32,40,48,64,96").split(",")]
VARIANTS = [("default", {})] + [(f"P{p}", dict(persistent_programs=p)) for p in PS] + [("default_again", {})]
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
  row = {"T_single": float(tdec), "T_app_c": float(idx.threshold)}
  kk_ = jnp.concatenate([k, kn], axis=1).swapaxes(0, 1)[None]
  vv_ = jnp.concatenate([v, vn], axis=1).swapaxes(0, 1)[None]
  dense = _dense_fns_nocat(plan)["cudnn"]
  dsets = [(qq[None, None], kk_, vv_) for qq in qs]
  tr = kernel_time_per_call(dense, dsets, n=10, top=3)
  row["cudnn"] = {"busy_us": round(tr["busy_ms_per_call"] * 1e3, 2),
                  "loop_ms": round(time_ms_looped(lambda q, a, b: dense(q, a, b), [s[0] for s in dsets],
                                                  fixed=dsets[0][1:], n_iter=300, reps=5), 4)}
  del kk_, vv_
  print(L, "cudnn", row["cudnn"], flush=True)
  for tname, thr in (("single", tdec), ("app_c", float(idx.threshold))):
    fixed = (ks, vs, cent, off, jnp.float32(thr), kn, vn, qp, kvp)
    ref = None
    for name, kw in VARIANTS:
      f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas",
                                    config=ClusteredConfig(**kw)))
      try:
        o = np.asarray(f(qs[0], *fixed), np.float32)
        ref = o if ref is None else ref
        tr = kernel_time_per_call(f, [(q, *fixed) for q in qs], n=10, top=4)
        r = {"busy_us": round(tr["busy_ms_per_call"] * 1e3, 2),
             "kernels": {x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]},
             "loop_ms": round(time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=fixed, n_iter=300, reps=5), 4),
             "max_abs_diff": float(np.max(np.abs(o - ref)))}
        r["ratio_busy"] = round(row["cudnn"]["busy_us"] / r["busy_us"], 3)
        r["ratio_loop"] = round(row["cudnn"]["loop_ms"] / r["loop_ms"], 3)
      except Exception as e:  # noqa: BLE001
        r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      row[f"{tname}/{name}"] = r
      print(L, tname, name, r, f"{time.time() - T0:.0f}s", flush=True)
  res["rows"][str(L)] = row
  json.dump(res, open(f"{OUT}/persistent_ab.json", "w"), indent=1)
  del k, v, ks, vs
print("done", flush=True)
