"""Where the tree level-2 kernel's time goes (512K and 128K, 32/8, suite inputs, App. C T1):
the kernel alone (kernel busy time, profiler trace of 10 calls) with parts left out
(tree_lookup._ABLATE: no logits store, no row search (affine rows), no tile loop) and other
tilings; candidates against hierarchical_lookup_reference's."""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd())
from benchmarks.speed import Plan, KeySource
from benchmarks._meta import metadata
from benchmarks._profile import kernel_time_per_call
import pallas_kernels as pk
from pallas_kernels import tree_lookup as TL
from pallas_kernels.centroid_lookup import CentroidLookupConfig, lookup_decode_raw
from sqjax.methods import ContextData, HierarchicalSqueezed
from sqjax import dispatch

OUT = os.environ["OUT"]
BE = os.environ.get("AB_BACKEND", "pallas")
T0 = time.time()
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
res = {"meta": {**metadata(), "keys": src.kind}, "rows": {}}
VARIANTS = [("default", set(), {})] + [
    (f"p{p}_bk{bk}", set(), dict(parents=p, block_k=bk)) for p in (16, 32, 64, 128) for bk in (32, 64)] + [
    ("p16_bk16", set(), dict(parents=16, block_k=16)), ("p32_w2", set(), dict(parents=32, num_warps=2)),
    ("p32_s1", set(), dict(parents=32, num_stages=1)), ("p32_nostore", {"nostore"}, dict(parents=32)),
    ("p32_nosearch", {"nosearch"}, dict(parents=32)), ("default_again", set(), {})]
for L in [int(x) for x in os.environ.get("AB_L", "524288,131072").split(",")]:
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  with dispatch.using("auto"):
    ix = HierarchicalSqueezed(sparsity=0.9, n_sink=1).build(ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale))[0]
  li = ix.layer(0)
  c1, n1, c2, n2, par = li.centroids1.astype(k.dtype), li.counts1, li.centroids.astype(k.dtype), li.counts, li.parent
  tree = pk.tree_layout(c2, n2, par, c1.shape[1])
  qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
  t1 = jnp.float32(ix.threshold1)
  cfg = CentroidLookupConfig()
  raws = [lookup_decode_raw(q, c1, n1, scale=scale, groups=8, cfg=cfg, backend=BE) for q in qs]
  row = {"C1": int(c1.shape[1]), "C2": int(c2.shape[1])}
  ref = pk.hierarchical_lookup_reference(qs[0], c1, n1, c2, n2, par, t1, jnp.float32(0.0), scale=scale)
  row["ref_touched"] = np.asarray(ref[2]).tolist()
  for name, abl, kw in VARIANTS:
    TL._ABLATE.clear(); TL._ABLATE.update(abl); jax.clear_caches()
    f = jax.jit(functools.partial(TL.level2_logits, scale=scale, groups=8, cols=c2.shape[1], backend=BE, **kw))
    try:
      x, m, l, nb = f(qs[0], tree, n1, *raws[0], t1)
      cand = np.asarray(x[:, 0, :c2.shape[1]] > -5e29)
      r = {"touched": (c1.shape[1] + cand.sum(1)).tolist()}
      tr = kernel_time_per_call(lambda q, raw: f(q, tree, n1, *raw, t1), [(q, raw) for q, raw in zip(qs, raws)], n=10, top=4)
      if tr:
        r["busy_us"] = round(tr["busy_ms_per_call"] * 1e3, 2)
        r["kernels"] = {kk["name"][:28]: round(kk["ms_per_call"] * 1e3, 2) for kk in tr["kernels"]}
    except Exception as e:  # noqa: BLE001
      r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    row[name] = r
    print(L, name, r, f"{time.time() - T0:.0f}s", flush=True)
  TL._ABLATE.clear(); jax.clear_caches()
  res["rows"][str(L)] = row
  json.dump(res, open(f"{OUT}/ablate.json", "w"), indent=1)
  del k, v
print("done", flush=True)
