"""Global threshold calibration (Squeezed Attention App. C).

The last `n_obs` fixed-context tokens' queries are scored against the remaining (clustered)
fixed-context keys; every key takes its cluster's score S (Eq. 1, averaged over the `n_obs`
queries); the threshold T is the quantile of those per-key scores over **all layers × heads ×
keys** that prunes the target fraction of keys. By default one T serves prefill and decode
(the paper's). A single decode query's scores are peakier than the window's average, so at that
T a decode step keeps fewer keys than nominal; `SqueezedConfig(decode_calibration="token")` also
calibrates decode thresholds on each observation query alone (`squeezed.token_thresholds`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sqjax._checks import check_fraction


def key_scores(cluster_scores: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-key score = its cluster's score.  cluster_scores [Hs, C], labels [Hkv, Lc] -> [Hs, Lc].

    One gather from the flattened scores (row h's labels offset by h * C).  The index build uses
    `key_threshold` / `key_fraction` instead, which need no [Hs, Lc] per-key array."""
    hs, c = cluster_scores.shape
    lab = labels if labels.shape[0] == hs else jnp.repeat(labels, hs // labels.shape[0], axis=0)
    flat = lab.astype(jnp.int32) + (jnp.arange(hs, dtype=jnp.int32) * c)[:, None]
    return jnp.take(cluster_scores.reshape(-1), flat)


def _key_weights(cluster_scores, counts) -> np.ndarray:
    """counts [Hkv, C] repeated to cluster_scores' selection heads [..., Hs, C] (a selection head
    reads its KV head's clusters) and broadcast over its leading axes."""
    n = np.asarray(counts)
    shape = np.shape(cluster_scores)
    if len(shape) < 2 or n.ndim != 2 or shape[-1] != n.shape[-1] or shape[-2] % n.shape[0]:
        raise ValueError(f"need cluster_scores [..., Hs, C] and counts [Hkv, C] with Hs a multiple of Hkv; "
                         f"got {shape} and {n.shape}")
    return np.broadcast_to(np.repeat(n, shape[-2] // n.shape[0], axis=0), shape)


def key_threshold(cluster_scores, counts, sparsity: float) -> float:
    """`global_threshold(key_scores(s, labels), sparsity)` from the clusters alone: every key scores
    its cluster's S, so the keys' scores are the cluster scores repeated by the clusters' counts
    (counts = bincount of labels).  Exact, in O(clusters), with no [Hs, Lc] per-key array.

    cluster_scores: [Hs, C] or a list of them (one per layer); counts: [Hkv, C] or a matching list.
    """
    check_fraction("sparsity", sparsity)
    ss = cluster_scores if isinstance(cluster_scores, (list, tuple)) else [cluster_scores]
    ns = counts if isinstance(counts, (list, tuple)) else [counts] * len(ss)
    if len(ns) != len(ss):
        raise ValueError(f"{len(ss)} score arrays but {len(ns)} count arrays")
    vals = np.concatenate([np.asarray(s, np.float32).reshape(-1) for s in ss])
    wts = np.concatenate([_key_weights(s, n).reshape(-1) for s, n in zip(ss, ns)])
    return weighted_quantile(vals, wts, sparsity)


def key_fraction(cluster_scores: jax.Array, counts: jax.Array, threshold) -> jax.Array:
    """`retrieved_fraction(key_scores(s, labels), T)` from the clusters: per selection head, the
    fraction of keys whose cluster scores S > T.  cluster_scores [Hs, C], counts [Hkv, C] -> [Hs]."""
    n = _key_weights(cluster_scores, counts)
    lc = n.sum(-1)
    if np.any(lc != lc[0]):
        raise ValueError(f"every head must hold the same number of keys; counts sum to {sorted(set(lc.tolist()))}")
    kept = jnp.sum(jnp.where(cluster_scores > threshold, jnp.asarray(n), 0), axis=-1)
    return kept.astype(jnp.float32) / int(lc[0])   # as jnp.mean divides: by a constant


def global_threshold(per_key_scores, sparsity: float) -> float:
    """T such that a `sparsity` fraction of all keys (pooled over layers and heads) has S <= T.

    per_key_scores: an array or a list of arrays of per-key scores (any shapes).
    Keys are retrieved when S > T, so the retrieved fraction on the calibration set is at
    most 1 − sparsity (ties at T are pruned).
    """
    check_fraction("sparsity", sparsity)
    arrs = per_key_scores if isinstance(per_key_scores, (list, tuple)) else [per_key_scores]
    flat = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrs])
    if flat.size == 0:
        raise ValueError("no key scores to calibrate on")
    return float(np.quantile(flat, sparsity, method="linear"))


def retrieved_fraction(per_key_scores: jax.Array, threshold: float) -> jax.Array:
    """Fraction of keys with S > T along the last axis (per head)."""
    return jnp.mean((per_key_scores > threshold).astype(jnp.float32), axis=-1)


def weighted_threshold(cluster_scores, counts, sparsity: float) -> float:
    """`global_threshold` from cluster scores, each weighted by its cluster's size: the smallest
    score T with at least a `sparsity` fraction of all keys at S <= T (the inverted-CDF quantile of
    the per-key scores, in O(clusters) instead of O(keys)).

    cluster_scores [..., Hs, C] (any leading axes: queries, layers); counts [Hkv, C] keys per
    cluster, Hs a multiple of Hkv (a selection head reads its KV head's clusters).
    """
    check_fraction("sparsity", sparsity)
    s = np.asarray(cluster_scores, np.float64)
    w = _key_weights(s, counts).astype(np.float64).reshape(-1)
    s = s.reshape(-1)
    keep = w > 0
    s, w = s[keep], w[keep]
    if s.size == 0:
        raise ValueError("no key scores to calibrate on (every cluster is empty)")
    order = np.argsort(s, kind="stable")
    cum = np.cumsum(w[order])
    i = int(np.searchsorted(cum, sparsity * cum[-1], side="left"))
    return float(s[order][min(i, s.size - 1)])


_FULL_SORT = 1 << 21  # entries up to which `weighted_quantile` sorts everything


def weighted_quantile(values, weights, q: float) -> float:
    """Exact `np.quantile(np.repeat(values, weights), q, method="linear")` without the repeat.

    values/weights: arrays of any (equal) shape; weights are non-negative integers. Large inputs
    (the per-token decode calibration pools up to 2^26 cluster scores) are not
    sorted whole: a strided sample brackets the two ranks needed, one pass counts the weight below
    the bracket, and only the entries inside it are sorted; the counts verify the bracket, so the
    result is the same as the full sort's.
    """
    v = np.asarray(values).reshape(-1)
    if v.dtype not in (np.float32, np.float64):
        v = v.astype(np.float64)
    w = np.asarray(weights).reshape(-1)
    keep = w > 0
    v, w = v[keep], w[keep]
    if v.size == 0:
        raise ValueError("no key scores to calibrate on")
    n = int(w.sum(dtype=np.int64))
    h = (n - 1) * q
    lo = int(math.floor(h))
    hi = min(lo + 1, n - 1)
    t = h - lo
    ft = v.dtype.type
    a, b = (ft(x) for x in _at_ranks(v, w, n, (lo, hi)))
    # numpy's lerp: a + (b − a)·t, computed from the upper end when t >= 0.5, in the values' float
    # type (numpy 2 promotes a Python-float t weakly: f32 values interpolate in f32)
    return float(b - (b - a) * ft(1 - t) if t >= 0.5 else a + (b - a) * ft(t))


def _ranks_sorted(v, w, ranks, below: int = 0) -> list[float]:
    """Values at 0-based `ranks` of the weight-expanded sorted sequence whose first `below` ranks
    are held by entries not in v."""
    order = np.argsort(v, kind="stable")
    cw = below + np.cumsum(w[order], dtype=np.int64)
    vs = v[order].astype(np.float64)
    return [float(vs[min(int(np.searchsorted(cw, r, side="right")), vs.size - 1)]) for r in ranks]


def _at_ranks(v, w, n: int, ranks: tuple[int, int]) -> list[float]:
    if v.size <= _FULL_SORT:
        return _ranks_sorted(v, w, ranks)
    step = -(-v.size // (_FULL_SORT // 2))
    vs, ws = v[::step], w[::step]
    ns = int(ws.sum(dtype=np.int64))
    for eps in (1e-3, 1e-2, 1e-1):
        r_lo = max(0, int((ranks[0] / n - eps) * ns))
        r_hi = min(ns - 1, int(math.ceil((ranks[1] / n + eps) * ns)))
        a, b = _ranks_sorted(vs, ws, (r_lo, r_hi))
        below = int(w[v < a].sum(dtype=np.int64))
        mid = (v >= a) & (v <= b)
        if below <= ranks[0] and below + int(w[mid].sum(dtype=np.int64)) > ranks[1]:
            return _ranks_sorted(v[mid], w[mid], ranks, below)
    return _ranks_sorted(v, w, ranks)
