"""Hierarchical lookup (Eq. 2-3): Pallas interpret vs reference vs brute-force numpy."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_kernels.centroid_lookup import CentroidLookupConfig, centroid_lookup_reference
from pallas_kernels.hierarchical_lookup import (hierarchical_lookup_decode, hierarchical_lookup_prefill,
                                                hierarchical_lookup_reference, hierarchical_scores)

def _eq1_rows(qh, cent, counts, allowed, scale):
  """Mean over tokens of Eq. 1 for one query head; qh [T, d]; allowed: set of ids."""
  num_c = cent.shape[0]
  out = np.zeros(num_c)
  live = [i for i in range(num_c) if i in allowed and counts[i] > 0]
  if not live:
    return out
  for qt in qh:
    logit = {i: scale * float(qt @ cent[i]) for i in live}
    mx = max(logit.values())
    den = sum(counts[i] * np.exp(logit[i] - mx) for i in live)
    for i in live:
      out[i] += np.exp(logit[i] - mx) / den / len(qh)
  return out


def brute_hierarchical(q, c1, n1, c2, n2, parent, t1, t2, scale, vote):
  q, c1, c2 = (np.asarray(x, np.float64) for x in (q, c1, c2))
  n1, n2, parent = np.asarray(n1), np.asarray(n2), np.asarray(parent)
  if q.ndim == 2:
    q = q[:, None]
  hq = q.shape[0]
  hkv, num_c1, _ = c1.shape
  num_c2 = c2.shape[1]
  g = hq // hkv
  groups = [[h] for h in range(hq)] if vote == "q" else [list(range(s * g, s * g + g))
                                                         for s in range(hkv)]
  sel = np.zeros((len(groups), num_c2), bool)
  scores = np.zeros((len(groups), num_c2))
  touched = np.zeros(len(groups), int)
  for s, heads in enumerate(groups):
    kv = heads[0] // g
    s1 = np.mean([_eq1_rows(q[h], c1[kv], n1[kv], set(range(num_c1)), scale) for h in heads], 0)
    surv = {p for p in range(num_c1) if n1[kv, p] > 0 and s1[p] >= t1}
    cand = {l for l in range(num_c2) if parent[kv, l] in surv and n2[kv, l] > 0}
    s2 = np.mean([_eq1_rows(q[h], c2[kv], n2[kv], cand, scale) for h in heads], 0)
    scores[s] = s2
    sel[s] = (s2 > t2) & np.isin(np.arange(num_c2), list(cand))
    touched[s] = num_c1 + len(cand)
  return sel, scores, touched


def make_inputs(rng, hq, hkv, seq_len, num_c1, num_c2, d, dtype, parent_major=False):
  """Random two-level tree; ``parent_major``: level-2 ids numbered parent by parent, else in
  random order (as k-means leaves them)."""
  q = rng.normal(size=(hq, seq_len, d)) * 1.5
  c2 = rng.normal(size=(hkv, num_c2, d))
  parent = rng.integers(0, num_c1, size=(hkv, num_c2))
  if parent_major:
    parent = np.sort(parent, axis=1)
  c1 = np.stack([np.stack([c2[h, parent[h] == p].mean(0) if (parent[h] == p).any()
                           else np.zeros(d) for p in range(num_c1)]) for h in range(hkv)])
  n2 = rng.integers(1, 20, size=(hkv, num_c2))
  n2[rng.random((hkv, num_c2)) < 0.15] = 0
  n1 = np.stack([[n2[h, parent[h] == p].sum() for p in range(num_c1)] for h in range(hkv)])
  j = lambda x, t: jnp.asarray(x, t)
  return (j(q, dtype), j(c1, dtype), j(n1, jnp.int32), j(c2, dtype), j(n2, jnp.int32),
          j(parent, jnp.int32))


def thresholds(q, c1, n1, vote, scale):
  _, s1 = centroid_lookup_reference(q, c1, n1, 0.0, scale=scale, vote=vote)
  s1 = np.unique(np.asarray(s1)[np.asarray(s1) > 0])
  # T1 in the widest gap between adjacent level-1 scores near the median, so that
  # rounding differences cannot flip a level-1 survivor.
  mid = len(s1) // 2
  lo, hi = max(0, mid - 3), min(len(s1) - 1, mid + 3)
  k = lo + int(np.argmax(np.diff(s1[lo:hi + 1]))) if hi > lo else 0
  t1 = (s1[k] + s1[k + 1]) / 2 if hi > lo else -1.0
  return np.float32(t1), np.float32(0.5 / c1.shape[1] / 4)


CASES = [  # hq, hkv, T, C1, C2, d, dtype, vote, prefill, parent-major level 2
    (8, 2, 21, 13, 90, 64, jnp.float32, "kv", True, False),
    (8, 2, 21, 13, 90, 64, jnp.bfloat16, "q", True, True),
    (8, 2, 1, 13, 90, 64, jnp.float32, "q", False, False),
    (4, 4, 6, 7, 40, 128, jnp.bfloat16, "kv", False, True),
    (4, 1, 37, 9, 133, 48, jnp.float32, "kv", True, True),
    (8, 2, 1, 21, 150, 32, jnp.bfloat16, "kv", False, True),   # decode, group vote over 4 heads
]


@pytest.mark.parametrize("hq,hkv,seq_len,num_c1,num_c2,d,dtype,vote,prefill,major", CASES)
def test_interpret_matches_reference(rng, prefill, hq, hkv, seq_len, num_c1, num_c2, d, dtype,
                                     vote, major):
  q, c1, n1, c2, n2, parent = make_inputs(rng, hq, hkv, seq_len, num_c1, num_c2, d, dtype, major)
  if not prefill:
    q = q[:, 0]
  scale = d ** -0.5
  t1, t2 = thresholds(q, c1, n1, vote, scale)
  f = hierarchical_lookup_prefill if prefill else hierarchical_lookup_decode
  args = (q, c1, n1, c2, n2, parent, t1, t2)
  sel, sc, nt = f(*args, scale=scale, vote=vote, backend="interpret",
                  config=CentroidLookupConfig(block_c=16, block_t=16))
  rsel, rsc, rnt = hierarchical_lookup_reference(*args, scale=scale, vote=vote)
  hs = hkv if vote == "kv" else hq
  assert sel.shape == sc.shape == (hs, num_c2) and nt.shape == (hs,) and nt.dtype == jnp.int32
  assert np.isfinite(np.asarray(sc)).all()
  # Level-1 survivors could flip only for scores at T1 within rounding: check they agree.
  np.testing.assert_array_equal(nt, rnt)
  np.testing.assert_allclose(sc, rsc, rtol=3e-5, atol=1e-7)
  far = np.abs(np.asarray(rsc) - t2) > 1e-5 * float(np.max(rsc))
  np.testing.assert_array_equal(np.asarray(sel)[far], np.asarray(rsel)[far])
  assert (np.asarray(nt) < num_c1 + num_c2).all()               # the point: fewer centroids


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_reference_matches_bruteforce(rng, vote):
  q, c1, n1, c2, n2, parent = make_inputs(rng, 6, 2, 5, 6, 30, 16, jnp.float32)
  t1, t2 = thresholds(q, c1, n1, vote, 0.3)
  sel, sc, nt = hierarchical_lookup_reference(q, c1, n1, c2, n2, parent, t1, t2, scale=0.3,
                                              vote=vote)
  bsel, bsc, bnt = brute_hierarchical(q, c1, n1, c2, n2, parent, t1, t2, 0.3, vote)
  np.testing.assert_array_equal(nt, bnt)
  np.testing.assert_allclose(sc, bsc, rtol=1e-5, atol=1e-8)
  far = np.abs(bsc - t2) > 1e-6
  np.testing.assert_array_equal(np.asarray(sel)[far], bsel[far])


def test_no_pruning_equals_one_level_lookup(rng):
  """T1 below every score: Eq. 3 over all level-2 clusters is Eq. 1."""
  q, c1, n1, c2, n2, parent = make_inputs(rng, 8, 2, 4, 5, 50, 32, jnp.float32)
  for backend in ("interpret", "reference"):
    sel, sc, nt = hierarchical_lookup_prefill(q, c1, n1, c2, n2, parent, -1.0, 0.01, scale=0.2,
                                              backend=backend)
    _, osc = centroid_lookup_reference(q, c2, n2, 0.01, scale=0.2)
    np.testing.assert_allclose(sc, osc, rtol=3e-5, atol=1e-8)
    np.testing.assert_array_equal(nt, 5 + np.sum(np.asarray(n2) > 0, axis=1))   # empty: not read


def test_everything_pruned(rng):
  q, c1, n1, c2, n2, parent = make_inputs(rng, 4, 2, 3, 4, 20, 16, jnp.float32)
  for backend in ("interpret", "reference"):
    sel, sc, nt = hierarchical_lookup_decode(q[:, 0], c1, n1, c2, n2, parent, 2.0, -1.0,
                                             scale=0.2, backend=backend)
    assert not np.asarray(sel).any()
    np.testing.assert_array_equal(sc, 0.0)
    np.testing.assert_array_equal(nt, 4)


@pytest.mark.parametrize("prefill", [True, False])
def test_parent_major_numbering_gives_the_same_selection(rng, prefill):
  """Renumbering level 2 parent by parent permutes the outputs and nothing else; orphans
  (parent -1 or >= C1) are never candidates."""
  q, c1, n1, c2, n2, parent = make_inputs(rng, 8, 2, 7, 6, 150, 32, jnp.float32)
  parent = parent.at[0, :5].set(-1).at[1, 7:9].set(6)       # orphans
  if not prefill:
    q = q[:, 0]
  t1, t2 = thresholds(q, c1, n1, "kv", 0.2)
  cfg = CentroidLookupConfig(block_c=16, block_t=16)
  f = hierarchical_lookup_prefill if prefill else hierarchical_lookup_decode
  sel, sc, nt = f(q, c1, n1, c2, n2, parent, t1, t2, scale=0.2, backend="interpret", config=cfg)
  order = jnp.argsort(parent, axis=1, stable=True)
  take = lambda x: jnp.take_along_axis(x, order[..., None] if x.ndim == 3 else order, axis=1)  # noqa: E731
  pm = [take(x) for x in (c2, n2, parent)]
  assert (np.diff(np.asarray(pm[2]), axis=1) >= 0).all()
  psel, psc, pnt = f(q, c1, n1, *pm, t1, t2, scale=0.2, backend="interpret", config=cfg)
  np.testing.assert_array_equal(pnt, nt)
  np.testing.assert_allclose(psc, take(sc), rtol=3e-5, atol=1e-8)
  np.testing.assert_array_equal(psel, take(sel))
  _, rsc, rnt = hierarchical_lookup_reference(q, c1, n1, *pm, t1, t2, scale=0.2)
  np.testing.assert_allclose(psc, rsc, rtol=3e-5, atol=1e-8)
  np.testing.assert_array_equal(pnt, rnt)
  assert not np.asarray(sc)[0, :5].any() and not np.asarray(sc)[1, 7:9].any()


def test_scores_expose_both_levels(rng):
  """``hierarchical_scores`` (what sqjax dispatches to) returns Eq. 2 scores and the
  candidate mask as the reference does."""
  q, c1, n1, c2, n2, parent = make_inputs(rng, 6, 3, 4, 5, 40, 16, jnp.float32, parent_major=True)
  t1, _ = thresholds(q, c1, n1, "q", 0.3)
  got = hierarchical_scores(q, c1, n1, c2, n2, parent, t1, scale=0.3, vote="q", backend="interpret",
                            config=CentroidLookupConfig(block_c=16, block_t=16))
  ref = hierarchical_scores(q, c1, n1, c2, n2, parent, t1, scale=0.3, vote="q", backend="reference")
  for a, b in zip(got, ref):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=3e-5, atol=1e-8)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 3]), seq_len=st.integers(1, 9),
       num_c1=st.integers(1, 8), num_c2=st.integers(1, 40), vote=st.sampled_from(["kv", "q"]),
       seed=st.integers(0, 2**31 - 1))
def test_property_random_shapes(hkv, g, seq_len, num_c1, num_c2, vote, seed):
  rng = np.random.default_rng(seed)
  q, c1, n1, c2, n2, parent = make_inputs(rng, hkv * g, hkv, seq_len, num_c1, num_c2, 16,
                                          jnp.float32)
  t1 = np.float32(0.5 / num_c1 / 10)
  args = (q, c1, n1, c2, n2, parent, t1, np.float32(0.0))
  _, sc, nt = hierarchical_lookup_prefill(*args, scale=0.2, vote=vote, backend="interpret")
  _, rsc, rnt = hierarchical_lookup_reference(*args, scale=0.2, vote=vote)
  np.testing.assert_array_equal(nt, rnt)
  np.testing.assert_allclose(sc, rsc, rtol=3e-5, atol=1e-7)


def test_validation_errors(rng):
  q, c1, n1, c2, n2, parent = make_inputs(rng, 4, 2, 3, 4, 20, 16, jnp.float32)
  with pytest.raises(ValueError, match=r"parent \[Hkv, C2\].*parent\(2, 19\)"):
    hierarchical_lookup_prefill(q, c1, n1, c2, n2, parent[:, :19], 0.0, 0.0, scale=1.0)
  with pytest.raises(ValueError, match="q must be"):
    hierarchical_lookup_decode(q, c1, n1, c2, n2, parent, 0.0, 0.0, scale=1.0)
  with pytest.raises(ValueError, match="t2"):
    hierarchical_lookup_decode(q[:, 0], c1, n1, c2, n2, parent, 0.0, jnp.zeros(3), scale=1.0)
  with pytest.raises(ValueError, match="int32"):
    hierarchical_lookup_decode(q[:, 0], c1, n1, c2, n2, parent.astype(jnp.float32), 0.0, 0.0,
                               scale=1.0)


@pytest.mark.parametrize("blocks,unroll", [(2, False), (3, True), (4, False)])
def test_decode_level2_blocks_per_program(rng, blocks, unroll):
  """Several level-2 blocks per program (a loop, or written out; the block count is padded
  up to a multiple) give the one-block-per-program result."""
  q, c1, n1, c2, n2, parent = make_inputs(rng, 8, 2, 1, 11, 150, 32, jnp.float32, parent_major=True)
  q = q[:, 0]
  t1, t2 = thresholds(q, c1, n1, "kv", 0.2)
  base = CentroidLookupConfig(block_c=16)
  want = hierarchical_lookup_decode(q, c1, n1, c2, n2, parent, t1, t2, scale=0.2, backend="interpret",
                                    config=base)
  got = hierarchical_lookup_decode(q, c1, n1, c2, n2, parent, t1, t2, scale=0.2, backend="interpret",
                                   config=CentroidLookupConfig(block_c=16, level2_blocks=blocks,
                                                               level2_unroll=unroll))
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-9)
  np.testing.assert_array_equal(got[2], want[2])
  _, rsc, _ = hierarchical_lookup_reference(q, c1, n1, c2, n2, parent, t1, t2, scale=0.2)
  np.testing.assert_allclose(got[1], rsc, rtol=3e-5, atol=1e-8)


@pytest.mark.parametrize("stats_splits", [1, 3])
def test_prefill_statistics_splits(rng, stats_splits):
  """The level-2 statistics pass over the compacted candidates shared by several programs
  per (token block, head) (their max / denominator combined after) gives the reference."""
  q, c1, n1, c2, n2, parent = make_inputs(rng, 8, 2, 19, 9, 140, 32, jnp.float32, parent_major=True)
  t1, t2 = thresholds(q, c1, n1, "kv", 0.2)
  cfg = CentroidLookupConfig(block_c=16, block_t=16, stats_splits=stats_splits)
  _, sc, nt = hierarchical_lookup_prefill(q, c1, n1, c2, n2, parent, t1, t2, scale=0.2, backend="interpret",
                                          config=cfg)
  _, rsc, rnt = hierarchical_lookup_reference(q, c1, n1, c2, n2, parent, t1, t2, scale=0.2)
  np.testing.assert_array_equal(nt, rnt)
  np.testing.assert_allclose(sc, rsc, rtol=3e-5, atol=1e-8)


@pytest.mark.parametrize("vote", ["kv", "q"])
@pytest.mark.parametrize("pad", [0, 9, 21])
def test_prefill_mean_over_valid_tokens(rng, vote, pad):
  """Left padding (q_valid): both levels average over the real tokens only -- the kernels equal
  the reference, which equals the lookup of the block without its padding rows."""
  hq, hkv, seq_len, num_c1, num_c2, d = 8, 2, 21, 13, 90, 64
  q, c1, n1, c2, n2, parent = make_inputs(rng, hq, hkv, seq_len, num_c1, num_c2, d, jnp.float32)
  q = q.at[:, :pad].set(jnp.asarray(rng.normal(size=(hq, pad, d)) * 40.0, q.dtype))
  q_valid = jnp.arange(seq_len) >= pad
  scale = d ** -0.5
  real = q[:, pad:] if pad < seq_len else q[:, :1]
  t1, t2 = thresholds(real, c1, n1, vote, scale)
  args = (q, c1, n1, c2, n2, parent, t1, t2)
  rsel, rsc, rnt = hierarchical_lookup_reference(*args, scale=scale, vote=vote, q_valid=q_valid)
  if pad < seq_len:
    asel, asc, ant = hierarchical_lookup_reference(real, *args[1:], scale=scale, vote=vote)
    np.testing.assert_array_equal(rnt, ant)
    np.testing.assert_allclose(rsc, asc, rtol=1e-5, atol=1e-8)
  else:  # no real token: every score is 0, nothing survives level 1 unless T1 <= 0
    assert not np.asarray(rsc).any()
  sel, sc, nt = hierarchical_lookup_prefill(*args, scale=scale, vote=vote, backend="interpret",
                                            config=CentroidLookupConfig(block_c=16, block_t=16), q_valid=q_valid)
  assert np.isfinite(np.asarray(sc)).all()
  np.testing.assert_array_equal(nt, rnt)
  np.testing.assert_allclose(sc, rsc, rtol=3e-5, atol=1e-7)


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_prefill_int8_logits_match_reference_over_quantized_inputs(rng, vote):
  """prefill_int8 in both levels (q quantized once for both; the level-2 centroids per KV head before the
  candidates are gathered, the scale the reference takes over the same rows): the reference over the quantized q, c1, c2 gives the same candidates, scores and
  selection; backend="reference" with the config computes exactly that; decode ignores the option."""
  from pallas_kernels.centroid_lookup import quantized_inputs
  q, c1, n1, c2, n2, parent = make_inputs(rng, 8, 2, 21, 13, 90, 64, jnp.bfloat16)
  scale = 64 ** -0.5
  qd, c1d, c2d = quantized_inputs(q, c1, c2)
  t1, t2 = thresholds(qd, c1d, n1, vote, scale)
  cfg = CentroidLookupConfig(block_c=16, block_t=16, prefill_int8="cvt", stats_anchor="rows")
  rsel, rsc, rnt = hierarchical_lookup_reference(qd, c1d, n1, c2d, n2, parent, t1, t2, scale=scale, vote=vote)
  for backend, tol in (("interpret", 3e-5), ("reference", 1e-6)):
    sel, sc, nt = hierarchical_lookup_prefill(q, c1, n1, c2, n2, parent, t1, t2, scale=scale, vote=vote,
                                              backend=backend, config=cfg)
    np.testing.assert_array_equal(nt, rnt)
    np.testing.assert_allclose(sc, rsc, rtol=tol, atol=1e-7)
    far = np.abs(np.asarray(rsc) - t2) > 1e-5 * float(np.max(rsc))
    np.testing.assert_array_equal(np.asarray(sel)[far], np.asarray(rsel)[far])
  dec = [hierarchical_lookup_decode(q[:, 0], c1, n1, c2, n2, parent, t1, t2, scale=scale, vote=vote,
                                    backend="reference", config=c) for c in (cfg, None)]
  for a, b in zip(*dec):
    np.testing.assert_array_equal(a, b)
