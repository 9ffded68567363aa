"""The Mosaic GPU prefill lookup passes (``lookup_mosaic``) in GPU interpret mode on the CPU
against the Eq. 1 reference, and the engine through the public lookups.

Not collected by the suite directly: ``test_kernels_lookup_mosaic.test_interpret_cases`` runs this
module in a subprocess with a time limit and a larger XLA CPU thread pool (the interpreter's
warpgroups block on barriers inside callbacks that run on that pool; see that test)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import centroid_lookup as cl
from pallas_kernels import lookup_mosaic as lm
from pallas_kernels.centroid_lookup import centroid_lookup_prefill, centroid_lookup_reference
from pallas_kernels.hierarchical_lookup import hierarchical_lookup_prefill
from test_kernels_centroid_lookup import make_inputs, pick_threshold


def ref_avg(q, cent, counts, n_valid, scale, groups):
  """Eq. 1 averaged over each group's heads and tokens, f64 numpy; rows past n_valid[g] and
  empty clusters take no part (score 0)."""
  q, cent, counts = (np.asarray(x, np.float64) for x in (q, cent, counts))
  hq, seq_len, _ = q.shape
  hkv, num_c, _ = cent.shape
  g, r = hq // hkv, hq // groups
  out = np.zeros((groups, num_c))
  for h in range(hq):
    live = counts[h // g] > 0
    if n_valid is not None:
      live = live & (np.arange(num_c) < int(n_valid[h // r]))
    if not live.any():
      continue
    x = scale * q[h] @ cent[h // g].T                             # [T, C]
    x = np.where(live, x, -np.inf)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    s = e / (e * counts[h // g]).sum(axis=1, keepdims=True)
    out[h // r] += s.sum(axis=0) / (r * seq_len)
  return out


CASES = [  # hq, hkv, T, C, d, groups, bounded, cfg, splits
    (8, 2, 37, 150, 64, 2, False, lm.MosaicLookupConfig(), None),          # GQA 4:1, ragged T, C
    (8, 2, 130, 333, 128, 8, True, lm.MosaicLookupConfig(stages=3), 2),     # vote q groups, bounded
    (4, 4, 70, 600, 128, 4, True,                                            # MHA 1:1, ring wraps
     lm.MosaicLookupConfig(stats_block_c=256, score_block_c=128, score_block_t=64), 1),
]


@pytest.mark.parametrize("hq,hkv,seq_len,num_c,d,groups,bounded,cfg,splits", CASES)
def test_mosaic_passes_match_reference(rng, hq, hkv, seq_len, num_c, d, groups, bounded, cfg, splits):
  q, cent, counts = make_inputs(rng, hq, hkv, seq_len, num_c, d, jnp.bfloat16)
  counts = counts.at[0, :].set(0) if not bounded else counts     # a KV head with nothing: 0, no NaN
  n_valid = None
  if bounded:
    n_valid = jnp.asarray(rng.integers(1, num_c, size=(groups,)), jnp.int32).at[0].set(0)
  got = lm.lookup_prefill_scores_mosaic(q, cent, counts, n_valid, scale=d ** -0.5, groups=groups,
                                        cfg=cfg, splits=splits, interpret=True)
  want = ref_avg(q, cent, counts, None if n_valid is None else np.asarray(n_valid), d ** -0.5, groups)
  got = np.asarray(got)
  assert got.shape == (groups, num_c) and np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7 * want.max())
  if bounded:   # a group bounded at 0 rows scores nothing
    assert not got[0].any()


def test_engine_dispatch_and_hierarchical(rng):
  """prefill_engine='mosaic' runs through the public lookups (interpret) and agrees with the
  Triton passes; the hierarchical prefill's bounded level 2 goes through it too."""
  hq, hkv, seq_len, d = 8, 2, 40, 64
  q, cent, counts = make_inputs(rng, hq, hkv, seq_len, 140, d, jnp.bfloat16)
  mos = dataclasses.replace(cl.DEFAULT_PREFILL, prefill_engine="mosaic")
  _, ref = centroid_lookup_reference(q, cent, counts, 0.0, scale=d ** -0.5, vote="kv")
  thr = pick_threshold(ref)
  sel, sc = centroid_lookup_prefill(q, cent, counts, thr, scale=d ** -0.5, backend="interpret",
                                    config=mos)
  np.testing.assert_allclose(sc, ref, rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(sel), np.asarray(sc) > thr)

  c1, n1 = cent[:, :20], jnp.zeros((hkv, 20), jnp.int32)
  parent = jnp.asarray(rng.integers(0, 20, size=(hkv, 140)), jnp.int32)
  n1 = jax.vmap(lambda p, n: jnp.zeros((20,), jnp.int32).at[p].add(n))(parent, counts)
  args = (q, c1, n1, cent, counts, parent, jnp.float32(0.02), jnp.float32(0.005))
  outs = [hierarchical_lookup_prefill(*args, scale=d ** -0.5, backend="interpret",
                                      config=dataclasses.replace(mos, prefill_engine=e))
          for e in ("triton", "mosaic")]
  np.testing.assert_array_equal(np.asarray(outs[0][2]), np.asarray(outs[1][2]))   # same candidates
  np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=2e-5, atol=1e-7)
