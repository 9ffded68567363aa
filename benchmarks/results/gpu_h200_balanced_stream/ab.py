"""The balanced streaming engine (ClusteredConfig(engine="balanced"): a selection kernel writing each
KV head's selected rows as compact index lists, then P programs per KV head streaming equal shares)
against the shipped one-launch kernel B (engine="clusters"), in one process: 512K and 128K, 32/8,
speed-suite inputs (captured SmolLM2 keys tiled), single-query and App. C thresholds, 1024 new keys.
busy_us: kernel time per call (profiler trace of 10 calls); loop_ms: 300 decodes in a fori_loop,
median of 5; max_abs_diff: output against the shipped kernel's; ref_diff: against the jnp reference."""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd())
from benchmarks.speed import Plan, KeySource, decode_threshold, _dense_fns_nocat
from benchmarks._meta import metadata, time_ms_looped
from benchmarks._profile import kernel_time_per_call
from pallas_kernels import (cluster_sort_layout, clustered_decode_attention, clustered_decode_attention_reference,
                            ClusteredConfig)
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ["OUT"]
T0 = time.time()
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
res = {"meta": {**metadata(), "keys": src.kind}, "rows": {}}
B = dict(engine="balanced")
VARIANTS = [("clusters", {}), ("bal", B),
            ("bal_P32", dict(B, stream_programs=32)), ("bal_P64", dict(B, stream_programs=64)),
            ("bal_P96", dict(B, stream_programs=96)), ("bal_P132", dict(B, stream_programs=132)),
            ("bal_cs512", dict(B, select_clusters=512)), ("bal_cs2048", dict(B, select_clusters=2048)),
            ("bal_st4", dict(B, num_stages=4)), ("bal_st2", dict(B, num_stages=2)),
            ("bal_bk32_st4", dict(B, block_k=32, num_stages=4)), ("bal_w8", dict(B, num_warps=8)),
            ("clusters_again", {}), ("bal_again", B)]
only = os.environ.get("AB_ONLY")
if only:
  VARIANTS = [v for v in VARIANTS if v[0] in only.split(",")]
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
    fref = jax.jit(functools.partial(clustered_decode_attention_reference, scale=scale, vote="kv", return_stats=True))
    oref, sref, rref = fref(qs[0], *fixed)
    oref = np.asarray(oref, np.float32)
    row[f"{tname}/kept"] = float(np.sum(np.asarray(rref)) / (8 * L))
    base = None
    for name, kw in VARIANTS:
      f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas",
                                    config=ClusteredConfig(**kw)))
      try:
        o = np.asarray(f(qs[0], *fixed), np.float32)
        fs = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas",
                                       config=ClusteredConfig(**kw), return_stats=True))
        _, s_, r_ = fs(qs[0], *fixed)
        base = o if base is None else base
        tr = kernel_time_per_call(f, [(q, *fixed) for q in qs], n=10, top=5)
        r = {"busy_us": round(tr["busy_ms_per_call"] * 1e3, 2),
             "kernels": {x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]},
             "loop_ms": round(time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=fixed, n_iter=300, reps=5), 4),
             "max_abs_diff": float(np.max(np.abs(o - base))), "ref_diff": float(np.max(np.abs(o - oref))),
             "same_selection": bool(np.array_equal(np.asarray(s_), np.asarray(sref))),
             "same_rows": bool(np.array_equal(np.asarray(r_), np.asarray(rref)))}
        r["ratio_busy"] = round(row["cudnn"]["busy_us"] / r["busy_us"], 3)
        r["ratio_loop"] = round(row["cudnn"]["loop_ms"] / r["loop_ms"], 3)
      except Exception as e:  # noqa: BLE001
        r = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
      row[f"{tname}/{name}"] = r
      print(L, tname, name, r, f"{time.time() - T0:.0f}s", flush=True)
  res["rows"][str(L)] = row
  json.dump(res, open(f"{OUT}/balanced_ab.json", "w"), indent=1)
  del k, v, ks, vs
print("done", flush=True)
