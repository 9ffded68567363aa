"""Kernel-time sweep of the fused clustered decode (speed-suite inputs: captured keys tiled).

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
sys.path.insert(0, ".scratch")
import clat_old
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch

T0 = time.time()
BUDGET = float(os.environ.get("SWEEP_S", "520"))
OUT = os.environ.get("OUT", "/tmp")
BF16 = jnp.bfloat16
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
print("keys:", src.kind, jax.devices()[0].device_kind, flush=True)
VARIANTS_ALL = [
    ("old", {}, None), ("new", {}, None), ("old_again", {}, None), ("new_again", {}, None),
    ("old_q", {}, "q"), ("new_q", {}, "q"),
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
  refs = {}
  for name, kw, th in VARIANTS:
    if time.time() - T0 > BUDGET:
      print("budget reached", flush=True)
      break
    mod = clat_old if name.startswith("old") else clat
    vote = "q" if th == "q" else "kv"
    f = jax.jit(functools.partial(mod.clustered_decode_attention, scale=scale, vote=vote, backend=BACKEND,
                                  config=mod.ClusteredConfig(**kw)))
    sets = list(base_sets)
    try:
      o = np.asarray(f(*sets[0]).astype(jnp.float32))
      refs.setdefault(vote, o)
      err = float(np.max(np.abs(o - refs[vote])))
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
