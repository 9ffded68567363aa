"""Sweep of the clustered decode's scoring blocks per program at 512K (programs per wave:
~3 per SM fit), speed-suite inputs, busy (profiler, 6 calls) + 300-decode loop, cuDNN same run."""
import dataclasses, functools, json, math, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource, _dense_fns_nocat
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped, metadata
from pallas_kernels import cluster_sort_layout
from pallas_kernels.clustered_attention import ClusteredConfig, clustered_decode_attention, _make_plan
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
BF16 = jnp.bfloat16
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
out = {"meta": {**metadata(), "timing": "busy_us: profiler trace of 6 calls; loop_ms: 300 decodes in a fori_loop, median of 5"},
       "results": {}}
save = lambda: json.dump(out, open(f"{OUT}/ab_score_blocks.json", "w"), indent=1)
L = 524288
k, v = src.kv(L, seed=L, n_heads=8)
q_obs = src.queries(100, seed=L, n_heads=32)[None]
scale = 1.0 / math.sqrt(128)
data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
with dispatch.using("auto"):
  index = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
ks, vs, off = cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                  num_clusters=index.layers.counts.shape[-1])[:3]
cent = index.layer(0).centroids.astype(BF16)
thr = jnp.asarray(index.threshold, jnp.float32)
kn, vn = src.kv(1024, seed=7, n_heads=8)
kvp = (L + jnp.arange(1024)).astype(jnp.int32)
qp = jnp.asarray([L + 1023], jnp.int32)
qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
cud = _dense_fns_nocat(plan)["cudnn"]
dq = [qq[:, None].swapaxes(0, 1)[None] for qq in qs]
tr = kernel_time_per_call(cud, [(qq, kk, vv) for qq in dq], n=6)
out["results"]["cudnn"] = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2),
                               loop_ms=round(time_ms_looped(cud, dq, fixed=(kk, vv), n_iter=300, reps=5), 4))
print("cudnn", out["results"]["cudnn"], flush=True)
del kk, vv
ref = None
variants = [("auto", {}), ("sb3", dict(score_blocks=3)), ("sb5", dict(score_blocks=5)),
            ("sb5_s3", dict(score_blocks=5, score_stages=3)), ("sb6_s3", dict(score_blocks=6, score_stages=3)),
            ("sb4_s3", dict(score_blocks=4, score_stages=3)), ("auto_2", {})]
for name, kw in variants:
  cfg = ClusteredConfig(**kw)
  p = _make_plan(32, 8, L, cent.shape[1], 1024, 128, "kv", cfg)
  f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas", config=cfg))
  sets = [(qq, ks, vs, cent, off, thr, kn, vn, qp, kvp) for qq in qs]
  o = np.asarray(f(*sets[0]), np.float32)
  ref = o if ref is None else ref
  tr = kernel_time_per_call(f, sets, n=6, top=4)
  loop = time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=sets[0][1:], n_iter=300, reps=5)
  r = dict(config=kw, score_programs=p.hkv * p.n_a, busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4),
           max_abs_diff_vs_auto=float(np.max(np.abs(o - ref))),
           kernels={x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]})
  r["busy_ratio_vs_cudnn"] = round(out["results"]["cudnn"]["busy_us"] / r["busy_us"], 3)
  out["results"][name] = r
  print(name, r, flush=True)
  save()
print("done", flush=True)
