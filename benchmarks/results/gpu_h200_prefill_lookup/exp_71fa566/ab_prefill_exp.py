"""A/B on one GPU: the prefill centroid-lookup passes with cheaper inner loops, patched into
`pallas_kernels.centroid_lookup` (caches cleared between variants).

Variants (flags of the two kernels below):
  fold     scoring pass: 1/D folded into the exponent, exp2(s - m - log2 D) (no multiply per element)
  mma      the count-weighted sum (statistics) / the token sum (scoring) on the tensor cores:
           p (f16) @ [Bc, 16] counts, ones [16, Bt] @ p (f16)
  f16exp   exponentials as ex2.approx.f16x2 (two per MUFU op); scoring scaled by 2^15 in f16
Inputs: the speed suite's (captured SmolLM2 keys tiled to 512K, Squeezed / HierarchicalSqueezed(0.9)),
4096 query tokens, 32/8 heads, d = 128, bf16.  busy_ms: profiler kernel time per call (4 calls)."""
import functools, json, math, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
sys.path.insert(0, ".")
from benchmarks.speed import Plan, KeySource
from benchmarks._meta import metadata
from pallas_kernels import centroid_lookup as cl, _common as cm
from sqjax.methods import ContextData, Squeezed, HierarchicalSqueezed
from sqjax import dispatch, squeezed

OUT = os.environ.get("OUT", "/tmp")
SMOKE = bool(os.environ.get("AB_SMOKE"))
BE = "interpret" if SMOKE else "pallas"
T0 = time.time()
F16 = jnp.float16
SCALE_EXP = 15.0


def exp2_f16(x):
  """exp2 of an f16 array, two per MUFU instruction."""
  if SMOKE:
    return jnp.exp2(x)
  [y] = plgpu.elementwise_inline_asm("ex2.approx.f16x2 $0, $1;", args=[x], constraints="=r,r", pack=2,
                                     result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, F16)])
  return y


def load_block(c_ref, n_ref, *, kv, j, num_c, d, live, bounds):
  if not bounds:
    return cl._load_centroid_block(c_ref, n_ref, kv=kv, j=j, num_c=num_c, d=d, live=live)
  cv = j < num_c if live is None else live
  row = kv * num_c + j
  cnt = cm.gather_vec(n_ref, row, cv, other=0)
  return cv & (cnt > 0), cnt.astype(jnp.float32), cm.gather_rows(c_ref, row, d, cv)


