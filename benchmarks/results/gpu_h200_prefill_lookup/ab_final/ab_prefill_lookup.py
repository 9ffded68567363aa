"""A/B on one GPU of the prefill lookup passes (HEAD 71fa566 = old vs this change = new) and of the
decode lookup kernels reading centroid rows without waiting for the counts (new_dec_nowait: every
`_load_centroid_block` call with rows_wait_counts=False, the statistics pass included).  Old functions
are loaded from HEAD's file and patched in; caches cleared between variants; old / new alternated twice.
Speed-suite inputs: captured SmolLM2 keys (benchmarks.capture_keys) tiled to 512K, Squeezed /
HierarchicalSqueezed(sparsity=0.9, n_sink=1), 1024 new keys, 32/8 heads, d = 128, bf16.
busy: profiler kernel time per call (decode 6 calls, prefill 3); span: first kernel start to last end per
call; loop_ms: 300 decodes in a fori_loop, median of 5."""
import functools, importlib.util, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource, _dense_fns_nocat, _library_path
from benchmarks._meta import time_ms_looped, metadata
from pallas_kernels import cluster_sort_layout, clustered_decode_hierarchical
from pallas_kernels import centroid_lookup as cl
from sqjax.methods import ContextData, Squeezed, HierarchicalSqueezed
from sqjax import dispatch, squeezed

OUT = os.environ.get("OUT", "/tmp")
SMOKE = bool(os.environ.get("AB_SMOKE"))
BE = "interpret" if SMOKE else "pallas"
BF16 = jnp.bfloat16
T0 = time.time()


def kernel_time_per_call(*a, **kw):
  from benchmarks._profile import kernel_time_per_call as ktpc
  r = None if SMOKE else ktpc(*a, **kw)
  return r or {"busy_ms_per_call": float("nan"), "span_ms_per_call": float("nan"), "kernels": []}


if SMOKE:
  time_ms_looped = lambda *a, **kw: float("nan")  # noqa: E731

spec = importlib.util.spec_from_file_location("old_cl", os.environ.get("AB_OLD", ".scratch/ab_deps/old_centroid_lookup.py"))
old = importlib.util.module_from_spec(spec)
sys.modules["old_cl"] = old
spec.loader.exec_module(old)
NEW = (cl._stats_kernel, cl._score_kernel, cl._load_centroid_block)
VARS = {"old": (old._stats_kernel, old._score_kernel, cl._load_centroid_block), "new": NEW,
        "new_dec_nowait": (NEW[0], NEW[1], functools.partial(NEW[2], rows_wait_counts=False))}


def use(name):
  cl._stats_kernel, cl._score_kernel, cl._load_centroid_block = VARS[name]
  jax.clear_caches()


plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
L = 4096 if SMOKE else 524288
T = 64 if SMOKE else 4096
scale = 1.0 / math.sqrt(128)
k, v = src.kv(L, seed=L, n_heads=8)
q_obs = src.queries(100, seed=L, n_heads=32)[None]
data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
hm = HierarchicalSqueezed(sparsity=0.9, n_sink=1)
with dispatch.using("auto"):
  hidx = hm.build(data)[0]
  idx = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
jax.block_until_ready((hidx, idx))
del data
print(f"indexes built {time.time() - T0:.0f}s", flush=True)
kn, vn = src.kv(1024, seed=7, n_heads=8)
kvp = (L + jnp.arange(1024)).astype(jnp.int32)
qp = jnp.asarray([L + 1023], jnp.int32)
qs = [src.queries(1, seed=100 + j, n_heads=32)[:, 0] for j in range(3)]
qs4 = [src.queries(T, seed=409600 + j, n_heads=32) for j in range(2)]
qp4 = (L + 1024 - T + jnp.arange(T)).astype(jnp.int32)
out = {"meta": {**metadata(), "keys": src.kind, "L": L, "T": T,
                "timing": "busy: profiler kernel time per call (decode 6 calls, prefill 3); loop_ms: 300 decodes, median of 5"},
       "results": {}}
R = out["results"]
out["meta"]["empty_cluster_fraction"] = {"1level": float(jnp.mean(idx.layer(0).counts == 0)),
                                         "hier_level2": float(jnp.mean(hidx.layer(0).counts == 0)),
                                         "hier_level1": float(jnp.mean(hidx.layer(0).counts1 == 0))}
print(out["meta"]["empty_cluster_fraction"], flush=True)
save = lambda: json.dump(out, open(f"{OUT}/ab_prefill_lookup.json", "w"), indent=1)  # noqa: E731

