"""Sparse attention over retrieved keys + causal new part: interpret vs reference vs numpy."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_kernels import _attention_core as core
from pallas_kernels.sparse_attention import (GATHER_ROWS, GATHER_ZERO, AttentionConfig,
                                             clusters_to_indices, gather_live_rows,
                                             gather_live_rows_reference,
                                             gather_then_dense_attention, sparse_attention,
                                             sparse_attention_reference)

def brute_attention(q, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new, scale):
  """Loops in float64: returns (o [Hq, T, d], lse [Hq, T]); duplicates counted."""
  q, k, v, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k, v, k_new, v_new))
  idx, counts = np.asarray(idx), np.asarray(counts)
  q_pos, kv_pos_new = np.asarray(q_pos), np.asarray(kv_pos_new)
  hq, seq_len, d = q.shape
  hkv, num_l, _ = k.shape
  hs, cap = idx.shape
  g, r = hq // hkv, hq // hs
  o = np.zeros((hq, seq_len, d))
  lse = np.full((hq, seq_len), -np.inf)
  for h in range(hq):
    s, kv = h // r, h // g
    fixed = [int(p) for p in idx[s, :max(0, min(int(counts[s]), cap))] if 0 <= p < num_l]
    for t in range(seq_len):
      keys = [k[kv, p] for p in fixed]
      vals = [v[kv, p] for p in fixed]
      for j in range(k_new.shape[1]):
        if 0 <= kv_pos_new[j] <= q_pos[t]:
          keys.append(k_new[kv, j])
          vals.append(v_new[kv, j])
      if not keys:
        continue
      logits = scale * np.array([q[h, t] @ kk for kk in keys])
      mx = logits.max()
      p = np.exp(logits - mx)
      o[h, t] = (p[:, None] * np.array(vals)).sum(0) / p.sum()
      lse[h, t] = mx + np.log(p.sum())
  return o, lse


def make_inputs(rng, hq, hkv, hs, seq_len, num_l, num_s, cap, d, dtype, *, poison=False):
  q = jnp.asarray(rng.normal(size=(hq, seq_len, d)), dtype)
  k = rng.normal(size=(hkv, num_l, d))
  v = rng.normal(size=(hkv, num_l, d))
  counts = rng.integers(0, cap + 1, size=(hs,))
  counts[rng.integers(hs)] = 0                                   # a head retrieves nothing
  idx = np.stack([rng.choice(num_l, size=cap, replace=cap > num_l) for _ in range(hs)])
  past = np.arange(cap)[None, :] >= counts[:, None]
  idx = np.where(past, rng.integers(-10**6, 10**6, size=idx.shape), idx)   # garbage past count
  if poison:   # rows nobody retrieved are NaN: they must never be read
    used = np.zeros((hkv, num_l), bool)
    g_s = hs // hkv
    for s in range(hs):
      used[s // g_s, idx[s, :counts[s]]] = True
    k = np.where(used[..., None], k, np.nan)
    v = np.where(used[..., None], v, np.nan)
  k_new = rng.normal(size=(hkv, num_s, d))
  v_new = rng.normal(size=(hkv, num_s, d))
  start = num_l
  kv_pos = start + np.arange(num_s)
  empty = rng.random(num_s) < 0.25
  kv_pos[empty] = -1                                             # empty slots
  if poison:
    k_new[:, empty] = np.nan
    v_new[:, empty] = np.nan
  q_pos = start + max(num_s - seq_len, 0) + np.arange(seq_len)
  return (q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(idx, jnp.int32),
          jnp.asarray(counts, jnp.int32), jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype),
          jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32))


TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2),
       jnp.float16: dict(rtol=4e-3, atol=4e-3)}


def assert_close(a, b, dtype, msg=""):
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  assert np.isfinite(a).all(), msg
  np.testing.assert_allclose(a, b, err_msg=msg, **TOL[dtype])


def assert_lse(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert not np.isnan(a).any()
  np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
  fin = np.isfinite(b)
  np.testing.assert_allclose(a[fin], b[fin], rtol=1e-5, atol=1e-4)


CASES = [  # hq, hkv, hs, T, L, S, cap, d, dtype, poison
    (8, 2, 2, 1, 100, 20, 40, 64, jnp.float32, True),    # decode, GQA 4:1, vote kv
    (8, 2, 8, 1, 100, 20, 40, 64, jnp.bfloat16, False),  # decode, per-query-head selection
    (8, 2, 2, 19, 77, 23, 30, 64, jnp.bfloat16, True),   # prefill, ragged everything
    (4, 4, 4, 6, 33, 9, 17, 128, jnp.float16, False),    # prefill, MHA 1:1, d=128, fp16
    (6, 2, 6, 5, 50, 0, 25, 24, jnp.float32, True),      # g=3, no new part, d=24
]


@pytest.mark.parametrize("hq,hkv,hs,seq_len,num_l,num_s,cap,d,dtype,poison", CASES)
def test_interpret_matches_reference(rng, hq, hkv, hs, seq_len, num_l, num_s, cap, d, dtype,
                                     poison):
  """poison: NaN in every K/V row nobody retrieved and in empty new slots, garbage idx
  past the counts -- none of it may be read."""
  args = make_inputs(rng, hq, hkv, hs, seq_len, num_l, num_s, cap, d, dtype, poison=poison)
  scale = d ** -0.5
  ref, ref_lse = sparse_attention_reference(*args, scale=scale, return_lse=True)
  cfg = AttentionConfig(block_rows=32, block_k=16, chunk_k=16, chunk_new=32)
  out, lse = sparse_attention(*args, scale=scale, return_lse=True, backend="interpret",
                              config=cfg)
  assert out.shape == (hq, seq_len, d) and out.dtype == dtype and lse.dtype == jnp.float32
  assert_close(out, ref, dtype)
  assert_lse(lse, ref_lse)


@pytest.mark.parametrize("hs,seq_len", [(2, 1), (8, 3)])
def test_reference_matches_bruteforce(rng, hs, seq_len):
  args = make_inputs(rng, 8, 2, hs, seq_len, 40, 11, 15, 16, jnp.float32)
  out, lse = sparse_attention_reference(*args, scale=0.3, return_lse=True)
  bo, blse = brute_attention(*args, scale=0.3)
  np.testing.assert_allclose(out, bo, rtol=1e-5, atol=1e-5)
  assert_lse(lse, blse)


def test_duplicates_are_attended_twice(rng):
  q, k, v, idx, counts, kn, vn, qp, kvp = make_inputs(rng, 4, 2, 2, 1, 30, 4, 12, 16, jnp.float32)
  idx = jnp.asarray([[3, 3, 3, 7, 7, 9] + [0] * 6, [5, 1, 5, 2, 2, 2] + [0] * 6], jnp.int32)
  counts = jnp.asarray([6, 6], jnp.int32)
  args = (q, k, v, idx, counts, kn, vn, qp, kvp)
  out = sparse_attention(*args, scale=0.25, backend="interpret")
  ref = sparse_attention_reference(*args, scale=0.25)
  bo, _ = brute_attention(*args, scale=0.25)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(ref, bo, rtol=1e-5, atol=1e-5)
  # ... and differs from the deduplicated list (the duplicate weights count).
  dedup = jnp.asarray([[3, 7, 9] + [0] * 9, [5, 1, 2] + [0] * 9], jnp.int32)
  out_d = sparse_attention_reference(q, k, v, dedup, jnp.asarray([3, 3], jnp.int32), kn, vn, qp,
                                     kvp, scale=0.25)
  assert np.abs(np.asarray(out_d) - np.asarray(out)).max() > 1e-3


def test_nothing_visible_gives_zero_not_nan(rng):
  q, k, v, idx, counts, kn, vn, qp, kvp = make_inputs(rng, 4, 2, 2, 3, 20, 6, 8, 16,
                                                      jnp.float32)
  counts = jnp.asarray([0, 5], jnp.int32)                        # head 0: all pruned
  idx = idx.at[1, :5].set(jnp.arange(5))
  kvp = jnp.full_like(kvp, -1).at[2].set(int(qp[1]))             # one new key, visible from t=1
  args = (q, k, v, idx, counts, kn, vn, qp, kvp)
  for backend in ("interpret", "reference"):
    out, lse = sparse_attention(*args, scale=0.3, return_lse=True, backend=backend)
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:2, 0], 0.0)               # group 0, token 0: nothing
    assert np.isneginf(lse[:2, 0]).all() and np.isfinite(lse[:2, 1:]).all()
    np.testing.assert_allclose(out[:2, 1:], np.broadcast_to(np.asarray(vn)[0, 2], (2, 2, 16)),
                               rtol=1e-6)                        # only the one new key
    assert np.isfinite(lse[2:]).all()
  bo, _ = brute_attention(*args, scale=0.3)
  np.testing.assert_allclose(out, bo, rtol=1e-5, atol=1e-6)


def test_count_overflow_is_clipped_to_capacity(rng):
  args = list(make_inputs(rng, 4, 2, 2, 1, 50, 3, 10, 16, jnp.float32))
  args[3] = jnp.asarray(rng.integers(0, 50, size=(2, 10)), jnp.int32)
  args[4] = jnp.asarray([25, 10], jnp.int32)                     # head 0 claims more than cap
  out = sparse_attention(*args, scale=0.3, backend="interpret")
  clipped = list(args)
  clipped[4] = jnp.asarray([10, 10], jnp.int32)
  np.testing.assert_allclose(out, sparse_attention_reference(*clipped, scale=0.3), rtol=2e-5,
                             atol=2e-5)


def test_unwritten_partials_are_poisoned_but_ignored(rng):
  """The interpreter fills unwritten outputs with NaN; the merge must never read them."""
  q, k, v, idx, counts, kn, vn, qp, kvp = make_inputs(rng, 4, 2, 2, 1, 64, 0, 64, 16,
                                                      jnp.float32)
  counts = jnp.asarray([5, 64], jnp.int32)
  cfg = AttentionConfig(block_rows=16, block_k=16, chunk_k=16)
  lay = core.row_layout(4, 1, 2, cfg)
  sel = jnp.arange(2, dtype=jnp.int32)[:, None]
  c = jnp.arange(4, dtype=jnp.int32)[None, :]
  lo = c * 16
  items = core.make_items(sel, core.KIND_LIST, lo, jnp.minimum(counts[:, None], lo + 16), sel,
                          sel * 4 + c)
  table, active = core.build_table([items], [lo < counts[:, None]], 2)
  assert np.asarray(table)[:5, 1].tolist() == [1] * 5 and (np.asarray(table)[5:, 1] == 0).all()
  o, m, l = core.attention_partials(q, k, v, None, None, qp, kvp, idx, table, lay=lay,
                                    n_slots=8, scale=0.3, cfg=cfg, backend="interpret")
  assert np.isnan(np.asarray(m)[0, 1:4]).all()                   # head 0, chunks 1-3: never run
  out, _ = core.merge_partials(o, m, l, active, lay=lay, d=16)
  ref = sparse_attention_reference(q, k, v, idx, counts, kn, vn, qp, kvp, scale=0.3)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("dtype,seq_len,hs", [(jnp.float32, 7, 2), (jnp.bfloat16, 5, 8)])
def test_gather_then_dense_matches_reference(rng, dtype, seq_len, hs, compact):
  """GQA 4:1 (hs = 2: four query heads folded into each head's query axis) and 1:1; rows
  nobody retrieved are NaN; ``compact=True`` (entries below each count are positions, as
  make_inputs builds them) skips the compaction and must give the same result."""
  args = make_inputs(rng, 8, 2, hs, seq_len, 70, 12, 30, 32, dtype, poison=True)
  ref, ref_lse = sparse_attention_reference(*args, scale=0.2, return_lse=True)
  out, lse = gather_then_dense_attention(*args, scale=0.2, return_lse=True, backend="interpret",
                                         compact=compact)
  # bf16: XLA's dense attention rounds its LSE to bf16 before the merge.
  tol = TOL[jnp.float32] if dtype == jnp.float32 else dict(rtol=6e-2, atol=6e-2)
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, np.asarray(ref, np.float32), **tol)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))


@pytest.mark.parametrize("dtype,d,hkv,hs,cap", [(jnp.bfloat16, 128, 2, 2, 700),
                                                (jnp.float32, 48, 2, 8, 2 * GATHER_ROWS + 3)])
def test_gather_live_rows_matches_reference(rng, dtype, d, hkv, hs, cap):
  """The live-row gather kernel (interpret) copies exactly the reference's rows below each
  head's count and zeroes GATHER_ZERO rows past it; ragged capacity, an empty head, a full
  head, GQA (Hs = 4 Hkv), a non-power-of-two head dim."""
  num_l = 900
  k = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  v = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  idx = jnp.asarray(rng.integers(0, num_l, size=(hs, cap)), jnp.int32)
  n = rng.integers(1, cap, size=hs)
  n[0], n[-1] = 0, cap                                           # nothing / everything live
  n = jnp.asarray(n, jnp.int32)
  ko, vo = gather_live_rows(k, v, idx, n, backend="interpret")
  kr, vr = gather_live_rows_reference(k, v, idx, n)
  cap_p = -(-cap // GATHER_ROWS) * GATHER_ROWS
  assert ko.shape == kr.shape == (hs, cap_p, d) and ko.dtype == dtype
  for s in range(hs):
    upto = min(cap_p, int(n[s]) + GATHER_ZERO)                   # what the kernel writes
    np.testing.assert_array_equal(np.asarray(ko[s, :upto]), np.asarray(kr[s, :upto]))
    np.testing.assert_array_equal(np.asarray(vo[s, :upto]), np.asarray(vr[s, :upto]))
  assert not np.asarray(kr[0]).any()                             # the empty head: zeros
  kv = np.arange(hs) // (hs // hkv)
  np.testing.assert_array_equal(np.asarray(kr[-1, :cap]), np.asarray(k)[kv[-1], np.asarray(idx[-1])])
  assert not np.asarray(kr[:, cap:]).any()


@pytest.mark.parametrize("splits,hs,few_programs", [(2, 2, False), (4, 6, True), (1, 2, True)])
def test_gather_live_rows_interleaved(rng, monkeypatch, splits, hs, few_programs):
  """``splits``: live row j lands in chunk j % splits at slot j // splits (the kernel in interpret
  mode == the reference), each chunk holds ceil((n - c) / splits) rows followed by a zeroed margin,
  and the chunks together hold exactly the rows the plain gather puts first; an empty head, a
  head with fewer rows than chunks, a full head; ``few_programs``: each program loops over
  several blocks."""
  import importlib

  from pallas_kernels.sparse_attention import interleaved_rows
  sa = importlib.import_module("pallas_kernels.sparse_attention")   # the package exports a function of that name
  if few_programs:
    monkeypatch.setattr(sa, "GATHER_PROGRAMS", 2 * hs)
  hkv, d, num_l, cap = 2, 16, 1500, 1200
  k = jnp.asarray(rng.normal(size=(hkv, num_l, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(hkv, num_l, d)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, num_l, size=(hs, cap)), jnp.int32)
  n = rng.integers(1, cap, size=hs)
  n[0], n[1], n[-1] = 0, splits - 1, cap
  n = jnp.asarray(n, jnp.int32)
  ko, vo = gather_live_rows(k, v, idx, n, backend="interpret", splits=splits)
  kr, vr = gather_live_rows_reference(k, v, idx, n, splits)
  k1, _ = gather_live_rows_reference(k, v, idx, n)
  cap_p = ko.shape[1]
  chunk = cap_p // splits
  assert cap_p % (GATHER_ROWS * splits) == 0 and cap_p >= cap and kr.shape == ko.shape
  src, lens = map(np.asarray, interleaved_rows(n, cap_p, splits))
  for s in range(hs):
    for c in range(splits):
      m = int(lens[s, c])
      assert m == max(0, -(-(int(n[s]) - c) // splits))
      part = slice(c * chunk, c * chunk + min(chunk, m + GATHER_ZERO))        # what the kernel writes
      np.testing.assert_array_equal(np.asarray(ko[s, part]), np.asarray(kr[s, part]))
      np.testing.assert_array_equal(np.asarray(vo[s, part]), np.asarray(vr[s, part]))
      np.testing.assert_array_equal(np.asarray(kr[s, c * chunk:c * chunk + m]),
                                    np.asarray(k1[s, c:int(n[s]):splits]))
      assert not np.asarray(kr[s, c * chunk + m:(c + 1) * chunk]).any()
  assert sorted(src.tolist()) == list(range(cap_p))                # each output row holds one live-row slot


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_then_dense_splits_keys_round_robin(rng, dtype):
  """A capacity long enough for several flash key splits (8192 -> 4 here): the gathered rows are dealt
  round-robin into the splits and each split's key length is its share; same result as the
  reference for ragged counts, an empty head and a head with fewer rows than splits."""
  from pallas_kernels.sparse_attention import flash_kv_splits
  hq, hkv, hs, seq_len, d, num_l, cap, num_s = 4, 2, 2, 8, 16, 9000, 8192, 8
  assert flash_kv_splits(hs, hq // hs * seq_len, cap) == 4
  q = jnp.asarray(rng.normal(size=(hq, seq_len, d)), dtype)
  k = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  v = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  idx = jnp.asarray(np.stack([rng.permutation(num_l)[:cap] for _ in range(hs)]), jnp.int32)
  kn = jnp.asarray(rng.normal(size=(hkv, num_s, d)), dtype)
  vn = jnp.asarray(rng.normal(size=(hkv, num_s, d)), dtype)
  qp = jnp.asarray(num_l + np.arange(seq_len), jnp.int32)
  for counts in ([5000, 3], [0, 8192]):
    args = (q, k, v, idx, jnp.asarray(counts, jnp.int32), kn, vn, qp, qp)
    ref = sparse_attention_reference(*args, scale=0.25)
    out = gather_then_dense_attention(*args, scale=0.25, backend="interpret", compact=True)
    tol = TOL[jnp.float32] if dtype == jnp.float32 else dict(rtol=6e-2, atol=6e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)


@pytest.mark.parametrize("hs", [2, 6])
def test_clusters_to_indices(rng, hs):
  hkv, num_l, num_c = 2, 60, 7
  labels = rng.integers(0, num_c, size=(hkv, num_l))
  keys = np.stack([np.argsort(lab, kind="stable") for lab in labels]).astype(np.int32)
  offs = np.stack([np.concatenate([[0], np.cumsum(np.bincount(lab, minlength=num_c))])
                   for lab in labels]).astype(np.int32)
  sel = rng.random((hs, num_c)) < 0.4
  sel[0] = False                                                 # nothing retrieved
  for cap in (num_l, 9):                                         # 9: overflow for most heads
    idx, cnt, wanted = map(np.asarray, clusters_to_indices(
        jnp.asarray(sel), jnp.asarray(offs), jnp.asarray(keys), cap=cap))
    for s in range(hs):
      kv = s // (hs // hkv)
      want = [p for c in range(num_c) if sel[s, c] for p in keys[kv, offs[kv, c]:offs[kv, c + 1]]]
      assert wanted[s] == len(want) and cnt[s] == min(len(want), cap)
      assert idx[s, :cnt[s]].tolist() == want[:cap] and (idx[s, cnt[s]:] == -1).all()
      assert sorted(want) == sorted(np.flatnonzero(np.isin(labels[kv], np.flatnonzero(sel[s])))
                                    .tolist())


def test_auto_is_reference_on_cpu(rng):
  args = make_inputs(rng, 4, 2, 2, 2, 20, 5, 8, 16, jnp.float32)
  np.testing.assert_array_equal(sparse_attention(*args, scale=0.3),
                                sparse_attention_reference(*args, scale=0.3))
  with pytest.raises(ValueError, match="GPU"):
    sparse_attention(*args, scale=0.3, backend="pallas")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2, 4]), per_q=st.booleans(),
       seq_len=st.sampled_from([1, 2, 9]), num_l=st.integers(1, 60), num_s=st.integers(0, 12),
       cap=st.integers(1, 40), d=st.sampled_from([16, 40]), seed=st.integers(0, 2**31 - 1))
def test_property_random_shapes(hkv, g, per_q, seq_len, num_l, num_s, cap, d, seed):
  rng = np.random.default_rng(seed)
  hq = hkv * g
  hs = hq if per_q else hkv
  args = make_inputs(rng, hq, hkv, hs, seq_len, num_l, num_s, cap, d, jnp.float32)
  ref, ref_lse = sparse_attention_reference(*args, scale=0.25, return_lse=True)
  out, lse = sparse_attention(*args, scale=0.25, return_lse=True, backend="interpret",
                              config=AttentionConfig(block_rows=16, block_k=16))
  assert_close(out, ref, jnp.float32)
  assert_lse(lse, ref_lse)


def test_validation_errors(rng):
  q, k, v, idx, counts, kn, vn, qp, kvp = make_inputs(rng, 4, 2, 2, 2, 20, 5, 8, 16,
                                                      jnp.float32)
  with pytest.raises(ValueError, match="idx"):
    sparse_attention(q, k, v, idx[:1], counts, kn, vn, qp, kvp, scale=1.0)
  with pytest.raises(ValueError, match="Hs in"):
    sparse_attention(q, k, v, jnp.zeros((3, 8), jnp.int32), jnp.zeros(3, jnp.int32), kn, vn, qp,
                     kvp, scale=1.0)
  with pytest.raises(ValueError, match="int32"):
    sparse_attention(q, k, v, idx.astype(jnp.int16), counts, kn, vn, qp, kvp, scale=1.0)
  with pytest.raises(ValueError, match="dtypes must match"):
    sparse_attention(q, k.astype(jnp.bfloat16), v, idx, counts, kn, vn, qp, kvp, scale=1.0)
  with pytest.raises(ValueError, match="q_pos"):
    sparse_attention(q, k, v, idx, counts, kn, vn, qp[:1], kvp, scale=1.0)
  with pytest.raises(ValueError, match="k_new"):
    sparse_attention(q, k, v, idx, counts, kn[:1], vn[:1], qp, kvp, scale=1.0)
  with pytest.raises(ValueError, match="chunk_k"):
    AttentionConfig(block_k=32, chunk_k=48)
  with pytest.raises(ValueError, match="block_rows"):
    AttentionConfig(block_rows=8)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_flash_fixed_part_in_key_splits(rng, splits):
  """`fixed_plus_new`'s fixed part cut into contiguous key chunks (what the prefill fast paths use
  to fill the GPU): per-head key counts that end inside a chunk, on a chunk boundary, at 0 (a head
  that only sees its new keys) and at the full length; XLA's attention as the flash route."""
  from pallas_kernels.sparse_attention import fixed_plus_new

  hq, hs, lk, t, s_new, d = 8, 4, 64, 3, 5, 16
  q = rng.normal(size=(hq, t, d)).astype(np.float32)
  ks, vs = rng.normal(size=(2, hs, lk, 1, d)).astype(np.float32)
  kn, vn = rng.normal(size=(2, hs, s_new, d)).astype(np.float32)
  n = np.asarray([37, 0, 32, 64], np.int32)
  q_pos = np.asarray([10, 11, 12], np.int32)
  kv_pos = np.asarray([8, 9, 10, 11, 12], np.int32)
  out, lse = fixed_plus_new(jnp.asarray(q), jnp.asarray(ks), jnp.asarray(vs), jnp.asarray(n), jnp.asarray(kn),
                            jnp.asarray(vn), jnp.asarray(q_pos), jnp.asarray(kv_pos), scale=0.25,
                            implementation="xla", return_lse=True, kv_splits=splits)
  _check_fixed_plus_new(out, lse, q, ks, vs, n, kn, vn, q_pos, kv_pos, 0.25)


