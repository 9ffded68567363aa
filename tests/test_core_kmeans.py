import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sqjax.kmeans import KMeansConfig, assign, cluster_level_up, normalize, spherical_kmeans


def _np_unit(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def test_fixed_point_and_means_match_numpy(rng):
    x = rng.normal(size=(2, 3, 300, 16)).astype(np.float32) * rng.uniform(0.5, 3.0, size=(2, 3, 300, 1)).astype(np.float32)
    res = spherical_kmeans(jnp.asarray(x), KMeansConfig(12, max_iters=50, chunk=64))
    labels = np.asarray(res.labels)
    for i in range(2):
        for h in range(3):
            xi, lab = x[i, h], labels[i, h]
            # counts and un-normalised means, computed independently
            cnt = np.bincount(lab, minlength=12)
            np.testing.assert_array_equal(np.asarray(res.counts[i, h]), cnt)
            for c in range(12):
                if cnt[c]:
                    np.testing.assert_allclose(np.asarray(res.centroids[i, h, c]), xi[lab == c].mean(0), rtol=1e-4, atol=1e-5)
                else:
                    assert np.all(np.asarray(res.centroids[i, h, c]) == 0)
            # converged (or capped): every point's label is its most cosine-similar unit centroid
            if int(res.n_iters[i, h]) < 50:
                sims = _np_unit(xi) @ np.asarray(res.unit_centroids[i, h]).T
                best = sims.max(-1)
                np.testing.assert_allclose(sims[np.arange(300), lab], best, atol=1e-5)


def test_deterministic_under_seed_and_seed_matters(rng):
    x = jnp.asarray(rng.normal(size=(200, 8)).astype(np.float32))
    a = spherical_kmeans(x, KMeansConfig(10, seed=3))
    b = spherical_kmeans(x, KMeansConfig(10, seed=3))
    np.testing.assert_array_equal(np.asarray(a.labels), np.asarray(b.labels))
    np.testing.assert_array_equal(np.asarray(a.centroids), np.asarray(b.centroids))


def _spy(monkeypatch, *targets) -> list:
    """Wrap each (module, function name) so that calls append the name to the returned list."""
    used = []
    for mod, name in targets:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _r=real, **k: used.append(_n) or _r(*a, **k))
    return used


def test_deterministic_build_uses_deterministic_programs(rng, monkeypatch):
    """KMeansConfig(deterministic=True) runs the clustering programs compiled with deterministic
    scatter-adds (on GPU the same inputs and seed then give a bit-identical index, 1.3-2.2x slower:
    benchmarks/results/gpu_h200_deterministic_build/); inside a caller's jit (jax takes compiler
    options only on a top-level jit) and by default the plain ones. Same clusters either way here."""
    from sqjax import kmeans, masked_kmeans

    # which programs carry the option (a private jax attribute: this fails loudly if jax moves it)
    assert dict(kmeans._spherical_kmeans_det._jit_info.compiler_options_kvs) == kmeans.DETERMINISTIC
    assert dict(masked_kmeans.level_up_deterministic._jit_info.compiler_options_kvs) == kmeans.DETERMINISTIC
    assert not kmeans._spherical_kmeans_jit._jit_info.compiler_options_kvs
    assert not masked_kmeans.level_up._jit_info.compiler_options_kvs
    used = _spy(monkeypatch, (kmeans, "_spherical_kmeans_det"), (kmeans, "_spherical_kmeans_jit"),
                (masked_kmeans, "level_up_deterministic"), (masked_kmeans, "level_up"))
    x = jnp.asarray(rng.normal(size=(2, 300, 8)).astype(np.float32))
    runs = {}
    for det in (False, True):
        cfg, cfg1 = KMeansConfig(12, seed=5, deterministic=det), KMeansConfig(3, seed=2, deterministic=det)
        used.clear()
        top = spherical_kmeans(x, cfg)
        up = cluster_level_up(top.centroids, top.counts, cfg1)
        assert used == (["_spherical_kmeans_det", "level_up_deterministic"] if det else
                        ["_spherical_kmeans_jit", "level_up"])
        runs[det] = (top, up)
    used.clear()
    nested = jax.jit(lambda a: spherical_kmeans(a, KMeansConfig(12, seed=5, deterministic=True)))(x)
    assert used == ["_spherical_kmeans_jit"]
    for r in (runs[True][0], nested):
        np.testing.assert_array_equal(np.asarray(r.labels), np.asarray(runs[False][0].labels))
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("pool,dtype", [(None, jnp.float32), (60, jnp.float32), (None, jnp.bfloat16)])
def test_recovers_separated_directions(rng, pool, dtype):
    """Also when k-means++ seeds from a random subset of 60 of the 500 points, and for bf16
    keys (bf16 assignment operands, f32 accumulation)."""
    dirs = _np_unit(rng.normal(size=(5, 32)))
    lab = rng.integers(0, 5, size=500)
    # tight clusters (within-cluster D² ~ 1e-5 vs ~2 across): k-means++ puts two seeds in one
    # cluster with probability ~1e-5, so a failure means a bug, not bad luck
    x = dirs[lab] * rng.uniform(1, 4, size=(500, 1)) + 0.001 * rng.normal(size=(500, 32))
    kw = {} if pool is None else {"seed_pool_per_centroid": 1, "seed_pool_min": pool}
    res = spherical_kmeans(jnp.asarray(x, dtype), KMeansConfig(5, seed=int(rng.integers(1 << 30)), **kw))
    got = np.asarray(res.labels)
    # same partition up to renaming
    for c in range(5):
        assert len(set(got[lab == c])) == 1


