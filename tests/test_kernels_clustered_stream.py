"""The balanced streaming engine of the clustered decode (``ClusteredConfig(engine="balanced")``).

Interpret-mode kernels against the plain-jnp reference and the float64 brute force of
``test_kernels_clustered`` on fresh random inputs (skewed cluster sizes, a cluster ~20x the
others, empty clusters, an exact part, padded new keys, unselected rows poisoned with NaN),
the selection kernel's index lists checked row by row, the engine under the hierarchical and
given-selection paths, the errors, and the Triton lowering at Llama-3-8B shapes.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import clustered_stream as cs
from pallas_kernels._dispatch import pallas_call
from pallas_kernels.clustered_attention import (ClusteredConfig, _score_call, clustered_decode_attention,
                                                clustered_decode_attention_reference,
                                                clustered_decode_selected,
                                                clustered_decode_selected_reference)
from test_kernels_clustered import (BF, HKV, HQ, D, SMALL, _lower, args_of, brute, f64, fake_h100,  # noqa: F401
                                    make_case, poison_unselected, rel, sds, threshold_for)

BAL = dataclasses.replace(SMALL, engine="balanced", select_clusters=16, stream_programs=3)


def _tol(dtype):
  return 2e-5 if dtype == jnp.float32 else 2e-2


# Blocks of 16 / 32 / 64 clusters over 37 (the last block part-empty, or one block for all);
# 3 streaming programs (several tiles each), 7, and 40 (more programs than tiles: empty shares).
@pytest.mark.parametrize("hq,hkv,dtype,select_clusters,stream_programs", [
    (8, 2, jnp.float32, 16, 3),
    (8, 2, jnp.float32, 32, 7),
    (3, 3, jnp.float32, 64, 40),     # 1:1
    (8, 2, BF, 16, 5),
    (8, 1, BF, 32, 2),               # 8:1
])
def test_balanced_matches_reference_and_bruteforce(rng, hq, hkv, dtype, select_clusters, stream_programs):
  scale = 32 ** -0.5
  x, meta = make_case(rng, hq=hq, hkv=hkv, d=32, dtype=dtype)
  thr = threshold_for(x, meta, scale, "kv")
  o_np, sel_np, rows_np = brute(x, thr, scale, "kv")
  x = poison_unselected(x, meta, sel_np)
  args = args_of(x, thr)
  cfg = dataclasses.replace(BAL, select_clusters=select_clusters, stream_programs=stream_programs)
  out, sel, rows = clustered_decode_attention(*args, scale=scale, vote="kv", return_stats=True,
                                              backend="interpret", config=cfg)
  ref = clustered_decode_attention_reference(*args, scale=scale, vote="kv")
  assert out.dtype == x["q"].dtype and out.shape == x["q"].shape
  assert not np.isnan(f64(out)).any()
  np.testing.assert_array_equal(np.asarray(sel), sel_np)
  np.testing.assert_array_equal(np.asarray(rows), rows_np)
  assert rel(out, ref) < _tol(dtype)
  assert rel(out, o_np[:, 0]) < _tol(dtype)


def _select(x, meta, thr, scale, cfg, hkv):
  """Kernel A then the selection kernel alone -> (idx [Hkv, L], n [Hkv, nbp], plans)."""
  p, _, offs, xx, ms, ls = _score_call(x["q"], x["cent"], x["offs"], num_l=meta["num_l"],
                                       num_s=x["kn"].shape[1], scale=scale, vote="kv", cfg=cfg,
                                       backend="interpret")
  sp = cs.StreamPlan.make(p.num_c, p.bcs, cfg)
  idx, n = pallas_call(functools.partial(cs._select_kernel, p=p, sp=sp, return_stats=False),
                       backend="interpret", num_warps=4, num_stages=1, grid=(hkv, sp.nb + 1),
                       out_shape=[jax.ShapeDtypeStruct((hkv * meta["num_l"],), jnp.int32),
                                  jax.ShapeDtypeStruct((hkv, sp.nbp), jnp.int32)],
                       )(jnp.asarray([thr], jnp.float32), offs, xx, ms, ls)
  return np.asarray(idx).reshape(hkv, -1), np.asarray(n), p, sp


def test_selection_kernel_writes_each_blocks_rows_in_order(rng):
  """idx[kv, offsets[b Cs] + i], i < n_b, lists block b's selected rows in row order; the last
  block is the exact part, every row of it."""
  scale = 32 ** -0.5
  x, meta = make_case(rng, hq=8, hkv=2, d=32, num_c=53)
  thr = threshold_for(x, meta, scale, "kv")
  _, sel_np, _ = brute(x, thr, scale, "kv")
  offs = np.asarray(x["offs"])
  idx, n, p, sp = _select(x, meta, thr, scale, BAL, 2)
  assert sp.nb == 4 and sp.cs == 16
  for kv in range(2):
    for b in range(sp.nb + 1):
      first = offs[kv, min(b * sp.cs, p.num_c)]
      if b < sp.nb:
        want = [r for c in range(b * sp.cs, min((b + 1) * sp.cs, p.num_c)) if sel_np[kv, c]
                for r in range(offs[kv, c], offs[kv, c + 1])]
      else:
        want = list(range(offs[kv, -1], meta["num_l"]))
      assert n[kv, b] == len(want)
      np.testing.assert_array_equal(idx[kv, first:first + n[kv, b]], want)


@pytest.mark.parametrize("thr,expect", [(2.0, "exact"), (-1.0, "all")])
def test_nothing_and_everything_selected(rng, thr, expect):
  """Threshold 2: no cluster, the exact part and the new keys still hold the softmax; -1: every
  non-empty cluster (dense over the layout)."""
  scale = 32 ** -0.5
  x, meta = make_case(rng, hq=8, hkv=2, d=32)
  args = args_of(x, thr)
  out, sel, rows = clustered_decode_attention(*args, scale=scale, vote="kv", return_stats=True,
                                              backend="interpret", config=BAL)
  ref, rsel, rrows = clustered_decode_attention_reference(*args, scale=scale, vote="kv", return_stats=True)
  np.testing.assert_array_equal(np.asarray(sel), np.asarray(rsel))
  np.testing.assert_array_equal(np.asarray(rows), np.asarray(rrows))
  if expect == "exact":
    assert not np.asarray(sel).any()
  else:
    np.testing.assert_array_equal(np.asarray(sel), meta["counts"] > 0)
  assert not np.isnan(f64(out)).any() and rel(out, ref) < 2e-5


def test_no_new_keys_and_no_exact_part(rng):
  """S = 0 (no user-input programs) and a layout whose clusters cover every row."""
  scale = 32 ** -0.5
  x, meta = make_case(rng, hq=8, hkv=2, d=32, num_s=0, n_sink=0, n_tail=0, unlabelled=0.0)
  thr = threshold_for(x, meta, scale, "kv")
  args = args_of(x, thr)
  out = clustered_decode_attention(*args, scale=scale, vote="kv", backend="interpret", config=BAL)
  ref = clustered_decode_attention_reference(*args, scale=scale, vote="kv")
  assert rel(out, ref) < 2e-5


def test_selected_and_hierarchical_paths_use_the_engine(rng):
  """The given-selection path (the hierarchical decode's attention) through the engine equals
  the reference and the clusters engine."""
  x, meta = make_case(rng, hq=8, hkv=2, d=32)
  sel = rng.random((2, meta["counts"].shape[1])) < 0.3
  sel[-1] = False
  args = (x["q"], x["k"], x["v"], x["offs"], jnp.asarray(sel), x["kn"], x["vn"], x["qp"], x["kvp"])
  out = clustered_decode_selected(*args, scale=0.2, vote="kv", backend="interpret", config=BAL)
  old = clustered_decode_selected(*args, scale=0.2, vote="kv", backend="interpret", config=SMALL)
  ref = clustered_decode_selected_reference(*args, scale=0.2)
  assert rel(out, ref) < 2e-5 and rel(out, old) < 2e-5


def test_errors(rng):
  x, meta = make_case(rng, hq=8, hkv=2, d=32)
  with pytest.raises(ValueError, match="needs vote='kv'"):
    clustered_decode_attention(*args_of(x, 0.01), scale=0.2, vote="q", backend="interpret", config=BAL)
  with pytest.raises(ValueError, match="engine must be one of"):
    ClusteredConfig(engine="fast")
  with pytest.raises(ValueError, match="select_clusters must be a positive multiple of sub_clusters=128"):
    ClusteredConfig(select_clusters=200)
  with pytest.raises(ValueError, match="stream_programs must be a positive int"):
    ClusteredConfig(stream_programs=0)


@pytest.mark.parametrize("num_l,num_c,num_s,return_stats", [(524288, 26214, 1024, False),
                                                             (131072, 6554, 0, True)])
def test_balanced_lowers(fake_h100, num_l, num_c, num_s, return_stats):
  cfg = ClusteredConfig(engine="balanced")
  _lower(lambda *a: clustered_decode_attention(*a, scale=D ** -0.5, backend="pallas", config=cfg,
                                               return_stats=return_stats),
         sds((HQ, D)), sds((HKV, num_l, D)), sds((HKV, num_l, D)), sds((HKV, num_c, D)),
         sds((HKV, num_c + 1), jnp.int32), sds((), jnp.float32), sds((HKV, num_s, D)),
         sds((HKV, num_s, D)), sds((1,), jnp.int32), sds((num_s,), jnp.int32))
  assert len(fake_h100) == 4                       # scoring + selection + streaming + merge
