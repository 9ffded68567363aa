import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sqjax import squeezed
from sqjax.attention import dense_attention, fixed_context_attention
from sqjax.calibration import global_threshold, key_fraction, key_scores, key_threshold, retrieved_fraction
from sqjax.squeezed import (
    SqueezedConfig, build_squeezed_index, cluster_fixed_context, cluster_layout, cluster_scores, hierarchical_scores, lookup,
    retrieval_mask, retrieve,
)


def np_eq1(q, cent, counts, scale, vote):
    """Brute-force Eq. 1 averaged over tokens, voted. q [Hq,T,d], cent [Hkv,C,d] -> [Hs,C]."""
    hq, hkv = q.shape[0], cent.shape[0]
    g = hq // hkv
    out = np.zeros((hq, cent.shape[1]))
    for h in range(hq):
        c, n = cent[h // g].astype(np.float64), counts[h // g]
        for t in range(q.shape[1]):
            x = scale * c @ q[h, t].astype(np.float64)
            x = np.where(n > 0, x, -np.inf)
            e = np.exp(x - x.max())
            out[h] += np.where(n > 0, e / np.sum(n * e), 0.0)
        out[h] /= q.shape[1]
    return out.reshape(hkv, g, -1).mean(1) if vote == "kv" else out


def np_eq3(q, c1, n1, c2, n2, parent, t1, scale, vote):
    """Brute-force hierarchical scores (Eq. 2 then Eq. 3 over surviving level-2 clusters)."""
    s1 = np_eq1(q, c1, n1, scale, vote)
    hq, hkv = q.shape[0], c2.shape[0]
    g = hq // hkv
    hs = s1.shape[0]
    per = hs // hkv
    out = np.zeros((hq, c2.shape[1]))
    for h in range(hq):
        kv = h // g
        s = h // g if vote == "kv" else h
        alive = (s1[s] >= t1) & (n1[kv] > 0)
        cand = alive[parent[kv]] & (n2[kv] > 0)
        for t in range(q.shape[1]):
            x = scale * c2[kv].astype(np.float64) @ q[h, t].astype(np.float64)
            x = np.where(cand, x, -np.inf)
            if not cand.any():
                continue
            e = np.where(cand, np.exp(x - x[cand].max()), 0)
            out[h] += e / np.sum(n2[kv] * e)
        out[h] /= q.shape[1]
    return out.reshape(hkv, g, -1).mean(1) if vote == "kv" else out


@pytest.mark.parametrize("vote", ["kv", "q"])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (3, 3), (6, 2)])
def test_eq1_matches_numpy(rng, vote, hq, hkv):
    t, c, d = int(rng.integers(1, 7)), int(rng.integers(3, 40)), 16
    q = rng.normal(size=(hq, t, d)).astype(np.float32)
    cent = (2 * rng.normal(size=(hkv, c, d))).astype(np.float32)
    counts = rng.integers(0, 9, size=(hkv, c)).astype(np.int32)
    counts[:, 0] = 0  # an empty cluster scores 0
    got = np.asarray(cluster_scores(jnp.asarray(q), jnp.asarray(cent), jnp.asarray(counts), 0.3, vote))
    want = np_eq1(q, cent, counts, 0.3, vote)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert np.all(got[:, 0] == 0)


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_hierarchical_matches_numpy(rng, vote):
    hq, hkv, t, d, c2, c1 = 4, 2, 3, 8, 30, 6
    q = rng.normal(size=(hq, t, d)).astype(np.float32)
    c2v = rng.normal(size=(hkv, c2, d)).astype(np.float32)
    n2 = rng.integers(1, 6, size=(hkv, c2)).astype(np.int32)
    parent = rng.integers(0, c1, size=(hkv, c2)).astype(np.int32)
    c1v = rng.normal(size=(hkv, c1, d)).astype(np.float32)
    n1 = np.stack([np.bincount(parent[h], weights=n2[h], minlength=c1) for h in range(hkv)]).astype(np.int32)
    t1 = float(rng.uniform(0.0, 0.1))
    got = hierarchical_scores(*(jnp.asarray(a) for a in (q, c1v, n1, c2v, n2, parent)), t1, 0.5, vote)
    want = np_eq3(q, c1v, n1, c2v, n2, parent, t1, 0.5, vote)
    np.testing.assert_allclose(np.asarray(got.scores), want, rtol=1e-5, atol=1e-7)
    n_cand = np.asarray(got.survivors).sum(-1)
    np.testing.assert_array_equal(np.asarray(got.n_touched), c1 + n_cand)


def test_hierarchical_with_zero_level1_threshold_is_one_level(rng):
    hkv, hq, length, d = 2, 4, 900, 16
    k = jnp.asarray(rng.normal(size=(1, hkv, length, d)).astype(np.float32))
    q_obs = jnp.asarray(rng.normal(size=(1, hq, 100, d)).astype(np.float32))
    cfg = SqueezedConfig(hierarchical=True, centroid_fraction=0.05, level1_fraction=0.01)
    idx, _ = build_squeezed_index(k, q_obs, cfg, 0.25)
    li = idx.layer(0)
    q = jnp.asarray(rng.normal(size=(hq, 5, d)).astype(np.float32))
    h = hierarchical_scores(q, li.centroids1, li.counts1, li.centroids, li.counts, li.parent, 0.0, 0.25)
    one = cluster_scores(q, li.centroids, li.counts, 0.25)
    np.testing.assert_allclose(np.asarray(h.scores), np.asarray(one), rtol=1e-5, atol=1e-8)


