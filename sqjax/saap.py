"""SAAP (Mazaré et al. 2025, §3–5, App. F): asymmetric partitioned attention.

Keys are de-roped (RoPE removed) and assigned to the nearest of C spherical k-means
centroids (trained offline, reused across prompts); the buckets are stored as CSR inverted
lists (`off` [C+1], `lst` [N]). A query's bucket distribution comes from a pluggable assigner
(the trained classifier f_q, or the nearest-centroid baseline); the g query heads of a group
sum their distributions, the top-ℓ buckets are visited and every key in them is attended
exactly, together with the dense part (the first `n_sink` tokens and the `n_recent` most
recent ones; "1+2047" in the paper, scaled down for short contexts). Layer 0 stays dense.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sqjax._checks import check_gqa, check_rank, check_same
from sqjax.kmeans import assign, normalize
from sqjax.selection import topk_mask
from sqjax.squeezed import cluster_layout


def assign_keys(k_pre: jax.Array, unit_centroids: jax.Array, chunk: int = 4096) -> jax.Array:
    """Nearest centroid (cosine) of every de-roped key.  k_pre [Hkv,N,d], centroids [Hkv,C,d] -> [Hkv,N] int32.

    Keys are normalized chunk by chunk inside the loop: an f32 copy of all of them (8 GiB at 32 KV
    heads × 512K) does not fit beside the context on an 80 GB GPU."""
    check_rank("k_pre", k_pre, 3, "[Hkv, N, d]")
    check_rank("unit_centroids", unit_centroids, 3, "[Hkv, C, d]")
    check_same("KV heads", [("k_pre", k_pre.shape[0]), ("unit_centroids", unit_centroids.shape[0])])
    check_same("head dim", [("k_pre", k_pre.shape[-1]), ("unit_centroids", unit_centroids.shape[-1])])
    return jax.vmap(lambda x, c: assign(x, normalize(c), chunk, prep=normalize))(k_pre, unit_centroids)


def inverted_lists(labels: jax.Array, n_buckets: int) -> tuple[jax.Array, jax.Array]:
    """CSR inverted lists: (off [Hkv, C+1], lst [Hkv, N]) — bucket b holds lst[off[b]:off[b+1]]."""
    lst, off = cluster_layout(labels, n_buckets)
    return off, lst


def nearest_centroid_scores(q_pre: jax.Array, unit_centroids: jax.Array) -> jax.Array:
    """Nearest-centroid assigner: Σ over the group of cos(q_h, c_b).  q_pre [Hq,T,d] -> [Hkv, T, C]."""
    check_rank("q_pre", q_pre, 3, "[Hq, T, d]")
    check_rank("unit_centroids", unit_centroids, 3, "[Hkv, C, d]")
    check_same("head dim", [("q_pre", q_pre.shape[-1]), ("unit_centroids", unit_centroids.shape[-1])])
    hq, t, d = q_pre.shape
    hkv = unit_centroids.shape[0]
    g = check_gqa(hq, hkv)
    qn = normalize(q_pre).reshape(hkv, g, t, d)
    return jnp.einsum("kgtd,kcd->ktc", qn, normalize(unit_centroids))


def visited_buckets(bucket_scores: jax.Array, probes: int) -> jax.Array:
    """Top-ℓ buckets per (KV head, token).  [Hkv, T, C] -> bool [Hkv, T, C]."""
    return topk_mask(bucket_scores, probes)


def dense_part(length: int, n_sink: int, n_recent: int) -> jax.Array:
    """bool [L]: the first `n_sink` and the last `n_recent` fixed-context positions."""
    pos = jnp.arange(length)
    return (pos < n_sink) | (pos >= length - n_recent)


def saap_mask(visited: jax.Array, labels: jax.Array, dense: jax.Array) -> jax.Array:
    """Keys attended: in a visited bucket, or in the dense part.  visited [Hkv,T,C], labels [Hkv,L] -> [Hkv,T,L]."""
    in_bucket = jnp.take_along_axis(visited, jnp.broadcast_to(labels[:, None, :], visited.shape[:2] + labels.shape[-1:]), axis=-1)
    return in_bucket | dense[None, None, :]
