"""A/B on one GPU: the prefill centroid-lookup kernels with (new) an added [Bc] bias instead of a
per-element select in the statistics pass and no clamp in the scoring pass, vs (old) the shipped
kernels (module copies cl_old / hl_old).  Speed-suite inputs: captured SmolLM2 keys tiled to 512K,
HierarchicalSqueezed / Squeezed(sparsity=0.9, n_sink=1), 4096 captured queries, 32/8 heads,
d = 128, bf16.  busy_ms: profiler kernel time per call (6 calls); old/new alternated twice."""
import functools, json, math, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "."); sys.path.insert(0, ".scratch/ab2")
from benchmarks.speed import Plan, KeySource
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import metadata
import cl_old, hl_old
from pallas_kernels import centroid_lookup as cl_new, hierarchical_lookup as hl_new
from sqjax.methods import ContextData, Squeezed, HierarchicalSqueezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
BE = os.environ.get("AB_BACKEND", "pallas")
L = int(os.environ.get("AB_L", "524288")); T = int(os.environ.get("AB_T", "4096"))
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
out = {"meta": {**metadata(), "L": L, "T": T, "timing": "busy_ms: profiler trace of 6 calls"}, "results": {}}
scale = 1.0 / math.sqrt(128)
k, v = src.kv(L, seed=L, n_heads=8)
q_obs = src.queries(100, seed=L, n_heads=32)[None]
data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
with dispatch.using("auto"):
  hidx = HierarchicalSqueezed(sparsity=0.9, n_sink=1).build(data)[0]
  idx = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
del k, v
qs = [src.queries(T, seed=100 * T + j, n_heads=32).astype(jnp.bfloat16) for j in range(3)]
h = hidx.layer(0); o = idx.layer(0)
bf = lambda x: x.astype(jnp.bfloat16)
hargs = (bf(h.centroids1), h.counts1, bf(h.centroids), h.counts, h.parent, jnp.asarray(hidx.threshold1, jnp.float32))
oargs = (bf(o.centroids), o.counts, jnp.asarray(idx.threshold, jnp.float32))
ref = {}
for rep in ("", "_2"):
  for name, hl, cl in (("old", hl_old, cl_old), ("new", hl_new, cl_new)):
    fh = jax.jit(functools.partial(hl.hierarchical_scores, scale=scale, vote="kv", backend=BE))
    fo = jax.jit(functools.partial(cl.centroid_lookup_prefill, scale=scale, vote="kv", backend=BE))
    s2, s1, cand, touched = fh(qs[0], *hargs)
    sel1, sc1 = fo(qs[0], *oargs)
    got = dict(s2=np.asarray(s2), s1=np.asarray(s1), sel1=np.asarray(sel1), sc1=np.asarray(sc1),
               cand=np.asarray(cand))
    r = {}
    if "old" in ref:
      a = ref["old"]
      for kk in ("s2", "s1", "sc1"):
        r[f"{kk}_max_rel_diff"] = float(np.max(np.abs(got[kk] - a[kk])) / max(np.max(np.abs(a[kk])), 1e-30))
      r["cand_diff"] = int(np.sum(got["cand"] != a["cand"])); r["sel1_diff"] = int(np.sum(got["sel1"] != a["sel1"]))
    ref.setdefault(name, got)
    r["nan"] = bool(np.isnan(got["s2"]).any() or np.isnan(got["sc1"]).any())
    if BE == "pallas":
      th = kernel_time_per_call(fh, [(qq, *hargs) for qq in qs], n=6, top=6)
      to = kernel_time_per_call(fo, [(qq, *oargs) for qq in qs], n=6, top=4)
      r["hier_busy_ms"] = round(th["busy_ms_per_call"], 4)
      r["hier_kernels"] = {x["name"][:28]: round(x["ms_per_call"], 4) for x in th["kernels"]}
      r["one_level_busy_ms"] = round(to["busy_ms_per_call"], 4)
      r["one_level_kernels"] = {x["name"][:28]: round(x["ms_per_call"], 4) for x in to["kernels"]}
    out["results"][name + rep] = r
    print(name + rep, r, flush=True)
    json.dump(out, open(f"{OUT}/ab_lookup_ops.json", "w"), indent=1)
print("done", flush=True)