def test_hierarchical_index_is_consistent(rng):
    """The built 2-level index: labels, counts, perm/offsets, parents and level-1 counts all
    describe the same clusters."""
    hkv, length, d = 2, 1200, 16
    k = jnp.asarray(rng.normal(size=(1, hkv, length, d)).astype(np.float32))
    cfg = SqueezedConfig(hierarchical=True, centroid_fraction=0.05, level1_fraction=0.01, n_obs=40)
    li = jax.tree.map(lambda a: np.asarray(a[0]), cluster_fixed_context(k, cfg))
    c2 = li.centroids.shape[1]
    for h in range(hkv):
        np.testing.assert_array_equal(np.bincount(li.labels[h], minlength=c2), li.counts[h])
        np.testing.assert_array_equal(np.bincount(li.parent[h], weights=li.counts[h], minlength=li.counts1.shape[1]),
                                      li.counts1[h])
        for c in range(c2):  # perm/offsets: the keys labelled c
            got = np.sort(li.perm[h, li.offsets[h, c]:li.offsets[h, c + 1]])
            np.testing.assert_array_equal(got, np.flatnonzero(li.labels[h] == c))
            if li.counts[h, c]:  # a centroid is the mean of its keys
                mean = np.asarray(k[0, h, :length - cfg.n_obs])[li.labels[h] == c].mean(0)
                np.testing.assert_allclose(li.centroids[h, c], mean, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("vote", ["kv", "q"])
@pytest.mark.parametrize("n_tokens", [1, 6])
def test_hierarchical_kernel_dispatch_equals_jnp(rng, vote, n_tokens):
    """On a Pallas backend (here the interpreter) `hierarchical_scores` runs the hierarchical
    lookup kernels; scores, level-1 scores, candidates and centroids read equal the jnp path's."""
    from sqjax import dispatch

    hkv, hq, length, d = 2, 4, 1500, 16
    k = jnp.asarray(rng.normal(size=(1, hkv, length, d)).astype(np.float32))
    q_obs = jnp.asarray(rng.normal(size=(1, hq, 64, d)).astype(np.float32))
    cfg = SqueezedConfig(hierarchical=True, centroid_fraction=0.05, level1_fraction=0.01, n_obs=64, vote=vote)
    idx, _ = build_squeezed_index(k, q_obs, cfg, 0.25)
    li = idx.layer(0)
    q = jnp.asarray(rng.normal(size=(hq, n_tokens, d)).astype(np.float32))
    args = (q, li.centroids1, li.counts1, li.centroids, li.counts, li.parent, idx.threshold1, 0.25, vote)
    with dispatch.using("interpret"):
        got = hierarchical_scores(*args)
    with dispatch.using("reference"):
        want = hierarchical_scores(*args)
    assert 0 < int(np.asarray(want.survivors).sum()) < np.asarray(want.survivors).size  # level 1 prunes
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=3e-5, atol=1e-8)


@pytest.mark.parametrize("vote", ["kv", "q"])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_kernel_dispatch_of_a_padded_block_equals_jnp(rng, vote, hierarchical):
    """A left-padded question block (q_valid) goes to the lookup kernels too (it went to the jnp
    path, which materialised [Hq, T, C] logits on the GPU): same scores as the jnp path, which
    averages over the real tokens only."""
    from sqjax import dispatch

    hkv, hq, length, d, t, pad = 2, 4, 1500, 16, 9, 4
    k = jnp.asarray(rng.normal(size=(1, hkv, length, d)).astype(np.float32))
    q_obs = jnp.asarray(rng.normal(size=(1, hq, 64, d)).astype(np.float32))
    cfg = SqueezedConfig(hierarchical=hierarchical, centroid_fraction=0.05, level1_fraction=0.01, n_obs=64, vote=vote)
    idx, _ = build_squeezed_index(k, q_obs, cfg, 0.25)
    li = idx.layer(0)
    q = jnp.asarray(rng.normal(size=(hq, t, d)).astype(np.float32)).at[:, :pad].multiply(30.0)
    q_valid = jnp.arange(t) >= pad
    if hierarchical:
        run = lambda qq, qv: hierarchical_scores(qq, li.centroids1, li.counts1, li.centroids, li.counts,  # noqa: E731
                                                 li.parent, idx.threshold1, 0.25, vote, qv)
    else:
        run = lambda qq, qv: (cluster_scores(qq, li.centroids, li.counts, 0.25, vote, qv),)  # noqa: E731
    with dispatch.using("interpret"):
        got = run(q, q_valid)
    with dispatch.using("reference"):
        want = run(q, q_valid)
        alone = run(q[:, pad:], None)
    for a, b, c in zip(got, want, alone):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=3e-5, atol=1e-8)
        np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(c, np.float64), rtol=3e-5, atol=1e-8)


