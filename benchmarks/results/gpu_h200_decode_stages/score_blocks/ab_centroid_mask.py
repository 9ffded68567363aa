"""A/B: centroid loads masked by counts (old) vs by bounds only (new) in the fused clustered decode;
kernel busy (profiler) and a 300-call loop; old/new alternated twice.

Run from the repository root at fb48686 with the old module beside it:
  mkdir -p .scratch/ab && git show fb48686~1:pallas_kernels/clustered_attention.py > .scratch/ab/clat_old.py
(only the fused decode is A/B'd: the lookup kernels' module is imported once, new)."""
import functools, json, math, os, sys, time, importlib.util
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped
from pallas_kernels import cluster_sort_layout
from pallas_kernels import clustered_attention as clat_new
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

def load(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
clat_old = load("clat_old", ".scratch/ab/clat_old.py")
OUT = os.environ.get("OUT", "/tmp")
BF16 = jnp.bfloat16
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", Plan())
out = {"meta": dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=os.environ.get("SQJAX_GIT_COMMIT", "?"),
                    timing="busy_us: profiler trace of 6 calls; loop_ms: 300 decodes in a fori_loop, median of 5"), "results": {}}
for L in (524288, 131072):
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
  thr = jnp.asarray(index.threshold, jnp.float32)
  kn, vn = src.kv(1024, seed=7, n_heads=8)
  kvp = (L + jnp.arange(1024)).astype(jnp.int32)
  qp = jnp.asarray([L + 1023], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
  sets = [(qq, ks, vs, cent, off, thr, kn, vn, qp, kvp) for qq in qs]
  ref = None
  for name, mod in (("old", clat_old), ("new", clat_new), ("old2", clat_old), ("new2", clat_new)):
    f = jax.jit(functools.partial(mod.clustered_decode_attention, scale=scale, vote="kv", backend="pallas"))
    o = np.asarray(f(*sets[0]).astype(jnp.float32))
    ref = o if ref is None else ref
    tr = kernel_time_per_call(f, sets, n=6, top=4)
    loop = time_ms_looped(lambda q, *c: f(q, *c), [s[0] for s in sets], fixed=sets[0][1:], n_iter=300, reps=5)
    r = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4), max_abs_diff=float(np.max(np.abs(o - ref))),
             kernels={x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]})
    out["results"][f"{L}/{name}"] = r
    print(L, name, r, flush=True)
  json.dump(out, open(f"{OUT}/ab_mask.json", "w"), indent=1)
print("done", flush=True)