if not SMOKE:
  kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
  vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
  cud = _dense_fns_nocat(plan)["cudnn"]
  dq = [qq[:, None].swapaxes(0, 1)[None] for qq in qs]
  tr = kernel_time_per_call(cud, [(qq, kk, vv) for qq in dq], n=6)
  R["cudnn_decode"] = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2),
                           loop_ms=round(time_ms_looped(cud, dq, fixed=(kk, vv), n_iter=300, reps=5), 4))
  dq4 = [qq.swapaxes(0, 1)[None] for qq in qs4]
  tr = kernel_time_per_call(cud, [(qq, kk, vv) for qq in dq4], n=3)
  R["cudnn_prefill4k"] = dict(busy_ms=round(tr["busy_ms_per_call"], 3), span_ms=round(tr["span_ms_per_call"], 3))
  print("cudnn", R["cudnn_decode"], R["cudnn_prefill4k"], flush=True)
  del kk, vv, dq4
  save()

hl, ol = hidx.layer(0), idx.layer(0)
hks, hvs, hoff = cluster_sort_layout(k, v, hl.labels, hidx.n_sink, hidx.n_tail, num_clusters=hl.counts.shape[-1])[:3]
c1, c2 = hl.centroids1.astype(BF16), hl.centroids.astype(BF16)
t1, t2 = jnp.float32(hidx.threshold1), jnp.float32(hidx.threshold)
hfix = (hks, hvs, c1, hl.counts1, c2, hoff, hl.parent, t1, t2, kn, vn, qp, kvp)


def hier(q, ks, vs, c1, n1, c2, off, par, t1, t2, kn, vn, qp, kvp):
  return clustered_decode_hierarchical(q, ks, vs, c1, n1, c2, off, par, t1, t2, kn, vn, qp, kvp, scale=scale,
                                       vote="kv", backend=BE)


def lookup(li, q, t1):
  with dispatch.using(BE):
    return squeezed.layer_scores(li, q, t1, scale, "kv")[0]


ref = {}
kern = lambda tr: {x["name"][:30]: round(x["ms_per_call"], 4) for x in tr["kernels"]}  # noqa: E731


def rec(key, r):
  R[key if key not in R else key + "_2"] = r
  print(key, r, f"{time.time() - T0:.0f}s", flush=True)
  save()


def diff(name, x):
  x = np.asarray(x, np.float64)
  ref.setdefault(name, x)
  return float(np.max(np.abs(x - ref[name])) / max(np.max(np.abs(ref[name])), 1e-30))


for tag in ("old", "new", "new_dec_nowait", "old", "new", "new_dec_nowait"):
  use(tag)
  fl = jax.jit(lookup)
  for lname, li in (("1level", ol), ("hier", hl)):
    for ph, qq in (("decode", [q[:, None] for q in qs]), ("prefill4k", qs4)):
      if ph == "prefill4k" and tag == "new_dec_nowait":
        continue
      e = diff(f"lookup_{ph}_{lname}", fl(li, qq[0], t1))
      tr = kernel_time_per_call(fl, [(li, x, t1) for x in qq], n=6 if ph == "decode" else 3, top=8)
      rec(f"{tag}/lookup_{ph}_{lname}", dict(busy_ms=round(tr["busy_ms_per_call"], 4), kernels=kern(tr),
                                             max_rel_diff_vs_first=e))
  f = jax.jit(hier)
  e = diff("hier_decode", f(qs[0], *hfix))
  tr = kernel_time_per_call(f, [(qq, *hfix) for qq in qs], n=6)
  loop = time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=hfix, n_iter=300, reps=5)
  rec(f"{tag}/hier_decode", dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4),
                                 kernels={x: round(y * 1e3, 2) for x, y in kern(tr).items()}, max_rel_diff_vs_first=e))
  if tag != "new_dec_nowait":
    lib = functools.partial(_library_path, hm, backend=BE)
    sets = [(hidx, qq, k, v, kn, vn, qp4, kvp) for qq in qs4]
    e = diff("prefill", lib(*sets[0])[0])
    tr = kernel_time_per_call(lambda *a: lib(*a)[0], sets, n=3, top=24)
    rec(f"{tag}/prefill4k_hier", dict(busy_ms=round(tr["busy_ms_per_call"], 3), span_ms=round(tr["span_ms_per_call"], 3),
                                      max_rel_diff_vs_first=e))
use("new")
print("done", f"{time.time() - T0:.0f}s", flush=True)

