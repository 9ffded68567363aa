"""Spherical k-means over a *masked* set of points: per device by `sqjax.sharding`, and by both
builds' level-up, which clusters only the non-empty level-2 clusters (`level_up`, called by
`sqjax.kmeans.cluster_level_up` and by the sharded build).

Context parallelism clusters each device's slice of the fixed context on that device. The
slices have one static shape, but the exact sink (first shard) and the exact tail (last shard)
are never clustered, so the number of points to cluster differs between devices. Every device
runs the same SPMD program on its whole slice with a point mask; masked-out points take no
part in seeding, assignment statistics, counts or means and get label −1.

Same algorithm as `sqjax.kmeans.spherical_kmeans` (k-means++ with D² = 2 − 2cos, Lloyd
iterations to convergence or a cap, empty clusters keep their previous centroid, stored
centroids are the means of the un-normalised points), with the mask added. Not bit-identical
to `spherical_kmeans` for an all-true mask (the random draws differ); `sharding.py` never
relies on that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sqjax.kmeans import DETERMINISTIC, KMeansResult, assign, normalize


def _draw(weights: jax.Array, key: jax.Array) -> jax.Array:
    """Index drawn with probability ∝ weights (inverse CDF, one uniform)."""
    cdf = jnp.cumsum(weights)
    u = jax.random.uniform(key, (), jnp.float32)
    return jnp.minimum(jnp.searchsorted(cdf, u * cdf[-1], side="right", method="scan_unrolled"), weights.shape[0] - 1)


def _masked_kmeans_pp(xn: jax.Array, valid: jax.Array, n_clusters: int, key: jax.Array) -> jax.Array:
    """k-means++ seeding over the valid unit points.  xn [N, d], valid [N] -> [C, d]."""
    n, d = xn.shape
    w = valid.astype(jnp.float32)
    k0, key = jax.random.split(key)
    first = _draw(w, k0)
    centers = jnp.zeros((n_clusters, d), jnp.float32).at[0].set(xn[first])
    dist = jnp.where(valid, jnp.maximum(2.0 - 2.0 * (xn @ xn[first]), 0.0), 0.0)

    def body(i, carry):
        centers, dist, key = carry
        key, sub = jax.random.split(key)
        # D² draw; when every valid point is already a centre (D² all 0), draw uniformly
        # among the valid points instead.
        idx = jnp.where(jnp.sum(dist) > 0, _draw(dist, sub), _draw(w, sub))
        c = xn[idx]
        centers = centers.at[i].set(c)
        dist = jnp.where(valid, jnp.minimum(dist, jnp.maximum(2.0 - 2.0 * (xn @ c), 0.0)), 0.0)
        return centers, dist, key

    centers, _, _ = jax.lax.fori_loop(1, n_clusters, body, (centers, dist, key))
    return centers


def _masked_random_init(xn: jax.Array, valid: jax.Array, n_clusters: int, key: jax.Array) -> jax.Array:
    """C distinct valid unit points drawn uniformly (Gumbel top-k over the valid ones; with fewer
    valid points than C the rest are masked points, zero rows, which attract nothing)."""
    g = jnp.where(valid, jax.random.gumbel(key, valid.shape), -jnp.inf)
    return xn[jax.lax.top_k(g, n_clusters)[1]]


def _masked_kmeans_single(x, valid, key, *, n_clusters: int, max_iters: int, chunk: int,
                          init: str = "kmeans++") -> KMeansResult:
    n, _ = x.shape
    c = n_clusters
    xn = normalize(x) * valid[:, None].astype(jnp.float32)   # masked points: zero rows
    if init == "random":
        cn0 = _masked_random_init(xn, valid, c, key)
    else:
        cn0 = _masked_kmeans_pp(xn, valid, c, key)
    labels0 = assign(xn, cn0, chunk)

    def update(labels, cn_prev):
        sums = jax.ops.segment_sum(xn, labels, num_segments=c)     # masked rows add 0
        norms = jnp.linalg.norm(sums, axis=-1, keepdims=True)
        return jnp.where(norms > 1e-12, sums / jnp.maximum(norms, 1e-12), cn_prev)

    def cond(state):
        _, _, it, changed = state
        return (it < max_iters) & changed

    def body(state):
        cn, labels, it, _ = state
        cn = update(labels, cn)
        new = assign(xn, cn, chunk)
        return cn, new, it + 1, jnp.any((new != labels) & valid)

    cn, labels, n_iters, _ = jax.lax.while_loop(cond, body, (cn0, labels0, jnp.int32(0), jnp.bool_(True)))
    w = valid.astype(jnp.int32)
    counts = jax.ops.segment_sum(w, labels, num_segments=c)
    sums = jax.ops.segment_sum(x.astype(jnp.float32) * w[:, None], labels, num_segments=c)
    means = sums / jnp.maximum(counts, 1)[:, None].astype(jnp.float32)
    labels = jnp.where(valid, labels, -1).astype(jnp.int32)
    return KMeansResult(means, cn, labels, counts.astype(jnp.int32), n_iters)


def _masked_spherical_kmeans(
    x: jax.Array,      # [..., N, d]
    valid: jax.Array,  # [N] bool (shared by the leading axes) or [..., N]
    seed: jax.Array,   # uint32 scalar (traced: seeds do not recompile)
    ids: jax.Array,    # [...] uint32 stream id of each batch entry (folded into the seed's key)
    *,
    n_clusters: int,
    max_iters: int = 25,
    chunk: int = 4096,
    init: str = "kmeans++",
) -> KMeansResult:
    """Spherical k-means of the valid points, batched over the leading axes of `x`.

    Batch entry i draws from ``fold_in(key(seed), ids[i])``, so a caller that numbers its
    entries globally gets results that do not depend on how the batch is split over devices.
    With fewer valid points than `n_clusters` some clusters stay empty. Labels of masked
    points are −1; counts and means ignore them. ``init``: "kmeans++" (D² seeding) or
    "random" (distinct valid points).
    """
    batch = x.shape[:-2]
    flat = x.reshape((-1,) + x.shape[-2:])
    vflat = jnp.broadcast_to(valid, x.shape[:-1]).reshape(flat.shape[:-1])
    base = jax.random.key(seed)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.broadcast_to(ids, batch).reshape(-1))
    f = functools.partial(_masked_kmeans_single, n_clusters=n_clusters, max_iters=max_iters,
                          chunk=min(chunk, x.shape[-2]), init=init)
    out = jax.vmap(f)(flat, vflat, keys)
    return jax.tree.map(lambda a: a.reshape(batch + a.shape[1:]), out)


_STATIC = ("n_clusters", "max_iters", "chunk", "init")
masked_spherical_kmeans = jax.jit(_masked_spherical_kmeans, static_argnames=_STATIC)


def _level_up(child_centroids: jax.Array, child_counts: jax.Array, seed, ids, *, n_clusters: int, max_iters: int,
              chunk: int = 4096, init: str = "kmeans++") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cluster level-2 centroids into level 1 (hierarchical Squeezed Attention §3.3).

    child_centroids [..., C2, d], child_counts [..., C2] -> (parent [..., C2] int32, centroids
    [..., C1, d] = count-weighted mean of the keys under each parent, counts [..., C1]).

    Only non-empty children are clustered. An empty child's centroid is a zero row: as a point
    it sits at the maximal D² from every centre, so k-means++ would seed on empty children
    first and spend level-1 clusters on them (measured: 73% of 5,243 level-1 clusters empty at
    512K when a quarter of level 2 was empty). Empty children get parent 0; they are never
    candidates (count 0) whatever their parent.
    """
    res = _masked_spherical_kmeans(child_centroids, child_counts > 0, seed, ids, n_clusters=n_clusters,
                                   max_iters=max_iters, chunk=chunk, init=init)
    parent = jnp.where(res.labels >= 0, res.labels, 0).astype(jnp.int32)
    w = child_counts.astype(jnp.float32)

    def per_entry(cent, w_, par):
        sums = jax.ops.segment_sum(cent * w_[:, None], par, num_segments=n_clusters)
        cnt = jax.ops.segment_sum(w_, par, num_segments=n_clusters)
        return sums / jnp.maximum(cnt, 1.0)[:, None], cnt.astype(jnp.int32)

    batch = child_centroids.shape[:-2]
    flat = lambda a, k: a.reshape((-1,) + a.shape[len(batch):])  # noqa: E731
    cent1, cnt1 = jax.vmap(per_entry)(flat(child_centroids.astype(jnp.float32), 0), flat(w, 0), flat(parent, 0))
    return parent, cent1.reshape(batch + cent1.shape[1:]), cnt1.reshape(batch + cnt1.shape[1:])


level_up = jax.jit(_level_up, static_argnames=_STATIC)
# the same at the top level, with deterministic scatter-adds on GPU (sqjax.kmeans.DETERMINISTIC)
level_up_deterministic = jax.jit(_level_up, static_argnames=_STATIC, compiler_options=DETERMINISTIC)
