"""Is the "compact" list kernel's gather rate set by the order of its rows? The same selection kernel, then
the list kernel over (a) the list as written (atomic reservations: clusters in arbitrary order), (b) the same
entries sorted by address, (c) N consecutive rows from row 0 (no selection: the rate of a sequential stream
through the same kernel), and (d) the shipped "ranges" kernel. Kernel times from a profiler trace (6 calls);
512K, keys from benchmarks.capture_keys, threshold calibrated on single queries (~8% kept), 32/8, bf16."""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource, decode_threshold
from benchmarks._meta import metadata
from benchmarks._profile import kernel_time_per_call
from pallas_kernels import cluster_sort_layout, clustered_decode_attention, ClusteredConfig
from pallas_kernels import clustered_attention as clat
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
L = 524288
k, v = src.kv(L, seed=L, n_heads=8)
q_obs = src.queries(100, seed=L, n_heads=32)[None]
with dispatch.using("auto"):
  idx = Squeezed(sparsity=0.9, n_sink=1).build(ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale))[0]
tdec = decode_threshold(idx, q_obs, scale, "kv", 0.9, "auto")
ol = idx.layer(0)
ks, vs, off = cluster_sort_layout(k, v, ol.labels, idx.n_sink, idx.n_tail, num_clusters=ol.counts.shape[-1])[:3]
del k, v
kn, vn = src.kv(1024, seed=7, n_heads=8)
kvp = (L + jnp.arange(1024)).astype(jnp.int32)
qp = jnp.asarray([L + 1023], jnp.int32)
qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
fixed = (ks, vs, ol.centroids.astype(jnp.bfloat16), off, jnp.float32(tdec), kn, vn, qp, kvp)
res = {"meta": {**metadata(), "L": L, "T_single": tdec, "timing": "profiler trace, 6 calls"}, "results": {}}

orig_call = clat.pallas_call
MODE = {"m": "as_written"}


def patched(kernel, **kw):
  f = orig_call(kernel, **kw)
  if kw.get("name") != "clustered_stream" or MODE["m"] == "as_written":
    return f

  def g(cnt, tbl, *rest):
    n = jnp.clip(cnt[0], 0, tbl.shape[0])
    pos = jnp.arange(tbl.shape[0], dtype=jnp.int32)
    if MODE["m"] == "sorted":
      tbl = jnp.sort(jnp.where(pos < n, tbl, jnp.iinfo(jnp.int32).max))
    else:                                                   # sequential rows 0 .. N-1
      tbl = pos
    return f(cnt, tbl, *rest)
  return g


clat.pallas_call = patched
ref = None
for name in ("ranges", "as_written", "sorted", "sequential", "ranges_2", "as_written_2", "sequential_2"):
  MODE["m"] = name.removesuffix("_2")
  # a distinct (no-op) stream_new_keys per mode: the jitted op is cached by its static config
  snk = {"as_written": 256, "sorted": 257, "sequential": 258}.get(MODE["m"], 256)
  cfg = ClusteredConfig() if name.startswith("ranges") else ClusteredConfig(attend="compact", stream_new_keys=snk)
  f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas", config=cfg))
  try:
    o = np.asarray(f(qs[0], *fixed), np.float32)
    ref = o if ref is None else ref
    tr = kernel_time_per_call(f, [(qq, *fixed) for qq in qs], n=6)
    r = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), max_abs_diff_vs_ranges=float(np.max(np.abs(o - ref))),
             kernels={x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]})
  except Exception as e:  # noqa: BLE001
    r = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
  res["results"][name] = r
  print(name, r, f"{time.time() - T0:.0f}s", flush=True)
  json.dump(res, open(f"{OUT}/ab_order.json", "w"), indent=1)
print("done", flush=True)
