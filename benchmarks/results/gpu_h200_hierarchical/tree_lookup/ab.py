"""A/B of the hierarchical decode's level-2 lookup: one program per level-2 block (the code
before, run from an exported copy of its commit) vs one program per level-1 block over a
TreeLayout (this commit), on the speed suite's inputs (captured SmolLM2 keys tiled, 5% / 1%
centroids, App. C thresholds, 1024 new keys), 32/8 heads, d = 128, bf16.

Per length: kernel busy time per call (profiler trace of 10 calls) of the 1-level and the
hierarchical lookup alone (what the suite's hierarchical-vs-1-level table times) and of the 1-level
and hierarchical fused decodes; device loop of 300 decodes; cuDNN dense beside. The outputs
(level-2 scores, candidates, decode outputs) are saved so that the second process compares them
with the first's.

    PYTHONPATH=<code> OUT=... TAG=old|new python ab.py
"""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np

sys.path.insert(0, os.path.abspath(os.environ.get("CODE_DIR", ".")))  # the code under test; inputs from the cwd
from benchmarks.speed import Plan, KeySource, _dense_fns_nocat
from benchmarks._meta import time_ms_looped, metadata
from benchmarks._profile import kernel_time_per_call
import pallas_kernels as pk
from sqjax.methods import ContextData, Squeezed, HierarchicalSqueezed
from sqjax import dispatch, squeezed

T0 = time.time()
OUT, TAG = os.environ["OUT"], os.environ["TAG"]
NEW = hasattr(pk, "tree_layout")
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
res = {"meta": {**metadata(), "tag": TAG, "code": os.environ.get("CODE_COMMIT", "?"), "keys": src.kind,
                "timing": "busy_us: profiler trace of 10 calls; loop_ms: 300 decodes in a fori_loop, median of 5"},
       "rows": {}}


BE = os.environ.get("AB_BACKEND", "pallas")


def busy(f, sets):
  tr = kernel_time_per_call(f, sets, n=10, top=8)
  if tr is None:  # CPU plumbing check
    jax.block_until_ready(f(*sets[0]))
    return -1.0, {}
  return round(tr["busy_ms_per_call"] * 1e3, 2), {k["name"][:32]: round(k["ms_per_call"] * 1e3, 2) for k in tr["kernels"]}


