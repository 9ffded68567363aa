"""A/B on one GPU: the fused clustered decode with bf16 centroids (shipped) vs int8 centroids
(pallas_kernels.centroid_quant), on the speed suite's inputs (captured SmolLM2 keys tiled to L,
Squeezed(sparsity=0.9, n_sink=1), 5% centroids, 1024 new keys; Llama-3-8B attention 32/8, d=128,
bf16), cuDNN dense timed in the same run.  busy_us: profiler kernel time per call (6 calls);
loop_ms: 300 decodes in one jitted fori_loop, median of 5.  Correctness: each int8 run against
clustered_decode_attention_reference on the same Int8Centroids (selection flips, output error),
and int8 vs bf16 (selection agreement, rows, output difference)."""
import dataclasses, functools, json, math, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource, _dense_fns_nocat
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped, metadata
from pallas_kernels import cluster_sort_layout
from pallas_kernels.clustered_attention import (ClusteredConfig, clustered_decode_attention,
                                                clustered_decode_attention_reference)
from pallas_kernels.centroid_quant import quantize_centroids
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
BE = os.environ.get("AB_BACKEND", "pallas")
SMOKE = bool(os.environ.get("AB_SMOKE"))
BF16 = jnp.bfloat16
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
out = {"meta": {**metadata(), "timing": "busy_us: profiler trace of 6 calls; loop_ms: 300 decodes in a fori_loop, median of 5"},
       "results": {}}
save = lambda: json.dump(out, open(f"{OUT}/ab_int8.json", "w"), indent=1)
lengths = [int(x) for x in os.environ.get("AB_LENGTHS", "524288,131072").split(",")]
for L in lengths:
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  scale = 1.0 / math.sqrt(128)
  data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
  with dispatch.using("auto"):
    index = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
  ks, vs, off = cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                    num_clusters=index.layers.counts.shape[-1])[:3]
  li = index.layer(0)
  cent = li.centroids.astype(BF16)
  qc = quantize_centroids(cent)
  thr = jnp.asarray(index.threshold, jnp.float32)
  kn, vn = src.kv(1024, seed=7, n_heads=8)
  kvp = (L + jnp.arange(1024)).astype(jnp.int32)
  qp = jnp.asarray([L + 1023], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
  row = out["results"][str(L)] = {"num_c": int(cent.shape[1]), "centroid_bytes_bf16": int(cent.size * 2),
                                  "centroid_bytes_int8": int(qc.values.size + qc.row_scale.size * 4 + qc.col_scale.size * 4)}
  # dense baseline, same run
  kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
  vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
  cud = _dense_fns_nocat(plan)["cudnn"]
  dq = [qq[:, None].swapaxes(0, 1)[None] for qq in qs]
  if SMOKE:
    cud = _dense_fns_nocat(dataclasses.replace(plan, cpu=True))["xla"]
  tr = kernel_time_per_call(cud, [(qq, kk, vv) for qq in dq], n=6) or {"busy_ms_per_call": 1.0}
  row["cudnn"] = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2),
                      loop_ms=1.0 if SMOKE else round(time_ms_looped(cud, dq, fixed=(kk, vv), n_iter=300, reps=5), 4))
  print(L, "cudnn", row["cudnn"], flush=True)
  del kk, vv
  # correctness (int8 vs its reference; int8 vs bf16)
  refs = {}
  for name, c in (("bf16", cent), ("int8", qc)):
    f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend=BE, return_stats=True))
    r = jax.jit(functools.partial(clustered_decode_attention_reference, scale=scale, vote="kv", return_stats=True))
    o, sel, rows = f(qs[0], ks, vs, c, off, thr, kn, vn, qp, kvp)
    ro, rsel, rrows = r(qs[0], ks, vs, c, off, thr, kn, vn, qp, kvp)
    o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    refs[name] = (o, np.asarray(sel), np.asarray(rows))
    row[f"check_{name}"] = dict(rel_err_vs_reference=float(np.max(np.abs(o - ro)) / np.max(np.abs(ro))),
                                selection_flips_vs_reference=int(np.sum(np.asarray(sel) != np.asarray(rsel))),
                                rows=int(np.sum(rows)), nan=bool(np.isnan(o).any()))
    print(L, "check", name, row[f"check_{name}"], flush=True)
  s8, s16 = refs["int8"][1], refs["bf16"][1]
  row["int8_vs_bf16"] = dict(selected_bf16=int(s16.sum()), selected_int8=int(s8.sum()),
                             jaccard=float((s8 & s16).sum() / max((s8 | s16).sum(), 1)),
                             rows_ratio=float(refs["int8"][2].sum() / refs["bf16"][2].sum()),
                             out_rel_diff=float(np.max(np.abs(refs["int8"][0] - refs["bf16"][0])) / np.max(np.abs(refs["bf16"][0]))))
  print(L, "int8_vs_bf16", row["int8_vs_bf16"], flush=True)
  variants = [("bf16", cent, None), ("int8", qc, None), ("bf16_2", cent, None), ("int8_2", qc, None),
              ("int8_sb2", qc, 2), ("int8_sb8", qc, 8), ("int8_sb1", qc, 1)]
  for name, c, sb in variants:
    cfg = ClusteredConfig() if sb is None else ClusteredConfig(score_blocks=sb)
    f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend=BE, config=cfg))
    sets = [(qq, ks, vs, c, off, thr, kn, vn, qp, kvp) for qq in qs]
    if SMOKE:
      f(*sets[0]).block_until_ready()
      tr, loop = {"busy_ms_per_call": 1.0, "kernels": []}, 1.0
    else:
      tr = kernel_time_per_call(f, sets, n=6, top=4)
      loop = time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=sets[0][1:], n_iter=300, reps=5)
    r = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4),
             kernels={x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]})
    r["busy_ratio_vs_cudnn"] = round(row["cudnn"]["busy_us"] / r["busy_us"], 3)
    r["loop_ratio_vs_cudnn"] = round(row["cudnn"]["loop_ms"] / r["loop_ms"], 3)
    row[name] = r
    print(L, name, r, flush=True)
    save()
  save()
print("done", flush=True)
