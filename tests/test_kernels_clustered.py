"""Clustered Squeezed attention over the cluster-contiguous layout.

Interpret-mode kernels vs the plain-jnp references, the references vs an
independent numpy brute force (float64 loops over explicit row sets), the layout
helper, the Triton lowering at Llama-3-8B shapes (with the MLIR verifier that
catches loop-bound type mismatches), and the GPU script's clustered checks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _dispatch
from pallas_kernels.centroid_lookup import CentroidLookupConfig
from pallas_kernels.clustered_attention import (ClusteredConfig, cluster_sort_layout,
                                                clustered_decode_attention,
                                                clustered_decode_attention_reference,
                                                clustered_decode_selected,
                                                clustered_decode_selected_reference,
                                                clustered_prefill_attention,
                                                clustered_prefill_attention_reference)

BF = jnp.bfloat16
# Small tiles so the test shapes exercise several programs, sub-blocks, tiles per
# cluster (clusters bigger than block_k), new-part chunks and exact-part programs.
SMALL = ClusteredConfig(block_c=16, block_clusters=32, sub_clusters=16, block_k=16,
                        chunk_new=16, exact_programs=2)


# ----------------------------------------------------------------------------
# Inputs and numpy brute force.
# ----------------------------------------------------------------------------
def synth_labels(rng, hkv, n, num_c, *, empty_frac=0.2, unlabelled=0.0):
  """Skewed cluster sizes: lognormal weights, some clusters empty, one ~20x bigger."""
  labels = []
  for _ in range(hkv):
    w = np.exp(1.2 * rng.normal(size=num_c))
    w[rng.random(num_c) < empty_frac] = 0.0
    w[rng.integers(num_c)] = 20.0 * w.max() + 1.0
    lab = rng.choice(num_c, size=n, p=w / w.sum())
    lab[rng.random(n) < unlabelled] = -1                       # -> exact part
    labels.append(lab)
  return np.stack(labels).astype(np.int32)


def make_case(rng, *, hq=8, hkv=2, num_c=37, n_sink=3, n_clustered=280, n_tail=13, d=32,
              num_s=20, seq_len=1, dtype=jnp.float32, unlabelled=0.02):
  num_l = n_sink + n_clustered + n_tail
  labels = synth_labels(rng, hkv, n_clustered, num_c, unlabelled=unlabelled)
  k = rng.normal(size=(hkv, num_l, d))
  v = rng.normal(size=(hkv, num_l, d))
  ks, vs, offs, perm = cluster_sort_layout(jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                           jnp.asarray(labels), n_sink, n_tail,
                                           num_clusters=num_c)
  counts = np.diff(np.asarray(offs), axis=1)
  cent = rng.normal(size=(hkv, num_c, d))
  cent[counts == 0] = np.nan                                   # never read
  q = rng.normal(size=(hq, seq_len, d))
  kn = rng.normal(size=(hkv, num_s, d))
  vn = rng.normal(size=(hkv, num_s, d))
  kvp = num_l + np.arange(num_s)
  empty = rng.random(num_s) < 0.25
  kvp[empty] = -1                                              # padding slots
  kn[:, empty] = np.nan                                        # never read
  vn[:, empty] = np.nan
  qp = num_l + num_s - seq_len - 2 + np.arange(seq_len)       # last 2 new keys are future
  x = dict(q=jnp.asarray(q if seq_len > 1 else q[:, 0], dtype), k=ks, v=vs,
           cent=jnp.asarray(cent, dtype), offs=offs, kn=jnp.asarray(kn, dtype),
           vn=jnp.asarray(vn, dtype), qp=jnp.asarray(qp, jnp.int32),
           kvp=jnp.asarray(kvp, jnp.int32))
  meta = dict(k_orig=k, v_orig=v, labels=labels, perm=np.asarray(perm), counts=counts,
              n_sink=n_sink, n_tail=n_tail, num_l=num_l, d=d)
  return x, meta


def args_of(x, thr):
  return (x["q"], x["k"], x["v"], x["cent"], x["offs"], jnp.float32(thr), x["kn"], x["vn"],
          x["qp"], x["kvp"])


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def np_scores(q, cent, counts, scale, vote):
  """Eq. 1 in float64: per token normalised, mean over tokens, then over the group."""
  q = f64(q)
  if q.ndim == 2:
    q = q[:, None]
  cent = f64(cent)
  hq, seq_len, _ = q.shape
  hkv, num_c = counts.shape
  g = hq // hkv
  s = np.zeros((hq, num_c))
  for h in range(hq):
    kv = h // g
    ok = counts[kv] > 0
    if not ok.any():
      continue
    for t in range(seq_len):
      logit = np.full(num_c, -np.inf)
      logit[ok] = scale * (cent[kv, ok] @ q[h, t])
      e = np.exp(logit - logit[ok].max())
      s[h] += e / np.sum(counts[kv] * e) / seq_len
  if vote == "kv":
    s = s.reshape(hkv, g, num_c).mean(axis=1)
  return s


def brute(x, thr, scale, vote, sel=None):
  """float64 loops over explicit row sets -> (o [Hq, T, d], selected [Hs, C], rows [Hs]);
  ``sel`` given: that selection instead of scoring the centroids."""
  q = f64(x["q"])
  if q.ndim == 2:
    q = q[:, None]
  ks, vs, kn, vn = (f64(x[n]) for n in ("k", "v", "kn", "vn"))
  offs = np.asarray(x["offs"])
  qp, kvp = np.asarray(x["qp"]), np.asarray(x["kvp"])
  hq, seq_len, d = q.shape
  hkv, num_l, _ = ks.shape
  counts = np.diff(offs, axis=1)
  if sel is None:
    s = np_scores(x["q"], x["cent"], counts, scale, vote)
    sel = (s > thr) & np.repeat(counts > 0, s.shape[0] // hkv, axis=0)
  hs = sel.shape[0]
  g, r = hq // hkv, hq // hs
  o = np.zeros((hq, seq_len, d))
  rows = np.zeros(hs, np.int64)
  for sh in range(hs):
    kv = sh * r // g
    idx = [i for c in np.nonzero(sel[sh])[0] for i in range(offs[kv, c], offs[kv, c + 1])]
    idx += list(range(offs[kv, -1], num_l))
    rows[sh] = len(idx)
    for h in range(sh * r, (sh + 1) * r):
      for t in range(seq_len):
        keys = [ks[kv, i] for i in idx]
        vals = [vs[kv, i] for i in idx]
        for j in range(kn.shape[1]):
          if 0 <= kvp[j] <= qp[t]:
            keys.append(kn[kv, j])
            vals.append(vn[kv, j])
        if not keys:
          continue
        logit = scale * np.array([q[h, t] @ kk for kk in keys])
        p = np.exp(logit - logit.max())
        o[h, t] = (p[:, None] * np.array(vals)).sum(0) / p.sum()
  return o, sel, rows


def pick_threshold(scores, valid, frac=0.5, lo_q=0.25, hi_q=0.75):
  """Midpoint of the widest relative gap between consecutive valid scores in a quantile
  window around ``1 - frac``: no score sits near it, so rounding never flips a cluster."""
  s = np.sort(scores[valid].reshape(-1))
  a = int(lo_q * (len(s) - 1))
  b = max(int(hi_q * (len(s) - 1)), a + 1)
  lo, hi = s[a:b], s[a + 1:b + 1]
  i = int(np.argmax((hi - lo) / np.maximum(np.abs(hi), 1e-300)))
  assert (hi[i] - lo[i]) / hi[i] > 1e-3, "no usable gap"
  return float(0.5 * (lo[i] + hi[i]))


def threshold_for(x, meta, scale, vote, **kw):
  if vote == "q":      # per-head sets: select fewer so the group's union leaves rows out
    kw = {"lo_q": 0.75, "hi_q": 0.95, **kw}
  s = np_scores(x["q"], x["cent"], meta["counts"], scale, vote)
  valid = np.repeat(meta["counts"] > 0, s.shape[0] // meta["counts"].shape[0], axis=0)
  return pick_threshold(s, valid, **kw)


def poison_unselected(x, meta, sel):
  """NaN in every sorted row that no selection head of the group retrieves."""
  offs = np.asarray(x["offs"])
  hkv = offs.shape[0]
  r = sel.shape[0] // hkv
  used = np.zeros((hkv, meta["num_l"]), bool)
  for sh in range(sel.shape[0]):
    kv = sh // r
    used[kv, offs[kv, -1]:] = True
    for c in np.nonzero(sel[sh])[0]:
      used[kv, offs[kv, c]:offs[kv, c + 1]] = True
  assert (~used).any()
  m = jnp.asarray(used)[..., None]
  dt = x["k"].dtype
  return dict(x, k=jnp.where(m, x["k"], jnp.nan).astype(dt),
              v=jnp.where(m, x["v"], jnp.nan).astype(dt))


def rel(a, b):
  a, b = f64(a), f64(b)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ----------------------------------------------------------------------------
# Layout.
# ----------------------------------------------------------------------------
def test_cluster_sort_layout(rng):
  hkv, n_sink, lc, n_tail, num_c, d = 3, 4, 200, 9, 23, 8
  labels = synth_labels(rng, hkv, lc, num_c, unlabelled=0.05)
  labels[0, :3] = num_c + 5                                    # out of range -> exact part
  k = rng.normal(size=(hkv, n_sink + lc + n_tail, d)).astype(np.float32)
  v = rng.normal(size=k.shape).astype(np.float32)
  ks, vs, offs, perm = cluster_sort_layout(jnp.asarray(k), jnp.asarray(v), jnp.asarray(labels),
                                           n_sink, n_tail, num_clusters=num_c)
  ks, vs, offs, perm = map(np.asarray, (ks, vs, offs, perm))
  assert offs.shape == (hkv, num_c + 1) and offs.dtype == np.int32
  for h in range(hkv):
    assert sorted(perm[h]) == list(range(k.shape[1]))
    np.testing.assert_array_equal(ks[h], k[h, perm[h]])
    np.testing.assert_array_equal(vs[h], v[h, perm[h]])
    lab = labels[h]
    ok = (lab >= 0) & (lab < num_c)
    np.testing.assert_array_equal(np.diff(offs[h]), np.bincount(lab[ok], minlength=num_c))
    assert offs[h, 0] == 0
    for c in range(num_c):
      pos = perm[h, offs[h, c]:offs[h, c + 1]]
      assert list(pos) == sorted(n_sink + np.nonzero(lab == c)[0])
    exact = perm[h, offs[h, -1]:]
    want = sorted(list(range(n_sink)) + list(n_sink + np.nonzero(~ok)[0])
                  + list(range(n_sink + lc, n_sink + lc + n_tail)))
    assert list(exact) == want
  # num_clusters inferred from concrete labels
  _, _, offs2, _ = cluster_sort_layout(jnp.asarray(k), jnp.asarray(v),
                                       jnp.asarray(np.abs(labels) % num_c), n_sink, n_tail)
  assert offs2.shape[1] == int((np.abs(labels) % num_c).max()) + 2
  with pytest.raises(ValueError, match="n_sink"):
    cluster_sort_layout(jnp.asarray(k), jnp.asarray(v), jnp.asarray(labels), n_sink, n_tail + 1,
                        num_clusters=num_c)


# ----------------------------------------------------------------------------
# Decode.
# ----------------------------------------------------------------------------
DECODE_CASES = [  # hq, hkv, vote, dtype, d
    (8, 2, "kv", jnp.float32, 32),
    (8, 2, "q", jnp.float32, 24),      # head dim padded to 32 inside the kernels
    (3, 3, "kv", jnp.float32, 32),     # 1:1
    (6, 2, "q", jnp.float32, 32),      # a group of 3: selection rows padded to 4
    (8, 2, "q", BF, 32),
]


# Several centroid blocks per scoring program (statistics folded online); with 37 clusters
# in blocks of 16, 2 blocks leave the second program one real block and one past the end.
MULTI_BLOCK = [(8, 2, "kv", jnp.float32, 32, 2), (8, 2, "q", jnp.float32, 32, 3),
               (8, 2, "kv", BF, 32, 2)]


@pytest.mark.parametrize("hq,hkv,vote,dtype,d,score_blocks",
                         [c + (1,) for c in DECODE_CASES] + MULTI_BLOCK)
def test_decode_interpret_matches_reference(rng, hq, hkv, vote, dtype, d, score_blocks):
  scale = d ** -0.5
  x, meta = make_case(rng, hq=hq, hkv=hkv, d=d, dtype=dtype)
  thr = threshold_for(x, meta, scale, vote)
  _, sel_np, rows_np = brute(x, thr, scale, vote)
  assert sel_np.any() and not sel_np[meta["counts"].repeat(sel_np.shape[0] // hkv, 0) > 0].all()
  big = [c for c in range(meta["counts"].shape[1]) if meta["counts"][0, c] > SMALL.block_k]
  assert big, "need clusters larger than the row tile"
  x = poison_unselected(x, meta, sel_np)
  args = args_of(x, thr)
  cfg = dataclasses.replace(SMALL, score_blocks=score_blocks, score_stages=min(score_blocks, 2))
  out, sel, rows = clustered_decode_attention(*args, scale=scale, vote=vote, return_stats=True,
                                              backend="interpret", config=cfg)
  ref, rsel, rrows = clustered_decode_attention_reference(*args, scale=scale, vote=vote,
                                                          return_stats=True)
  assert out.dtype == x["q"].dtype and out.shape == x["q"].shape
  assert not np.isnan(f64(out)).any() and not np.isnan(f64(ref)).any()
  np.testing.assert_array_equal(np.asarray(sel), sel_np)
  np.testing.assert_array_equal(np.asarray(rsel), sel_np)
  np.testing.assert_array_equal(np.asarray(rows), rows_np)
  np.testing.assert_array_equal(np.asarray(rrows), rows_np)
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  assert rel(out, ref) < tol


@pytest.mark.parametrize("hq,hkv,vote,dtype", [(8, 2, "kv", jnp.float32), (8, 2, "q", jnp.float32),
                                                 (3, 3, "kv", jnp.float32), (8, 2, "kv", BF)])
def test_decode_selected_matches_reference_and_bruteforce(rng, hq, hkv, vote, dtype):
  """Attention over a selection made elsewhere (the hierarchical lookup's): random sets, one
  head selecting nothing (exact part + new keys only), selected empty clusters ignored."""
  x, meta = make_case(rng, hq=hq, hkv=hkv, dtype=dtype)
  hs = hkv if vote == "kv" else hq
  num_c = meta["counts"].shape[1]
  sel = rng.random((hs, num_c)) < 0.3
  sel[-1] = False
  o_np, _, _ = brute(x, None, 0.2, vote, sel=sel)
  args = (x["q"], x["k"], x["v"], x["offs"], jnp.asarray(sel), x["kn"], x["vn"], x["qp"], x["kvp"])
  out = clustered_decode_selected(*args, scale=0.2, vote=vote, backend="interpret", config=SMALL)
  ref = clustered_decode_selected_reference(*args, scale=0.2)
  assert out.dtype == x["q"].dtype and out.shape == x["q"].shape
  assert not np.isnan(f64(out)).any()
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  assert rel(ref, o_np[:, 0]) < tol and rel(out, o_np[:, 0]) < tol
  # the same selection made by the scoring kernel gives the same output
  thr = threshold_for(x, meta, 0.2, vote)
  out2, sel2, _ = clustered_decode_attention(*args_of(x, thr), scale=0.2, vote=vote, return_stats=True,
                                             backend="interpret", config=SMALL)
  out3 = clustered_decode_selected(*args[:4], sel2, *args[5:], scale=0.2, vote=vote, backend="interpret",
                                   config=SMALL)
  assert rel(out3, out2) < tol
  with pytest.raises(ValueError, match=r"selected must be bool \[Hs, C\]"):
    clustered_decode_selected(*args[:4], jnp.asarray(sel[:, :-1]), *args[5:], scale=0.2, vote=vote)


def _union_layout(parts):
  """Two cluster-contiguous slices -> one layout over both: slice 0's clusters, slice 1's, then
  both exact parts (per KV head; offsets shifted)."""
  (x0, m0), (x1, m1) = parts
  hkv = m0["counts"].shape[0]
  ks, vs, offs = [], [], []
  for h in range(hkv):
    o0, o1 = np.asarray(x0["offs"][h]), np.asarray(x1["offs"][h])
    for name, out in (("k", ks), ("v", vs)):
      a0, a1 = f64(x0[name][h]), f64(x1[name][h])
      out.append(np.concatenate([a0[:o0[-1]], a1[:o1[-1]], a0[o0[-1]:], a1[o1[-1]:]]))
    offs.append(np.concatenate([o0[:-1], o0[-1] + o1]))
  dt = x0["k"].dtype
  return dict(x0, k=jnp.asarray(np.stack(ks), dt), v=jnp.asarray(np.stack(vs), dt),
              cent=jnp.concatenate([x0["cent"], x1["cent"]], axis=1),
              offs=jnp.asarray(np.stack(offs), jnp.int32))


@pytest.mark.parametrize("vote,backend", [("kv", "interpret"), ("q", "interpret"), ("kv", "reference")])
def test_partial_over_two_slices_equals_one_layout(rng, vote, backend):
  """clustered_decode_partial on two context slices (each its own clusters), with the Eq. 1
  statistics combined across them (vmap over a "ctx" axis, the all-gather of
  `sharding._global_stats`) and a log-sum-exp merge == one decode over the union layout."""
  from pallas_kernels.clustered_attention import clustered_decode_partial
  from sqjax.sharding import CTX, _global_stats

  scale = 32 ** -0.5
  parts = [make_case(rng, hq=8, hkv=2, d=32, num_c=19, n_clustered=150) for _ in range(2)]
  union = _union_layout(parts)
  counts = np.diff(np.asarray(union["offs"]), axis=1)
  s = np_scores(union["q"], union["cent"], counts, scale, vote)
  thr = pick_threshold(s, np.repeat(counts > 0, s.shape[0] // 2, axis=0))
  x0, x1 = (p[0] for p in parts)
  no_new = jnp.full_like(x0["kvp"], -1)                 # the user input lives on the last slice
  stack = lambda name: jnp.stack([x0[name], x1[name]])  # noqa: E731

  def one(k, v, cent, offs, kvp):
    return clustered_decode_partial(union["q"], k, v, cent, offs, jnp.float32(thr), union["kn"], union["vn"],
                                    union["qp"], kvp, scale=scale, vote=vote, reduce_stats=_global_stats,
                                    backend=backend, config=SMALL)

  o, lse = jax.vmap(one, axis_name=CTX)(stack("k"), stack("v"), stack("cent"), stack("offs"),
                                        jnp.stack([no_new, union["kvp"]]))
  tot = jax.nn.logsumexp(lse, axis=0)
  merged = jnp.sum(jnp.exp(lse - tot)[..., None] * o, axis=0)
  ref = clustered_decode_attention_reference(*args_of(union, thr), scale=scale, vote=vote)
  assert o.dtype == jnp.float32 and lse.shape == (2, 8)
  assert rel(merged, ref) < 2e-5
  # one slice alone, no reduction: the single-layout kernel's answer and log-sum-exp
  o1, lse1 = clustered_decode_partial(*args_of(x1, thr), scale=scale, vote=vote, backend=backend, config=SMALL)
  assert rel(o1, clustered_decode_attention_reference(*args_of(x1, thr), scale=scale, vote=vote)) < 2e-5
  assert np.isfinite(np.asarray(lse1)).all()
  # a call holding whole heads asks for its output dtype: the merge writes it, same numbers rounded
  o16, lse16 = clustered_decode_partial(*args_of(x1, thr), scale=scale, vote=vote, backend=backend, config=SMALL,
                                        out_dtype=jnp.bfloat16)
  assert o16.dtype == jnp.bfloat16 and lse16.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(o16), np.asarray(o1.astype(jnp.bfloat16)))
  np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse1))


@pytest.mark.parametrize("vote,seq_len", [("kv", 1), ("q", 1), ("kv", 5), ("q", 4)])
def test_reference_matches_bruteforce(rng, vote, seq_len):
  d = 16
  scale = d ** -0.5
  x, meta = make_case(rng, hq=4, hkv=2, num_c=13, n_clustered=90, n_tail=5, d=d, num_s=9,
                      seq_len=seq_len)
  thr = threshold_for(x, meta, scale, vote)
  o_np, sel_np, rows_np = brute(x, thr, scale, vote)
  x = poison_unselected(x, meta, sel_np)
  fn = (clustered_decode_attention_reference if seq_len == 1
        else clustered_prefill_attention_reference)
  with jax.default_matmul_precision("highest"):
    out, sel, rows = fn(*args_of(x, thr), scale=scale, vote=vote, return_stats=True)
  out = f64(out).reshape(o_np.shape)
  assert rel(out, o_np) < 1e-5
  np.testing.assert_array_equal(np.asarray(sel), sel_np)
  np.testing.assert_array_equal(np.asarray(rows), rows_np)


def dense_numpy(q, k, v, kn, vn, qp, kvp, scale):
  """Attention over every fixed row (original order) + visible new keys, float64."""
  hq, d = q.shape
  hkv = k.shape[0]
  g = hq // hkv
  out = np.zeros((hq, d))
  vis = (kvp >= 0) & (kvp <= qp[0])
  for h in range(hq):
    keys = np.concatenate([k[h // g], kn[h // g][vis]])
    vals = np.concatenate([v[h // g], vn[h // g][vis]])
    lg = scale * keys @ q[h]
    p = np.exp(lg - lg.max())
    out[h] = p @ vals / p.sum()
  return out


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_threshold_selecting_everything_is_dense_attention(rng, vote):
  d = 32
  scale = d ** -0.5
  x, meta = make_case(rng, d=d)
  out, sel, rows = clustered_decode_attention(*args_of(x, -1.0), scale=scale, vote=vote,
                                              return_stats=True, backend="interpret",
                                              config=SMALL)
  want = dense_numpy(f64(x["q"]), meta["k_orig"], meta["v_orig"], f64(x["kn"]), f64(x["vn"]),
                     np.asarray(x["qp"]), np.asarray(x["kvp"]), scale)
  assert rel(out, want) <= 1e-5
  r = np.asarray(sel).shape[0] // meta["counts"].shape[0]
  np.testing.assert_array_equal(np.asarray(sel), np.repeat(meta["counts"] > 0, r, axis=0))
  assert (np.asarray(rows) == meta["num_l"]).all()


def test_threshold_selecting_nothing_keeps_the_exact_part(rng):
  d = 32
  scale = d ** -0.5
  x, meta = make_case(rng, d=d, unlabelled=0.05)
  x = poison_unselected(x, meta, np.zeros((2, meta["counts"].shape[1]), bool))
  out, sel, rows = clustered_decode_attention(*args_of(x, 1e30), scale=scale,
                                              return_stats=True, backend="interpret",
                                              config=SMALL)
  assert not np.asarray(sel).any()
  offs = np.asarray(x["offs"])
  np.testing.assert_array_equal(np.asarray(rows), meta["num_l"] - offs[:, -1])
  # exact part = sink + unlabelled + tail, in original positions
  perm = meta["perm"]
  q = f64(x["q"])
  kn, vn, kvp, qp = f64(x["kn"]), f64(x["vn"]), np.asarray(x["kvp"]), np.asarray(x["qp"])
  want = np.zeros_like(q)
  for h in range(q.shape[0]):
    kv = h // 4
    pos = perm[kv, offs[kv, -1]:]
    vis = (kvp >= 0) & (kvp <= qp[0])
    keys = np.concatenate([meta["k_orig"][kv, pos], kn[kv][vis]])
    vals = np.concatenate([meta["v_orig"][kv, pos], vn[kv][vis]])
    lg = scale * keys @ q[h]
    p = np.exp(lg - lg.max())
    want[h] = p @ vals / p.sum()
  assert rel(out, want) <= 1e-5


def test_nothing_visible_gives_zero_not_nan(rng):
  d = 16
  # no exact part (no sink, no tail), nothing selected; new part all empty / in the future
  x, meta = make_case(rng, hq=4, hkv=2, num_c=11, n_sink=0, n_clustered=60, n_tail=0, d=d,
                      num_s=5, unlabelled=0.0)
  x["kvp"] = jnp.asarray([-1, -1, 10**6, -1, 10**6], jnp.int32)
  x["kn"] = jnp.where(x["kvp"][None, :, None] < 0, jnp.nan, x["kn"])
  out = clustered_decode_attention(*args_of(x, 1e30), scale=d ** -0.5, backend="interpret",
                                   config=SMALL)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  # one KV head with no valid cluster at all, S = 0, selection of everything
  x["offs"] = x["offs"].at[1].set(60)
  x["k"] = x["k"].at[1].set(jnp.nan)
  x["v"] = x["v"].at[1].set(jnp.nan)
  x["kn"], x["vn"] = x["kn"][:, :0], x["vn"][:, :0]
  x["kvp"] = x["kvp"][:0]
  out, sel, rows = clustered_decode_attention(*args_of(x, -1.0), scale=d ** -0.5,
                                              return_stats=True, backend="interpret",
                                              config=SMALL)
  ref = clustered_decode_attention_reference(*args_of(x, -1.0), scale=d ** -0.5)
  np.testing.assert_array_equal(np.asarray(out[2:]), 0.0)
  assert not np.asarray(sel)[1].any() and int(rows[1]) == 0 and int(rows[0]) == 60
  assert rel(out, ref) < 2e-5


def test_random_shapes(rng):
  """One fresh random shape/config draw per run."""
  hkv = int(rng.integers(1, 3))
  g = int(rng.choice([1, 2, 4]))
  num_c = int(rng.integers(3, 60))
  n_cl = int(rng.integers(num_c, 300))
  d = int(rng.choice([16, 24, 32]))
  vote = str(rng.choice(["kv", "q"]))
  cfg = ClusteredConfig(block_c=int(rng.choice([16, 32])), sub_clusters=16,
                        block_clusters=int(rng.choice([16, 32, 48])),
                        block_k=int(rng.choice([16, 32])), exact_programs=int(rng.integers(1, 4)),
                        score_blocks=int(rng.integers(1, 4)))
  print(dict(hkv=hkv, g=g, num_c=num_c, n_cl=n_cl, d=d, vote=vote, cfg=cfg))
  x, meta = make_case(rng, hq=hkv * g, hkv=hkv, num_c=num_c, n_sink=int(rng.integers(0, 5)),
                      n_clustered=n_cl, n_tail=int(rng.integers(0, 20)), d=d,
                      num_s=int(rng.integers(0, 40)))
  thr = float(rng.choice([-1.0, 1e30, 1.0 / num_c / 2]))
  # a cluster whose score is within rounding of the threshold may flip: move the threshold
  # off every score (steps of 0.1%; each score blocks a 2e-5-wide window) so all compare
  s = np_scores(x["q"], x["cent"], meta["counts"], d ** -0.5, vote)
  for _ in range(100):
    if not np.any(np.abs(s - thr) < 1e-5 * max(abs(thr), 1e-30)):
      break
    thr *= 1.001
  else:
    raise AssertionError("no threshold clear of the scores")
  args = args_of(x, thr)
  out, sel, rows = clustered_decode_attention(*args, scale=d ** -0.5, vote=vote,
                                              return_stats=True, backend="interpret", config=cfg)
  ref, rsel, rrows = clustered_decode_attention_reference(*args, scale=d ** -0.5, vote=vote,
                                                          return_stats=True)
  np.testing.assert_array_equal(np.asarray(sel), np.asarray(rsel))
  np.testing.assert_array_equal(np.asarray(rows), np.asarray(rrows))
  assert rel(out, ref) < 2e-5


# ----------------------------------------------------------------------------
# Prefill.
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("vote,dtype,capacity", [
    ("kv", jnp.float32, None),        # f32: in-kernel gather (sparse_attention)
    ("q", jnp.float32, "small"),      # capacity too small for some head -> exact fallback
    ("kv", BF, 200),                  # bf16: gather + dense (cuDNN on GPU, XLA here)
])
def test_prefill_interpret_matches_reference(rng, vote, dtype, capacity):
  d, seq_len = 32, 6
  scale = d ** -0.5
  x, meta = make_case(rng, d=d, seq_len=seq_len, num_s=12, dtype=dtype)
  thr = threshold_for(x, meta, scale, vote)
  _, sel_np, rows_np = brute(x, thr, scale, vote)
  x = poison_unselected(x, meta, sel_np)
  args = args_of(x, thr)
  if capacity == "small":
    capacity = int(np.median(rows_np))
    assert (rows_np > capacity).any()                          # the fallback branch runs
  out, sel, rows = clustered_prefill_attention(*args, scale=scale, vote=vote, capacity=capacity,
                                               return_stats=True, backend="interpret")
  ref = clustered_prefill_attention_reference(*args, scale=scale, vote=vote)
  assert out.shape == x["q"].shape and out.dtype == x["q"].dtype
  assert not np.isnan(f64(out)).any()
  np.testing.assert_array_equal(np.asarray(sel), sel_np)
  np.testing.assert_array_equal(np.asarray(rows), rows_np)
  assert rel(out, ref) < (2e-5 if dtype == jnp.float32 else 3e-2)


def _left_padded(x, n_pad):
  """The block's first n_pad tokens made padding (position -1), as a question bucket pads them."""
  qp = np.asarray(x["qp"]).copy()
  qp[:n_pad] = -1
  return dict(x, qp=jnp.asarray(qp, jnp.int32)), jnp.asarray(qp >= 0)


@pytest.mark.parametrize("vote,dtype,new_part,n_prefix", [("kv", BF, "causal_left_padded", 0), ("q", jnp.float32, "causal", 0),
                                                            ("kv", BF, "prefix_causal_left_padded", 9)])
def test_prefill_q_valid_matches_brute(rng, vote, dtype, new_part, n_prefix):
  """A left-padded block (the question route; with n_prefix, a follow-up after that many kept tokens
  of its conversation): S averaged over the real tokens only; the padding rows attend the fixed part
  alone; every selected row attended with no capacity (interpret) == float64 brute force over the
  real tokens' selection, and == the reference."""
  from pallas_kernels.sparse_attention import causal_alignment

  d, seq_len, n_pad = 32, 7, 3
  scale = d ** -0.5
  x, meta = make_case(rng, d=d, seq_len=seq_len, num_s=n_prefix + seq_len, dtype=dtype)
  kvp = meta["num_l"] + np.arange(n_prefix + seq_len)                           # the turns, then the block's keys
  x = dict(x, kvp=jnp.asarray(kvp, jnp.int32), qp=jnp.asarray(kvp[n_prefix:], jnp.int32),
           kn=jnp.nan_to_num(x["kn"]), vn=jnp.nan_to_num(x["vn"]))
  x, q_valid = _left_padded(x, n_pad)
  if new_part != "causal":   # the padding's slots are empty, as a question block leaves them: the aligned route
    kvp[n_prefix:n_prefix + n_pad] = -1
    x = dict(x, kvp=jnp.asarray(kvp, jnp.int32))
    assert bool(causal_alignment(x["qp"], x["kvp"], True, n_prefix > 0)[2])
  real = dict(x, q=x["q"][:, n_pad:])
  thr = threshold_for(real, meta, scale, vote)
  _, sel_np, rows_np = brute(real, thr, scale, vote)
  o_np, _, _ = brute(x, thr, scale, vote, sel=sel_np)
  x = poison_unselected(x, meta, sel_np)
  args = args_of(x, thr)
  out, sel, rows = clustered_prefill_attention(*args, scale=scale, vote=vote, return_stats=True, backend="interpret",
                                               q_valid=q_valid, new_part=new_part)
  ref = clustered_prefill_attention_reference(*args, scale=scale, vote=vote, q_valid=q_valid)
  np.testing.assert_array_equal(np.asarray(sel), sel_np)
  np.testing.assert_array_equal(np.asarray(rows), rows_np)
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  assert not np.isnan(f64(out)).any() and rel(out, o_np) < tol and rel(ref, o_np) < tol


@pytest.mark.parametrize("hq,hkv,vote,dtype,capacity", [(8, 2, "kv", BF, None), (8, 2, "q", jnp.float32, None),
                                                          (3, 3, "kv", BF, "small")])
def test_prefill_hierarchical_matches_brute(rng, hq, hkv, vote, dtype, capacity):
  """clustered_prefill_hierarchical (interpret: the hierarchical lookup kernels, then the gather +
  dense route) == Eq. 2-3 averaged over the block's real tokens (float64 brute force) attended
  exactly, with the rows no head selects poisoned; == its reference; a capacity some head exceeds
  takes the exact branch; T1 above every level-1 score leaves the exact part and the new keys."""
  from pallas_kernels.clustered_attention import (clustered_prefill_hierarchical,
                                                  clustered_prefill_hierarchical_reference)
  from test_kernels_hierarchical_lookup import brute_hierarchical   # tests/ is on sys.path under pytest
  d, seq_len, n_pad = 32, 6, 2
  scale = d ** -0.5
  x, meta, tree = _tree_case(rng, hq=hq, hkv=hkv, dtype=dtype, d=d, seq_len=seq_len, num_s=12)
  x, q_valid = _left_padded(x, n_pad)
  real_q = x["q"][:, n_pad:]
  t1, t2 = _tree_thresholds(dict(x, q=real_q), meta, tree, scale, vote)
  sel_np, _, _ = brute_hierarchical(f64(real_q), f64(tree["c1"]), tree["n1"], f64(tree["c2"]), meta["counts"],
                                    tree["parent"], t1, t2, scale, vote)
  assert sel_np.any()
  o_np, _, rows_np = brute(x, None, scale, vote, sel=sel_np)
  x = poison_unselected(x, meta, sel_np)
  args = (x["q"], x["k"], x["v"], tree["c1"], tree["n1"], tree["c2"], x["offs"], tree["parent"],
          jnp.float32(t1), jnp.float32(t2), x["kn"], x["vn"], x["qp"], x["kvp"])
  if capacity == "small":
    capacity = int(np.min(rows_np))
    assert (rows_np > capacity).any()                          # the exact branch runs
  out, sel, rows = clustered_prefill_hierarchical(*args, scale=scale, vote=vote, capacity=capacity, return_stats=True,
                                                  backend="interpret", q_valid=q_valid,
                                                  config=CentroidLookupConfig(block_c=16, block_t=16))
  ref = clustered_prefill_hierarchical_reference(*args, scale=scale, vote=vote, q_valid=q_valid)
  np.testing.assert_array_equal(np.asarray(sel), sel_np)
  np.testing.assert_array_equal(np.asarray(rows), rows_np)
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  assert out.dtype == dtype and not np.isnan(f64(out)).any() and rel(out, o_np) < tol and rel(ref, o_np) < tol
  none = clustered_prefill_hierarchical(*args[:8], jnp.float32(2.0), *args[9:], scale=scale, vote=vote,
                                        backend="interpret", q_valid=q_valid)
  o0, _, _ = brute(x, None, scale, vote, sel=np.zeros_like(sel_np))
  assert not np.isnan(f64(none)).any() and rel(none, o0) < tol


def test_prefill_int8_reference_matches_interpret(rng):
  """The int8 lookup config: the reference backend selects from the quantized inputs as the
  kernels do, so both routes attend the same clusters."""
  from pallas_kernels.centroid_lookup import INT8_PREFILL
  d, seq_len = 32, 8
  scale = d ** -0.5
  x, meta = make_case(rng, d=d, seq_len=seq_len, num_s=12, dtype=BF)
  thr = threshold_for(x, meta, scale, "kv")
  args = args_of(x, thr)
  got = [clustered_prefill_attention(*args, scale=scale, return_stats=True, backend=be, config=INT8_PREFILL)
         for be in ("interpret", "reference")]
  np.testing.assert_array_equal(np.asarray(got[0][1]), np.asarray(got[1][1]))
  assert rel(got[0][0], got[1][0]) < 3e-2


def test_prefill_validation(rng):
  x, meta = make_case(rng, seq_len=4, num_s=4)
  args = args_of(x, 0.01)
  with pytest.raises(ValueError, match=r"q_valid must be bool \[T\] = \[4\]"):
    clustered_prefill_attention(*args, scale=0.2, backend="interpret", q_valid=jnp.ones((5,), bool))
  with pytest.raises(ValueError, match="capacity must be None or a positive int"):
    clustered_prefill_attention(*args, scale=0.2, backend="interpret", capacity=0)
  with pytest.raises(ValueError, match="new_part must be one of"):
    clustered_prefill_attention(*args, scale=0.2, backend="interpret", new_part="bogus")


# ----------------------------------------------------------------------------
# Dispatch and validation.
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,d,n_prog", [(BF, 48, 37), (jnp.float32, 128, 16)])
def test_merge_kernel_matches_reference(rng, dtype, d, n_prog):
  """The merge kernel (interpret) == the jnp log-sum-exp merge: programs that saw nothing
  (l = 0, garbage m and o) are ignored, a head that saw nothing gets 0 and lse -inf, the
  padded head-dim columns are never written, the output is in the requested dtype."""
  from pallas_kernels import clustered_attention as clat
  hkv, g, dp = 3, 4, max(16, 1 << (d - 1).bit_length())
  o = rng.normal(size=(hkv, n_prog, g, dp)).astype(np.float32)
  m = rng.normal(size=(hkv, n_prog, g)).astype(np.float32) * 3
  l = rng.random((hkv, n_prog, g)).astype(np.float32) + 0.1
  dead = rng.random((hkv, n_prog, g)) < 0.3
  l[dead] = 0.0
  m[dead] = np.nan                        # never read where l = 0
  o[dead] = np.nan
  l[1, :, 2] = 0.0                        # one head saw nothing at all
  ref_o, ref_lse = clat._merge(jnp.asarray(np.where(dead[..., None], 0.0, o)), jnp.asarray(np.where(dead, 0.0, m)),
                               jnp.asarray(l))
  out, lse = clat._merge_pallas(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), d=d, out_dtype=dtype,
                                backend="interpret")
  assert out.shape == (hkv, g, d) and out.dtype == dtype and lse.shape == (hkv, g)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_o[..., :d].astype(dtype), np.float32),
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6)
  assert not np.asarray(out[1, 2], np.float32).any() and np.isneginf(np.asarray(lse[1, 2]))


