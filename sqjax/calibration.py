"""Global threshold calibration (Squeezed Attention App. C).

The last `n_obs` fixed-context tokens' queries are scored against the remaining (clustered)
fixed-context keys; every key takes its cluster's score S (Eq. 1, averaged over the `n_obs`
queries); the threshold T is the quantile of those per-key scores over **all layers × heads ×
keys** that prunes the target fraction of keys. One T serves prefill and decode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sqjax._checks import check_fraction


def key_scores(cluster_scores: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-key score = its cluster's score.  cluster_scores [Hs, C], labels [Hkv, Lc] -> [Hs, Lc]."""
    hs = cluster_scores.shape[0]
    lab = labels if labels.shape[0] == hs else jnp.repeat(labels, hs // labels.shape[0], axis=0)
    return jnp.take_along_axis(cluster_scores, lab, axis=-1)


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