def test_empty_clusters_do_not_nan():
    # 4 distinct points, 6 clusters: at least two clusters stay empty
    x = jnp.asarray(np.repeat(np.eye(4, 8, dtype=np.float32), 5, axis=0))
    res = spherical_kmeans(x, KMeansConfig(6))
    assert not np.isnan(np.asarray(res.centroids)).any()
    assert not np.isnan(np.asarray(res.unit_centroids)).any()
    assert int(res.counts.sum()) == 20
    assert int((res.counts == 0).sum()) >= 2


def test_chunked_assign_equals_bruteforce(rng):
    x = rng.normal(size=(1000, 24)).astype(np.float32)
    c = _np_unit(rng.normal(size=(37, 24))).astype(np.float32)
    got = np.asarray(assign(normalize(jnp.asarray(x)), jnp.asarray(c), chunk=96))
    want = np.argmax(_np_unit(x) @ c.T, axis=-1)
    np.testing.assert_array_equal(got, want)


def test_level_up_counts_and_weighted_means(rng):
    x = jnp.asarray(rng.normal(size=(2, 400, 8)).astype(np.float32))
    lvl2 = spherical_kmeans(x, KMeansConfig(20))
    parent, c1, n1 = cluster_level_up(lvl2.centroids, lvl2.counts, KMeansConfig(4))
    for h in range(2):
        par = np.asarray(parent[h])
        cnt2 = np.asarray(lvl2.counts[h])
        key_parent = par[np.asarray(lvl2.labels[h])]
        np.testing.assert_array_equal(np.asarray(n1[h]), np.bincount(key_parent, minlength=4))
        for p in range(4):
            if (key_parent == p).any():
                np.testing.assert_allclose(np.asarray(c1[h, p]), np.asarray(x[h])[key_parent == p].mean(0), rtol=1e-4, atol=1e-5)
        assert cnt2.sum() == 400


def test_errors():
    x = jnp.zeros((10, 4))
    with pytest.raises(ValueError, match="more centroids than points"):
        spherical_kmeans(x, KMeansConfig(11))
    with pytest.raises(ValueError, match="floating"):
        spherical_kmeans(jnp.zeros((10, 4), jnp.int32), KMeansConfig(2))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, d\]"):
        spherical_kmeans(jnp.zeros((10,)), KMeansConfig(2))
    with pytest.raises(ValueError, match="n_clusters"):
        KMeansConfig(0)
    with pytest.raises(ValueError, match="seed pool"):
        KMeansConfig(2, seed_pool_min=0)


@pytest.mark.parametrize("init", ["kmeans++", "random"])
def test_level_up_spends_no_cluster_on_empty_children(rng, init):
    # An empty child's centroid is a zero row, at the maximal D² from every centre: clustered as a
    # point it drew k-means++ seeds and left level-1 clusters empty (41-45% with 26% empty children:
    # benchmarks/results/gpu_h200_capture_keys/empty_clusters_cpu; 73% at 512K on the benchmark
    # keys). Only non-empty children are clustered now.
    c2, c1, d = 600, 120, 16
    cent = rng.normal(size=(2, c2, d)).astype(np.float32)
    cnt = rng.integers(1, 40, size=(2, c2)).astype(np.int32)
    empty = rng.random((2, c2)) < 0.3
    cent[empty], cnt[empty] = 0.0, 0
    parent, c1_cent, n1 = cluster_level_up(jnp.asarray(cent), jnp.asarray(cnt), KMeansConfig(c1, init=init))
    parent, n1 = np.asarray(parent), np.asarray(n1)
    assert ((parent >= 0) & (parent < c1)).all()
    assert (n1 > 0).all()                                  # every level-1 cluster holds keys
    for h in range(2):
        np.testing.assert_array_equal(n1[h], np.bincount(parent[h], weights=cnt[h], minlength=c1).astype(np.int64))
    assert np.isfinite(np.asarray(c1_cent)).all()
    with pytest.raises(ValueError, match="more centroids than points"):
        cluster_level_up(jnp.asarray(cent), jnp.asarray(cnt), KMeansConfig(c2 + 1))


