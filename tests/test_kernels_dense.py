"""Dense split-KV attention (the Pallas dense baseline): interpret vs reference vs numpy."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_kernels import AttentionConfig, dense_attention_reference, dense_decode_attention, dense_prefill_attention

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def brute_dense(q, k, v, k_new, v_new, q_pos, kv_pos, scale):
  """Per head and token: softmax over every fixed key + the visible new keys, float64."""
  q, k, v, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k, v, k_new, v_new))
  squeeze = q.ndim == 2
  q = q[:, None] if squeeze else q
  hq, seq_len, d = q.shape
  g = hq // k.shape[0]
  o = np.zeros((hq, seq_len, d))
  for h in range(hq):
    for t in range(seq_len):
      vis = [j for j in range(k_new.shape[1]) if 0 <= kv_pos[j] <= q_pos[t]]
      keys = np.concatenate([k[h // g], k_new[h // g, vis]])
      vals = np.concatenate([v[h // g], v_new[h // g, vis]])
      lg = scale * keys @ q[h, t]
      w = np.exp(lg - lg.max())
      o[h, t] = w @ vals / w.sum()
  return o[:, 0] if squeeze else o


def make(rng, hq, hkv, t, num_l, num_s, d, dtype, empty_frac=0.2):
  q = rng.normal(size=(hq, d) if t is None else (hq, t, d))
  k, v = rng.normal(size=(2, hkv, num_l, d))
  k_new, v_new = rng.normal(size=(2, hkv, num_s, d))
  kv_pos = np.where(rng.random(num_s) < empty_frac, -1, num_l + np.arange(num_s)).astype(np.int32)
  tt = 1 if t is None else t
  q_pos = (num_l + max(num_s - tt, 0) + np.arange(tt)).astype(np.int32)
  arrs = [jnp.asarray(x, dtype) for x in (q, k, v, k_new, v_new)]
  return arrs + [jnp.asarray(q_pos), jnp.asarray(kv_pos)]


def check(args, dtype, scale=0.3, **kw):
  want = brute_dense(*(np.asarray(a, np.float32) for a in args[:5]), np.asarray(args[5]),
                     np.asarray(args[6]), scale)
  ref = dense_attention_reference(*args, scale=scale)
  got = dense_decode_attention(*args, scale=scale, backend="interpret", **kw)
  assert got.shape == ref.shape == want.shape and got.dtype == args[0].dtype
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(ref, np.float32), want, rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_decode_matches_bruteforce(rng, dtype, hq, hkv):
  check(make(rng, hq, hkv, None, 333, 21, 64, dtype), dtype)


@pytest.mark.parametrize("t", [1, 7])
def test_block_of_tokens_and_ragged_chunks(rng, t):
  # an explicit chunk smaller than L: several ranges per head, the last one ragged
  cfg = AttentionConfig(block_rows=16, block_k=16, chunk_k=48, chunk_new=16)
  check(make(rng, 4, 2, t, 150, 19, 24, jnp.float32), jnp.float32, config=cfg)


def test_no_new_keys_and_all_slots_empty(rng):
  q, k, v, kn, vn, qp, kp = make(rng, 4, 1, None, 70, 0, 16, jnp.float32)
  check([q, k, v, kn, vn, qp, kp], jnp.float32)
  args = make(rng, 4, 2, None, 70, 9, 16, jnp.float32, empty_frac=1.0)  # every new slot is -1
  check(args, jnp.float32)


def test_return_lse_matches_reference(rng):
  args = make(rng, 8, 2, None, 200, 10, 32, jnp.float32)
  o1, l1 = dense_attention_reference(*args, scale=0.2, return_lse=True)
  o2, l2 = dense_decode_attention(*args, scale=0.2, backend="interpret", return_lse=True)
  np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=2e-5, atol=2e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=st.sampled_from([1, 2, 4]), hkv=st.integers(1, 3), num_l=st.integers(1, 300),
       num_s=st.integers(0, 40), t=st.sampled_from([None, 1, 3]), d=st.sampled_from([8, 16, 40]))
def test_property_random_shapes(rng, g, hkv, num_l, num_s, t, d):
  check(make(rng, g * hkv, hkv, t, num_l, num_s, d, jnp.float32), jnp.float32)


def test_errors_name_the_shapes(rng):
  q, k, v, kn, vn, qp, kp = make(rng, 4, 2, None, 20, 3, 8, jnp.float32)
  with pytest.raises(ValueError, match=r"k\(2, 20, 8\)"):
    dense_decode_attention(q, k, v[:, :5], kn, vn, qp, kp, scale=0.1, backend="interpret")
  with pytest.raises(ValueError, match="multiple of KV heads"):
    dense_decode_attention(q[:3], k, v, kn, vn, qp, kp, scale=0.1, backend="interpret")
  with pytest.raises(ValueError, match="dtypes must match"):
    dense_decode_attention(q, k.astype(jnp.bfloat16), v, kn, vn, qp, kp, scale=0.1, backend="interpret")
  with pytest.raises(ValueError, match="int32"):
    dense_decode_attention(q, k, v, kn, vn, qp.astype(jnp.float32), kp, scale=0.1, backend="interpret")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hq,hkv,t,num_s,empty_frac", [(8, 2, 7, 19, 0.2), (4, 4, 5, 9, 0.2), (4, 2, 6, 0, 0.2),
                                                       (4, 2, 3, 8, 1.0)])
def test_prefill_flash_route_matches_bruteforce(rng, dtype, hq, hkv, t, num_s, empty_frac):
  """`dense_prefill_attention` (flash attention over the fixed K/V in place, the g query heads of a
  KV head folded into its rows, the causal new part apart, log-sum-exp merge; interpret = the
  same plumbing with XLA's attention) equals the float64 brute force: GQA 4:1 and 1:1, ragged
  sizes, empty slots, no new keys, every new slot empty."""
  args = make(rng, hq, hkv, t, 151, num_s, 24, dtype, empty_frac=empty_frac)
  want = brute_dense(*(np.asarray(a, np.float32) for a in args[:5]), np.asarray(args[5]), np.asarray(args[6]), 0.3)
  got, lse = dense_prefill_attention(*args, scale=0.3, backend="interpret", return_lse=True)
  _, lse_ref = dense_attention_reference(*args, scale=0.3, return_lse=True)
  assert got.shape == want.shape and got.dtype == args[0].dtype and np.all(np.isfinite(np.asarray(got, np.float32)))
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=TOL[dtype], atol=TOL[dtype])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=TOL[dtype], atol=TOL[dtype])
  with pytest.raises(ValueError, match=r"q must be \[Hq, T, d\]"):
    dense_prefill_attention(args[0][:, 0], *args[1:], scale=0.3, backend="interpret")


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_prefill_flash_route_with_kv_splits(rng, splits):
  """The fixed context cut into contiguous chunks (flash attention on each, log-sum-exp merge):
  the same result; a split that does not divide L is refused."""
  from pallas_kernels.sparse_attention import flash_kv_splits

  args = make(rng, 8, 2, 3, 160, 11, 16, jnp.float32)
  want = brute_dense(*(np.asarray(a) for a in args[:5]), np.asarray(args[5]), np.asarray(args[6]), 0.3)
  got = dense_prefill_attention(*args, scale=0.3, backend="interpret", kv_splits=splits)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="divisor of L=160"):
    dense_prefill_attention(*args, scale=0.3, backend="interpret", kv_splits=3)
  # the automatic choice: 128 tokens x 4 heads over 128K keys and 8 KV heads -> 8 x 4 tiles -> 16 chunks
  assert flash_kv_splits(8, 512, 131072) == 16 and flash_kv_splits(8, 16384, 524288) == 1
  assert flash_kv_splits(8, 512, 3000) == 1      # chunks would be shorter than 2048 keys
