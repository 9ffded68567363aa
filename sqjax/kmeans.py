"""Spherical k-means with k-means++ seeding, batched over (layer, head), memory-bounded.

Squeezed Attention §3.1: keys are clustered by cosine similarity (K-means on L2-normalised
keys); each stored centroid is the mean of the *un-normalised* keys of its cluster (what the
official code does). SAAP §3 uses the same spherical k-means for its key buckets.

The N×C similarity matrix is never materialised whole: points are processed in chunks of
`chunk` rows, so 128K keys × 6.5K centroids per head fit in a few hundred MB.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sqjax._checks import check_choice, check_count, check_float, check_rank, check_seed

_EPS = 1e-12
INITS = ("kmeans++", "random")  # `KMeansConfig.init`

# jax.jit compiler_options of the clustering programs with `KMeansConfig(deterministic=True)`:
# on GPU, XLA's scatter-adds (the centroid sums) accumulate in whatever order the threads arrive,
# so two builds of one document give slightly different clusters; with deterministic ops the same
# inputs and seed give a bit-identical index, at 1.3-2.2x the build time (128K-512K, measured on an H200:
# benchmarks/results/gpu_h200_deterministic_build/).  jax takes compiler_options only on a
# top-level jit, so inside a caller's jit the plain programs run; the sharded build puts these
# options on its own top-level jit (`sharding._cluster_fn`).
DETERMINISTIC = {"xla_gpu_deterministic_ops": True}


def _top_level(*arrays) -> bool:
    """True unless called inside a jax transformation (arrays are tracers there)."""
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


@dataclasses.dataclass(frozen=True)
class KMeansConfig:
    """Static k-means settings.

    n_clusters: number of centroids C (>= 1, <= number of points).
    max_iters:  Lloyd iteration cap; stops earlier once no label changes.
    chunk:      points per similarity block (bounds memory to chunk × C floats per head).
    seed:       PRNG seed for the seeding (on CPU results are deterministic under a seed; on
                GPU only with `deterministic`).
    deterministic: compile with deterministic scatter-adds (`DETERMINISTIC`): bit-identical
                results on GPU too, 1.3-2.2x slower there (called inside a jit: no effect).
    init:       "kmeans++" (D² sampling, C sequential steps) or "random" (C distinct points:
                one step; what SAAP's Faiss training uses).
    seed_pool_per_centroid, seed_pool_min: k-means++ draws its seeds from a random subset of
                max(seed_pool_per_centroid · C, seed_pool_min) points (all N when N is not
                larger). Each of the C sequential seeding steps reads the whole pool, so for a
                128K-token context with 5% centroids this cuts the seeding traffic 5×; the
                Lloyd iterations then run on all N points.
    """

    n_clusters: int
    max_iters: int = 25
    chunk: int = 4096
    seed: int = 0
    init: str = "kmeans++"
    seed_pool_per_centroid: int = 4
    seed_pool_min: int = 16384
    deterministic: bool = False

    def __post_init__(self):
        check_count("n_clusters", self.n_clusters, 1)
        check_count("max_iters", self.max_iters, 0)
        check_count("chunk", self.chunk, 1)
        check_seed("seed", self.seed)
        if self.seed_pool_per_centroid < 1 or self.seed_pool_min < 1:
            raise ValueError(f"seed pool sizes must be >= 1; got {self.seed_pool_per_centroid}, {self.seed_pool_min}")
        check_choice("init", self.init, INITS)


class KMeansResult(NamedTuple):
    centroids: jax.Array       # [..., C, d] mean of the un-normalised points of each cluster (0 if empty)
    unit_centroids: jax.Array  # [..., C, d] L2-normalised spherical centroids (used for assignment)
    labels: jax.Array          # [..., N] int32 cluster of each point
    counts: jax.Array          # [..., C] int32 points per cluster (0 = empty cluster)
    n_iters: jax.Array         # [...] int32 Lloyd iterations run


def normalize(x: jax.Array) -> jax.Array:
    """Row-wise L2 normalisation in f32 (zero rows stay zero)."""
    x = x.astype(jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), _EPS)


def _pad_rows(x: jax.Array, chunk: int) -> tuple[jax.Array, int]:
    n = x.shape[0]
    n_pad = (-n) % chunk
    return jnp.pad(x, ((0, n_pad), (0, 0))), n_pad


ASSIGN_BLOCK_BYTES = 1 << 32  # one assignment step's similarity block [heads, chunk, C] f32, at most


def assign_chunk(n_heads: int, n_clusters: int, chunk: int = 4096) -> int:
    """Points per assignment step when `n_heads` point sets are assigned together (vmapped): `chunk`,
    shortened (to a multiple of 64, at least 256) so that the [n_heads, chunk, n_clusters] f32
    similarity block stays under `ASSIGN_BLOCK_BYTES` (32 KV heads x 512K keys at 4096: 13.7 GB, and
    a 29 GiB temporary that an 80 GB H100 could not hold)."""
    fit = ASSIGN_BLOCK_BYTES // max(4 * n_heads * n_clusters, 1) // 64 * 64
    return int(min(chunk, max(256, fit)))


def assign(xn: jax.Array, cn: jax.Array, chunk: int, prep=None) -> jax.Array:
    """Label of each unit point = argmax_c xn·cn, chunked over points.  xn [N,d], cn [C,d] -> [N].

    The similarities are accumulated in f32 from operands in the points' dtype (bf16 keys: bf16
    unit vectors on the tensor cores; f32 keys: f32).  `prep` (e.g. `normalize`) maps each chunk of
    raw points to unit points inside the loop, so no prepared copy of all N points is made.
    """
    n = xn.shape[0]
    n_chunks = -(-n // min(chunk, n))
    chunk = -(-n // n_chunks)  # balanced chunks: little padding
    xp, _ = _pad_rows(xn, chunk)
    blocks = xp.reshape(-1, chunk, xn.shape[-1])
    prep = prep or (lambda b: b)
    dtype = jax.eval_shape(prep, blocks[0]).dtype
    cn = cn.astype(dtype)
    labels = jax.lax.map(
        lambda b: jnp.argmax(jnp.dot(prep(b), cn.T, preferred_element_type=jnp.float32), axis=-1).astype(jnp.int32),
        blocks)
    return labels.reshape(-1)[:n]


def _kmeans_pp(xn: jax.Array, n_clusters: int, key: jax.Array) -> jax.Array:
    """k-means++ seeding on unit vectors with D² sampling (D² = 2 − 2·cos).  xn [N,d] -> [C,d]."""
    n, d = xn.shape
    k0, key = jax.random.split(key)
    first = jax.random.randint(k0, (), 0, n)
    centers = jnp.zeros((n_clusters, d), jnp.float32).at[0].set(xn[first])
    dist = jnp.maximum(2.0 - 2.0 * (xn @ xn[first]), 0.0)  # [N]

    def body(i, carry):
        centers, dist, key = carry
        key, sub = jax.random.split(key)
        # Inverse-CDF draw proportional to D² (one uniform per step: cheap on CPU too).
        # Points already chosen have D² = 0 and are never drawn again; if every D² is 0
        # (fewer distinct points than clusters) fall back to a uniform draw.
        cdf = jnp.cumsum(dist)
        total = cdf[-1]
        u = jax.random.uniform(sub, (), jnp.float32)
        idx_d2 = jnp.searchsorted(cdf, u * total, side="right", method="scan_unrolled")
        idx = jnp.where(total > 0, jnp.minimum(idx_d2, n - 1), jnp.minimum((u * n).astype(jnp.int32), n - 1))
        c = xn[idx]
        centers = centers.at[i].set(c)
        dist = jnp.minimum(dist, jnp.maximum(2.0 - 2.0 * (xn @ c), 0.0))
        return centers, dist, key

    centers, _, _ = jax.lax.fori_loop(1, n_clusters, body, (centers, dist, key))
    return centers


def _spherical_kmeans_single(x: jax.Array, key: jax.Array, cfg: KMeansConfig) -> KMeansResult:
    """One (layer, head): x [N, d] -> KMeansResult with unbatched shapes."""
    n, d = x.shape
    c = cfg.n_clusters
    xn = normalize(x)
    # assignment operands in the keys' dtype when it is a 16-bit float (see `assign`)
    xa = xn.astype(x.dtype) if jnp.dtype(x.dtype).itemsize == 2 else xn
    if cfg.init == "random":
        cn0 = xn[jax.random.choice(key, n, (c,), replace=False)]
    else:
        pool = max(cfg.seed_pool_per_centroid * c, cfg.seed_pool_min)
        if pool < n:  # seed from a random subset (see KMeansConfig)
            key, kp = jax.random.split(key)
            cn0 = _kmeans_pp(xn[jax.random.choice(kp, n, (pool,), replace=False)], c, key)
        else:
            cn0 = _kmeans_pp(xn, c, key)
    labels0 = assign(xa, cn0, cfg.chunk)

    def update(labels, cn_prev):
        sums = jax.ops.segment_sum(xn, labels, num_segments=c)  # [C, d]
        norms = jnp.linalg.norm(sums, axis=-1, keepdims=True)
        # An empty cluster keeps its previous centroid (never NaN).
        return jnp.where(norms > _EPS, sums / jnp.maximum(norms, _EPS), cn_prev)

    def cond(state):
        _, _, it, changed = state
        return (it < cfg.max_iters) & changed

    def body(state):
        cn, labels, it, _ = state
        cn = update(labels, cn)
        new_labels = assign(xa, cn, cfg.chunk)
        return cn, new_labels, it + 1, jnp.any(new_labels != labels)

    cn, labels, n_iters, _ = jax.lax.while_loop(
        cond, body, (cn0, labels0, jnp.int32(0), jnp.bool_(True))
    )
    counts = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), labels, num_segments=c)
    sums = jax.ops.segment_sum(x.astype(jnp.float32), labels, num_segments=c)
    means = sums / jnp.maximum(counts, 1)[:, None].astype(jnp.float32)
    return KMeansResult(means, cn, labels, counts, n_iters)


def _spherical_kmeans_batched(x: jax.Array, seed: jax.Array, cfg: KMeansConfig) -> KMeansResult:
    batch_shape = x.shape[:-2]
    flat = x.reshape((-1,) + x.shape[-2:])
    keys = jax.random.split(jax.random.key(seed), flat.shape[0])
    out = jax.vmap(lambda xi, ki: _spherical_kmeans_single(xi, ki, cfg))(flat, keys)
    return jax.tree.map(lambda a: a.reshape(batch_shape + a.shape[1:]), out)


_spherical_kmeans_jit = jax.jit(_spherical_kmeans_batched, static_argnames=("cfg",))
_spherical_kmeans_det = jax.jit(_spherical_kmeans_batched, static_argnames=("cfg",), compiler_options=DETERMINISTIC)


def _check_enough_points(n_clusters: int, name: str, x: jax.Array) -> None:
    """x [..., N, d]: at least n_clusters points to cluster."""
    if n_clusters > x.shape[-2]:
        raise ValueError(f"more centroids than points: n_clusters={n_clusters} > N={x.shape[-2]} "
                         f"({name} shape {tuple(x.shape)})")


def spherical_kmeans(x: jax.Array, cfg: KMeansConfig) -> KMeansResult:
    """Spherical k-means over the last two axes of `x` [..., N, d], batched over leading axes.

    Assignment maximises cosine similarity; k-means++ seeding draws with D² = 2 − 2cos.
    Returns centroids as means of the un-normalised points (Squeezed Attention §3.1).
    """
    if x.ndim < 2 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape [..., N, d] with d >= 1; got shape {tuple(x.shape)}")
    check_float("x", x)
    _check_enough_points(cfg.n_clusters, "x", x)
    # the seed is traced, so configs that differ only in seed share one compilation
    fn = _spherical_kmeans_det if cfg.deterministic and _top_level(x) else _spherical_kmeans_jit
    return fn(x, jnp.uint32(cfg.seed), dataclasses.replace(cfg, seed=0))


def cluster_level_up(
    child_centroids: jax.Array, child_counts: jax.Array, cfg: KMeansConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cluster a level of centroids into a coarser level (hierarchical Squeezed Attention §3.3).

    child_centroids [..., C2, d] (means of un-normalised keys), child_counts [..., C2]
    -> (parent [..., C2] int32, centroids [..., C1, d] = count-weighted mean of the keys under
        each parent, counts [..., C1] = keys under each parent).
    Only the non-empty children are clustered (`sqjax.masked_kmeans.level_up`, batch entries
    numbered in order); empty children get parent 0 and weigh nothing.
    """
    from sqjax.masked_kmeans import level_up, level_up_deterministic

    check_rank("child_counts", child_counts, child_centroids.ndim - 1, "[..., C2]")
    _check_enough_points(cfg.n_clusters, "child centroids", child_centroids)
    batch = child_centroids.shape[:-2]
    ids = jnp.arange(math.prod(batch), dtype=jnp.uint32).reshape(batch)
    fn = level_up_deterministic if cfg.deterministic and _top_level(child_centroids, child_counts) else level_up
    return fn(child_centroids, child_counts, jnp.uint32(cfg.seed), ids, n_clusters=cfg.n_clusters,
              max_iters=cfg.max_iters, chunk=cfg.chunk, init=cfg.init)