for L in [int(x) for x in os.environ.get("AB_L", "524288,131072").split(",")]:
  hq, hkv = 32, 8
  k, v = src.kv(L, seed=L, n_heads=hkv)
  q_obs = src.queries(100, seed=L, n_heads=hq)[None]
  data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
  with dispatch.using("auto"):
    i1 = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
    i2 = HierarchicalSqueezed(sparsity=0.9, n_sink=1).build(data)[0]
  kn, vn = src.kv(1024, seed=7, n_heads=hkv)
  kvp = (L + jnp.arange(1024)).astype(jnp.int32)
  qp = jnp.asarray([L + 1023], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=hq)[:, 0] for j in range(3)]
  lay = {}
  for name, ix in (("one", i1), ("hier", i2)):
    li = ix.layer(0)
    ks, vs, off = pk.cluster_sort_layout(k, v, li.labels, ix.n_sink, ix.n_tail, num_clusters=li.counts.shape[-1])[:3]
    tree = None
    if NEW and name == "hier":
      tree = pk.hierarchical_tree(li.centroids.astype(k.dtype), off, li.parent, li.centroids1.shape[-2], L)
    lay[name] = (li, ks, vs, off, tree)
  print(f"[inputs] L={L} built {time.time() - T0:.0f}s", flush=True)
  row = {}

  def lookup(name):
    li, _, _, _, tree = lay[name]
    ix = i1 if name == "one" else i2
    kw = {"tree": tree} if tree is not None else {}

    @jax.jit
    def f(q, li, t1, tree_args):
      with dispatch.using(BE):
        return squeezed.layer_scores(li, q[:, None], t1, scale, "kv", **({"tree": tree_args} if tree_args is not None else {}))
    return lambda q: f(q, li, ix.threshold1, tree)

  def decode(name):
    li, ks, vs, off, tree = lay[name]
    ix = i1 if name == "one" else i2
    level1 = None
    if name == "hier":
      level1 = (li.centroids1.astype(k.dtype), li.counts1, li.parent) + ((tree,) if tree is not None else ())

    @jax.jit
    def f(q, ks, vs, cent, off, thr, kn, vn, qp, kvp, level1, t1):
      with dispatch.using(BE):
        return dispatch.clustered_decode(q[:, None], ks, vs, cent, off, thr, kn, vn, qp, kvp, scale, "kv",
                                         level1=level1, threshold1=t1)[:, 0]
    fixed = (ks, vs, li.centroids.astype(k.dtype), off, ix.threshold, kn, vn, qp, kvp, level1, ix.threshold1)
    return f, fixed

  saved = {}
  for name in ("one", "hier"):
    try:
      fl = lookup(name)
      s = fl(qs[0])
      saved[f"{name}_scores"] = np.asarray(s[0])
      saved[f"{name}_touched"] = np.asarray(s[1])
      b, kern = busy(lambda q: fl(q), [(q,) for q in qs])
      row[f"{name}_lookup_busy_us"], row[f"{name}_lookup_kernels"] = b, kern
    except Exception as e:  # noqa: BLE001
      row[f"{name}_lookup_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    try:
      f, fixed = decode(name)
      o = f(qs[0], *fixed)
      saved[f"{name}_decode"] = np.asarray(o, np.float32)
      b, kern = busy(f, [(q, *fixed) for q in qs])
      row[f"{name}_decode_busy_us"], row[f"{name}_decode_kernels"] = b, kern
      row[f"{name}_decode_loop_ms"] = round(time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=fixed, n_iter=int(os.environ.get("AB_ITERS", "300")), reps=5), 4)
    except Exception as e:  # noqa: BLE001
      row[f"{name}_decode_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(L, name, {kk: vv for kk, vv in row.items() if kk.startswith(name)}, f"{time.time() - T0:.0f}s", flush=True)
  if "one_lookup_busy_us" in row and "hier_lookup_busy_us" in row:
    row["lookup_ratio_hier_vs_one"] = round(row["hier_lookup_busy_us"] / row["one_lookup_busy_us"], 3)
  kk_ = jnp.concatenate([k, kn], axis=1).swapaxes(0, 1)[None]
  vv_ = jnp.concatenate([v, vn], axis=1).swapaxes(0, 1)[None]
  dense = _dense_fns_nocat(plan)["cudnn" if BE == "pallas" else "xla"]
  dsets = [(qq[None, None], kk_, vv_) for qq in qs]
  row["cudnn_busy_us"], _ = busy(dense, dsets)
  row["cudnn_loop_ms"] = round(time_ms_looped(lambda q, a, b: dense(q, a, b), [s[0] for s in dsets], fixed=dsets[0][1:],
                                              n_iter=int(os.environ.get("AB_ITERS", "300")), reps=5), 4)
  for name in ("one", "hier"):
    if f"{name}_decode_busy_us" in row:
      row[f"{name}_decode_ratio_busy"] = round(row["cudnn_busy_us"] / row[f"{name}_decode_busy_us"], 3)
      row[f"{name}_decode_ratio_loop"] = round(row["cudnn_loop_ms"] / row[f"{name}_decode_loop_ms"], 3)
  del kk_, vv_
  npz = os.environ.get("NPZ_DIR", OUT)
  np.savez(f"{npz}/outputs_{TAG}_{L}.npz", **saved)
  other = os.environ.get("OTHER")
  if other and os.path.exists(f"{other}/outputs_old_{L}.npz"):
    o = np.load(f"{other}/outputs_old_{L}.npz")
    row["vs_old"] = {key: float(np.max(np.abs(o[key].astype(np.float64) - saved[key].astype(np.float64))))
                     for key in saved if key in o}
  res["rows"][str(L)] = row
  print(L, {kk: vv for kk, vv in row.items() if "kernels" not in kk}, flush=True)
  json.dump(res, open(f"{OUT}/ab_{TAG}.json", "w"), indent=1)
  del k, v, kn, vn, lay, i1, i2, data
print("done", f"{time.time() - T0:.0f}s", flush=True)
