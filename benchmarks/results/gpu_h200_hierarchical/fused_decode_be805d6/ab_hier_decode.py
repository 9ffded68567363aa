"""A/B on one GPU: hierarchical decode as (old) hierarchical_lookup_decode + clustered_decode_selected
(the lookup's selection -> indicator logits -> attention kernel) vs (new) clustered_decode_hierarchical
(level-2 logits and block statistics handed to the attention kernel: 4 launches), beside the 1-level
fused decode and cuDNN, on the speed suite's inputs (captured SmolLM2 keys tiled to L,
HierarchicalSqueezed / Squeezed(sparsity=0.9, n_sink=1), 1024 new keys, 32/8 heads, d = 128, bf16).
busy_us: profiler kernel time per call (6 calls); loop_ms: 300 decodes in one fori_loop, median of 5."""
import functools, json, math, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource, _dense_fns_nocat
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped, metadata
from pallas_kernels import (cluster_sort_layout, clustered_decode_attention, clustered_decode_hierarchical,
                            clustered_decode_hierarchical_reference, clustered_decode_selected,
                            hierarchical_lookup_decode)
from sqjax.methods import ContextData, Squeezed, HierarchicalSqueezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
BE = os.environ.get("AB_BACKEND", "pallas")
SMOKE = bool(os.environ.get("AB_SMOKE"))
BF16 = jnp.bfloat16
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
out = {"meta": {**metadata(), "timing": "busy_us: profiler trace of 6 calls; loop_ms: 300 decodes in a fori_loop, median of 5"},
       "results": {}}
save = lambda: json.dump(out, open(f"{OUT}/ab_hier_decode.json", "w"), indent=1)
for L in [int(x) for x in os.environ.get("AB_LENGTHS", "524288,131072").split(",")]:
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  scale = 1.0 / math.sqrt(128)
  data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
  with dispatch.using("auto"):
    hidx = HierarchicalSqueezed(sparsity=0.9, n_sink=1).build(data)[0]
    idx = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
  kn, vn = src.kv(1024, seed=7, n_heads=8)
  kvp = (L + jnp.arange(1024)).astype(jnp.int32)
  qp = jnp.asarray([L + 1023], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
  row = out["results"][str(L)] = {}
  if not SMOKE:
    kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
    vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
    cud = _dense_fns_nocat(plan)["cudnn"]
    dq = [qq[:, None].swapaxes(0, 1)[None] for qq in qs]
    tr = kernel_time_per_call(cud, [(qq, kk, vv) for qq in dq], n=6)
    row["cudnn"] = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2),
                        loop_ms=round(time_ms_looped(cud, dq, fixed=(kk, vv), n_iter=300, reps=5), 4))
    print(L, "cudnn", row["cudnn"], flush=True)
    del kk, vv
  hl = hidx.layer(0); ol = idx.layer(0)
  hks, hvs, hoff = cluster_sort_layout(k, v, hl.labels, hidx.n_sink, hidx.n_tail, num_clusters=hl.counts.shape[-1])[:3]
  oks, ovs, ooff = cluster_sort_layout(k, v, ol.labels, idx.n_sink, idx.n_tail, num_clusters=ol.counts.shape[-1])[:3]
  del k, v
  c1, c2 = hl.centroids1.astype(BF16), hl.centroids.astype(BF16)
  t1, t2 = jnp.float32(hidx.threshold1), jnp.float32(hidx.threshold)

  def old(q, ks, vs, c1, n1, c2, off, par, n2, t1, t2, kn, vn, qp, kvp):
    sel, _, _ = hierarchical_lookup_decode(q, c1, n1, c2, n2, par, t1, t2, scale=scale, vote="kv", backend=BE)
    return clustered_decode_selected(q, ks, vs, off, sel, kn, vn, qp, kvp, scale=scale, vote="kv", backend=BE)

  def new(q, ks, vs, c1, n1, c2, off, par, n2, t1, t2, kn, vn, qp, kvp):
    return clustered_decode_hierarchical(q, ks, vs, c1, n1, c2, off, par, t1, t2, kn, vn, qp, kvp, scale=scale,
                                         vote="kv", backend=BE)

  def one_level(q, ks, vs, c, off, t, kn, vn, qp, kvp):
    return clustered_decode_attention(q, ks, vs, c, off, t, kn, vn, qp, kvp, scale=scale, vote="kv", backend=BE)

  hfix = (hks, hvs, c1, hl.counts1, c2, hoff, hl.parent, hl.counts, t1, t2, kn, vn, qp, kvp)
  ofix = (oks, ovs, ol.centroids.astype(BF16), ooff, jnp.float32(idx.threshold), kn, vn, qp, kvp)
  ref = np.asarray(jax.jit(functools.partial(clustered_decode_hierarchical_reference, scale=scale, vote="kv"))(
      qs[0], hks, hvs, c1, hl.counts1, c2, hoff, hl.parent, t1, t2, kn, vn, qp, kvp), np.float32)
  outs = {}
  for name, fn, fixed in (("hier_old", old, hfix), ("hier_new", new, hfix), ("one_level", one_level, ofix),
                          ("hier_old_2", old, hfix), ("hier_new_2", new, hfix), ("one_level_2", one_level, ofix)):
    f = jax.jit(fn)
    o = np.asarray(f(qs[0], *fixed), np.float32)
    r = dict(rel_err_vs_hier_reference=float(np.max(np.abs(o - ref)) / np.max(np.abs(ref))) if "hier" in name else None,
             nan=bool(np.isnan(o).any()))
    outs[name] = o
    if name == "hier_new":
      r["max_abs_diff_vs_old"] = float(np.max(np.abs(o - outs["hier_old"])))
    if not SMOKE:
      sets = [(qq, *fixed) for qq in qs]
      tr = kernel_time_per_call(f, sets, n=6, top=8)
      r["busy_us"] = round(tr["busy_ms_per_call"] * 1e3, 2)
      r["kernels_per_call"] = tr.get("kernels_per_call")
      r["kernels"] = {x["name"][:32]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]}
      r["loop_ms"] = round(time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=fixed, n_iter=300, reps=5), 4)
      r["busy_ratio_vs_cudnn"] = round(row["cudnn"]["busy_us"] / r["busy_us"], 3)
      r["loop_ratio_vs_cudnn"] = round(row["cudnn"]["loop_ms"] / r["loop_ms"], 3)
    row[name] = r
    print(L, name, r, flush=True)
    save()
print("done", flush=True)