def np_retrieve(selected, scores, counts, labels, n_tail, capacity):
    """Brute force: keys of selected clusters, dropping lowest-score clusters when over capacity."""
    lc = labels.shape[0]
    order = sorted([c for c in range(len(selected)) if selected[c]], key=lambda c: -scores[c])
    kept, total, overflow = [], 0, False
    for c in order:
        if total + counts[c] <= capacity - n_tail and not overflow:
            kept.append(c)
            total += counts[c]
        else:
            overflow = True
    keys = set(np.nonzero(np.isin(labels, kept))[0].tolist()) | set(range(lc, lc + n_tail))
    return keys, overflow


@pytest.mark.parametrize("method", ["scan", "scan_unrolled"])   # a CPU's search, an accelerator's
@pytest.mark.parametrize("vote", ["kv", "q"])
def test_retrieve_matches_numpy(rng, monkeypatch, vote, method):
    from sqjax import squeezed

    monkeypatch.setattr(squeezed, "search_method", lambda: method)
    hkv, c, lc, n_tail = 2, 17, 150, 7
    hs = hkv if vote == "kv" else 2 * hkv
    labels = rng.integers(0, c, size=(hkv, lc)).astype(np.int32)
    counts = np.stack([np.bincount(labels[h], minlength=c) for h in range(hkv)]).astype(np.int32)
    perm, offsets = cluster_layout(jnp.asarray(labels), c)
    selected = rng.random((hs, c)) < 0.4
    scores = rng.random((hs, c)).astype(np.float32)
    # no cut possible (never sorted), a cut possible but not needed (cond: unsorted), cuts (sorted)
    for capacity in (n_tail + lc, n_tail + lc - 1, n_tail + 40, n_tail):
        ret = retrieve(jnp.asarray(selected), jnp.asarray(scores), jnp.asarray(counts), perm, offsets, n_tail, capacity)
        for s in range(hs):
            kv = s * hkv // hs
            want, over = np_retrieve(selected[s], scores[s], counts[kv], labels[kv], n_tail, capacity)
            got = np.asarray(ret.idx[s, : int(ret.count[s])])
            assert len(got) == len(set(got.tolist())), "no duplicates"
            assert set(got.tolist()) == want
            assert bool(ret.overflow[s]) == over
            assert np.all(got[:n_tail] == np.arange(lc, lc + n_tail)), "exact tail first"


def test_retrieve_count_needs_no_sort_when_everything_fits(rng):
    """The accounting reads only count and overflow: with a capacity that holds every key they are
    a masked sum (no sort compiled), equal to the sorted path's; with a smaller one the sort stays."""
    hkv, c, lc, n_tail = 2, 17, 150, 7
    labels = rng.integers(0, c, size=(hkv, lc)).astype(np.int32)
    counts = jnp.asarray(np.stack([np.bincount(labels[h], minlength=c) for h in range(hkv)]).astype(np.int32))
    perm, offsets = cluster_layout(jnp.asarray(labels), c)
    sel = jnp.asarray(rng.random((hkv, c)) < 0.4)
    sc = jnp.asarray(rng.random((hkv, c)).astype(np.float32))
    for capacity, sorted_ in ((n_tail + lc, False), (n_tail + lc + 5, False), (n_tail + 40, True)):
        f = jax.jit(lambda s, x, cap=capacity: retrieve(s, x, counts, perm, offsets, n_tail, cap)[1:])
        assert (" sort(" in f.lower(sel, sc).compile().as_text()) == sorted_, capacity
        count, over = f(sel, sc)
        if not sorted_:
            want = n_tail + np.sum(np.where(np.asarray(sel), np.asarray(counts), 0), axis=1)
            np.testing.assert_array_equal(np.asarray(count), want)
            assert not np.any(np.asarray(over))


def _setup(rng, hq=4, hkv=2, length=1200, d=16, hierarchical=False, sparsity=0.9):
    k = jnp.asarray(rng.normal(size=(2, hkv, length, d)).astype(np.float32))
    q_obs = jnp.asarray(rng.normal(size=(2, hq, 100, d)).astype(np.float32))
    cfg = SqueezedConfig(sparsity=sparsity, hierarchical=hierarchical)
    idx, info = build_squeezed_index(k, q_obs, cfg, 1 / math.sqrt(d))
    return k, idx, info


def test_retrieve_everything_reproduces_dense(rng):
    hq, hkv, length, d = 4, 2, 1200, 16
    k, idx, _ = _setup(rng, hq, hkv, length, d)
    v = jnp.asarray(rng.normal(size=(hkv, length, d)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(hq, 6, d)).astype(np.float32))
    ret, _ = lookup(idx.layer(0), q, -1.0, 0.0, scale=0.25, vote="kv", n_tail=100, capacity=length)
    assert np.all(np.asarray(ret.count) == length)
    k_new = jnp.asarray(rng.normal(size=(hkv, 8, d)).astype(np.float32))
    v_new = jnp.asarray(rng.normal(size=(hkv, 8, d)).astype(np.float32))
    q_pos = jnp.arange(6) + length
    kv_pos = jnp.concatenate([jnp.arange(6) + length, -jnp.ones(2, jnp.int32)])
    got = fixed_context_attention(q, k[0], v, retrieval_mask(ret, length)[:, None], k_new, v_new, q_pos, kv_pos, 0.25)
    full_k = jnp.concatenate([k[0], k_new], 1)
    full_v = jnp.concatenate([v, v_new], 1)
    want = dense_attention(q, full_k, full_v, q_pos, jnp.concatenate([jnp.arange(length), kv_pos]), 0.25)
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert rel <= 1e-5


