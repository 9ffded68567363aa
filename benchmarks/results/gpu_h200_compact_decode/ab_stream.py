"""A/B in one process: kernel B of the clustered decode as "ranges" (shipped: each cluster program streams
the rows of its own clusters) vs "compact" (a selection kernel writes the selected rows to one list, then
~one wave of programs splits the list evenly). Keys from benchmarks.capture_keys, tiled; 32/8 heads,
d = 128, bf16; thresholds: calibrated on single queries (speed.decode_threshold) and App. C.
busy_us: profiler kernel time per call (6 calls); loop_ms: 300 decodes in a fori_loop, median of 5;
rel_err: vs backend="reference" on the first query; cuDNN (dense over fixed + new keys) timed the same ways."""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource, decode_threshold, _dense_fns
from benchmarks._meta import time_ms_looped, metadata
from benchmarks._profile import kernel_time_per_call
from pallas_kernels import (cluster_sort_layout, clustered_decode_attention, clustered_decode_hierarchical,
                            ClusteredConfig)
from sqjax.methods import ContextData, Squeezed, HierarchicalSqueezed
from sqjax import dispatch

OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(128)
res = {"meta": {**metadata(), "keys": src.kind,
                "timing": "busy_us: profiler trace of 6 calls; loop_ms: 300 decodes, median of 5"}, "results": {}}
C = lambda **kw: ClusteredConfig(attend="compact", **kw)
VARIANTS = [("ranges", ClusteredConfig()), ("compact", C()),
            ("compact_p132", C(stream_programs=132)), ("compact_p396", C(stream_programs=396)),
            ("compact_p528", C(stream_programs=528)), ("compact_p1056", C(stream_programs=1056)),
            ("compact_st2", C(num_stages=2)), ("compact_st4", C(num_stages=4)),
            ("compact_bk32_st4", C(block_k=32, num_stages=4)), ("compact_bk128_st2", C(block_k=128, num_stages=2)),
            ("compact_w8", C(num_warps=8)), ("compact_sel8", C(select_warps=8)),
            ("compact_sub64", C(sub_clusters=64)), ("ranges_2", ClusteredConfig()), ("compact_2", C())]
SHORT = ("ranges", "compact", "compact_p528", "ranges_2", "compact_2")


def save():
  json.dump(res, open(f"{OUT}/ab_stream.json", "w"), indent=1)


def timed(f, qs, fixed):
  tr = kernel_time_per_call(f, [(qq, *fixed) for qq in qs], n=6)
  loop = time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=fixed, n_iter=300, reps=5)
  return dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4),
              kernels={x["name"][:24]: round(x["ms_per_call"] * 1e3, 2) for x in tr["kernels"]})


for L in (524288, 131072):
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  ctx = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
  with dispatch.using("auto"):
    idx = Squeezed(sparsity=0.9, n_sink=1).build(ctx)[0]
  tdec = decode_threshold(idx, q_obs, scale, "kv", 0.9, "auto")
  ol = idx.layer(0)
  ks, vs, off = cluster_sort_layout(k, v, ol.labels, idx.n_sink, idx.n_tail, num_clusters=ol.counts.shape[-1])[:3]
  kn, vn = src.kv(1024, seed=7, n_heads=8)
  kvp = (L + jnp.arange(1024)).astype(jnp.int32)
  qp = jnp.asarray([L + 1023], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
  cent = ol.centroids.astype(jnp.bfloat16)
  res["meta"][f"{L}/T_single"] = tdec
  res["meta"][f"{L}/T_app_c"] = float(idx.threshold)
  # dense baseline, same run
  dn = _dense_fns(plan)["cudnn"]
  dfix = (k, v, kn, vn)
  res["results"][f"{L}/cudnn"] = timed(dn, [qq[:, None] for qq in qs], dfix)
  print(L, "cudnn", res["results"][f"{L}/cudnn"], f"{time.time() - T0:.0f}s", flush=True)
  for tname, thr in (("single", tdec), ("app_c", float(idx.threshold))):
    fixed = (ks, vs, cent, off, jnp.float32(thr), kn, vn, qp, kvp)
    ref = np.asarray(jax.jit(functools.partial(clustered_decode_attention, scale=scale, backend="reference"))(
        qs[0], *fixed), np.float32)
    kept = None
    for name, cfg in VARIANTS:
      if tname == "app_c" and name not in SHORT:
        continue
      if L == 131072 and name not in SHORT:
        continue
      f = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas", config=cfg))
      try:
        o = np.asarray(f(qs[0], *fixed), np.float32)
        fs = jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote="kv", backend="pallas",
                                       config=cfg, return_stats=True))
        _, sel, rows = fs(qs[0], *fixed)
        r = dict(rel_err=float(np.linalg.norm(o - ref) / np.linalg.norm(ref)), kept=float(np.mean(np.asarray(rows))) / L,
                 **timed(f, qs, fixed))
        r["ratio_busy"] = round(res["results"][f"{L}/cudnn"]["busy_us"] / r["busy_us"], 3)
        r["ratio_loop"] = round(res["results"][f"{L}/cudnn"]["loop_ms"] / r["loop_ms"], 3)
      except Exception as e:  # noqa: BLE001
        r = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
      res["results"][f"{L}/{tname}/{name}"] = r
      print(L, tname, name, r, f"{time.time() - T0:.0f}s", flush=True)
      save()
  # hierarchical (App. C thresholds), both kernel-B modes
  if L == 524288:
    with dispatch.using("auto"):
      hidx = HierarchicalSqueezed(sparsity=0.9, n_sink=1).build(ctx)[0]
    hl = hidx.layer(0)
    ks2, vs2, off2 = cluster_sort_layout(k, v, hl.labels, hidx.n_sink, hidx.n_tail,
                                         num_clusters=hl.counts.shape[-1])[:3]
    hfix = (ks2, vs2, hl.centroids1.astype(jnp.bfloat16), hl.counts1, hl.centroids.astype(jnp.bfloat16), off2,
            hl.parent, jnp.float32(hidx.threshold1), jnp.float32(hidx.threshold), kn, vn, qp, kvp)
    href = np.asarray(jax.jit(functools.partial(clustered_decode_hierarchical, scale=scale, backend="reference"))(
        qs[0], *hfix), np.float32)
    for name, cfg in (("ranges", ClusteredConfig()), ("compact", C()), ("ranges_2", ClusteredConfig()), ("compact_2", C())):
      f = jax.jit(functools.partial(clustered_decode_hierarchical, scale=scale, backend="pallas", config=cfg))
      try:
        o = np.asarray(f(qs[0], *hfix), np.float32)
        r = dict(rel_err=float(np.linalg.norm(o - href) / np.linalg.norm(href)), **timed(f, qs, hfix))
        r["ratio_busy"] = round(res["results"][f"{L}/cudnn"]["busy_us"] / r["busy_us"], 3)
        r["ratio_loop"] = round(res["results"][f"{L}/cudnn"]["loop_ms"] / r["loop_ms"], 3)
      except Exception as e:  # noqa: BLE001
        r = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
      res["results"][f"{L}/hier_app_c/{name}"] = r
      print(L, "hier", name, r, f"{time.time() - T0:.0f}s", flush=True)
      save()
    del hidx, hl, ks2, vs2
  del k, v, ks, vs, idx, ctx
print("done", f"{time.time() - T0:.0f}s", flush=True)
