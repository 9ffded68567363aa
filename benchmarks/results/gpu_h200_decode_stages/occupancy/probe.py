"""Registers, shared memory and occupancy of the fused decode's kernels (512K, 32/8, suite inputs):
every stat the profiler trace carries for each kernel event, printed once per kernel name."""
import functools, json, math, os, sys, glob, tempfile
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd())
from benchmarks.speed import Plan, KeySource
from pallas_kernels import cluster_sort_layout, clustered_decode_attention, ClusteredConfig
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ["OUT"]
L = int(os.environ.get("AB_L", "524288"))
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
k, v = src.kv(L, seed=L, n_heads=8)
q_obs = src.queries(100, seed=L, n_heads=32)[None]
with dispatch.using("auto"):
  idx = Squeezed(sparsity=0.9, n_sink=1).build(ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale))[0]
ol = idx.layer(0)
ks, vs, off = cluster_sort_layout(k, v, ol.labels, idx.n_sink, idx.n_tail, num_clusters=ol.counts.shape[-1])[:3]
kn, vn = src.kv(1024, seed=7, n_heads=8)
kvp = (L + jnp.arange(1024)).astype(jnp.int32)
qp = jnp.asarray([L + 1023], jnp.int32)
q = src.queries(1, seed=100, n_heads=32)[:, 0]
fixed = (ks, vs, ol.centroids.astype(jnp.bfloat16), off, jnp.float32(idx.threshold), kn, vn, qp, kvp)
out = {}
for name, kw in (("default", {}), ("bk32_s3", dict(block_k=32)), ("s2", dict(num_stages=2)), ("w2", dict(num_warps=2))):
  f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas", config=ClusteredConfig(**kw)))
  f(q, *fixed).block_until_ready()
  from jax.profiler import ProfileData
  tmp = tempfile.mkdtemp()
  with jax.profiler.trace(tmp):
    for _ in range(3):
      o = f(q, *fixed)
    o.block_until_ready()
  path = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0]
  data = ProfileData.from_file(path)
  seen = {}
  for plane in data.planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      for ev in line.events:
        if ev.name in seen or ev.end_ns <= ev.start_ns:
          continue
        try:
          st = {str(kk): str(vv) for kk, vv in ev.stats}
        except Exception as e:  # noqa: BLE001
          st = {"error": repr(e)}
        seen[ev.name] = st
  out[name] = seen
  print(name, json.dumps({kk[:40]: vv for kk, vv in seen.items()}, indent=0)[:3000], flush=True)
json.dump(out, open(f"{OUT}/occupancy.json", "w"), indent=1)