def _check_fixed_plus_new(out, lse, q, ks, vs, n, kn, vn, q_pos, kv_pos, scale):
  """`fixed_plus_new`'s (out, lse) against float64 loops: head h sees its selection head's first n
  fixed rows and the new slots j with 0 <= kv_pos[j] <= q_pos[i]; a row seeing nothing is 0, -inf."""
  hq, t = q.shape[:2]
  g = hq // ks.shape[0]
  for h in range(hq):
    for i in range(t):
      vis = (kv_pos >= 0) & (kv_pos <= q_pos[i])
      keys = np.concatenate([ks[h // g, :n[h // g], 0], kn[h // g, vis]]).astype(np.float64)
      vals = np.concatenate([vs[h // g, :n[h // g], 0], vn[h // g, vis]]).astype(np.float64)
      if not len(keys):
        np.testing.assert_array_equal(np.asarray(out[h, i]), 0.0)
        assert float(lse[h, i]) == -np.inf
        continue
      lg = scale * keys @ q[h, i]
      w = np.exp(lg - lg.max())
      np.testing.assert_allclose(np.asarray(out[h, i]), w @ vals / w.sum(), rtol=2e-5, atol=2e-5)
      np.testing.assert_allclose(float(lse[h, i]), lg.max() + np.log(w.sum()), rtol=2e-5, atol=2e-5)


_P = 100
_NEW_LAYOUTS = {   # name: (q_pos, kv_pos, aligned for "causal", for "causal_left_padded", for "prefix_causal_left_padded")
    "own keys": (_P + np.arange(6), _P + np.arange(6), True, True, True),
    "own keys, then empty slots (a cache)": (_P + np.arange(4), np.r_[_P + np.arange(4), [-1] * 5], True, True, True),
    "the last 3 queries' own keys": (_P - 5 + np.arange(8), _P + np.arange(3), True, True, True),
    "right padding": (np.r_[_P + np.arange(3), [-1, -1]], np.r_[_P + np.arange(3), [-1] * 3], True, True, True),
    "left padding": (np.r_[[-1, -1], _P + np.arange(3)], np.r_[[-1, -1], _P + np.arange(3), [-1]], False, True, True),
    "a left-padded question in a cache": (np.r_[[-1] * 3, _P + np.arange(4)],
                                          np.r_[[-1] * 3, _P + np.arange(4), [-1] * 5], False, True, True),
    "left padding, then a gap": (np.r_[-1, _P, _P + 1], np.r_[-1, _P, _P + 2], False, False, False),
    "an earlier chunk first": (_P + np.arange(3), _P - 3 + np.arange(6), False, False, True),
    "two equal positions": (np.r_[_P, _P, _P + 1], np.r_[_P, _P, _P + 1], False, False, False),
    "shuffled": (_P + np.array([2, 0, 3, 1]), _P + np.array([1, 3, 0, 2]), False, False, False),
    "no query sees a new key": (_P + np.arange(3), _P + 10 + np.arange(3), True, True, True),
    # a conversation's follow-up: its earlier turns' slots, then its left-padded block, then empty slots
    "a follow-up after its turns": (np.r_[[-1] * 2, _P + 5 + np.arange(4)],
                                    np.r_[_P + np.arange(5), [-1] * 2, _P + 5 + np.arange(4), [-1] * 3],
                                    False, False, True),
    "a follow-up after its turns, no padding": (_P + 5 + np.arange(4), np.r_[_P + np.arange(5), _P + 5 + np.arange(4)],
                                                False, False, True),
    "a follow-up filling the cache": (np.r_[-1, _P + 3 + np.arange(3)], np.r_[_P + np.arange(3), -1, _P + 3 + np.arange(3)],
                                      False, False, True),
    "a follow-up after turns with a hole": (np.r_[-1, _P + 5 + np.arange(3)],
                                            np.r_[_P + np.arange(2), -1, _P + 2 + np.arange(3), -1, _P + 5 + np.arange(3)],
                                            False, False, False),
    "a follow-up whose block is not in order": (_P + 5 + np.arange(3), np.r_[_P + np.arange(5), _P + np.array([6, 5, 7])],
                                                False, False, False),
    "a follow-up after a turn it must not see": (_P + 5 + np.arange(3), np.r_[_P + 9, _P + 5 + np.arange(3)],
                                                 False, False, False),
    "a block with no real query": (np.full(3, -1), np.r_[_P + np.arange(4), [-1] * 3], True, True, True),
}
_NEW_PART_ALIGNED = ("causal", "causal_left_padded", "prefix_causal_left_padded")


@pytest.mark.parametrize("new_part", ["causal", "causal_left_padded", "prefix_causal_left_padded", "mask"])
@pytest.mark.parametrize("layout", list(_NEW_LAYOUTS))
def test_new_part_causal_mask_when_positions_allow(rng, layout, new_part):
  """`fixed_plus_new`'s new part: when every query sees exactly slots 0 .. i - (T - min(T, S)) (with
  "causal_left_padded": that square rolled past its leading padding rows; with
  "prefix_causal_left_padded": that square after slots every real query sees) it runs under a causal
  mask (cuDNN skips the tiles above the diagonal; the prefix by a split flash call with no mask),
  otherwise under the position mask; both calls are made (the other with zero-length padding) and
  the device picks, so every layout is exact; "mask" makes the position-mask call alone. Heads with
  no fixed row make the rows that see no new key see nothing at all."""
  from pallas_kernels.sparse_attention import causal_alignment, fixed_plus_new

  q_pos, kv_pos = (np.asarray(x, np.int32) for x in _NEW_LAYOUTS[layout][:2])
  for mode, want in zip(_NEW_PART_ALIGNED, _NEW_LAYOUTS[layout][2:]):
    got = causal_alignment(jnp.asarray(q_pos), jnp.asarray(kv_pos), mode != "causal", mode.startswith("prefix"))
    assert bool(got[2]) == want, mode
  hq, hs, lk, d = 8, 4, 16, 16
  t, s_new = len(q_pos), len(kv_pos)
  q = rng.normal(size=(hq, t, d)).astype(np.float32)
  ks, vs = rng.normal(size=(2, hs, lk, 1, d)).astype(np.float32)
  kn, vn = rng.normal(size=(2, hs, s_new, d)).astype(np.float32)
  n = np.asarray([5, 0, 16, 0], np.int32)
  out, lse = fixed_plus_new(*(jnp.asarray(x) for x in (q, ks, vs, n, kn, vn, q_pos, kv_pos)), scale=0.3,
                            implementation="xla", return_lse=True, new_part=new_part)
  _check_fixed_plus_new(out, lse, q, ks, vs, n, kn, vn, q_pos, kv_pos, 0.3)


@pytest.mark.parametrize("hq,hkv,t,n_prefix,pad,cap", [(8, 2, 16, 300, 5, 1024), (4, 4, 9, 0, 3, 64),
                                                        (6, 3, 32, 1500, 0, 2048), (8, 8, 5, 61, 4, 128)])
def test_prefix_new_part_splits_the_prefix(rng, hq, hkv, t, n_prefix, pad, cap):
  """"prefix_causal_left_padded" on a conversation's cache (GQA; prefixes long enough to be cut into
  splits, empty, or filling a split unevenly; a block with and without padding; the cache's empty
  tail): the same attention as the position mask alone, and the layout counts as aligned."""
  from pallas_kernels.sparse_attention import PREFIX_MIN_CHUNK, causal_alignment, fixed_plus_new, flash_kv_splits

  d = 16
  q_pos = np.r_[[-1] * pad, _P + n_prefix + np.arange(t - pad)].astype(np.int32)
  kv_pos = np.full(cap, -1, np.int32)
  kv_pos[:n_prefix] = _P + np.arange(n_prefix)
  kv_pos[n_prefix + pad:n_prefix + t] = q_pos[pad:]
  assert bool(causal_alignment(jnp.asarray(q_pos), jnp.asarray(kv_pos), True, True)[2])
  if n_prefix > 1000:
    assert flash_kv_splits(hkv, hq // hkv * t, cap, min_chunk=PREFIX_MIN_CHUNK) > 1
  q = rng.normal(size=(hq, t, d)).astype(np.float32)
  kn, vn = rng.normal(size=(2, hkv, cap, d)).astype(np.float32)
  ks = vs = np.zeros((hkv, 0, 1, d), np.float32)
  args = [jnp.asarray(x) for x in (q, ks, vs, np.zeros(hkv, np.int32), kn, vn, q_pos, kv_pos)]
  got = fixed_plus_new(*args, scale=0.25, implementation="xla", return_lse=True, new_part="prefix_causal_left_padded")
  want = fixed_plus_new(*args, scale=0.25, implementation="xla", return_lse=True, new_part="mask")
  real = q_pos >= 0
  np.testing.assert_allclose(np.asarray(got[0])[:, real], np.asarray(want[0])[:, real], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(got[1])[:, real], np.asarray(want[1])[:, real], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(got[0])[:, ~real], 0.0)


def test_new_part_mode_error():
  from pallas_kernels.sparse_attention import fixed_plus_new

  z = jnp.zeros((2, 3, 4), jnp.float32)
  pos = jnp.arange(3, dtype=jnp.int32)
  with pytest.raises(ValueError, match="new_part must be one of"):
    fixed_plus_new(z, z[:, :, None], z[:, :, None], None, z, z, pos, pos, scale=0.5, implementation="xla",
                   return_lse=False, new_part="rolled")


@pytest.mark.parametrize("chunk", [1, 7, 16, 512])
@pytest.mark.parametrize("hq,hkv,hs,seq_len,num_l,num_s,cap,d,dtype,poison", CASES)
def test_retrieved_attention_matches_reference(rng, chunk, hq, hkv, hs, seq_len, num_l, num_s, cap, d, dtype,
                                               poison):
  """sqjax's jnp route for a compact retrieval without a GPU (`retrieved_attention`: the retrieved rows
  `chunk` at a time, up to the largest count) equals the kernels' reference: ragged counts, an empty
  selection, garbage and NaN rows past the counts, empty new slots, GQA and per-query-head selections,
  chunks that do not divide the capacity and one wider than it."""
  from sqjax.attention import retrieved_attention

  args = make_inputs(rng, hq, hkv, hs, seq_len, num_l, num_s, cap, d, dtype, poison=poison)
  scale = d ** -0.5
  ref = sparse_attention_reference(*args, scale=scale)
  out = retrieved_attention(*args, scale, chunk)
  assert out.shape == (hq, seq_len, d) and out.dtype == dtype
  assert_close(out, ref, dtype)
  q, k, v, idx, counts, kn, vn, qp, kvp = args
  # Counts past the capacity are clipped to it. Every slot then counts: the garbage indices past the
  # counts outside [0, L) stay ignored, but one inside it may reach a NaN-poisoned row, so those are zeros.
  k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
  over = jnp.full_like(counts, cap + 5)
  assert_close(retrieved_attention(q, k, v, idx, over, kn, vn, qp, kvp, scale, chunk),
               sparse_attention_reference(q, k, v, idx, over, kn, vn, qp, kvp, scale=scale), dtype)


def test_retrieved_attention_counts_duplicates_and_names_bad_shapes(rng):
  from sqjax.attention import retrieved_attention

  q, k, v, idx, counts, kn, vn, qp, kvp = make_inputs(rng, 4, 2, 2, 3, 20, 5, 8, 16, jnp.float32)
  dup = jnp.stack([jnp.full((8,), 3, jnp.int32), jnp.arange(8, dtype=jnp.int32)])
  full = jnp.asarray([8, 8], jnp.int32)
  np.testing.assert_allclose(retrieved_attention(q, k, v, dup, full, kn, vn, qp, kvp, 0.25, 3),
                             sparse_attention_reference(q, k, v, dup, full, kn, vn, qp, kvp, scale=0.25),
                             rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match=r"selection heads.*\(3\)"):
    retrieved_attention(q, k, v, jnp.zeros((3, 8), jnp.int32), jnp.zeros(3, jnp.int32), kn, vn, qp, kvp, 1.0)
  with pytest.raises(ValueError, match=r"idx.*\[Hs, cap\]"):
    retrieved_attention(q, k, v, idx[0], counts, kn, vn, qp, kvp, 1.0)
  with pytest.raises(ValueError, match="count"):
    retrieved_attention(q, k, v, idx, counts[:1], kn, vn, qp, kvp, 1.0)
  with pytest.raises(ValueError, match="chunk"):
    retrieved_attention(q, k, v, idx, counts, kn, vn, qp, kvp, 1.0, 0)
  with pytest.raises(ValueError, match="q_pos"):
    retrieved_attention(q, k, v, idx, counts, kn, vn, qp[:1], kvp, 1.0)