def test_auto_is_reference_on_cpu(rng):
  x, meta = make_case(rng, hq=4, hkv=2, num_c=9, n_clustered=50, n_tail=3, d=16, num_s=4)
  args = args_of(x, 0.01)
  out = clustered_decode_attention(*args, scale=0.25)
  np.testing.assert_array_equal(np.asarray(out),
                                np.asarray(clustered_decode_attention_reference(*args, scale=0.25)))
  with pytest.raises(ValueError, match="needs a GPU"):
    clustered_decode_attention(*args, scale=0.25, backend="pallas")


def test_validation_errors(rng):
  x, meta = make_case(rng, hq=4, hkv=2, num_c=9, n_clustered=50, n_tail=3, d=16, num_s=4)
  a = list(args_of(x, 0.01))

  def call(i, val, fn=clustered_decode_attention, **kw):
    b = list(a)
    if i is not None:
      b[i] = val
    return fn(*b, **{"scale": 0.25, "backend": "interpret", **kw})

  with pytest.raises(ValueError, match="q must be"):
    call(0, a[0][:, None])
  with pytest.raises(ValueError, match="k_sorted"):
    call(1, a[1][:, :10])
  with pytest.raises(ValueError, match="offsets"):
    call(4, a[4][:, :-1])
  with pytest.raises(ValueError, match="int32"):
    call(4, a[4].astype(jnp.float32))
  with pytest.raises(ValueError, match="dtypes must match"):
    call(3, a[3].astype(BF))
  with pytest.raises(ValueError, match="threshold"):
    call(5, jnp.zeros((2,), jnp.float32))
  with pytest.raises(ValueError, match="q_pos"):
    call(8, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="vote"):
    call(None, None, vote="max")
  with pytest.raises(ValueError, match="scale"):
    call(None, None, scale=None)
  with pytest.raises(ValueError, match="capacity"):
    call(0, a[0][:, None], fn=clustered_prefill_attention, capacity=0)
  with pytest.raises(ValueError, match="block_clusters"):
    ClusteredConfig(block_clusters=24, sub_clusters=16)
  with pytest.raises(ValueError, match="block_k"):
    ClusteredConfig(block_k=24)
  with pytest.raises(ValueError, match="exact_programs"):
    ClusteredConfig(exact_programs=0)
  with pytest.raises(ValueError, match="score_blocks"):
    ClusteredConfig(score_blocks=0)
  with pytest.raises(ValueError, match="max_score_blocks"):
    ClusteredConfig(max_score_blocks=0)
  with pytest.raises(ValueError, match="score_programs"):
    ClusteredConfig(score_programs=2.5)
  with pytest.raises(ValueError, match="num_stages"):
    ClusteredConfig(score_stages=0)


