"""A/B of the clustered decode's kernel B with the next tile's rows prefetched into registers
(``ClusteredConfig(prefetch_tiles=True)``) against the shipped kernel, in one process: speed-suite
keys (``benchmarks.capture_keys``), Llama-3-8B shape (32/8, d = 128, bf16), one decode token over
a fixed context of L (argv[1], default 524288) plus 1024 new keys; thresholds: single-query
(``speed.decode_threshold``, the suite's 512K headline row) and App. C (the index's). busy_us:
profiler trace of 6 calls; loop_ms: 300 decodes in a fori_loop, median of 5. Each variant's output
is compared with the jnp reference (relative error) and with the shipped kernel's (max |diff|)."""
import functools, json, math, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource, _dense_fns_nocat, decode_threshold
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped, metadata
from pallas_kernels import cluster_sort_layout
from pallas_kernels.clustered_attention import (ClusteredConfig, clustered_decode_attention,
                                                clustered_decode_attention_reference)
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
L = int(sys.argv[1]) if len(sys.argv) > 1 else 524288
BF16 = jnp.bfloat16
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
out = {"meta": {**metadata(), "L": L, "timing": "busy_us: profiler trace of 6 calls; loop_ms: 300 decodes in a "
                "fori_loop, median of 5; ratios against cuDNN timed the same ways in this process"},
       "results": {}}
path = f"{OUT}/ab_prefetch_{L}.json"
save = lambda: json.dump(out, open(path, "w"), indent=1)
k, v = src.kv(L, seed=L, n_heads=8)
q_obs = src.queries(100, seed=L, n_heads=32)[None]
scale = 1.0 / math.sqrt(128)
data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
with dispatch.using("auto"):
  index = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
thresholds = {"single_query": float(decode_threshold(index, q_obs, scale, "kv", 0.9, "auto")),
              "app_c": float(index.threshold)}
out["meta"]["thresholds"] = thresholds
ks, vs, off = cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                  num_clusters=index.layers.counts.shape[-1])[:3]
cent = index.layer(0).centroids.astype(BF16)
kn, vn = src.kv(1024, seed=7, n_heads=8)
kvp = (L + jnp.arange(1024)).astype(jnp.int32)
qp = jnp.asarray([L + 1023], jnp.int32)
qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
cud = _dense_fns_nocat(plan)["cudnn"]
dq = [qq[:, None].swapaxes(0, 1)[None] for qq in qs]
tr = kernel_time_per_call(cud, [(qq, kk, vv) for qq in dq], n=6)
cudnn = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2),
             loop_ms=round(time_ms_looped(cud, dq, fixed=(kk, vv), n_iter=300, reps=5), 4))
out["results"]["cudnn"] = cudnn
print("cudnn", cudnn, flush=True)
del kk, vv
variants = [("default", {}), ("prefetch_s1", dict(prefetch_tiles=True, num_stages=1)),
            ("prefetch_s2", dict(prefetch_tiles=True, num_stages=2)),
            ("prefetch_s1_bk32", dict(prefetch_tiles=True, num_stages=1, block_k=32)),
            ("prefetch_s3", dict(prefetch_tiles=True)), ("default_again", {})]
ref_fn = jax.jit(functools.partial(clustered_decode_attention_reference, scale=scale, vote="kv",
                                   return_stats=True))
for tname, t in thresholds.items():
  thr = jnp.asarray(t, jnp.float32)
  sets = [(qq, ks, vs, cent, off, thr, kn, vn, qp, kvp) for qq in qs]
  want, _, rows = ref_fn(*sets[0])
  want = np.asarray(want, np.float32)
  kept = float(np.mean(np.asarray(rows, np.float64)) / L)
  base = None
  for name, kw in variants:
    key = f"{tname}/{name}"
    try:
      cfg = ClusteredConfig(**kw)
      f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas", config=cfg))
      o = np.asarray(f(*sets[0]), np.float32)
      base = o if base is None else base
      tr = kernel_time_per_call(f, sets, n=6, top=4)
      loop = time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=sets[0][1:], n_iter=300, reps=5)
      r = dict(config=kw, threshold=t, kept_rows_fraction=round(kept, 4),
               busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4),
               rel_err_vs_reference=float(np.linalg.norm(o - want) / np.linalg.norm(want)),
               max_abs_diff_vs_default=float(np.max(np.abs(o - base))), nan=bool(np.isnan(o).any()),
               kernels={x["name"][:28]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]})
      r["busy_ratio_vs_cudnn"] = round(cudnn["busy_us"] / r["busy_us"], 3)
      r["loop_ratio_vs_cudnn"] = round(cudnn["loop_ms"] / r["loop_ms"], 3)
    except Exception as e:  # noqa: BLE001
      r = dict(config=kw, error=f"{type(e).__name__}: {str(e)[:400]}")
    out["results"][key] = r
    print(key, r, flush=True)
    save()
print("done", flush=True)
