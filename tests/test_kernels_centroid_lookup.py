"""Centroid lookup (Eq. 1): Pallas interpret vs reference vs brute-force numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_kernels.centroid_lookup import (CentroidLookupConfig, centroid_lookup_decode,
                                            centroid_lookup_prefill, centroid_lookup_reference)

def brute_scores(q, cent, counts, scale, vote):
  """Eq. 1 by loops in float64; q [Hq, T, d] -> [Hs, C]."""
  q = np.asarray(q, np.float64)
  cent = np.asarray(cent, np.float64)
  counts = np.asarray(counts)
  hq, seq_len, _ = q.shape
  hkv, num_c, _ = cent.shape
  g = hq // hkv
  s = np.zeros((hq, num_c))
  for h in range(hq):
    kv = h // g
    live = [i for i in range(num_c) if counts[kv, i] > 0]
    for t in range(seq_len):
      if not live:
        continue
      logit = {i: scale * float(q[h, t] @ cent[kv, i]) for i in live}
      mx = max(logit.values())
      den = sum(counts[kv, i] * np.exp(logit[i] - mx) for i in live)
      for i in live:
        s[h, i] += np.exp(logit[i] - mx) / den / seq_len
  if vote == "kv":
    s = s.reshape(hkv, g, num_c).mean(axis=1)
  return s


def make_inputs(rng, hq, hkv, seq_len, num_c, d, dtype, empty_frac=0.2):
  q = rng.normal(size=(hq, seq_len, d)) * 1.5
  cent = rng.normal(size=(hkv, num_c, d))
  counts = rng.integers(1, 30, size=(hkv, num_c))
  counts[rng.random((hkv, num_c)) < empty_frac] = 0
  return (jnp.asarray(q, dtype), jnp.asarray(cent, dtype), jnp.asarray(counts, jnp.int32))


def pick_threshold(scores, frac=0.3):
  s = np.asarray(scores)
  s = s[s > 0]
  return np.float32(np.quantile(s, 1 - frac)) if s.size else np.float32(0.0)


def check_selected(sel, scores, thr, ref_scores, tol):
  sel, scores, ref_scores = map(np.asarray, (sel, scores, ref_scores))
  np.testing.assert_array_equal(sel, scores > thr)      # kernel self-consistent
  far = np.abs(ref_scores - thr) > tol                     # away from the boundary
  np.testing.assert_array_equal(sel[far], (ref_scores > thr)[far])


TOL = {dt: dict(rtol=2e-5, atol=1e-7) for dt in (jnp.float32, jnp.bfloat16, jnp.float16)}

CASES = [  # hq, hkv, T, C, d, dtype, vote
    (8, 2, 37, 150, 64, jnp.float32, "kv"),    # GQA 4:1, ragged T and C
    (8, 2, 37, 150, 64, jnp.bfloat16, "q"),
    (4, 4, 5, 33, 128, jnp.float16, "kv"),     # MHA 1:1, d=128, fp16
    (6, 2, 3, 20, 24, jnp.float32, "q"),       # g=3, d=24 (padded to 32)
]


@pytest.mark.parametrize("hq,hkv,seq_len,num_c,d,dtype,vote", CASES)
def test_prefill_interpret_matches_reference(rng, hq, hkv, seq_len, num_c, d, dtype, vote):
  q, cent, counts = make_inputs(rng, hq, hkv, seq_len, num_c, d, dtype)
  scale = d ** -0.5
  _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=scale, vote=vote)
  thr = pick_threshold(ref)
  sel, sc = centroid_lookup_prefill(q, cent, counts, thr, scale=scale, vote=vote,
                                    backend="interpret",
                                    config=CentroidLookupConfig(block_c=32, block_t=16))
  hs = hkv if vote == "kv" else hq
  assert sel.shape == sc.shape == (hs, num_c) and sel.dtype == bool and sc.dtype == jnp.float32
  assert np.isfinite(np.asarray(sc)).all()
  np.testing.assert_allclose(sc, ref, **TOL[dtype])
  check_selected(sel, sc, thr, ref, 1e-5 * float(np.max(ref)))


@pytest.mark.parametrize("hq,hkv,seq_len,num_c,d,dtype,vote", CASES)
def test_decode_interpret_matches_reference(rng, hq, hkv, seq_len, num_c, d, dtype, vote):
  q, cent, counts = make_inputs(rng, hq, hkv, 1, num_c, d, dtype)
  q = q[:, 0]
  scale = d ** -0.5
  _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=scale, vote=vote)
  thr = pick_threshold(ref)
  sel, sc = centroid_lookup_decode(q, cent, counts, thr, scale=scale, vote=vote,
                                   backend="interpret", config=CentroidLookupConfig(block_c=32))
  assert np.isfinite(np.asarray(sc)).all()
  np.testing.assert_allclose(sc, ref, **TOL[dtype])
  check_selected(sel, sc, thr, ref, 1e-5 * float(np.max(ref)))


@pytest.mark.parametrize("vote", ["kv", "q"])
@pytest.mark.parametrize("seq_len", [1, 7])
def test_reference_matches_bruteforce(rng, vote, seq_len):
  q, cent, counts = make_inputs(rng, 6, 2, seq_len, 23, 16, jnp.float32)
  thr = np.float32(0.01)
  sel, sc = centroid_lookup_reference(q, cent, counts, thr, scale=0.3, vote=vote)
  bf = brute_scores(q, cent, counts, 0.3, vote)
  np.testing.assert_allclose(sc, bf, rtol=1e-5, atol=1e-8)
  valid = np.asarray(counts > 0)
  if vote == "q":
    valid = np.repeat(valid, 3, axis=0)
  far = np.abs(bf - thr) > 1e-6
  np.testing.assert_array_equal(np.asarray(sel)[far], ((bf > thr) & valid)[far])
  # Eq. 1 is a distribution over keys: sum_i N_i S_i = 1 for every head with a live cluster.
  nsum = (bf * (np.repeat(np.asarray(counts), 3, 0) if vote == "q" else np.asarray(counts))).sum(1)
  np.testing.assert_allclose(nsum[valid.any(1)], 1.0, rtol=1e-6)


def test_empty_heads_and_poisoned_invalid_centroids(rng):
  """A KV head with no valid cluster, NaN centroids in empty clusters: no NaN anywhere."""
  hq, hkv, seq_len, num_c, d = 4, 2, 9, 40, 32
  q, cent, counts = make_inputs(rng, hq, hkv, seq_len, num_c, d, jnp.float32, empty_frac=0.4)
  counts = counts.at[1].set(0)                                  # KV head 1: all empty
  cent = jnp.where((counts == 0)[..., None], jnp.nan, cent)     # poison what must not be read
  for backend in ("interpret", "reference"):
    for vote in ("kv", "q"):
      sel, sc = centroid_lookup_prefill(q, cent, counts, jnp.float32(-1.0), scale=0.2,
                                        vote=vote, backend=backend)
      sel_d, sc_d = centroid_lookup_decode(q[:, 0], cent, counts, jnp.float32(-1.0),
                                           scale=0.2, vote=vote, backend=backend)
      for s_, x in ((sel, sc), (sel_d, sc_d)):
        x = np.asarray(x)
        assert np.isfinite(x).all(), backend
        valid = np.asarray(counts > 0)
        if vote == "q":
          valid = np.repeat(valid, 2, axis=0)
        assert (x[~valid] == 0).all()
        # threshold -1: exactly the valid clusters are selected, never an invalid one
        np.testing.assert_array_equal(np.asarray(s_), valid)


def test_threshold_is_traced(rng):
  q, cent, counts = make_inputs(rng, 4, 2, 4, 30, 16, jnp.float32)
  f = jax.jit(lambda t: centroid_lookup_prefill(q, cent, counts, t, scale=0.25,
                                                backend="interpret"))
  sel_lo, sc = f(jnp.float32(0.0))
  sel_hi, _ = f(jnp.float32(1.0))
  assert f._cache_size() == 1
  np.testing.assert_array_equal(sel_lo, np.asarray(sc) > 0)
  assert not np.asarray(sel_hi).any()


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2, 3]), seq_len=st.integers(1, 20),
       num_c=st.integers(1, 45), d=st.sampled_from([16, 20, 64]), vote=st.sampled_from(["kv", "q"]),
       seed=st.integers(0, 2**31 - 1))
def test_property_random_shapes(hkv, g, seq_len, num_c, d, vote, seed):
  rng = np.random.default_rng(seed)
  q, cent, counts = make_inputs(rng, hkv * g, hkv, seq_len, num_c, d, jnp.float32)
  cfg = CentroidLookupConfig(block_c=16, block_t=16)
  _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=0.2, vote=vote)
  _, sc = centroid_lookup_prefill(q, cent, counts, 0.0, scale=0.2, vote=vote,
                                  backend="interpret", config=cfg)
  np.testing.assert_allclose(sc, ref, rtol=2e-5, atol=1e-7)
  _, ref_d = centroid_lookup_reference(q[:, 0], cent, counts, 0.0, scale=0.2, vote=vote)
  _, sc_d = centroid_lookup_decode(q[:, 0], cent, counts, 0.0, scale=0.2, vote=vote,
                                   backend="interpret", config=cfg)
  np.testing.assert_allclose(sc_d, ref_d, rtol=2e-5, atol=1e-7)


def test_validation_errors():
  q = jnp.zeros((8, 3, 16))
  cent = jnp.zeros((2, 5, 16))
  counts = jnp.ones((2, 5), jnp.int32)
  with pytest.raises(ValueError, match="q must be"):
    centroid_lookup_prefill(q[:, 0], cent, counts, 0.0, scale=1.0)
  with pytest.raises(ValueError, match="counts"):
    centroid_lookup_prefill(q, cent, counts[:, :4], 0.0, scale=1.0)
  with pytest.raises(ValueError, match="multiple"):
    centroid_lookup_prefill(jnp.zeros((7, 3, 16)), cent, counts, 0.0, scale=1.0)
  with pytest.raises(ValueError, match="int32"):
    centroid_lookup_prefill(q, cent, counts.astype(jnp.float32), 0.0, scale=1.0)
  with pytest.raises(ValueError, match="dtypes must match"):
    centroid_lookup_prefill(q, cent.astype(jnp.bfloat16), counts, 0.0, scale=1.0)
  with pytest.raises(ValueError, match="vote"):
    centroid_lookup_decode(q[:, 0], cent, counts, 0.0, scale=1.0, vote="x")
  with pytest.raises(ValueError, match="threshold"):
    centroid_lookup_decode(q[:, 0], cent, counts, jnp.zeros(2), scale=1.0)
  with pytest.raises(ValueError, match="backend"):
    centroid_lookup_decode(q[:, 0], cent, counts, 0.0, scale=1.0, backend="triton")
  with pytest.raises(ValueError, match="block_c"):
    CentroidLookupConfig(block_c=24)
  with pytest.raises(ValueError, match="num_warps"):
    CentroidLookupConfig(num_warps=3)
  with pytest.raises(ValueError, match="score_block_t"):
    CentroidLookupConfig(score_block_t=24)
  with pytest.raises(ValueError, match="num_warps"):
    CentroidLookupConfig(score_warps=5)


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_prefill_tile_accumulation_matches_reference(rng, vote):
  """tile_acc=True (scores summed over the tokens once, at the end): same Eq. 1 averages,
  ragged T and C, empty clusters, GQA 4:1."""
  q, cent, counts = make_inputs(rng, 8, 2, 37, 77, 32, jnp.float32)
  _, ref = centroid_lookup_reference(q, cent, counts, jnp.float32(0.0), scale=0.2, vote=vote)
  thr = pick_threshold(ref)
  cfg = CentroidLookupConfig(block_c=32, block_t=16, tile_acc=True)
  # the scoring pass tiled differently from the statistics pass (both ways round)
  for other in (CentroidLookupConfig(block_c=16, block_t=32, score_block_t=16, score_block_c=64, tile_acc=True),
                CentroidLookupConfig(block_c=64, block_t=16, score_block_t=64, score_block_c=16, score_warps=8)):
    _, got = centroid_lookup_prefill(q, cent, counts, jnp.float32(thr), scale=0.2, vote=vote,
                                     backend="interpret", config=other)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **TOL[jnp.float32])
  sel, got = centroid_lookup_prefill(q, cent, counts, jnp.float32(thr), scale=0.2, vote=vote,
                                     backend="interpret", config=cfg)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **TOL[jnp.float32])
  check_selected(sel, got, thr, ref, 1e-6)
  assert np.all(np.isfinite(np.asarray(got)))


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_prefill_score_splits_match_reference(rng, splits):
  """The scoring pass's tiles shared by `splits` programs per centroid block (partial sums
  added after; 64 > the 3 x 4 tiles there are: clipped) give the same Eq. 1 averages."""
  q, cent, counts = make_inputs(rng, 8, 2, 45, 50, 32, jnp.float32)
  _, ref = centroid_lookup_reference(q, cent, counts, jnp.float32(0.0), scale=0.2)
  for tile_acc in (False, True):
    cfg = CentroidLookupConfig(block_c=16, block_t=16, tile_acc=tile_acc, score_splits=splits)
    _, got = centroid_lookup_prefill(q, cent, counts, jnp.float32(0.0), scale=0.2, backend="interpret", config=cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **TOL[jnp.float32])


def test_score_splits_rule():
  from pallas_kernels.centroid_lookup import score_splits
  cfg = CentroidLookupConfig()
  assert score_splits(cfg, 1640, 256, False) == 1        # 1-level at 512K: the grid is full already
  assert score_splits(cfg, 328, 256, False) == 3         # level 1 at 512K: 41 blocks x 8 heads
  assert score_splits(cfg, 1640, 256, True) == 4         # compacted level 2: most programs exit at once
  assert score_splits(cfg, 4, 3, False) == 3             # never more shares than tiles
  assert score_splits(CentroidLookupConfig(score_splits=2), 4, 100, False) == 2
  with pytest.raises(ValueError, match="score_splits"):
    CentroidLookupConfig(score_splits=0)


@pytest.mark.parametrize("vote", ["kv", "q"])
@pytest.mark.parametrize("pad", [0, 11, 36, 37])   # none, some, all but one, all tokens padding
def test_prefill_mean_over_valid_tokens(rng, vote, pad):
  """A left-padded block (q_valid): the kernel's scores are the mean over the real tokens only,
  i.e. the lookup of the block without its padding rows; padding rows hold garbage."""
  hq, hkv, seq_len, num_c, d = 8, 2, 37, 150, 64
  q, cent, counts = make_inputs(rng, hq, hkv, seq_len, num_c, d, jnp.float32)
  q = q.at[:, :pad].set(jnp.asarray(rng.normal(size=(hq, pad, d)) * 40.0, q.dtype))  # padding: huge
  q_valid = jnp.arange(seq_len) >= pad
  scale = d ** -0.5
  _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=scale, vote=vote, q_valid=q_valid)
  if pad < seq_len:   # the reference over the real tokens alone, and brute force
    _, alone = centroid_lookup_reference(q[:, pad:], cent, counts, 0.0, scale=scale, vote=vote)
    np.testing.assert_allclose(ref, alone, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(ref, brute_scores(q[:, pad:], cent, counts, scale, vote), rtol=1e-4, atol=1e-9)
  else:
    assert not np.asarray(ref).any()
  for splits in (None, 3):
    _, sc = centroid_lookup_prefill(q, cent, counts, 0.5, scale=scale, vote=vote, backend="interpret",
                                    config=CentroidLookupConfig(block_c=32, block_t=16, score_splits=splits),
                                    q_valid=q_valid)
    assert np.isfinite(np.asarray(sc)).all()
    np.testing.assert_allclose(sc, ref, rtol=2e-5, atol=1e-7)


def test_prefill_q_valid_errors(rng):
  q, cent, counts = make_inputs(rng, 4, 2, 5, 20, 32, jnp.float32)
  for bad in (jnp.ones((4,), bool), jnp.ones((5,), jnp.int32)):
    with pytest.raises(ValueError, match=r"q_valid must be bool \[T\] = \[5\]"):
      centroid_lookup_prefill(q, cent, counts, 0.1, scale=0.2, backend="interpret", q_valid=bad)


@pytest.mark.parametrize("stats_splits", [None, 3, 64])
def test_prefill_statistics_splits_of_a_short_block(rng, stats_splits):
  """A short block (one token block: a question) splits the statistics pass's centroid blocks
  over several programs, their (max, denominator) combined after: same scores, padded or not."""
  q, cent, counts = make_inputs(rng, 8, 2, 11, 300, 64, jnp.float32)
  cfg = CentroidLookupConfig(block_c=32, block_t=16, stats_splits=stats_splits)
  for q_valid in (None, jnp.arange(11) >= 4):
    _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=0.125, q_valid=q_valid)
    _, sc = centroid_lookup_prefill(q, cent, counts, 0.5, scale=0.125, backend="interpret", config=cfg,
                                    q_valid=q_valid)
    np.testing.assert_allclose(sc, ref, rtol=2e-5, atol=1e-7)


def test_statistics_splits_rule():
  from pallas_kernels.centroid_lookup import DEFAULT_PREFILL, stats_splits
  blocks = 52                                                       # 6.5K centroids / 128
  assert stats_splits(DEFAULT_PREFILL, 32, blocks, False) == 8      # a question: 1 token block x 32 heads
  assert stats_splits(DEFAULT_PREFILL, 1024, blocks, False) == 1    # 4K tokens: unchanged
  assert stats_splits(DEFAULT_PREFILL, 1024, blocks, True) == 2     # a bounded level 2: as before
  assert stats_splits(DEFAULT_PREFILL, 32, 3, False) == 3           # never more shares than blocks
  assert stats_splits(CentroidLookupConfig(stats_splits=5), 32, blocks, False) == 5


@pytest.mark.parametrize("anchor", ["rows", "tile"])
def test_prefill_anchored_statistics_match_reference(rng, anchor):
  """stats_anchor (the statistics pass without a running max, logits taken relative to each row's
  first-block max): the same Eq. 1 averages as the reference for ragged T and C with empty clusters,
  GQA 4:1 and vote "q", a split statistics pass (a short block), a left-padded block, a KV head with
  no valid cluster, and the bounded pass (the hierarchical lookup's level 2 over its compacted
  candidates)."""
  for vote in ("kv", "q"):
    q, cent, counts = make_inputs(rng, 8, 2, 37, 150, 64, jnp.float32)
    counts = counts.at[1, :40].set(0)                      # head 1: its first block(s) empty
    _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=0.125, vote=vote)
    for cfg in (CentroidLookupConfig(block_c=32, block_t=16, stats_anchor=anchor),
                CentroidLookupConfig(block_c=32, block_t=16, stats_anchor=anchor, stats_splits=3, tile_acc=True)):
      _, sc = centroid_lookup_prefill(q, cent, counts, 0.5, scale=0.125, vote=vote, backend="interpret", config=cfg)
      np.testing.assert_allclose(sc, ref, **TOL[jnp.float32])
  q_valid = jnp.arange(37) >= 9
  _, ref = centroid_lookup_reference(q, cent, counts.at[0].set(0), 0.0, scale=0.125, q_valid=q_valid)
  _, sc = centroid_lookup_prefill(q, cent, counts.at[0].set(0), 0.5, scale=0.125, backend="interpret",
                                  q_valid=q_valid, config=CentroidLookupConfig(block_c=32, block_t=16,
                                                                              stats_anchor=anchor))
  assert np.isfinite(np.asarray(sc)).all() and not np.asarray(sc)[0].any()
  np.testing.assert_allclose(sc, ref, **TOL[jnp.float32])
  # the bounded pass (the hierarchical level 2 over compacted candidates: rows [0, n_valid) only)
  from pallas_kernels.centroid_lookup import lookup_prefill_scores
  n_valid = jnp.asarray([100, 37], jnp.int32)
  inside = jnp.arange(150)[None, :] < n_valid[:, None]
  _, ref = centroid_lookup_reference(q, cent, jnp.where(inside, counts, 0), 0.0, scale=0.125)
  for splits in (None, 3):
    got = lookup_prefill_scores(q, cent, counts, n_valid, scale=0.125, groups=2, backend="interpret",
                                cfg=CentroidLookupConfig(block_c=32, block_t=16, stats_anchor=anchor,
                                                         stats_splits=splits))
    np.testing.assert_allclose(got, ref, **TOL[jnp.float32])


def test_prefill_anchored_statistics_fall_back_when_a_later_block_overflows(rng):
  """A row whose logits in a later centroid block lie > 128 log2 units above its first block's
  max (the anchored sum overflows f32) and a head whose first block has no valid cluster: the
  program redoes its statistics with the running max, so the scores equal the reference."""
  hq, hkv, seq_len, num_c, d = 4, 2, 9, 64, 32
  q, cent, counts = make_inputs(rng, hq, hkv, seq_len, num_c, d, jnp.float32, empty_frac=0.0)
  q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  cent = 0.01 * cent                                        # blocks hold logits near 0 ...
  far = (np.asarray(q[0, 0]) * 4000.0).astype(np.float32)   # ... but one centroid of head 0's last block
  cent = cent.at[0, num_c - 1].set(far)                     # sits 4000 / sqrt(d) log-e units above
  counts = counts.at[1, :16].set(0)                         # head 1: its first block has no valid cluster
  scale = d ** -0.5
  gap = scale * np.log2(np.e) * (np.asarray(q[0, 0]) @ far - np.max(np.asarray(q[0, 0]) @ np.asarray(cent[0, :16]).T))
  assert gap > 128                                          # the precondition: an anchored sum would overflow
  _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=scale)
  for anchor in (None, "rows", "tile"):
    _, sc = centroid_lookup_prefill(q, cent, counts, 0.5, scale=scale, backend="interpret",
                                    config=CentroidLookupConfig(block_c=16, block_t=16, stats_anchor=anchor))
    assert np.isfinite(np.asarray(sc)).all(), anchor
    np.testing.assert_allclose(sc, ref, rtol=2e-5, atol=1e-7, err_msg=str(anchor))
  with pytest.raises(ValueError, match="stats_anchor must be None, 'rows' or 'tile'"):
    CentroidLookupConfig(stats_anchor="max")


def test_exp2_ftz_is_exp2_off_the_gpu(rng):
  """_common.exp2_ftz (the prefill passes' exp2 on the GPU: ex2.approx.ftz.f32): outside the Triton lowering it is
  lax.exp2, eagerly, under jit and vmap, for the whole f32 range the passes feed it (the masked -1e30 included);
  other dtypes are refused by name."""
  from pallas_kernels import _common as cm
  x = jnp.asarray(np.concatenate([rng.uniform(-140, 2, 200), [-1e30, 0.0, -126.0, -149.0]]), jnp.float32)
  want = np.asarray(jnp.exp2(x))
  np.testing.assert_array_equal(cm.exp2_ftz(x), want)
  np.testing.assert_array_equal(jax.jit(cm.exp2_ftz)(x), want)
  np.testing.assert_array_equal(jax.vmap(cm.exp2_ftz)(x.reshape(4, -1)), want.reshape(4, -1))
  with pytest.raises(TypeError, match="exp2_ftz takes float32, got bfloat16"):
    cm.exp2_ftz(x.astype(jnp.bfloat16))


def test_fma_is_mul_add_off_the_gpu(rng):
  """_common.fma (the prefill passes' multiply and bias on the GPU: fma.rn.f32): outside the Triton lowering it is
  x * y + z, eagerly, under jit and vmap (an unbatched operand broadcast), up to the last bit (XLA's CPU compiler
  may contract it into one rounding); other dtypes and mismatched shapes are refused by name."""
  from pallas_kernels import _common as cm
  x, y, z = (jnp.asarray(rng.normal(size=(4, 8)), jnp.float32) for _ in range(3))
  want = np.asarray(x, np.float64) * np.asarray(y, np.float64) + np.asarray(z, np.float64)
  tol = dict(rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(cm.fma(x, y, z), want, **tol)
  np.testing.assert_allclose(jax.jit(cm.fma)(x, y, z), want, **tol)
  np.testing.assert_allclose(jax.vmap(cm.fma, in_axes=(0, 0, None))(x, y, z[0]),
                             np.asarray(x, np.float64) * np.asarray(y, np.float64) + np.asarray(z[0], np.float64), **tol)
  with pytest.raises(TypeError, match="fma takes float32 arrays of one shape"):
    cm.fma(x, y, z.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="fma takes float32 arrays of one shape"):
    cm.fma(x, y, z[0])


@pytest.mark.parametrize("int8", [None, "cvt", "magic"])
def test_prefill_exp2_ftz_and_fma_settings_give_the_same_scores(rng, int8):
  """exp2_ftz and logits_fma on (the defaults) and off: the same Eq. 1 averages in the interpreter, for the
  running-max and the anchored statistics passes, GQA with ragged T and C, bf16 and int8 logits ("magic" keeps its
  large offset apart from the bias), and the bounded pass."""
  from pallas_kernels.centroid_lookup import lookup_prefill_scores
  q, cent, counts = make_inputs(rng, 8, 2, 37, 150, 64, jnp.bfloat16)
  assert CentroidLookupConfig().exp2_ftz and CentroidLookupConfig().logits_fma
  for anchor in (None, "rows"):
    got = {}
    for ftz in (True, False):
      cfg = CentroidLookupConfig(block_c=32, block_t=16, stats_anchor=anchor, prefill_int8=int8, exp2_ftz=ftz,
                                 logits_fma=ftz)
      got[ftz] = (centroid_lookup_prefill(q, cent, counts, 0.5, scale=0.125, backend="interpret", config=cfg)[1],
                  lookup_prefill_scores(q, cent, counts, jnp.asarray([100, 37], jnp.int32), scale=0.125, groups=2,
                                        backend="interpret", cfg=cfg))
    for a, b in zip(got[True], got[False]):
      assert float(jnp.max(a)) > 0
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("int8", [None, "cvt"])
def test_prefill_scoring_contiguous_loads_match_reference(rng, int8, monkeypatch):
  """The scoring pass's ``contiguous`` option (a token block's q rows and int8 multipliers as one slice, T a multiple
  of its block) and the masked row gather (the default) give the reference's Eq. 1 averages (GQA, vote "kv" and
  "q", the bounded pass); the slice refuses a ragged T by name.  ``lookup_prefill_scores`` is not jitted, so each
  call traces the patched kernel afresh (no jit cache to clear)."""
  import functools

  from pallas_kernels import centroid_lookup as cl
  q, cent, counts = make_inputs(rng, 8, 2, 64, 150, 64, jnp.bfloat16)          # T = 4 scoring blocks of 16
  cfg = CentroidLookupConfig(block_c=32, block_t=16, stats_anchor="rows", prefill_int8=int8)
  qd, cd = (q, cent) if int8 is None else cl.quantized_inputs(q, cent)
  tol = TOL[jnp.float32] if int8 is None else dict(rtol=1e-5, atol=1e-8)
  n_valid = jnp.asarray([100, 37], jnp.int32)
  inside = jnp.arange(150)[None, :] < n_valid[:, None]
  want = {(vote, nv is None): centroid_lookup_reference(qd, cd, counts if nv is None else jnp.where(inside, counts, 0),
                                                        0.0, scale=0.125, vote=vote)[1]
          for vote, nv in (("kv", None), ("q", None), ("kv", n_valid))}   # n_valid: one bound per KV head
  orig = cl._score_kernel
  for contiguous in (True, False):
    monkeypatch.setattr(cl, "_score_kernel", functools.partial(orig, contiguous=contiguous))
    for (vote, whole), ref in want.items():
      got = cl.lookup_prefill_scores(q, cent, counts, None if whole else n_valid, scale=0.125,
                                     groups=2 if vote == "kv" else 8, backend="interpret", cfg=cfg)
      np.testing.assert_allclose(got, ref, **tol)
  monkeypatch.setattr(cl, "_score_kernel", functools.partial(orig, contiguous=True))
  with pytest.raises(ValueError, match="contiguous q loads need seq_len % block_t == 0, got 37 % 16"):
    cl.lookup_prefill_scores(q[:, :37], cent, counts, scale=0.125, groups=2, backend="interpret", cfg=cfg)


@pytest.mark.parametrize("int8", [None, "cvt"])
def test_prefill_stats_rows_wait_setting_gives_the_same_scores(rng, int8):
  """``stats_rows_wait`` None (automatic), True and False give the reference's Eq. 1 averages over empty clusters
  (their rows read or not), with the running-max and the anchored statistics pass, bounded and not; a value that is
  not a bool or None is refused by name."""
  from pallas_kernels import centroid_lookup as cl
  q, cent, counts = make_inputs(rng, 8, 2, 37, 150, 64, jnp.bfloat16, empty_frac=0.4)
  qd, cd = (q, cent) if int8 is None else cl.quantized_inputs(q, cent)
  tol = TOL[jnp.float32] if int8 is None else dict(rtol=1e-5, atol=1e-8)
  n_valid = jnp.asarray([100, 37], jnp.int32)
  inside = jnp.arange(150)[None, :] < n_valid[:, None]
  for nv in (None, n_valid):
    ref = centroid_lookup_reference(qd, cd, counts if nv is None else jnp.where(inside, counts, 0), 0.0,
                                    scale=0.125, vote="kv")[1]
    for anchor in (None, "rows"):
      for wait in (None, True, False):
        cfg = CentroidLookupConfig(block_c=32, block_t=16, stats_anchor=anchor, prefill_int8=int8,
                                   stats_rows_wait=wait)
        got = cl.lookup_prefill_scores(q, cent, counts, nv, scale=0.125, groups=2, backend="interpret", cfg=cfg)
        np.testing.assert_allclose(got, ref, **tol)
  with pytest.raises(ValueError, match="stats_rows_wait must be None, True or False, got 'yes'"):
    CentroidLookupConfig(stats_rows_wait="yes")


def test_quantize_int8_rounds_to_the_nearest_step(rng):
  """quantize_int8: max |x| maps to 127, every value within half a step, an all-zero row gets scale 1 and
  zeros (no division by zero); quantized_inputs scales q per (head, token) row and centroids per head."""
  from pallas_kernels.centroid_lookup import quantize_int8, quantized_inputs
  x = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32).at[1, 2].set(0.0)
  v, sc = quantize_int8(x, (-1,))
  assert v.dtype == jnp.int8 and sc.shape == (3, 5, 1)
  v, sc = np.asarray(v, np.int32), np.asarray(sc)
  assert (np.abs(v).max(axis=-1)[np.asarray(x).any(axis=-1)] == 127).all()
  assert sc[1, 2, 0] == 1.0 and not v[1, 2].any()
  assert np.all(np.abs(v * sc - np.asarray(x)) <= sc / 2 + 1e-7)
  qd, cd = quantized_inputs(x, x)
  np.testing.assert_allclose(qd, v * sc, rtol=1e-6)                            # q: per row
  cv, cs = quantize_int8(x, (1, 2))
  assert cs.shape == (3, 1, 1)
  np.testing.assert_allclose(cd, np.asarray(cv, np.int32) * np.asarray(cs), rtol=1e-6)   # centroids: per head


@pytest.mark.parametrize("mode", ["cvt", "magic"])
def test_prefill_int8_logits_match_reference_over_quantized_inputs(rng, mode):
  """prefill_int8: the two passes on int8 q (per token row) and centroids (per KV head) give the Eq. 1
  averages of the quantized inputs -- GQA and vote "q", ragged T and C with empty clusters, the running
  max and the anchored statistics pass, a split statistics pass, a left-padded block with an all-zero
  padding row, a head with no valid cluster, the bounded pass, and d = 320 (where "magic" falls back to
  "cvt": 127^2 d >= 2^22).  backend="reference" with the config computes the same; the scores move off
  the unquantized ones only by the rounding."""
  from pallas_kernels.centroid_lookup import lookup_prefill_scores, quantized_inputs
  for vote in ("kv", "q"):
    q, cent, counts = make_inputs(rng, 8, 2, 37, 150, 64, jnp.bfloat16)
    qd, cd = quantized_inputs(q, cent)
    _, ref = centroid_lookup_reference(qd, cd, counts, 0.0, scale=0.125, vote=vote)
    for cfg in (CentroidLookupConfig(block_c=32, block_t=16, prefill_int8=mode),
                CentroidLookupConfig(block_c=32, block_t=16, prefill_int8=mode, stats_anchor="rows", stats_splits=3,
                                     tile_acc=True)):
      _, sc = centroid_lookup_prefill(q, cent, counts, 0.5, scale=0.125, vote=vote, backend="interpret", config=cfg)
      np.testing.assert_allclose(sc, ref, rtol=1e-5, atol=1e-8)
      _, sr = centroid_lookup_prefill(q, cent, counts, 0.5, scale=0.125, vote=vote, backend="reference", config=cfg)
      np.testing.assert_allclose(sr, ref, rtol=1e-6, atol=1e-9)
    _, plain = centroid_lookup_reference(q, cent, counts, 0.0, scale=0.125, vote=vote)
    assert 0 < float(jnp.max(jnp.abs(sc - plain))) < 0.1 * float(jnp.max(plain))
  cfg = CentroidLookupConfig(block_c=32, block_t=16, prefill_int8=mode, stats_anchor="rows")
  q_valid = jnp.arange(37) >= 9
  qz = q.at[:, 3].set(0.0)                                  # a padding token with an all-zero row
  qd, cd = quantized_inputs(qz, cent)
  _, ref = centroid_lookup_reference(qd, cd, counts.at[0].set(0), 0.0, scale=0.125, q_valid=q_valid)
  _, sc = centroid_lookup_prefill(qz, cent, counts.at[0].set(0), 0.5, scale=0.125, backend="interpret",
                                  q_valid=q_valid, config=cfg)
  assert np.isfinite(np.asarray(sc)).all() and not np.asarray(sc)[0].any()
  np.testing.assert_allclose(sc, ref, rtol=1e-5, atol=1e-8)
  n_valid = jnp.asarray([100, 37], jnp.int32)                # the bounded pass
  inside = jnp.arange(150)[None, :] < n_valid[:, None]
  _, ref = centroid_lookup_reference(*quantized_inputs(q, cent), jnp.where(inside, counts, 0), 0.0, scale=0.125)
  got = lookup_prefill_scores(q, cent, counts, n_valid, scale=0.125, groups=2, backend="interpret", cfg=cfg)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-8)
  q, cent, counts = make_inputs(rng, 4, 2, 5, 40, 320, jnp.float32)
  _, ref = centroid_lookup_reference(*quantized_inputs(q, cent), counts, 0.0, scale=320 ** -0.5)
  _, sc = centroid_lookup_prefill(q, cent, counts, 0.5, scale=320 ** -0.5, backend="interpret",
                                  config=CentroidLookupConfig(block_c=16, block_t=16, prefill_int8=mode))
  np.testing.assert_allclose(sc, ref, rtol=1e-5, atol=1e-8)


def test_prefill_int8_config_errors():
  with pytest.raises(ValueError, match="prefill_int8 must be one of"):
    CentroidLookupConfig(prefill_int8="fp8")
  with pytest.raises(ValueError, match="prefill_int8 runs in the Triton passes"):
    CentroidLookupConfig(prefill_int8="cvt", prefill_engine="mosaic")
  from pallas_kernels.centroid_lookup import INT8_PREFILL, _mosaic_engine
  auto = CentroidLookupConfig(prefill_int8="cvt", prefill_engine="auto")
  q = jnp.zeros((4, 8, 64), jnp.bfloat16)
  assert not _mosaic_engine(auto, q, jnp.zeros((2, 16, 64), jnp.bfloat16), "pallas")   # int8: always Triton
  assert INT8_PREFILL.prefill_int8 == "cvt"