# ----------------------------------------------------------------------------
# Triton lowering at Llama-3-8B shapes (no GPU needed).
# ----------------------------------------------------------------------------
HQ, HKV, D = 32, 8, 128


@pytest.fixture
def fake_h100(monkeypatch):
  """Pretends to be an H100 and runs the MLIR verifier on every Triton module (this is
  what rejected ``fori_loop(0, jnp.where(c, python_int, 0))`` on the H200)."""
  from jax._src.pallas.triton import gpu_info, lowering
  from jax._src.pallas.triton import pallas_call_registration as registration
  monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                      lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100))
  orig = lowering.lower_jaxpr_to_triton_module
  verified = []

  def verify(*args, **kwargs):
    res = orig(*args, **kwargs)
    res.module.operation.verify()          # raises MLIRError on an invalid module
    verified.append(1)
    return res
  monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verify)
  return verified


def sds(shape, dtype=BF):
  return jax.ShapeDtypeStruct(shape, dtype)


def _lower(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  return text


@pytest.mark.parametrize("vote,return_stats,dtype,num_l,num_c,num_s", [
    ("kv", False, BF, 131072, 6554, 1024),
    ("q", True, BF, 131072, 6554, 1024),
    ("kv", True, BF, 524288, 26214, 0),
    ("kv", False, jnp.float32, 4096, 205, 64),
])
def test_decode_lowers(fake_h100, vote, return_stats, dtype, num_l, num_c, num_s):
  _lower(lambda *a: clustered_decode_attention(*a, scale=D ** -0.5, vote=vote,
                                               return_stats=return_stats, backend="pallas"),
         sds((HQ, D), dtype), sds((HKV, num_l, D), dtype), sds((HKV, num_l, D), dtype),
         sds((HKV, num_c, D), dtype), sds((HKV, num_c + 1), jnp.int32), sds((), jnp.float32),
         sds((HKV, num_s, D), dtype), sds((HKV, num_s, D), dtype), sds((1,), jnp.int32),
         sds((num_s,), jnp.int32))
  assert len(fake_h100) == 3                       # scoring + attention + merge kernels


def test_decode_selected_lowers(fake_h100):
  num_l, num_c, num_s = 524288, 26214, 64
  _lower(lambda *a: clustered_decode_selected(*a, scale=D ** -0.5, backend="pallas"),
         sds((HQ, D)), sds((HKV, num_l, D)), sds((HKV, num_l, D)), sds((HKV, num_c + 1), jnp.int32),
         sds((HKV, num_c), bool), sds((HKV, num_s, D)), sds((HKV, num_s, D)), sds((1,), jnp.int32),
         sds((num_s,), jnp.int32))
  assert len(fake_h100) == 2                       # the attention kernel + the merge


@pytest.mark.parametrize("cfg", [
    ClusteredConfig(block_clusters=256, sub_clusters=256),
    ClusteredConfig(block_clusters=256, sub_clusters=64, block_k=32, num_stages=3),
    ClusteredConfig(block_clusters=512, sub_clusters=128, num_warps=8),
    ClusteredConfig(score_blocks=4, score_stages=2),
])
def test_decode_configs_lower(fake_h100, cfg):
  num_l, num_c, num_s = 131072, 6554, 1024
  _lower(lambda *a: clustered_decode_attention(*a, scale=D ** -0.5, backend="pallas",
                                               config=cfg),
         sds((HQ, D)), sds((HKV, num_l, D)), sds((HKV, num_l, D)), sds((HKV, num_c, D)),
         sds((HKV, num_c + 1), jnp.int32), sds((), jnp.float32), sds((HKV, num_s, D)),
         sds((HKV, num_s, D)), sds((1,), jnp.int32), sds((num_s,), jnp.int32))


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_prefill_lowers(fake_h100, vote):
  """f32 prefill: lookup kernels + in-kernel gather (the bf16 route's cuDNN call needs
  a GPU to lower)."""
  num_l, num_c, t = 4096, 205, 100
  f = jnp.float32
  _lower(lambda *a: clustered_prefill_attention(*a, scale=D ** -0.5, vote=vote, capacity=1024,
                                                backend="pallas"),
         sds((HQ, t, D), f), sds((HKV, num_l, D), f), sds((HKV, num_l, D), f),
         sds((HKV, num_c, D), f), sds((HKV, num_c + 1), jnp.int32), sds((), jnp.float32),
         sds((HKV, t, D), f), sds((HKV, t, D), f), sds((t,), jnp.int32), sds((t,), jnp.int32))
  assert len(fake_h100) >= 3


@pytest.mark.parametrize("splits", [1, 4])
def test_gather_live_rows_lowers_verified(fake_h100, splits):
  """The live-row gather (its loop over a head's written blocks has a traced trip count) passes the
  MLIR verifier at the 512K prefill's buffer size."""
  from pallas_kernels.sparse_attention import gather_live_rows
  cap = 524288
  _lower(lambda k, v, i, n: gather_live_rows(k, v, i, n, backend="pallas", splits=splits),
         sds((HKV, cap, D)), sds((HKV, cap, D)), sds((HKV, cap), jnp.int32), sds((HKV,), jnp.int32))
  assert fake_h100


# ----------------------------------------------------------------------------
# The GPU script's clustered checks (plumbing, tiny shapes, interpret mode).
# ----------------------------------------------------------------------------
def test_gpu_script_clustered_checks():
  from benchmarks import gpu_kernels
  plan = gpu_kernels.Plan(backend="interpret", dense_impl="xla", checks="smoke",
                          check_scale="tiny")
  res = gpu_kernels.run_clustered_checks(plan, lambda m: None)
  assert len(res) == 5 and any("left-padded" in c["name"] for c in res)
  assert all(c["status"] == "PASS" for c in res), res


@pytest.mark.parametrize("num_l,num_c,hkv,want", [
    (524288, 26214, 8, 4),       # 205 blocks of 128 per KV head -> 410 programs of 4 blocks
    (131072, 6554, 8, 1),
    (1048576, 52429, 4, 4),      # one GPU's half of the KV heads at 1M
    (1048576, 52429, 8, 4),      # 8 by the program count, capped at max_score_blocks
    (524288, 26214, 32, 4),      # Llama-2-7B heads: 16 by the count, capped
    (131072, 6554, 32, 4),
    (300, 37, 2, 1),
])
def test_score_blocks_auto(num_l, num_c, hkv, want):
  from pallas_kernels.clustered_attention import _make_plan
  p = _make_plan(4 * hkv, hkv, num_l, num_c, 0, 128, "kv", ClusteredConfig())
  assert p.score_blocks == want
  bc = p.block_c                 # 128, or less for a small C (37 -> 64)
  assert p.n_a == -(-num_c // (bc * want)) and p.cx >= p.n_a * want * bc
  assert _make_plan(4 * hkv, hkv, num_l, num_c, 0, 128, "kv",
                    ClusteredConfig(score_blocks=2)).score_blocks == min(2, -(-num_c // bc))


# ----------------------------------------------------------------------------
# Hierarchical decode (level-2 logits handed to the attention kernel).
# ----------------------------------------------------------------------------
def _tree_case(rng, *, hq, hkv, dtype, num_c1=9, d=32, **case):
  """make_case's layout (its 37 clusters are the level-2 ones) under a random level-1 tree:
  parents at random (some -1: no parent), level-1 centroids the mean of their children's,
  level-1 counts the sum of theirs."""
  x, meta = make_case(rng, hq=hq, hkv=hkv, d=d, dtype=dtype, **case)
  counts = meta["counts"]
  num_c = counts.shape[1]
  c2 = np.nan_to_num(f64(x["cent"]))
  parent = rng.integers(0, num_c1, size=(hkv, num_c))
  parent[rng.random((hkv, num_c)) < 0.1] = -1
  c1 = np.stack([np.stack([c2[h, parent[h] == p].mean(0) + 0.3 * rng.normal(size=d)
                           if (parent[h] == p).any() else np.zeros(d) for p in range(num_c1)])
                 for h in range(hkv)])
  n1 = np.stack([[counts[h, parent[h] == p].sum() for p in range(num_c1)] for h in range(hkv)])
  tree = dict(c1=jnp.asarray(c1, dtype), n1=jnp.asarray(n1, jnp.int32), c2=x["cent"],
              parent=jnp.asarray(parent, jnp.int32))
  return x, meta, tree


def _tree_thresholds(x, meta, tree, scale, vote, qs=None):
  """(T1, T2) in gaps of the level-1 / level-2 reference scores of the query x["q"] (or of
  every query in ``qs``): rounding flips nothing."""
  from pallas_kernels.hierarchical_lookup import hierarchical_scores
  qs = [x["q"]] if qs is None else qs
  hs = qs[0].shape[0] if vote == "q" else meta["counts"].shape[0]
  tree_args = (tree["c1"], tree["n1"], tree["c2"], jnp.asarray(meta["counts"], jnp.int32), tree["parent"])

  def scores(t1):
    return [hierarchical_scores(q, *tree_args, jnp.float32(t1), scale=scale, vote=vote, backend="reference")
            for q in qs]

  valid1 = np.repeat(f64(tree["n1"]) > 0, hs // meta["counts"].shape[0], axis=0)
  t1 = pick_threshold(np.concatenate([f64(s[1]) for s in scores(0.0)]), np.concatenate([valid1] * len(qs)),
                      lo_q=0.2, hi_q=0.6)
  level2 = scores(t1)
  kw = {"lo_q": 0.6, "hi_q": 0.95} if vote == "q" or len(qs) > 1 else {"lo_q": 0.3, "hi_q": 0.8}
  return t1, pick_threshold(np.concatenate([f64(s[0]) for s in level2]),
                            np.concatenate([np.asarray(s[2]) for s in level2]), **kw)


@pytest.mark.parametrize("hq,hkv,vote,dtype", [(8, 2, "kv", jnp.float32), (8, 2, "q", jnp.float32),
                                                 (3, 3, "kv", jnp.float32), (8, 2, "kv", BF), (8, 2, "q", BF)])
def test_decode_hierarchical_matches_lookup_then_selected(rng, hq, hkv, vote, dtype):
  """clustered_decode_hierarchical (level-2 logits -> attention kernel) == the hierarchical lookup's
  selection (Eq. 2-3, float64 brute force) attended exactly (brute force), with the rows no head
  selects poisoned; and == its reference."""
  from pallas_kernels.clustered_attention import (clustered_decode_hierarchical,
                                                  clustered_decode_hierarchical_reference)
  scale = 32 ** -0.5
  x, meta, tree = _tree_case(rng, hq=hq, hkv=hkv, dtype=dtype)
  t1, t2 = _tree_thresholds(x, meta, tree, scale, vote)
  from test_kernels_hierarchical_lookup import brute_hierarchical   # tests/ is on sys.path under pytest
  sel_np, _, _ = brute_hierarchical(f64(x["q"]), f64(tree["c1"]), tree["n1"], f64(tree["c2"]), meta["counts"],
                         tree["parent"], t1, t2, scale, vote)
  assert sel_np.any() and not sel_np[np.repeat(meta["counts"] > 0, sel_np.shape[0] // hkv, 0)].all()
  o_np, _, _ = brute(x, None, scale, vote, sel=sel_np)
  x = poison_unselected(x, meta, sel_np)
  args = (x["q"], x["k"], x["v"], tree["c1"], tree["n1"], tree["c2"], x["offs"], tree["parent"],
          jnp.float32(t1), jnp.float32(t2), x["kn"], x["vn"], x["qp"], x["kvp"])
  out = clustered_decode_hierarchical(*args, scale=scale, vote=vote, backend="interpret", config=SMALL,
                                      lookup_config=CentroidLookupConfig(block_c=16, level2_blocks=2))
  ref = clustered_decode_hierarchical_reference(*args, scale=scale, vote=vote)
  assert out.dtype == x["q"].dtype and out.shape == x["q"].shape and not np.isnan(f64(out)).any()
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  assert rel(ref, o_np[:, 0]) < tol and rel(out, o_np[:, 0]) < tol
  # T1 above every level-1 score: no candidate, only the exact part and the new keys
  none = clustered_decode_hierarchical(*args[:8], jnp.float32(2.0), *args[9:], scale=scale, vote=vote,
                                       backend="interpret", config=SMALL)
  o0, _, _ = brute(x, None, scale, vote, sel=np.zeros_like(sel_np))
  assert not np.isnan(f64(none)).any() and rel(none, o0[:, 0]) < tol


@pytest.mark.parametrize("vote,n_rows", [("q", 1), ("kv", 3), ("q", 2)])
def test_level2_rows_share_programs_same_logits(rng, vote, n_rows):
  """The level-2 logits kernel with a KV head's vote segments sharing programs (``level2_rows``)
  writes the same per-row logits (MASK off each row's own survivors) and block statistics as one
  program per segment, in fewer, wider programs; the segments' survivors differ."""
  from pallas_kernels.centroid_lookup import Level1Raw, lookup_decode_raw
  scale = 32 ** -0.5
  hs = 8 * n_rows if vote == "q" else 2 * n_rows

  def level2(l2_rows):
    res = lookup_decode_raw(qf, tree["c2"], x["offs"], raw, scale=scale, groups=hs, backend="interpret",
                            cfg=CentroidLookupConfig(block_c=16, level2_rows=l2_rows), logits_cols=1,
                            offsets_l=x["k"].shape[1])
    return [np.asarray(a).reshape(2, 4 * n_rows, -1) for a in res[:3]], res[0].shape[0]

  for _ in range(8):   # draws until the segments' survivors differ (the test's power)
    x, meta, tree = _tree_case(rng, hq=8, hkv=2, dtype=jnp.float32)
    qs = [x["q"]] + [make_case(np.random.default_rng(rng.integers(1 << 30)), hq=8, hkv=2, d=32,
                               dtype=jnp.float32)[0]["q"] for _ in range(n_rows - 1)]
    t1, _ = _tree_thresholds(x, meta, tree, scale, vote, qs=qs)
    qf = jnp.stack(qs).reshape(n_rows, 2, 4, 32).swapaxes(0, 1).reshape(8 * n_rows, 32)   # [Hkv, B, g]
    e1, m1, l1, _ = lookup_decode_raw(qf, tree["c1"], tree["n1"], None, scale=scale, groups=2,
                                      cfg=CentroidLookupConfig(block_c=16), backend="interpret")
    raw = Level1Raw(e1, m1, l1, tree["n1"], tree["parent"], jnp.float32(t1))
    (x1, m1_, l1_), g1 = level2(1)
    live = x1 > -1e29
    if live.any() and (live[:, :, None, :] != live[:, None, :, :]).any():
      break
  else:
    pytest.fail("no draw in 8 gave segments with different survivors")
  (x32, m32, l32), g32 = level2(32)
  assert g1 == hs and g32 == 2                                   # one level-2 program group per KV head
  assert (live == (x32 > -1e29)).all() and not live.all()
  np.testing.assert_allclose(x32[live], x1[live], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(m32, m1_, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(l32, l1_, rtol=1e-6, atol=1e-6)


def test_decode_hierarchical_validation(rng):
  from pallas_kernels.clustered_attention import clustered_decode_hierarchical
  x, meta, tree = _tree_case(rng, hq=4, hkv=2, dtype=jnp.float32)
  args = [x["q"], x["k"], x["v"], tree["c1"], tree["n1"], tree["c2"], x["offs"], tree["parent"],
          jnp.float32(0.1), jnp.float32(0.1), x["kn"], x["vn"], x["qp"], x["kvp"]]

  def call(i, val):
    b = list(args)
    b[i] = val
    return clustered_decode_hierarchical(*b, scale=0.2, backend="interpret")

  with pytest.raises(ValueError, match=r"need parent \[Hkv, C\] = \[2, 37\]"):
    call(7, tree["parent"][:, :-1])
  with pytest.raises(ValueError, match=r"c1 \[Hkv, C1, d\]"):
    call(4, tree["n1"][:, :-1])
  with pytest.raises(ValueError, match="t1 must be a scalar"):
    call(8, jnp.zeros((2,), jnp.float32))
  with pytest.raises(ValueError, match="threshold must be a scalar"):
    call(9, jnp.zeros((2,), jnp.float32))


def test_decode_hierarchical_lowers(fake_h100):
  from pallas_kernels.clustered_attention import clustered_decode_hierarchical
  num_l, num_c, num_c1, num_s = 524288, 26214, 5242, 1024
  i32 = jnp.int32
  _lower(lambda q, k, v, c1, n1, c2, o, par, kn, vn: clustered_decode_hierarchical(
      q, k, v, c1, n1, c2, o, par, jnp.float32(1e-4), jnp.float32(1e-4), kn, vn, jnp.zeros((1,), i32),
      jnp.zeros((num_s,), i32), scale=D ** -0.5, backend="pallas"),
      sds((HQ, D)), sds((HKV, num_l, D)), sds((HKV, num_l, D)), sds((HKV, num_c1, D)), sds((HKV, num_c1), i32),
      sds((HKV, num_c, D)), sds((HKV, num_c + 1), i32), sds((HKV, num_c), i32), sds((HKV, num_s, D)),
      sds((HKV, num_s, D)))
  assert len(fake_h100) == 4                       # level 1, level 2, attention, merge


# ----------------------------------------------------------------------------
# Batched decode: B rows over one shared fixed context.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv,vote,dtype,n_rows,l2_rows", [
    (8, 2, "kv", jnp.float32, 3, 32),   # the 3 rows' 12 heads in one level-2 program per KV head
    (8, 2, "q", jnp.float32, 2, 32),    # 8 rows each voting alone, one program
    (8, 2, "q", jnp.float32, 2, 1),     # ... one program per row (the layout before 2026-11-25)
    (8, 2, "kv", jnp.float32, 4, 8),    # two programs per KV head, two rows (8 heads) each
    (8, 2, "kv", jnp.float32, 3, 1),    # one program per (KV head, row)
    (3, 3, "kv", jnp.float32, 2, 32), (8, 2, "kv", BF, 2, 32)])
def test_decode_hierarchical_batched_matches_rows(rng, hq, hkv, vote, dtype, n_rows, l2_rows):
  """B rows of hierarchical decode in one call (interpret mode) == each row's Eq. 2-3 selection
  (float64 brute force, the row's own level-1 survivors and candidates) attended exactly with its
  own new keys; the rows no row selects are NaN (never read); == the row-by-row reference.
  ``l2_rows``: how many of a KV head's stacked rows (whole vote segments) share a level-2 program."""
  from pallas_kernels.clustered_attention import (clustered_decode_hierarchical_batched,
                                                  clustered_decode_hierarchical_batched_reference)
  from test_kernels_hierarchical_lookup import brute_hierarchical   # tests/ is on sys.path under pytest
  scale = 32 ** -0.5
  for _ in range(8):   # draws until the rows select differently (one threshold pair serves all rows)
    x, meta, tree = _tree_case(rng, hq=hq, hkv=hkv, dtype=dtype)
    rows = []
    for b in range(n_rows):
      xb, _ = make_case(np.random.default_rng(rng.integers(1 << 30)), hq=hq, hkv=hkv, d=32, dtype=dtype)
      rows.append(dict(x, q=xb["q"], kn=xb["kn"], vn=xb["vn"], kvp=xb["kvp"], qp=xb["qp"] - b))
    t1, t2 = _tree_thresholds(x, meta, tree, scale, vote, qs=[r["q"] for r in rows])
    sels = [brute_hierarchical(f64(r["q"]), f64(tree["c1"]), tree["n1"], f64(tree["c2"]), meta["counts"],
                               tree["parent"], t1, t2, scale, vote)[0] for r in rows]
    # a row may select nothing (its exact part and new keys only)
    if any(sl.any() for sl in sels) and any((a != b).any() for a, b in zip(sels, sels[1:])):
      break
  else:
    pytest.fail("no draw in 8 gave rows that select differently")
  union = np.any(np.stack(sels), axis=0)
  poisoned = poison_unselected(x, meta, union)
  rows = [dict(r, k=poisoned["k"], v=poisoned["v"]) for r in rows]
  args = (jnp.stack([r["q"] for r in rows]), poisoned["k"], poisoned["v"], tree["c1"], tree["n1"], tree["c2"],
          x["offs"], tree["parent"], jnp.float32(t1), jnp.float32(t2), jnp.stack([r["kn"] for r in rows]),
          jnp.stack([r["vn"] for r in rows]), jnp.concatenate([r["qp"] for r in rows]),
          jnp.stack([r["kvp"] for r in rows]))
  out = clustered_decode_hierarchical_batched(*args, scale=scale, vote=vote, backend="interpret", config=SMALL,
                                              lookup_config=CentroidLookupConfig(block_c=16, level2_rows=l2_rows))
  ref = clustered_decode_hierarchical_batched_reference(*args, scale=scale, vote=vote)
  assert out.shape == (n_rows, hq, 32) and out.dtype == dtype and not np.isnan(f64(out)).any()
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  for b, (r, sl) in enumerate(zip(rows, sels)):
    want = brute(r, None, scale, vote, sel=sl)[0][:, 0]
    assert rel(out[b], want) < tol, b
    assert rel(ref[b], want) < tol, b


def test_decode_hierarchical_batched_validation_and_lowering(rng, fake_h100):
  """Clear errors for a row count the vote bits cannot hold and for a wrong tree; on an H100 the
  batch is the one-row call's four launches."""
  from pallas_kernels.clustered_attention import clustered_decode_hierarchical_batched
  x, meta, tree = _tree_case(rng, hq=8, hkv=2, dtype=jnp.float32)
  n = 31
  args = [jnp.stack([x["q"]] * n), x["k"], x["v"], tree["c1"], tree["n1"], tree["c2"], x["offs"], tree["parent"],
          jnp.float32(0.1), jnp.float32(0.1), jnp.stack([x["kn"]] * n), jnp.stack([x["vn"]] * n),
          jnp.concatenate([x["qp"]] * n), jnp.stack([x["kvp"]] * n)]
  with pytest.raises(ValueError, match="vote='kv' keeps one bit per row: 31 rows > 30; split the batch"):
    clustered_decode_hierarchical_batched(*args, scale=0.2, backend="interpret")
  args = [a[:2] if i in (0, 10, 11, 12, 13) else a for i, a in enumerate(args)]
  bad = list(args)
  bad[7] = tree["parent"][:, :-1]
  with pytest.raises(ValueError, match=r"need parent \[Hkv, C\] = \[2, 37\]"):
    clustered_decode_hierarchical_batched(*bad, scale=0.2, backend="interpret")
  fake_h100.clear()
  num_l, num_c, num_c1, num_s, n_rows = 524288, 26214, 5242, 16, 4
  i32 = jnp.int32
  _lower(lambda q, k, v, c1, n1, c2, o, par, kn, vn: clustered_decode_hierarchical_batched(
      q, k, v, c1, n1, c2, o, par, jnp.float32(1e-4), jnp.float32(1e-4), kn, vn, jnp.zeros((n_rows,), i32),
      jnp.zeros((n_rows, num_s), i32), scale=D ** -0.5, backend="pallas"),
      sds((n_rows, HQ, D)), sds((HKV, num_l, D)), sds((HKV, num_l, D)), sds((HKV, num_c1, D)),
      sds((HKV, num_c1), i32), sds((HKV, num_c, D)), sds((HKV, num_c + 1), i32), sds((HKV, num_c), i32),
      sds((n_rows, HKV, num_s, D)), sds((n_rows, HKV, num_s, D)))
  assert len(fake_h100) == 4                       # level 1, level 2, attention, merge for all rows
BATCH_CASES = [  # hq, hkv, vote, dtype, rows
    (8, 2, "kv", jnp.float32, 3),
    (8, 2, "q", jnp.float32, 3),       # 12 query heads per KV head, a bit each
    (3, 3, "kv", jnp.float32, 2),      # 1:1
    (6, 2, "kv", jnp.float32, 5),      # groups of 3, 15 stacked rows padded to 16
    (8, 2, "kv", BF, 2),
    (8, 2, "kv", jnp.float32, 1),
]


def batched_case(rng, hq, hkv, vote, dtype, n_rows, scale):
  """One fixed context, n_rows rows with their own query, new keys (some slots empty, row 1's
  all invisible) and position; a threshold in a wide gap of every row's scores."""
  x, meta = make_case(rng, hq=hq, hkv=hkv, d=32, dtype=dtype)
  rows = []
  for b in range(n_rows):
    xb, _ = make_case(np.random.default_rng(rng.integers(1 << 30)), hq=hq, hkv=hkv, d=32, dtype=dtype)
    xb = dict(x, q=xb["q"], kn=xb["kn"], vn=xb["vn"], kvp=xb["kvp"], qp=xb["qp"] - b)
    if b == 1:
      xb["kvp"] = jnp.where(xb["kvp"] >= 0, xb["qp"][0] + 1 + jnp.arange(xb["kvp"].shape[0]), -1).astype(jnp.int32)
    rows.append(xb)
  s = [np_scores(r["q"], x["cent"], meta["counts"], scale, vote) for r in rows]
  valid = np.repeat(meta["counts"] > 0, s[0].shape[0] // hkv, axis=0)
  # select few per row (vote "q": per head), so the rows' union still leaves clusters out
  kw = {"lo_q": 0.75, "hi_q": 0.95} if vote == "q" or n_rows > 1 else {}
  thr = pick_threshold(np.concatenate(s), np.concatenate([valid] * n_rows), **kw)
  return x, meta, rows, thr


def stack_rows(rows, thr):
  x0 = rows[0]
  return (jnp.stack([r["q"] for r in rows]), x0["k"], x0["v"], x0["cent"], x0["offs"], jnp.float32(thr),
          jnp.stack([r["kn"] for r in rows]), jnp.stack([r["vn"] for r in rows]),
          jnp.concatenate([r["qp"] for r in rows]), jnp.stack([r["kvp"] for r in rows]))


@pytest.mark.parametrize("hq,hkv,vote,dtype,n_rows", BATCH_CASES)
def test_decode_batched_matches_rows(rng, hq, hkv, vote, dtype, n_rows):
  """The batched kernels (interpret mode) give each row what the one-row decode gives it: the
  float64 brute force over the row's own selection, its own new keys; rows no row selects are
  NaN (never read), and so are the new keys' empty slots."""
  from pallas_kernels.clustered_attention import clustered_decode_batched, clustered_decode_batched_reference

  scale = 32 ** -0.5
  x, meta, rows, thr = batched_case(rng, hq, hkv, vote, dtype, n_rows, scale)
  sels = [brute(r, thr, scale, vote)[1] for r in rows]
  union = np.any(np.stack(sels), axis=0)
  assert union.any() and not union[np.repeat(meta["counts"] > 0, union.shape[0] // hkv, 0)].all()
  if n_rows > 1:
    assert any((a != b).any() for a, b in zip(sels, sels[1:])), "rows should select differently"
  poisoned = poison_unselected(x, meta, union)
  rows = [dict(r, k=poisoned["k"], v=poisoned["v"]) for r in rows]
  args = stack_rows(rows, thr)
  out = clustered_decode_batched(*args, scale=scale, vote=vote, backend="interpret", config=SMALL)
  ref = clustered_decode_batched_reference(*args, scale=scale, vote=vote)
  assert out.shape == (n_rows, hq, 32) and out.dtype == dtype
  assert not np.isnan(f64(out)).any()
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  for b, r in enumerate(rows):
    want = brute(r, thr, scale, vote)[0][:, 0]
    assert rel(out[b], want) < tol, b
    assert rel(ref[b], want) < tol, b


def test_decode_batched_extremes_and_validation(rng):
  """Everything selected = dense attention per row; nothing selected keeps the exact part; clear
  errors for wrong shapes and for more rows than the vote bits hold."""
  from pallas_kernels.clustered_attention import clustered_decode_batched, clustered_decode_batched_reference

  scale = 32 ** -0.5
  _, _, rows, _ = batched_case(rng, 8, 2, "kv", jnp.float32, 2, scale)
  for thr in (-1.0, 1e30):
    args = stack_rows(rows, thr)
    out = clustered_decode_batched(*args, scale=scale, backend="interpret", config=SMALL)
    ref = clustered_decode_batched_reference(*args, scale=scale)
    assert rel(out, ref) < 2e-5 and not np.isnan(f64(out)).any()
  args = list(stack_rows(rows, 0.0))
  with pytest.raises(ValueError, match=r"q must be \[B, Hq, d\]; got q\(8, 32\)"):
    clustered_decode_batched(args[0][0], *args[1:], scale=scale, backend="interpret")
  with pytest.raises(ValueError, match=r"k_new and v_new \[B, Hkv, S, d\]"):
    clustered_decode_batched(*args[:6], args[6][0], args[7][0], *args[8:], scale=scale, backend="interpret")
  with pytest.raises(ValueError, match=r"q_pos \[B\] and kv_pos_new \[B, S\]"):
    clustered_decode_batched(*args[:8], args[8][:1], args[9], scale=scale, backend="interpret")
  big = [jnp.repeat(a, 8, axis=0) for a in (args[0], args[6], args[7], args[8], args[9])]   # 16 rows x 4 heads
  with pytest.raises(ValueError, match="vote='q' keeps one bit per query head.*split the batch"):
    clustered_decode_batched(big[0], *args[1:6], *big[1:], scale=scale, vote="q", backend="interpret")


def test_decode_batched_lowers(fake_h100):
  from pallas_kernels.clustered_attention import clustered_decode_batched

  num_l, num_c, num_s, n_rows = 524288, 26214, 16, 4
  _lower(lambda *a: clustered_decode_batched(*a, scale=D ** -0.5, backend="pallas"),
         sds((n_rows, HQ, D)), sds((HKV, num_l, D)), sds((HKV, num_l, D)), sds((HKV, num_c, D)),
         sds((HKV, num_c + 1), jnp.int32), sds((), jnp.float32), sds((n_rows, HKV, num_s, D)),
         sds((n_rows, HKV, num_s, D)), sds((n_rows,), jnp.int32), sds((n_rows, num_s), jnp.int32))
  assert len(fake_h100) == 3                       # scoring + attention + merge kernels
