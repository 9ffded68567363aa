"""SAAP bucket attention: interpret vs reference vs brute-force numpy."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_kernels.saap_attention import (AttentionConfig, saap_attention,
                                           saap_attention_reference)

def brute_saap(q, k, v, off, lst, bucket_idx, k_new, v_new, q_pos, kv_pos, scale, n_sink,
               n_recent):
  """Key sets built as Python sets (each key once), float64 softmax."""
  q, k, v, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k, v, k_new, v_new))
  off, lst, bucket_idx, q_pos, kv_pos = map(np.asarray, (off, lst, bucket_idx, q_pos, kv_pos))
  squeeze = q.ndim == 2
  if squeeze:
    q = q[:, None]
  hq, seq_len, d = q.shape
  hkv, num_l, _ = k.shape
  num_b = off.shape[1] - 1
  g = hq // hkv
  o = np.zeros((hq, seq_len, d))
  for kv in range(hkv):
    fixed = {p for p in range(num_l) if p < n_sink or p >= num_l - n_recent}
    for b in set(bucket_idx[kv].tolist()):
      if 0 <= b < num_b:
        fixed |= {int(p) for p in lst[kv, off[kv, b]:off[kv, b + 1]] if 0 <= p < num_l}
    fixed = sorted(fixed)
    for h in range(kv * g, kv * g + g):
      for t in range(seq_len):
        keys = [k[kv, p] for p in fixed]
        vals = [v[kv, p] for p in fixed]
        for j in range(k_new.shape[1]):
          if 0 <= kv_pos[j] <= q_pos[t]:
            keys.append(k_new[kv, j])
            vals.append(v_new[kv, j])
        if keys:
          lg = scale * np.array([q[h, t] @ x for x in keys])
          w = np.exp(lg - lg.max())
          o[h, t] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
  return o[:, 0] if squeeze else o


def make_inputs(rng, hq, hkv, seq_len, num_l, num_s, num_b, ell, d, dtype):
  shape_q = (hq, d) if seq_len is None else (hq, seq_len, d)
  q = jnp.asarray(rng.normal(size=shape_q), dtype)
  k = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  v = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  off = np.zeros((hkv, num_b + 1), np.int32)
  lst = np.zeros((hkv, num_l), np.int32)
  for h in range(hkv):
    lab = rng.integers(0, num_b, size=num_l)
    lab[rng.random(num_l) < 0.1] = num_b - 1                    # a large bucket
    lst[h] = np.argsort(lab, kind="stable")
    off[h, 1:] = np.cumsum(np.bincount(lab, minlength=num_b))
  bidx = np.stack([rng.choice(num_b, size=ell, replace=True) for _ in range(hkv)])
  bidx[0, -1] = -1                                               # padding id
  bidx[-1, 0] = num_b + 3                                        # out of range id
  if ell > 2:
    bidx[0, 1] = bidx[0, 0]                                      # visited twice -> once
  k_new = jnp.asarray(rng.normal(size=(hkv, num_s, d)), dtype)
  v_new = jnp.asarray(rng.normal(size=(hkv, num_s, d)), dtype)
  kv_pos = np.where(rng.random(num_s) < 0.2, -1, num_l + np.arange(num_s))
  t = 1 if seq_len is None else seq_len
  q_pos = num_l + max(num_s - t, 0) + np.arange(t)
  return (q, k, v, jnp.asarray(off), jnp.asarray(lst), jnp.asarray(bidx, jnp.int32), k_new,
          v_new, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32))


CASES = [  # hq, hkv, T(None = decode [Hq, d]), L, S, C, l, d, n_sink, n_recent, dtype
    (8, 2, None, 120, 9, 10, 4, 64, 1, 15, jnp.float32),
    (8, 2, None, 120, 9, 10, 4, 64, 3, 40, jnp.bfloat16),
    (4, 4, 5, 70, 12, 6, 3, 128, 1, 7, jnp.float32),         # T > 1, MHA, d = 128
    (6, 2, None, 30, 0, 4, 3, 32, 20, 20, jnp.float32),      # dense part covers everything
]


@pytest.mark.parametrize("hq,hkv,seq_len,num_l,num_s,num_b,ell,d,n_sink,n_recent,dtype", CASES)
def test_interpret_matches_reference_and_bruteforce(rng, hq, hkv, seq_len, num_l, num_s, num_b,
                                                    ell, d, n_sink, n_recent, dtype):
  args = make_inputs(rng, hq, hkv, seq_len, num_l, num_s, num_b, ell, d, dtype)
  kw = dict(scale=d ** -0.5, n_sink=n_sink, n_recent=n_recent)
  out, lse = saap_attention(*args, **kw, return_lse=True, backend="interpret",
                            config=AttentionConfig(block_rows=16, block_k=16, chunk_k=16,
                                                   chunk_new=16))
  ref, rlse = saap_attention_reference(*args, **kw, return_lse=True)
  assert out.shape == args[0].shape and out.dtype == dtype
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  out32 = np.asarray(out, np.float32)
  assert np.isfinite(out32).all() and not np.isnan(np.asarray(lse)).any()
  np.testing.assert_allclose(out32, np.asarray(ref, np.float32), **tol)
  np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(ref, np.float32), brute_saap(*args, **kw), **tol)


def test_dense_keys_in_buckets_counted_once(rng):
  """Every bucket visited: the result is plain attention over all keys (+ new part)."""
  args = list(make_inputs(rng, 4, 2, None, 50, 5, 5, 5, 16, jnp.float32))
  args[5] = jnp.asarray([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]], jnp.int32)
  kw = dict(scale=0.25, n_sink=4, n_recent=10)
  out = saap_attention(*args, **kw, backend="interpret")
  full = saap_attention_reference(*args, scale=0.25, n_sink=50, n_recent=0)   # all keys dense
  np.testing.assert_allclose(out, full, rtol=2e-5, atol=2e-5)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 3]), num_l=st.integers(1, 50),
       num_s=st.integers(0, 8), num_b=st.integers(1, 8), ell=st.integers(1, 5),
       n_sink=st.integers(0, 3), n_recent=st.integers(0, 12), seed=st.integers(0, 2**31 - 1))
def test_property_random_shapes(hkv, g, num_l, num_s, num_b, ell, n_sink, n_recent, seed):
  rng = np.random.default_rng(seed)
  args = make_inputs(rng, hkv * g, hkv, None, num_l, num_s, num_b, ell, 16, jnp.float32)
  kw = dict(scale=0.3, n_sink=n_sink, n_recent=n_recent)
  out = saap_attention(*args, **kw, backend="interpret",
                       config=AttentionConfig(block_rows=16, block_k=16))
  np.testing.assert_allclose(out, saap_attention_reference(*args, **kw), rtol=2e-5, atol=2e-5)


def test_validation_errors(rng):
  args = make_inputs(rng, 4, 2, None, 20, 3, 4, 2, 16, jnp.float32)
  q, k, v, off, lst, bidx, kn, vn, qp, kvp = args
  with pytest.raises(ValueError, match="off"):
    saap_attention(q, k, v, off[:1], lst, bidx, kn, vn, qp, kvp, scale=1.0)
  with pytest.raises(ValueError, match="n_sink"):
    saap_attention(*args, scale=1.0, n_sink=-1)
  with pytest.raises(ValueError, match="int32"):
    saap_attention(q, k, v, off, lst.astype(jnp.float32), bidx, kn, vn, qp, kvp, scale=1.0)
  with pytest.raises(ValueError, match="bucket_idx"):
    saap_attention(q, k, v, off, lst, bidx[0], kn, vn, qp, kvp, scale=1.0)