def stats_v(q_ref, c_ref, n_ref, *refs, scale, seq_len, num_c, group, r, block_t, block_c, d, bounded, splits=1,
            f16exp=False, mma=False, bounds=False, **_):
  if bounded:
    nv_ref, m_ref, l_ref = refs
  else:
    m_ref, l_ref = refs
  tb = pl.program_id(0)
  h = pl.program_id(1)
  z = pl.program_id(2)
  grp = cm.kdiv(h, r)
  kv = cm.kdiv(h, group)
  t = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
  q = cm.gather_rows(q_ref, h * seq_len + t, d, t < seq_len)
  n = jnp.clip(nv_ref[grp], 0, num_c) if bounded else num_c
  scale2 = scale * cl._LOG2E
  col16 = jnp.arange(16, dtype=jnp.int32)

  def body(b, carry):
    m_prev, l_prev = carry
    j = b * block_c + jnp.arange(block_c, dtype=jnp.int32)
    valid, cnt, c = load_block(c_ref, n_ref, kv=kv, j=j, num_c=num_c, d=d,
                               live=(j < n) if bounded else None, bounds=bounds)
    s = plgpu.dot(q, c, trans_b=True) * scale2
    s = jnp.where(valid[None, :], s, cm.MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    x = s - m_next[:, None]
    p = exp2_f16(x.astype(F16)) if f16exp else jnp.exp2(x)
    if mma:
      cmat = jnp.where(col16[None, :] == 0, cnt[:, None], 0.0).astype(F16)       # [Bc, 16]
      lsum = jnp.sum(plgpu.dot(p.astype(F16), cmat), axis=1)                       # [Bt]
    else:
      lsum = jnp.sum(p.astype(jnp.float32) * cnt[None, :], axis=1)
    l_next = l_prev * jnp.exp2(m_prev - m_next) + lsum
    return m_next, l_next

  m0 = jnp.full((block_t,), cm.MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((block_t,), jnp.float32)
  if bounded:
    nblk = cm.kcdiv(n, block_c)
    chunk = cm.kcdiv(nblk, splits)
    start = (z * chunk).astype(jnp.int32)
    stop = jnp.maximum(jnp.minimum(start + chunk, nblk), start).astype(jnp.int32)
    m, l = lax.fori_loop(start, stop, body, (m0, l0))
  else:
    m, l = lax.fori_loop(0, cm.cdiv(num_c, block_c), body, (m0, l0))
  m_ref[z, h, pl.ds(tb * block_t, block_t)] = m
  l_ref[z, h, pl.ds(tb * block_t, block_t)] = l


def score_v(q_ref, c_ref, n_ref, ms_ref, ls_ref, *refs, scale, seq_len, num_c, group, r, n_tb, block_t, block_c, d,
            bounded, tile_acc=False, splits=1, fold=False, f16exp=False, mma=False, bounds=False):
  (nv_ref, o_ref) = refs if bounded else (None, refs[0])
  cb = pl.program_id(0)
  grp = pl.program_id(1)
  z = pl.program_id(2)
  kv = cm.kdiv(grp * r, group)
  j = cb * block_c + jnp.arange(block_c, dtype=jnp.int32)
  n = jnp.clip(nv_ref[grp], 0, num_c) if bounded else num_c
  valid, _, c = load_block(c_ref, n_ref, kv=kv, j=j, num_c=num_c, d=d,
                           live=(j < n) if bounded else None, bounds=bounds)
  scale2 = scale * cl._LOG2E
  bias = SCALE_EXP if f16exp else 0.0
  row16 = jnp.arange(16, dtype=jnp.int32)

  def body(it, acc):
    rr = cm.kdiv(it, n_tb)
    tb = cm.krem(it, n_tb)
    h = grp * r + rr
    t = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
    tv = t < seq_len
    q = cm.gather_rows(q_ref, h * seq_len + t, d, tv)
    mt = ms_ref[h, pl.ds(tb * block_t, block_t)]
    lt = ls_ref[h, pl.ds(tb * block_t, block_t)]
    s = plgpu.dot(q, c, trans_b=True) * scale2
    if fold:   # exp2(s - m - log2 D [+ 15]): the normalised score itself; padding tokens -> 0
      ok = tv & (lt > 0)
      mt2 = jnp.where(ok, mt + jnp.log2(jnp.where(ok, lt, 1.0)) - bias, -cm.MASK_VALUE)
      x = jnp.minimum(s - mt2[:, None], bias)
      p = exp2_f16(x.astype(F16)) if f16exp else jnp.exp2(x)
      if mma:
        ones = jnp.broadcast_to(jnp.where(row16[:, None] == 0, 1.0, 0.0), (16, block_t)).astype(F16)  # [16, Bt]
        return acc + plgpu.dot(ones, p.astype(F16))                                # [16, Bc]
      return acc + p.astype(jnp.float32)
    inv = jnp.where(tv & (lt > 0), 1.0 / jnp.where(lt > 0, lt, 1.0), 0.0)
    p = jnp.exp2(jnp.minimum(s - mt[:, None], 0.0))
    return acc + p * inv[:, None]

  active = cb * block_c < n
  total = r * n_tb
  chunk = cm.cdiv(total, splits)
  start = (z * chunk).astype(jnp.int32)
  stop = jnp.where(active, jnp.minimum(start + chunk, jnp.int32(total)), start).astype(jnp.int32)
  shape = (16, block_c) if (fold and mma) else (block_t, block_c)
  acc = lax.fori_loop(start, jnp.maximum(stop, start), body, jnp.zeros(shape, jnp.float32))
  acc = jnp.sum(acc, axis=0) * (2.0 ** -bias)
  acc = jnp.where(valid, acc, 0.0)
  o_ref[grp, z, pl.ds(cb * block_c, block_c)] = acc * (1.0 / (r * seq_len))


import dataclasses
from pallas_kernels import hierarchical_lookup as hl_mod
ORIG = (cl._stats_kernel, cl._score_kernel, cl.DEFAULT_PREFILL)
B = dict(bounds=True)
VARIANTS = {
    "base": None,
    "fold": dict(stats={}, score=dict(fold=True)),
    "fold_bounds": dict(stats=B, score=dict(fold=True, **B)),
    "fold_st3": dict(stats={}, score=dict(fold=True), cfg=dict(num_stages=3)),
    "fold_bounds_st3": dict(stats=B, score=dict(fold=True, **B), cfg=dict(num_stages=3)),
    "fold_bounds_w8": dict(stats=B, score=dict(fold=True, **B), cfg=dict(num_warps=8)),
    "fold_sbt128": dict(stats={}, score=dict(fold=True), cfg=dict(score_block_t=128)),
    "fold_bounds_sbt128": dict(stats=B, score=dict(fold=True, **B), cfg=dict(score_block_t=128)),
    "fold_mma": dict(stats=dict(mma=True), score=dict(fold=True, mma=True)),
    "f16exp_fold": dict(stats=dict(f16exp=True), score=dict(fold=True, f16exp=True)),
    "f16exp_fold_mma": dict(stats=dict(f16exp=True, mma=True), score=dict(fold=True, f16exp=True, mma=True)),
}
# AB_RUN=1: the first run (ab_prefill_exp.json); 2 (default): the second (ab_prefill_exp2.json)
RUNS = {"1": ("base", "fold", "fold_mma", "f16exp_fold", "f16exp_fold_mma", "base", "f16exp_fold_mma"),
        "2": ("base", "fold", "fold_bounds", "fold_st3", "fold_bounds_st3", "fold_bounds_w8", "fold_sbt128",
              "fold_bounds_sbt128", "base", "fold", "fold_bounds")}
RUN = os.environ.get("AB_RUN", "2")


def use(name):
  v = VARIANTS[name]
  if v is None:
    cl._stats_kernel, cl._score_kernel, cfg = ORIG
  else:
    cl._stats_kernel = functools.partial(stats_v, **v["stats"])
    cl._score_kernel = functools.partial(score_v, **v["score"])
    cfg = dataclasses.replace(ORIG[2], **v.get("cfg", {}))
  cl.DEFAULT_PREFILL = hl_mod.DEFAULT_PREFILL = cfg
  jax.clear_caches()


def kernel_time(f, sets, n):
  if SMOKE:
    return {"busy_ms_per_call": float("nan"), "kernels": []}
  from benchmarks._profile import kernel_time_per_call
  return kernel_time_per_call(f, sets, n=n, top=8)


plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
L = 4096 if SMOKE else 524288
T = 64 if SMOKE else 4096
scale = 1.0 / math.sqrt(128)
k, v = src.kv(L, seed=L, n_heads=8)
q_obs = src.queries(100, seed=L, n_heads=32)[None]
data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
with dispatch.using("auto"):
  hidx = HierarchicalSqueezed(sparsity=0.9, n_sink=1).build(data)[0]
  idx = Squeezed(sparsity=0.9, n_sink=1).build(data)[0]
jax.block_until_ready((hidx, idx))
del k, v, data
print(f"indexes built {time.time() - T0:.0f}s", flush=True)
qs = [src.queries(T, seed=409600 + j, n_heads=32) for j in range(2)]
hl, ol = hidx.layer(0), idx.layer(0)
t1 = jnp.float32(hidx.threshold1)
out = {"meta": {**metadata(), "keys": src.kind, "L": L, "T": T,
                "timing": "busy_ms: profiler kernel time per call, 4 calls"}, "results": {}}
R = out["results"]


def lookup(li, q, t1):
  with dispatch.using(BE):
    return squeezed.layer_scores(li, q, t1, scale, "kv")[0]


f = jax.jit(lookup)
ref = {}
for name in RUNS[RUN]:
  use(name)
  for lname, li in (("1level", ol), ("hier", hl)):
    key = f"{name}/{lname}"
    try:
      s = np.asarray(f(li, qs[0], t1), np.float64)
      ref.setdefault(lname, s)
      rs = ref[lname]
      tr = kernel_time(f, [(li, qq, t1) for qq in qs], n=4)
      thr = float(idx.threshold if lname == "1level" else hidx.threshold)
      r = dict(busy_ms=round(tr["busy_ms_per_call"], 4),
               kernels={x["name"][:30]: round(x["ms_per_call"], 4) for x in tr["kernels"]},
               max_rel_err=float(np.max(np.abs(s - rs)) / max(np.max(np.abs(rs)), 1e-30)),
               sel_flips=int(np.sum((s > thr) != (rs > thr))), sel_base=int(np.sum(rs > thr)))
    except Exception as e:  # noqa: BLE001
      r = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
    R[key if key not in R else key + "_2"] = r
    print(key, r, f"{time.time() - T0:.0f}s", flush=True)
    json.dump(out, open(f"{OUT}/ab_prefill_exp{'' if RUN == '1' else RUN}.json", "w"), indent=1)
use("base")
print("done", f"{time.time() - T0:.0f}s", flush=True)