# ---- 1-level fused decode: the scoring kernel's centroid rows -------------------------------------------
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import clustered_attention as clat, clustered_decode_attention, _common as cm


def score_pf(q_ref, c_ref, offs_ref, x_ref, m_ref, l_ref, *, p, scale, exact_dot, mode):
  """clat._score_kernel with the next block's counts loaded one iteration ahead ("pf": the row load
  waits on a carried mask) or rows read under bounds only ("nowait")."""
  kv = pl.program_id(0)
  sp = pl.program_id(1)
  hr = jnp.arange(p.rp, dtype=jnp.int32)
  hv = hr < p.g
  q = cm.gather_rows(q_ref, kv * p.g + hr, p.dp, hv)
  last = jnp.minimum((sp + 1) * p.score_blocks, cm.cdiv(p.num_c, p.block_c))

  def counts(cb):
    j = cb * p.block_c + jnp.arange(p.block_c, dtype=jnp.int32)
    jv = (j < p.num_c) & (cb < last)
    _, cnt = clat._clipped_ranges(offs_ref, kv, j, jv, num_c=p.num_c, num_l=p.num_l)
    return jv & (cnt > 0), cnt

  def block(b, carry):
    m_run, l_run, valid, cnt = carry
    cb = sp * p.score_blocks + b
    j = cb * p.block_c + jnp.arange(p.block_c, dtype=jnp.int32)
    jv = j < p.num_c
    if mode == "pf":
      valid_n, cnt_n = counts(cb + 1)
      c = cm.gather_rows(c_ref, kv * p.num_c + j, p.dp, valid)
    else:
      valid, cnt = counts(cb)
      valid_n, cnt_n = valid, cnt
      c = cm.gather_rows(c_ref, kv * p.num_c + j, p.dp, jv)
    x = plgpu.dot(q, c, trans_b=True)
    x = jnp.where(valid[None, :], x * scale, cm.MASK_VALUE)
    plgpu.store(x_ref.at[kv, pl.ds(0, p.rp), pl.ds(cb * p.block_c, p.block_c)], x, mask=hv[:, None])
    m_new = jnp.maximum(m_run, jnp.max(x, axis=1))
    e = jnp.where(valid[None, :], jnp.exp(x - m_new[:, None]), 0.0)
    l_new = l_run * jnp.exp(m_run - m_new) + jnp.sum(e * cnt.astype(jnp.float32)[None, :], axis=1)
    return m_new, l_new, valid_n, cnt_n

  v0, c0 = counts(sp * p.score_blocks)
  init = (jnp.full((p.rp,), cm.MASK_VALUE, jnp.float32), jnp.zeros((p.rp,), jnp.float32), v0, c0)
  if p.score_blocks == 1:
    m, l, _, _ = block(0, init)
  else:
    m, l, _, _ = lax.fori_loop(0, p.score_blocks, block, init)
  plgpu.store(m_ref.at[kv, pl.ds(0, p.rp), sp], m, mask=hv)
  plgpu.store(l_ref.at[kv, pl.ds(0, p.rp), sp], l, mask=hv)


ORIG_SCORE = clat._score_kernel
oks, ovs, ooff = cluster_sort_layout(k, v, ol.labels, idx.n_sink, idx.n_tail, num_clusters=ol.counts.shape[-1])[:3]
ofix = (oks, ovs, ol.centroids.astype(BF16), ooff, jnp.float32(idx.threshold), kn, vn, qp, kvp)
del hks, hvs


def one_level(q, ks, vs, c, off, t, kn, vn, qp, kvp):
  return clustered_decode_attention(q, ks, vs, c, off, t, kn, vn, qp, kvp, scale=scale, vote="kv", backend=BE)


for tag in ("base", "pf", "nowait", "base", "pf", "nowait"):
  clat._score_kernel = ORIG_SCORE if tag == "base" else functools.partial(score_pf, mode=tag)
  jax.clear_caches()
  f = jax.jit(one_level)
  e = diff("one_level", f(qs[0], *ofix))
  tr = kernel_time_per_call(f, [(qq, *ofix) for qq in qs], n=6)
  loop = time_ms_looped(lambda q, *a: f(q, *a), qs, fixed=ofix, n_iter=300, reps=5)
  rec(f"score_{tag}/one_level_decode", dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 2), loop_ms=round(loop, 4),
                                             kernels={x: round(y * 1e3, 2) for x, y in kern(tr).items()},
                                             max_rel_diff_vs_first=e))
clat._score_kernel = ORIG_SCORE
print("done2", f"{time.time() - T0:.0f}s", flush=True)