def test_squeezed_deterministic_build_reaches_the_clustering(rng, monkeypatch):
    """`Squeezed(deterministic_build=True)` (and the hierarchical one) cluster through the
    deterministic programs; the index equals the default build's here (CPU)."""
    from sqjax import kmeans, masked_kmeans
    from sqjax.methods import ContextData, HierarchicalSqueezed

    used = _spy(monkeypatch, (kmeans, "_spherical_kmeans_det"), (masked_kmeans, "level_up_deterministic"))
    k = jnp.asarray(rng.normal(size=(1, 2, 700, 16)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(1, 4, 100, 16)).astype(np.float32))
    data = ContextData(k, k, q, k_pre=k, scale=0.25)
    idx = [HierarchicalSqueezed(centroid_fraction=0.05, level1_fraction=0.01, deterministic_build=det).build(data)[0]
           for det in (False, True)]
    assert used == ["_spherical_kmeans_det", "level_up_deterministic"]
    for f in ("labels", "centroids", "parent", "centroids1"):
        np.testing.assert_array_equal(np.asarray(getattr(idx[0].layers, f)), np.asarray(getattr(idx[1].layers, f)))


def test_saap_deterministic_build_reaches_the_clustering(rng, monkeypatch):
    """`Saap(deterministic_build=True)` clusters its buckets through the deterministic program;
    the buckets equal the default build's here (CPU)."""
    from sqjax import kmeans
    from sqjax.methods import ContextData, Saap

    used = _spy(monkeypatch, (kmeans, "_spherical_kmeans_det"))
    k = jnp.asarray(rng.normal(size=(2, 2, 600, 16)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(2, 4, 100, 16)).astype(np.float32))
    data = ContextData(k, k, q, k_pre=k, scale=0.25)
    idx = [Saap(n_buckets=12, deterministic_build=det).build(data)[0] for det in (False, True)]
    assert used == ["_spherical_kmeans_det"] * 2                       # one per layer, only when asked
    for f in ("unit", "labels", "off", "lst"):
        np.testing.assert_array_equal(np.asarray(idx[0][f]), np.asarray(idx[1][f]))


def test_sharded_deterministic_build_compiles_deterministic(rng):
    """The per-device clustering of `sharding.cluster_sharded` is compiled with deterministic
    scatter-adds when `SqueezedConfig(deterministic_build=True)`; same clusters here (CPU)."""
    from sqjax import kmeans, sharding, squeezed

    mesh = sharding.make_mesh(1, 1)
    k = jnp.asarray(rng.normal(size=(1, 2, 640, 16)).astype(np.float32))
    out = []
    for det in (False, True):
        cfg = squeezed.SqueezedConfig(centroid_fraction=0.05, n_obs=64, kmeans_iters=4, deterministic_build=det)
        out.append(sharding.cluster_sharded(k, cfg, mesh))
        c2, c1 = sharding.cluster_counts(cfg, 640, 1)
        ls, _ = sharding._shard_sizes(640, 1, cfg.n_sink, cfg.n_obs)
        fn = sharding._cluster_fn(mesh, 1, 2, ls, c2, c1, cfg.n_sink, cfg.n_obs, cfg.kmeans_iters, 4096, det)
        opts = dict(fn._jit_info.compiler_options_kvs or ())
        assert opts == (kmeans.DETERMINISTIC if det else {})
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_assign_chunk_caps_the_similarity_block():
    """4096 points per step unless [heads, chunk, C] f32 would pass 4 GiB; then a multiple of 64, >= 256."""
    from sqjax.kmeans import ASSIGN_BLOCK_BYTES, assign_chunk

    assert assign_chunk(8, 6554) == 4096 and assign_chunk(8, 26209) == 4096   # Llama-3-8B at 128K / 512K
    c = assign_chunk(32, 26209)                                             # Llama-2-7B at 512K
    assert c == 1280 and c % 64 == 0 and 4 * 32 * c * 26209 <= ASSIGN_BLOCK_BYTES < 4 * 32 * (c + 64) * 26209
    assert assign_chunk(1024, 1 << 20) == 256 and assign_chunk(1, 1, chunk=96) == 96


def test_empty_feature_axis_and_config_types():
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., N, d\] with d >= 1; got shape \(10, 0\)"):
        spherical_kmeans(jnp.zeros((10, 0)), KMeansConfig(2))
    for kw, msg in [({"n_clusters": 2.0}, r"n_clusters must be an integer >= 1; got 2.0 \(float\)"),
                    ({"n_clusters": 2, "seed": -1}, r"seed must be an integer in \[0, 2\*\*32\); got -1"),
                    ({"n_clusters": 2, "max_iters": -1}, "max_iters must be >= 0; got -1"),
                    ({"n_clusters": 2, "init": "x"}, r"init must be one of \('kmeans\+\+', 'random'\); got 'x'")]:
        with pytest.raises(ValueError, match=msg):
            KMeansConfig(**kw)
