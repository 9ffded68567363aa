"""Kernel-time sweeps of the fused clustered decode (scoring blocks per program, tilings, fixed cost) (speed-suite inputs: captured keys tiled).

Per (L, variant): kernel busy time per call from a profiler trace (per kernel), the device loop
(30 decodes), max |diff| against the default config. Threshold ablations: nothing selected
(fixed cost) and everything selected (streaming efficiency with long programs). cuDNN dense beside.
"""
import dataclasses, functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from benchmarks.speed import Plan, KeySource, _dense_fns_nocat
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped
from pallas_kernels import cluster_sort_layout
from pallas_kernels import clustered_attention as clat
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

T0 = time.time()
BUDGET = float(os.environ.get("SWEEP_S", "520"))
OUT = os.environ.get("OUT", "/tmp")
BF16 = jnp.bfloat16
plan = Plan(hq=int(os.environ.get("SWEEP_HQ", "32")), hkv=int(os.environ.get("SWEEP_HKV", "8")))
src = KeySource(".scratch/captured/smollm2_qkv.npz", Plan())  # captured 8 KV heads, tiled to plan.hkv
print("keys:", src.kind, jax.devices()[0].device_kind, flush=True)
# The variants of the three runs (each run named its subset per length with SWEEP_ONLY_<L>;
# every result in the JSON records its config).  sweep_abf0b46.json ran at abf0b46, where the
# default was score_blocks=1 with one scoring stage; the other two at 6d9db38 (auto blocks).
VARIANTS_ALL = [
    # sweep_abf0b46.json
    ("sb4s2", dict(score_blocks=4, score_stages=2), None),
    ("sb8s2", dict(score_blocks=8, score_stages=2), None),
    ("sb8s3", dict(score_blocks=8, score_stages=3), None),
    ("sb16s3", dict(score_blocks=16, score_stages=3), None),
    ("sb4s2w8", dict(score_blocks=4, score_stages=2, score_warps=8), None),
    ("rsf", dict(reduce_stats_first=True), None),
    ("sb8s2_none", dict(score_blocks=8, score_stages=2), 1e30),
    # sweep_6d9db38.json (and base / sb2 / sb4 / base_again in the first)
    ("base", {}, None),
    ("sb1", dict(score_blocks=1), None),
    ("sb2", dict(score_blocks=2), None),
    ("sb8", dict(score_blocks=8), None),
    ("sb4", dict(score_blocks=4), None),
    ("w8", dict(num_warps=8), None),
    ("bk32s4", dict(block_k=32, num_stages=4), None),
    ("bk128s2", dict(block_k=128, num_stages=2), None),
    ("t2048", dict(target_programs=2048), None),
    ("t1024", dict(target_programs=1024), None),
    ("base_again", {}, None),
    ("sb1_again", dict(score_blocks=1), None),
    # fixed_cost_6d9db38.json: nothing selected (threshold 1e30) per tiling, and full runs
    ("base_none", {}, 1e30),
    ("s1_none", dict(num_stages=1), 1e30),
    ("s2_none", dict(num_stages=2), 1e30),
    ("bk32s3_none", dict(block_k=32), 1e30),
    ("bk16s3_none", dict(block_k=16), 1e30),
    ("w2_none", dict(num_warps=2), 1e30),
    ("s1", dict(num_stages=1), None),
    ("s2", dict(num_stages=2), None),
    ("bk32s3", dict(block_k=32), None),
    ("base_none_again", {}, 1e30),
]
VARIANTS = VARIANTS_ALL[: int(os.environ.get("SWEEP_N", "99"))]
out = {"meta": dict(device=jax.devices()[0].device_kind, jax=jax.__version__, keys=src.kind,
                    commit=os.environ.get("SQJAX_GIT_COMMIT", "?"),
                    timing="busy_us: kernel time per call, profiler trace of 6 calls; loop_ms: 30 decodes in a fori_loop, median of 5"),
       "results": {}}


def save():
  json.dump(out, open(f"{OUT}/sweep.json", "w"), indent=1)