def test_lower_threshold_never_shrinks(rng):
    _, idx, _ = _setup(rng)
    q = jnp.asarray(rng.normal(size=(4, 3, 16)).astype(np.float32))
    prev = None
    for t in np.sort(rng.uniform(0, 0.01, size=6))[::-1]:
        ret, _ = lookup(idx.layer(1), q, float(t), 0.0, scale=0.25, vote="kv", n_tail=100, capacity=1200)
        m = np.asarray(retrieval_mask(ret, 1200))
        if prev is not None:
            assert np.all(m >= prev)
        prev = m


@pytest.mark.parametrize("hierarchical", [False, True])
def test_calibrated_sparsity_on_held_out_queries(rng, hierarchical):
    """Keys and queries from one distribution (clustered directions); blocks of 100 queries."""
    hq, hkv, length, d, n_layers = 4, 2, 2100, 16, 2
    dirs = rng.normal(size=(n_layers, hkv, 24, d))
    lab = rng.integers(0, 24, size=(n_layers, hkv, length))
    k = np.take_along_axis(dirs, lab[..., None], axis=2) + 0.5 * rng.normal(size=(n_layers, hkv, length, d))

    def queries():
        qd = rng.normal(size=(n_layers, hkv, 1, 1, d))
        return (np.repeat(qd, hq // hkv, axis=2).reshape(n_layers, hq, 1, d) + rng.normal(size=(n_layers, hq, 100, d))).astype(np.float32)

    cal = [queries() for _ in range(32)]  # enough blocks that sampling noise stays well under 2 points
    cfg = SqueezedConfig(sparsity=0.8, hierarchical=hierarchical, centroid_fraction=0.05, level1_fraction=0.01)
    scale = 1 / math.sqrt(d)
    # calibrate on several blocks (stacked along the query axis would average them: keep blocks separate)
    idx, _ = build_squeezed_index(jnp.asarray(k.astype(np.float32)), jnp.asarray(cal[0]), cfg, scale)
    per_key = []
    for block in cal:
        for layer in range(n_layers):
            li = idx.layer(layer)
            s, _ = squeezed.layer_scores(li, jnp.asarray(block[layer]), idx.threshold1, scale, "kv")
            per_key.append(key_scores(s, li.labels))
    t = global_threshold(per_key, 0.8)
    fracs = []
    for _ in range(32):
        block = queries()
        for layer in range(n_layers):
            li = idx.layer(layer)
            s, _ = squeezed.layer_scores(li, jnp.asarray(block[layer]), idx.threshold1, scale, "kv")
            fracs.append(float(jnp.mean(key_scores(s, li.labels) > t)))
    assert abs((1 - np.mean(fracs)) - 0.8) <= 0.02


def test_hierarchical_touches_fewer_centroids(rng):
    k, idx, _ = _setup(rng, length=4100, hierarchical=True)
    q = jnp.asarray(rng.normal(size=(4, 1, 16)).astype(np.float32))
    ret, touched = lookup(idx.layer(0), q, idx.threshold, idx.threshold1, scale=0.25, vote="kv", n_tail=100, capacity=idx.capacity)
    assert np.all(np.asarray(touched) < idx.layer(0).centroids.shape[1])


def test_config_errors():
    with pytest.raises(ValueError, match="sparsity"):
        SqueezedConfig(sparsity=1.0)
    with pytest.raises(ValueError, match="sparsity"):
        SqueezedConfig(sparsity=0.0)
    with pytest.raises(ValueError, match="vote"):
        SqueezedConfig(vote="x")
    with pytest.raises(ValueError, match="more centroids than keys"):
        SqueezedConfig(n_centroids=50).n_clusters(40)
    with pytest.raises(ValueError, match=r"not longer than the exact sink \+ tail \(0 \+ 100\)"):
        build_squeezed_index(jnp.zeros((1, 1, 100, 4)), jnp.zeros((1, 1, 100, 4)), SqueezedConfig(), 0.5)
    with pytest.raises(ValueError, match=r"q must have shape \[Hq, T, d\]"):
        cluster_scores(jnp.zeros((2, 4)), jnp.zeros((1, 3, 4)), jnp.ones((1, 3), jnp.int32), 1.0)
    with pytest.raises(ValueError, match="head dim"):
        cluster_scores(jnp.zeros((2, 1, 4)), jnp.zeros((1, 3, 8)), jnp.ones((1, 3), jnp.int32), 1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        cluster_scores(jnp.zeros((3, 1, 4)), jnp.zeros((2, 3, 4)), jnp.ones((2, 3), jnp.int32), 1.0)


def test_weighted_threshold_is_the_per_key_quantile():
    from sqjax.calibration import weighted_threshold

    rng = np.random.default_rng(3)
    hkv, g, c, lc = 2, 3, 40, 500
    labels = rng.integers(0, c, size=(hkv, lc))
    counts = np.stack([np.bincount(labels[h], minlength=c) for h in range(hkv)])
    scores = rng.random((4, hkv * g, c)).astype(np.float32)   # 4 queries, Hs = Hq
    per_key = np.stack([np.asarray(key_scores(jnp.asarray(s), jnp.asarray(labels))) for s in scores])
    for sp in (0.1, 0.5, 0.9, 0.97):
        t = weighted_threshold(scores, counts, sp)
        assert t == pytest.approx(float(np.quantile(per_key, sp, method="inverted_cdf")), abs=0)
        assert np.mean(per_key <= t) >= sp and np.mean(per_key < t) < sp
    with pytest.raises(ValueError, match="multiple of Hkv"):
        weighted_threshold(scores[:, :5], counts, 0.9)
    with pytest.raises(ValueError, match="every cluster is empty"):
        weighted_threshold(scores, np.zeros_like(counts), 0.9)


@pytest.mark.parametrize("hierarchical", [False, True])
def test_token_calibration_is_the_single_query_quantile(rng, hierarchical):
    """decode_calibration="token": T (and T1) are App. C's quantiles with each observation query a
    block of its own (brute force over keys); App. C's pair is unchanged; one-token blocks select
    with the decode pair, longer blocks with App. C's; a decode query keeps ~1 − sparsity."""
    hq, hkv, length, d, n_layers, n_obs = 4, 2, 1500, 16, 2, 24
    dirs = rng.normal(size=(n_layers, hkv, 16, d))
    lab = rng.integers(0, 16, size=(n_layers, hkv, length))
    k = jnp.asarray((np.take_along_axis(dirs, lab[..., None], axis=2)
                     + 0.5 * rng.normal(size=(n_layers, hkv, length, d))).astype(np.float32))
    q_obs = jnp.asarray((2 * rng.normal(size=(n_layers, hq, n_obs, d))).astype(np.float32))
    base = dict(sparsity=0.8, hierarchical=hierarchical, centroid_fraction=0.05, level1_fraction=0.01,
                n_obs=n_obs, kmeans_iters=5)
    scale = 1 / math.sqrt(d)
    idx, info = build_squeezed_index(k, q_obs, SqueezedConfig(**base, decode_calibration="token"), scale)
    win, _ = build_squeezed_index(k, q_obs, SqueezedConfig(**base), scale)
    assert win.threshold_decode is None and win.thresholds(1) == (win.threshold, win.threshold1)
    assert float(idx.threshold) == float(win.threshold) and float(idx.threshold1) == float(win.threshold1)
    per = [idx.layer(i) for i in range(n_layers)]
    t1 = 0.0
    if hierarchical:
        lvl1 = [key_scores(jnp.take_along_axis(cluster_scores(q_obs[i][:, j:j + 1], li.centroids1, li.counts1, scale),
                                               li.parent, axis=-1), li.labels)
                for i, li in enumerate(per) for j in range(n_obs)]
        t1 = global_threshold(lvl1, 0.5)
    def keys_at(t1):  # every single query's key scores under T1
        return [key_scores(squeezed.layer_scores(li, q_obs[i][:, j:j + 1], t1, scale, "kv")[0], li.labels)
                for i, li in enumerate(per) for j in range(n_obs)]

    keys = keys_at(t1)
    t = global_threshold(keys, 0.8)
    assert info["threshold_decode"] == pytest.approx(t, rel=1e-6)
    assert info["threshold1_decode"] == pytest.approx(t1, rel=1e-6)
    assert info["decode_calibration_queries"] == n_obs
    kept = np.mean([float(jnp.mean(x > t)) for x in keys])
    # what single queries read at App. C's pair (the decode budget without decode thresholds)
    want = np.mean([float(jnp.mean(x > idx.threshold)) for x in keys_at(idx.threshold1)])
    assert np.mean(np.asarray(info["decode_retrieved_fraction_app_c"])) == pytest.approx(want, abs=1e-6)
    assert abs(kept - 0.2) < 0.01 and np.mean(np.asarray(info["decode_retrieved_fraction"])) == pytest.approx(kept, abs=1e-6)
    assert idx.thresholds(1) == (idx.threshold_decode, idx.threshold1_decode)
    assert idx.thresholds(7) == (idx.threshold, idx.threshold1)
    # the capacity holds what either phase retrieved on calibration
    lc = length - n_obs
    top = max(float(np.max(np.asarray(info["decode_retrieved_fraction"]))),
              float(np.max(np.asarray(info["calibrated_retrieved_fraction"]))))
    assert idx.capacity >= n_obs + top * lc
    args = (per, q_obs, SqueezedConfig(**base, decode_calibration="token"), scale)
    if hierarchical:  # a given T1 replaces its quantile; T is the quantile under it
        t_at, t1_at = squeezed.token_thresholds(*args, t1=1.5 * t1)[:2]
        assert t1_at == 1.5 * t1 and t_at == pytest.approx(global_threshold(keys_at(1.5 * t1), 0.8), rel=1e-6)
    else:
        with pytest.raises(ValueError, match="1-level index"):
            squeezed.token_thresholds(*args, t1=0.1)


def test_token_queries_are_evenly_spaced_under_the_pool(monkeypatch):
    assert squeezed.token_queries(100, 10) == list(range(100))
    monkeypatch.setattr(squeezed, "_TOKEN_POOL", 250)
    cols = squeezed.token_queries(100, 10)   # 25 queries of 10 scores each
    assert len(cols) == 25 and cols[0] == 0 and cols[-1] == 99 and cols == sorted(set(cols))
    assert squeezed.token_queries(100, 10_000) == [0]
    with pytest.raises(ValueError, match="decode_calibration"):
        SqueezedConfig(decode_calibration="tokens")


def test_weighted_quantile_bracketed_path_equals_the_full_sort(monkeypatch):
    """Large inputs sort only a bracket found from a sample; the result is the full sort's, ties,
    zero weights and the extreme quantiles included."""
    from sqjax import calibration

    rng = np.random.default_rng(11)
    n = 40_000
    for trial in range(4):
        v = rng.standard_normal(n).astype(np.float32)
        if trial % 2:
            v = np.round(v, 1).astype(np.float32)   # heavy ties
        w = rng.integers(0, 30, size=n)
        qs = (0.0, 0.3, 0.9, 0.999, 1.0)
        want = [calibration.weighted_quantile(v, w, q) for q in qs]
        monkeypatch.setattr(calibration, "_FULL_SORT", 1000)
        got = [calibration.weighted_quantile(v, w, q) for q in qs]
        monkeypatch.setattr(calibration, "_FULL_SORT", 1 << 21)
        assert got == want
        assert want[2] == float(np.quantile(np.repeat(v, w), 0.9, method="linear"))


def test_weighted_quantile_of_f32_values_interpolates_in_f32_as_numpy_does():
    """numpy 2 interpolates f32 values in f32 (a Python-float q promotes weakly); interpolating in
    f64 differed in the last bits in 341 of 3000 draws like these (~1 in 9)."""
    from sqjax.calibration import weighted_quantile

    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 4000))
        v = rng.random(n).astype(np.float32)
        w = rng.integers(0, 9, n)
        w[0] = 1
        q = float(rng.choice([0.0, 0.5, 0.8, 0.9, 0.97, 0.999, 1.0]))
        assert weighted_quantile(v, w, q) == float(np.quantile(np.repeat(v, w), q, method="linear"))


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_key_threshold_equals_the_per_key_quantile(rng, vote):
    """App. C's threshold and kept fractions from cluster scores weighted by counts equal those of
    the per-key scores (`key_scores`), bit for bit: several layers, GQA, empty clusters, ties."""
    hkv, g, c, lc = 2, 3, 40, 997
    hs = hkv * g if vote == "q" else hkv
    scores, counts, per_key = [], [], []
    for layer in range(3):
        labels = rng.integers(0, c - 5, size=(hkv, lc)).astype(np.int32)   # the last 5 clusters empty
        n = np.stack([np.bincount(lab, minlength=c) for lab in labels]).astype(np.int32)
        s = rng.random((hs, c)).astype(np.float32)
        s[:, ::7] = s[:, :1]                                                  # ties across clusters
        scores.append(jnp.asarray(s))
        counts.append(jnp.asarray(n))
        per_key.append(key_scores(jnp.asarray(s), jnp.asarray(labels)))
    for sparsity in (0.5, 0.8, 0.9, 0.97):
        t = key_threshold(scores, counts, sparsity)
        assert t == global_threshold(per_key, sparsity)
        for s, n, p in zip(scores, counts, per_key):
            np.testing.assert_array_equal(np.asarray(key_fraction(s, n, t)), np.asarray(retrieved_fraction(p, t)))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        key_threshold(jnp.zeros((3, c)), jnp.ones((2, c), jnp.int32), 0.9)


@pytest.mark.parametrize("hierarchical", [False, True])
def test_lookup_int8_rounds_blocks_like_the_kernels(rng, hierarchical):
    """`SqueezedConfig.lookup_int8`: a block's lookup scores the int8-rounded q and centroids on the jnp path
    (what `pallas_kernels.centroid_lookup.quantized_inputs` gives) and through the kernels (here the
    interpreter) alike; the calibration's threshold is the quantile of those scores; a decode query (one
    token) is not rounded; the method carries the option into its config and label."""
    from pallas_kernels.centroid_lookup import quantized_inputs
    from sqjax import dispatch
    from sqjax.methods import HierarchicalSqueezed, Squeezed

    hkv, hq, length, d, scale = 2, 4, 1500, 16, 0.25
    k = jnp.asarray(rng.normal(size=(1, hkv, length, d)).astype(np.float32))
    q_obs = jnp.asarray(rng.normal(size=(1, hq, 64, d)).astype(np.float32))
    cfg = SqueezedConfig(hierarchical=hierarchical, centroid_fraction=0.05, level1_fraction=0.01, n_obs=64,
                         lookup_int8=True)
    idx, info = build_squeezed_index(k, q_obs, cfg, scale)
    li = idx.layer(0)
    # calibration on the rounded scores
    s_obs = squeezed.layer_scores(li, q_obs[0], idx.threshold1, scale, "kv", int8=True)[0]
    assert float(info["threshold"]) == pytest.approx(global_threshold([key_scores(s_obs, li.labels)], cfg.sparsity))
    plain = squeezed.layer_scores(li, q_obs[0], idx.threshold1, scale, "kv")[0]
    assert float(jnp.max(jnp.abs(s_obs - plain))) > 0   # rounded (a level-1 survivor may flip: no bound there)
    if not hierarchical:
        assert float(jnp.max(jnp.abs(s_obs - plain))) < 0.1 * float(jnp.max(plain))
    q = jnp.asarray(rng.normal(size=(hq, 7, d)).astype(np.float32))
    q_valid = jnp.arange(7) >= 2
    if hierarchical:
        qd, c1d, c2d = quantized_inputs(q, li.centroids1, li.centroids)
        want = hierarchical_scores(qd, c1d, li.counts1, c2d, li.counts, li.parent, idx.threshold1, scale, "kv").scores
    else:
        qd, cd = quantized_inputs(q, li.centroids)
        want = cluster_scores(qd, cd, li.counts, scale, "kv")
    got = squeezed.layer_scores(li, q, idx.threshold1, scale, "kv", int8=True)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)
    with dispatch.using("interpret"):
        for qv in (None, q_valid):
            kern = squeezed.layer_scores(li, q, idx.threshold1, scale, "kv", qv, int8=True)[0]
            with dispatch.using("reference"):
                ref = squeezed.layer_scores(li, q, idx.threshold1, scale, "kv", qv, int8=True)[0]
            np.testing.assert_allclose(np.asarray(kern), np.asarray(ref), rtol=3e-5, atol=1e-8)
    one = q[:, :1]
    np.testing.assert_array_equal(squeezed.layer_scores(li, one, idx.threshold1, scale, "kv", int8=True)[0],
                                  squeezed.layer_scores(li, one, idx.threshold1, scale, "kv")[0])
    m = (HierarchicalSqueezed if hierarchical else Squeezed)(lookup_int8=True)
    assert m.config.lookup_int8 and m.label.endswith("/int8")


