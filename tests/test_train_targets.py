"""train_qclassifier targets: KL loss, attention-mass bucket targets, long-range filtering (CPU, tiny)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from train_qclassifier.data import TrainingSet, sample_query_positions, select_rows
from train_qclassifier.targets import kl_loss, kl_rows, long_range_mask, query_stats


def _np_kl(t, logits):
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        tlogt = np.where(t > 0, t * np.log(np.where(t > 0, t, 1.0)), 0.0)
    return (tlogt - t * logp).sum(-1)


def test_kl_loss_equals_numpy(rng):
    n, C = 37, 11
    t = rng.random((n, C)) ** 3
    t[rng.random((n, C)) < 0.3] = 0.0  # exact zeros: 0 log 0 = 0
    t[:, 0] += 1e-3
    t /= t.sum(-1, keepdims=True)
    logits = 3 * rng.standard_normal((n, C))
    ref_rows = _np_kl(t, logits)
    np.testing.assert_allclose(np.asarray(kl_rows(jnp.asarray(t, jnp.float32), jnp.asarray(logits, jnp.float32))),
                               ref_rows, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(kl_loss(jnp.asarray(t), jnp.asarray(logits))), ref_rows.mean(), rtol=1e-4)
    w = (rng.random(n) < 0.6).astype(np.float32)
    w[0] = 1.0
    np.testing.assert_allclose(float(kl_loss(jnp.asarray(t), jnp.asarray(logits), jnp.asarray(w))),
                               (ref_rows * w).sum() / w.sum(), rtol=1e-4)
    # KL(t || p) >= 0 and == 0 when p = t
    assert np.all(ref_rows > -1e-6)
    assert float(kl_loss(jnp.asarray(t), jnp.log(jnp.asarray(t) + 1e-30))) == pytest.approx(0.0, abs=1e-5)


def _brute(q, k, q_pos, labels, C, n_sink):
    hq, n, d = q.shape
    hkv, T, _ = k.shape
    g = hq // hkv
    P = labels.shape[0]
    dist = np.full((hq, n), -1, np.int64)
    mass = np.zeros((P, hq, n, C))
    counts = np.zeros((P, hkv, n, C), np.int64)
    for h in range(hq):
        for i in range(n):
            t = int(q_pos[i])
            keys = np.arange(n_sink, t + 1)
            if len(keys) == 0:
                continue
            s = k[h // g, keys].astype(np.float64) @ q[h, i].astype(np.float64) / math.sqrt(d)
            dist[h, i] = t - keys[np.argmax(s)]
            a = np.exp(s - s.max())
            a /= a.sum()
            for p in range(P):
                np.add.at(mass[p, h, i], labels[p, h // g, keys], a)
                if h % g == 0:
                    counts[p, h // g, i] = np.bincount(labels[p, h // g, keys], minlength=C)
    return dist, mass, counts


@pytest.mark.parametrize("n_sink", [1, 2])
def test_query_stats_vs_brute_force(rng, n_sink):
    hq, hkv, T, d, C, n, P = 6, 2, 45, 8, 5, 23, 2
    q = rng.standard_normal((hq, n, d)).astype(np.float32) * 2
    k = rng.standard_normal((hkv, T, d)).astype(np.float32) * 2
    q_pos = rng.integers(0, T, n).astype(np.int32)  # unsorted, may include positions < n_sink
    q_pos[:2] = [0, n_sink - 1]
    labels = rng.integers(0, C, (P, hkv, T)).astype(np.int32)
    dist, mass, counts = query_stats(q, k, q_pos, labels, n_buckets=C, n_sink=n_sink, chunk=4, key_block=8,
                                     with_counts=True)
    bd, bm, bc = _brute(q, k, q_pos, labels, C, n_sink)
    np.testing.assert_array_equal(np.asarray(dist), bd)
    np.testing.assert_allclose(np.asarray(mass), bm, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(counts), bc)
    # bucket targets are distributions: rows sum to one wherever a candidate key is visible
    sums = np.asarray(mass).sum(-1)
    visible = q_pos >= n_sink
    np.testing.assert_allclose(sums[..., visible], 1.0, atol=1e-5)
    np.testing.assert_array_equal(sums[..., ~visible], 0.0)
    assert np.all(np.asarray(mass) >= 0)


def test_long_range_filter_keeps_exactly_qualifying_pairs(rng):
    hq, hkv, T, d, C, n = 4, 2, 120, 8, 6, 60
    q = rng.standard_normal((hq, n, d)).astype(np.float32) * 3
    k = rng.standard_normal((hkv, T, d)).astype(np.float32) * 3
    q_pos = np.sort(rng.choice(T, n, replace=False)).astype(np.int32)
    labels = rng.integers(0, C, (1, hkv, T)).astype(np.int32)
    min_d = 25
    dist, mass, _ = query_stats(q, k, q_pos, labels, n_buckets=C, n_sink=1, chunk=16, key_block=32)
    dist, mass = np.asarray(dist), np.asarray(mass[0])
    # brute force: argmax-attention key (sink excluded) more than min_d tokens back
    want = np.zeros((hq, n), bool)
    for h in range(hq):
        for i in range(n):
            t = q_pos[i]
            if t < 1:
                continue
            s = k[h // 2, 1:t + 1] @ q[h, i]
            want[h, i] = t - (1 + np.argmax(s)) > min_d
    np.testing.assert_array_equal(np.asarray(long_range_mask(dist, min_d)), want)
    assert 0 < want.sum() < want.size  # the check is not vacuous
    # select_rows keeps exactly those (head, position) pairs, pooled per KV head
    q_pre = rng.standard_normal((hq, n, d)).astype(np.float32)
    x, t, nv = select_rows(dist, mass, q_pre, n_kv_heads=hkv, min_distance=min_d, rows=10_000,
                           rng=np.random.default_rng(0))
    for kv in range(hkv):
        hs, ps = np.nonzero(want[kv * 2:(kv + 1) * 2])
        assert nv[kv] == len(hs)
        got = {tuple(r) for r in x[kv, :nv[kv]].round(6)}
        exp = {tuple(r) for r in q_pre[kv * 2 + hs, ps].round(6)}
        assert got == exp
        np.testing.assert_array_equal(x[kv, nv[kv]:], 0.0)
        np.testing.assert_allclose(t[kv, :nv[kv]].sum(-1), 1.0, atol=1e-5)
    # with a cap, a subset of the qualifying pairs of the requested size
    x2, _, nv2 = select_rows(dist, mass, q_pre, n_kv_heads=hkv, min_distance=min_d, rows=3,
                             rng=np.random.default_rng(1))
    assert np.all(nv2 == np.minimum(nv, 3))


def test_sampled_positions_can_be_long_range():
    pos = sample_query_positions(1000, 100, min_distance=256, n_sink=1, seed=0)
    assert len(pos) == 100 and pos.min() >= 258 and pos.max() < 1000 and np.all(np.diff(pos) > 0)
    np.testing.assert_array_equal(pos, sample_query_positions(1000, 100, min_distance=256, n_sink=1, seed=0))
    assert len(sample_query_positions(200, 100, min_distance=256, n_sink=1, seed=0)) == 0


def test_batches_are_deterministic_and_from_one_document(rng):
    L, hkv, R, d, C = 2, 2, 7, 4, 3
    docs = 3
    xs = [(np.full((L, hkv, R, d), i) + rng.random((L, hkv, R, d)) * 0.1).astype(np.float32) for i in range(docs)]
    ts = [rng.random((L, hkv, R, C)).astype(np.float32) for _ in range(docs)]
    nvs = [np.array([[7, 3], [0, 5]], np.int32) for _ in range(docs)]
    data = TrainingSet.from_arrays(xs, ts, nvs, batch_queries=5, seed=3)
    seen = set()
    for step in range(6):
        b = data.batch(step)
        b2 = data.batch(step)
        np.testing.assert_array_equal(b["x"], b2["x"])
        assert b["x"].shape == (L * hkv, 5, d) and b["t"].shape == (L * hkv, 5, C)
        assert np.all(np.floor(b["x"]) == b["doc"])  # one prompt per batch
        np.testing.assert_array_equal(b["head_valid"], [True, True, False, True])
        # valid rows only (< n_valid); without replacement when enough rows
        flat_nv = nvs[0].reshape(-1)
        for f in range(L * hkv):
            if flat_nv[f] == 0:
                continue
            src = xs[b["doc"]].reshape(L * hkv, R, d)[f, :flat_nv[f]]
            rows = [int(np.nonzero((src == r).all(-1))[0][0]) for r in b["x"][f]]
            assert len(set(rows)) == min(5, flat_nv[f])
        seen.add(b["doc"])
        if step == 2:
            assert seen == {0, 1, 2}  # every document once per epoch


def test_default_corpus_is_reproducible_and_disjoint():
    import re

    from train_qclassifier.corpus import (DEFAULT_HELDOUT_MODULES, DEFAULT_TRAIN_MODULES, Document, check_disjoint,
                                          pydoc_document)

    doc = pydoc_document("socket")  # its page shows object addresses, which change between processes
    assert not re.search(r"0x[0-9a-fA-F]{6,}", doc.text) and "class socket" in doc.text
    assert not set(DEFAULT_TRAIN_MODULES) & set(DEFAULT_HELDOUT_MODULES)
    assert not {"argparse", "re", "random", "zipfile"} & set(DEFAULT_TRAIN_MODULES)  # the quality harness's docs
    with pytest.raises(ValueError, match="overlap"):
        check_disjoint([Document("a", "same text")], [Document("b", "same text")])