LENGTHS = tuple(int(x) for x in os.environ.get("SWEEP_L", "524288,131072").split(","))
BACKEND = os.environ.get("SWEEP_BACKEND", "pallas")
GPU = jax.devices()[0].platform == "gpu"
def run_variants(tag, base_sets, scale):
  ref = None
  only = os.environ.get(f"SWEEP_ONLY_{tag}")
  for name, kw, th in VARIANTS:
    if only and name not in only.split(","):
      continue
    if time.time() - T0 > BUDGET:
      print("budget reached", flush=True)
      break
    cfg = clat.ClusteredConfig(**kw)
    f = jax.jit(functools.partial(clat.clustered_decode_attention, scale=scale, vote="kv", backend=BACKEND,
                                  config=cfg))
    sets = [s_[:5] + ((jnp.float32(th),) if th is not None else s_[5:6]) + s_[6:] for s_ in base_sets]
    try:
      o = np.asarray(f(*sets[0]).astype(jnp.float32))
      if ref is None:
        ref = o
      err = float(np.max(np.abs(o - ref))) if th is None else None
      tr = kernel_time_per_call(f, sets, n=6, top=6) if GPU else None
      res = dict(cfg=kw, thr=th, max_abs_diff_vs_default=err)
      if tr:
        loop = time_ms_looped(lambda q, *c: f(q, *c), [s_[0] for s_ in sets], fixed=sets[0][1:], n_iter=30, reps=5)
        res.update(busy_us=round(tr["busy_ms_per_call"] * 1e3, 1), loop_ms=round(loop, 4),
                   kernels={kk_["name"][:24]: round(kk_["ms_per_call"] * 1e3, 1) for kk_ in tr["kernels"]})
      out["results"][f"{tag}/{name}"] = res
    except Exception as e:  # noqa: BLE001
      out["results"][f"{tag}/{name}"] = dict(cfg=kw, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(tag, name, out["results"][f"{tag}/{name}"], flush=True)
    save()


def gaussian_sets(L):
  from benchmarks import decode_profile as dp
  ctx = dp.make_inputs(dp.Plan(smoke=False, backend=BACKEND, n_sets=3, lengths=(L,)), L, print)
  return ctx["whole"], ctx["scale"]


for L in LENGTHS:
  if L < 0:  # gaussian inputs of decode_profile
    L = -L
    gsets, scale = gaussian_sets(L)
    tag = f"g{L}"
    run_variants(tag, gsets, scale)
    continue
  k, v = src.kv(L, seed=L, n_heads=plan.hkv)
  q_obs = src.queries(100, seed=L, n_heads=plan.hq)[None]
  scale = 1.0 / math.sqrt(plan.d)
  data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
  with dispatch.using("auto"):
    index = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
  ks, vs, off = cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                    num_clusters=index.layers.counts.shape[-1])[:3]
  li = index.layer(0)
  cent = li.centroids.astype(BF16)
  thr = jnp.asarray(index.threshold, jnp.float32)
  NNEW = int(os.environ.get("SWEEP_NEW", "1024"))
  kn, vn = src.kv(NNEW, seed=7, n_heads=plan.hkv)
  kvp = (L + jnp.arange(NNEW)).astype(jnp.int32)
  qp = jnp.asarray([L + NNEW - 1], jnp.int32)
  qs = [src.queries(1, seed=100 + j, n_heads=plan.hq)[:, 0] for j in range(3)]
  print(f"[inputs] L={L} C={cent.shape[1]} built at {time.time() - T0:.0f}s", flush=True)
  # dense cuDNN, same run
  kk = jnp.concatenate([k, kn], axis=1).swapaxes(0, 1)[None]
  vv = jnp.concatenate([v, vn], axis=1).swapaxes(0, 1)[None]
  dense = _dense_fns_nocat(plan)["cudnn"]
  dsets = [(qq[None, None], kk, vv) for qq in qs]
  tr = kernel_time_per_call(dense, dsets, n=6, top=3) if GPU else None
  loop = None
  if tr:
    loop = time_ms_looped(lambda q, a, b: dense(q, a, b), [s[0] for s in dsets], fixed=dsets[0][1:], n_iter=30, reps=5)
    out["results"][f"{L}/cudnn"] = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 1), loop_ms=round(loop, 4))
    print(L, "cudnn", out["results"][f"{L}/cudnn"], flush=True)
  del kk, vv
  run_variants(str(L), [(qq, ks, vs, cent, off, thr, kn, vn, qp, kvp) for qq in qs], scale)
save()
print("done", time.time() - T0, flush=True)