def test_key_scores_is_one_flat_gather_with_take_along_axis_values():
    """Every key gets its cluster's score (GQA: each KV head's labels serve its selection heads),
    read by a plain gather from the flattened [Hs * C] scores: no batched gather (an H100 ran out
    of memory in one here at 32 heads x 512K keys, benchmarks/results/gpu_h100_suite_1f6c886)."""
    rng = np.random.default_rng(3)
    for hs, hkv, c, lc in [(8, 4, 37, 101), (4, 4, 5, 9), (6, 2, 1, 3)]:
        s = jnp.asarray(rng.standard_normal((hs, c)), jnp.float32)
        labels = jnp.asarray(rng.integers(0, c, (hkv, lc)), jnp.int32)
        want = jnp.take_along_axis(s, jnp.repeat(labels, hs // hkv, axis=0), axis=-1)
        np.testing.assert_array_equal(np.asarray(key_scores(s, labels)), np.asarray(want))
    hlo = jax.jit(key_scores).lower(jax.ShapeDtypeStruct((32, 26214), jnp.float32),
                                    jax.ShapeDtypeStruct((32, 524188), jnp.int32)).as_text()
    assert "operand_batching_dims" not in hlo and "tensor<838848xf32>" in hlo


def test_retrieve_shape_errors(rng):
    labels = jnp.asarray(rng.integers(0, 5, (2, 40)), jnp.int32)
    perm, offsets = cluster_layout(labels, 5)
    counts = offsets[:, 1:] - offsets[:, :-1]
    sel, sc = jnp.ones((2, 6), bool), jnp.ones((2, 6), jnp.float32)
    with pytest.raises(ValueError, match="inconsistent clusters: selected=6, scores=6, counts=5, offsets - 1=5"):
        retrieve(sel, sc, counts, perm, offsets, n_tail=3, capacity=60)
    with pytest.raises(ValueError, match=r"selection heads of selected and scores \(3\) must be a positive multiple "
                                         r"of KV heads \(2\)"):
        retrieve(sel[:1].repeat(3, 0)[:, :5], sc[:1].repeat(3, 0)[:, :5], counts, perm, offsets, n_tail=3, capacity=60)
    with pytest.raises(ValueError, match="inconsistent KV heads: counts=2, perm=1, offsets=2"):
        retrieve(sel[:, :5], sc[:, :5], counts, perm[:1], offsets, n_tail=3, capacity=60)
    with pytest.raises(ValueError, match=r"perm must have shape \[Hkv, Lc\]"):
        retrieve(sel[:, :5], sc[:, :5], counts, perm[0], offsets, n_tail=3, capacity=60)
    for name in ("n_tail", "n_sink"):
        kw = {"n_tail": 3, "n_sink": 0, name: -1}
        with pytest.raises(ValueError, match=f"{name} must be >= 0; got -1"):
            retrieve(sel[:, :5], sc[:, :5], counts, perm, offsets, capacity=60, **kw)
    ret = retrieve(sel[:, :5], sc[:, :5], counts, perm, offsets, n_tail=3, capacity=60)  # the valid call
    assert np.all(np.asarray(ret.count) == 43)


def test_lookup_input_errors():
    cent, counts = jnp.ones((2, 5, 8)), jnp.full((2, 5), 3, jnp.int32)
    with pytest.raises(ValueError, match=r"need at least one query token; got q shape \(4, 0, 8\)"):
        cluster_scores(jnp.ones((4, 0, 8)), cent, counts, 0.5)
    with pytest.raises(ValueError, match=r"need at least one cluster; got centroids shape \(2, 0, 8\)"):
        cluster_scores(jnp.ones((4, 1, 8)), cent[:, :0], counts[:, :0], 0.5)
    with pytest.raises(ValueError, match="inconsistent query tokens: q=3, q_valid=4"):
        cluster_scores(jnp.ones((4, 3, 8)), cent, counts, 0.5, q_valid=jnp.ones((4,), bool))
    with pytest.raises(ValueError, match=r"q_valid must have shape \[T\]"):
        cluster_scores(jnp.ones((4, 3, 8)), cent, counts, 0.5, q_valid=jnp.ones((1, 3), bool))
    parent = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="inconsistent query tokens: q=3, q_valid=2"):
        hierarchical_scores(jnp.ones((4, 3, 8)), cent[:, :2], counts[:, :2], cent, counts, parent, 0.0, 0.5,
                            q_valid=jnp.ones((2,), bool))


def test_config_field_errors_and_one_level_fractions():
    # one level: the level-1 fraction plays no part; n_centroids overrides the level-2 fraction
    assert SqueezedConfig(centroid_fraction=0.01).n_clusters(1000) == (10, 0)
    assert SqueezedConfig(centroid_fraction=0.005, n_centroids=50, hierarchical=True).n_clusters(1000) == (50, 10)
    with pytest.raises(ValueError, match=r"level1_fraction \(0.01\) must be below centroid_fraction \(0.005\)"):
        SqueezedConfig(centroid_fraction=0.005, hierarchical=True)
    for kw, msg in [({"n_obs": 1.5}, r"n_obs must be an integer >= 1; got 1.5 \(float\)"),
                    ({"n_sink": -1}, "n_sink must be >= 0; got -1"),
                    ({"n_centroids": 0}, "n_centroids must be >= 1; got 0"),
                    ({"kmeans_iters": 2.0}, "kmeans_iters must be an integer"),
                    ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*32\); got -1"),
                    ({"sparsity": "0.9"}, r"sparsity must be a number in \(0, 1\); got '0.9' \(str\)"),
                    ({"sparsity": float("nan")}, r"sparsity must lie in \(0, 1\); got nan"),
                    ({"capacity_fraction": "1"}, r"capacity_fraction must be a number in \(0, 1\]"),
                    ({"kmeans_init": "x"}, r"kmeans_init must be one of \('kmeans\+\+', 'random'\); got 'x'"),
                    ({"decode_calibration": "x"}, "decode_calibration must be one of")]:
        with pytest.raises(ValueError, match=msg):
            SqueezedConfig(**kw)


