"""QUEST page scores, selection and page-sparse decode: interpret vs reference vs numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quest import (AttentionConfig, QuestScoreConfig, quest_decode_attention,
                                  quest_decode_attention_reference, quest_page_minmax,
                                  quest_page_scores, quest_page_scores_reference, quest_select)

def brute_minmax(k, page):
  k = np.asarray(k, np.float64)
  hkv, num_l, d = k.shape
  num_p = -(-num_l // page)
  mn = np.zeros((hkv, num_p, d))
  mx = np.zeros((hkv, num_p, d))
  for h in range(hkv):
    for p in range(num_p):
      rows = k[h, p * page:min(num_l, (p + 1) * page)]
      mn[h, p], mx[h, p] = rows.min(0), rows.max(0)
  return mn, mx


def brute_scores(q, mn, mx, vote):
  q, mn, mx = (np.asarray(x, np.float64) for x in (q, mn, mx))
  hq, d = q.shape
  hkv, num_p, _ = mn.shape
  g = hq // hkv
  u = np.zeros((hq, num_p))
  for h in range(hq):
    for p in range(num_p):
      u[h, p] = sum(max(q[h, c] * mx[h // g, p, c], q[h, c] * mn[h // g, p, c]) for c in range(d))
  return u.reshape(hkv, g, num_p).max(1) if vote == "kv" else u


def brute_page_attention(q, k, v, page_idx, k_new, v_new, q_pos, kv_pos, scale, page):
  q, k, v, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k, v, k_new, v_new))
  page_idx, q_pos, kv_pos = map(np.asarray, (page_idx, q_pos, kv_pos))
  hq, d = q.shape
  hkv, num_l, _ = k.shape
  hs = page_idx.shape[0]
  num_p = -(-num_l // page)
  o = np.zeros((hq, d))
  for h in range(hq):
    kv, s = h // (hq // hkv), h // (hq // hs)
    keys, vals = [], []
    for p in page_idx[s]:
      if 0 <= p < num_p:
        for row in range(p * page, min(num_l, (p + 1) * page)):
          keys.append(k[kv, row])
          vals.append(v[kv, row])
    for j in range(k_new.shape[1]):
      if 0 <= kv_pos[j] <= q_pos[0]:
        keys.append(k_new[kv, j])
        vals.append(v_new[kv, j])
    if keys:
      lg = scale * np.array([q[h] @ x for x in keys])
      w = np.exp(lg - lg.max())
      o[h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
  return o


def test_minmax_ragged_last_page(rng):
  k = jnp.asarray(rng.normal(size=(2, 37, 8)), jnp.float32)
  mn, mx = quest_page_minmax(k, 16)
  bmn, bmx = brute_minmax(k, 16)
  assert mn.shape == (2, 3, 8)
  np.testing.assert_allclose(mn, bmn)
  np.testing.assert_allclose(mx, bmx)


@pytest.mark.parametrize("vote,dtype,hq,hkv,d", [("kv", jnp.float32, 8, 2, 64),
                                                 ("q", jnp.bfloat16, 8, 2, 64),
                                                 ("kv", jnp.bfloat16, 4, 4, 128)])
def test_page_scores(rng, vote, dtype, hq, hkv, d):
  k = jnp.asarray(rng.normal(size=(hkv, 16 * 21 + 5, d)), dtype)
  q = jnp.asarray(rng.normal(size=(hq, d)), dtype)
  mn, mx = quest_page_minmax(k)
  out = quest_page_scores(q, mn, mx, vote=vote, backend="interpret",
                          config=QuestScoreConfig(block_p=16))
  ref = quest_page_scores_reference(q, mn, mx, vote=vote)
  assert out.shape == (hkv if vote == "kv" else hq, 22) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ref, brute_scores(q, mn, mx, vote), rtol=1e-5, atol=1e-4)


def test_page_score_is_an_upper_bound(rng):
  k = jnp.asarray(rng.normal(size=(2, 50, 16)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
  mn, mx = quest_page_minmax(k)
  u = np.asarray(quest_page_scores(q, mn, mx, vote="q", backend="interpret"))
  qk = np.einsum("hd,hld->hl", np.asarray(q), np.repeat(np.asarray(k), 2, axis=0))
  for p in range(4):
    assert (u[:, p] >= qk[:, p * 16:(p + 1) * 16].max(1) - 1e-5).all()


def test_select_topk_with_forced_page(rng):
  scores = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)
  idx = np.asarray(quest_select(scores, 4, force_page=9))
  s = np.asarray(scores)
  for h in range(3):
    assert 9 in idx[h] and len(set(idx[h].tolist())) == 4 and (np.diff(idx[h]) > 0).all()
    others = sorted(p for p in idx[h] if p != 9)
    assert others == sorted(
        [p for p in np.argsort(-s[h]) if p != 9][:3])
  idx = np.asarray(quest_select(scores, 12, force_page=-1))       # K > P: padded with -1
  assert (idx[:, 10:] == -1).all() and sorted(idx[0, :10].tolist()) == list(range(10))


CASES = [  # hq, hkv, hs, L, S, K, d, dtype
    (8, 2, 2, 16 * 9 + 7, 11, 4, 64, jnp.float32),
    (8, 2, 8, 16 * 9 + 7, 11, 4, 64, jnp.bfloat16),
    (4, 4, 4, 16 * 5, 0, 3, 128, jnp.bfloat16),
]


@pytest.mark.parametrize("hq,hkv,hs,num_l,num_s,kk,d,dtype", CASES)
def test_page_sparse_decode(rng, hq, hkv, hs, num_l, num_s, kk, d, dtype):
  q = jnp.asarray(rng.normal(size=(hq, d)), dtype)
  k = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  v = jnp.asarray(rng.normal(size=(hkv, num_l, d)), dtype)
  num_p = -(-num_l // 16)
  pages = np.stack([rng.choice(num_p, size=kk, replace=False) for _ in range(hs)])
  pages[0, 0] = num_p - 1                                         # ragged last page
  pages[-1, -1] = -1                                              # padding entry
  if hs > 1:
    pages[1, 1] = pages[1, 0]                                     # duplicate: attended twice
  k_new = jnp.asarray(rng.normal(size=(hkv, num_s, d)), dtype)
  v_new = jnp.asarray(rng.normal(size=(hkv, num_s, d)), dtype)
  kv_pos = np.where(rng.random(num_s) < 0.3, -1, num_l + np.arange(num_s))
  args = (q, k, v, jnp.asarray(pages, jnp.int32), k_new, v_new,
          jnp.asarray([num_l + num_s], jnp.int32), jnp.asarray(kv_pos, jnp.int32))
  out, lse = quest_decode_attention(*args, scale=d ** -0.5, return_lse=True, backend="interpret",
                                    config=AttentionConfig(block_rows=16, block_k=16, chunk_k=32))
  ref, rlse = quest_decode_attention_reference(*args, scale=d ** -0.5, return_lse=True)
  assert out.shape == (hq, d) and out.dtype == dtype and lse.shape == (hq,)
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
  np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
  bo = brute_page_attention(*args, scale=d ** -0.5, page=16)
  np.testing.assert_allclose(np.asarray(ref, np.float32), bo, **tol)


def test_validation_errors(rng):
  q = jnp.zeros((4, 16))
  k = jnp.zeros((2, 40, 16))
  mn, mx = quest_page_minmax(k)
  with pytest.raises(ValueError, match="kmin"):
    quest_page_scores(q, mn[:, :, :8], mx, backend="interpret")
  with pytest.raises(ValueError, match="vote"):
    quest_page_scores(q, mn, mx, vote="max")
  with pytest.raises(ValueError, match="k_pages"):
    quest_select(jnp.zeros((2, 3)), 0)
  with pytest.raises(ValueError, match="page_idx"):
    quest_decode_attention(q, k, k, jnp.zeros((2, 3), jnp.float32), jnp.zeros((2, 0, 16)),
                           jnp.zeros((2, 0, 16)), jnp.zeros(1, jnp.int32),
                           jnp.zeros(0, jnp.int32), scale=1.0)
  with pytest.raises(ValueError, match="block_p"):
    QuestScoreConfig(block_p=12)