@pytest.mark.parametrize("hs_per_q,t", [(False, 1), (True, 1), (False, 5)])
def test_cpu_attends_a_retrieval_by_gathering_its_rows(rng, monkeypatch, hs_per_q, t):
    """Without a GPU, "auto" attends a Squeezed selection over its retrieved rows only (what the GPU
    kernels compute), never the whole fixed context under the mask; the output equals the mask route's
    ("reference") for ragged counts, an empty selection, a full capacity, GQA, per-query-head
    selections and left-padded new tokens."""
    from sqjax import dispatch
    from sqjax.selection import Selection

    hq, hkv, length, d, cap, s_new = 8, 2, 300, 16, 40, 9
    hs = hq if hs_per_q else hkv
    q = jnp.asarray(rng.normal(size=(hq, t, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(hkv, length, d)), jnp.float32) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.normal(size=(hkv, s_new, d)), jnp.float32) for _ in range(2))
    kv_pos = jnp.asarray([-1, -1] + list(range(length, length + s_new - 2)), jnp.int32)   # two padding slots
    q_pos = kv_pos[-t:]
    idx = np.stack([rng.permutation(length)[:cap] for _ in range(hs)]).astype(np.int32)
    count = rng.integers(1, cap, size=hs).astype(np.int32)
    count[0], count[-1] = 0, cap                                    # an empty selection, a full one
    idx[1, count[1]:] = rng.integers(-5, 2 * length, size=cap - count[1])   # past the count: ignored
    ret = squeezed.Retrieval(jnp.asarray(idx), jnp.asarray(count), jnp.zeros((hs,), bool))
    sel = Selection(squeezed.retrieval_mask(ret, length)[:, None, :], ret.count[:, None],
                    jnp.zeros((hs, 1), jnp.float32), ret.overflow, ret)
    scale = 1 / math.sqrt(d)
    with dispatch.using("reference"):
        want = dispatch.attention(q, k, v, sel, k_new, v_new, q_pos, kv_pos, scale)
    monkeypatch.setattr(dispatch, "fixed_context_attention",
                        lambda *a, **kw: pytest.fail("the mask route was taken"))
    for chunk in (dispatch.CPU_GATHER_CHUNK, 16):   # one chunk; three, the last one ragged
        monkeypatch.setattr(dispatch, "CPU_GATHER_CHUNK", chunk)
        got = dispatch.attention(q, k, v, sel, k_new, v_new, q_pos, kv_pos, scale)
        assert got.shape == (hq, t, d) and bool(jnp.all(jnp.isfinite(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    assert squeezed.search_method() == "scan"   # no GPU: the retrieval's slot search is a loop
