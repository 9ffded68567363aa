"""Reference baselines in the same harness: StreamingLLM and the oracle.

StreamingLLM (Xiao et al. 2024): the attention sink (first `n_sink` tokens) plus a window of
the most recent fixed-context tokens, independent of the query.

Oracle (Squeezed Attention App. H, "ideal"): the keys with the highest *true* attention
weights at the same budget — the upper bound every lookup is judged against. Per token,
per selection head: softmax(s·q·K) (voted over the group: mean of the g heads' weights),
the top `k` clustered keys plus the exact tail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sqjax._checks import check_gqa
from sqjax.selection import topk_mask


def streaming_mask(length: int, n_sink: int, n_recent: int) -> jax.Array:
    """bool [L] of the sink + recent window."""
    pos = jnp.arange(length)
    return (pos < n_sink) | (pos >= length - n_recent)


def true_attention(q: jax.Array, k: jax.Array, scale: float, vote: str) -> jax.Array:
    """Softmax weights of each query on the fixed keys, voted per selection head.

    q [Hq, T, d], k [Hkv, L, d] -> [Hs, T, L] f32.
    """
    hq, t, d = q.shape
    hkv, length, _ = k.shape
    g = check_gqa(hq, hkv)
    logits = jnp.einsum("kgtd,kld->kgtl", q.astype(jnp.float32).reshape(hkv, g, t, d), k.astype(jnp.float32)) * scale
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.mean(p, axis=1) if vote == "kv" else p.reshape(hq, t, length)


def oracle_topk_mask(q: jax.Array, k: jax.Array, scale: float, n_keep: int, n_tail: int, vote: str) -> jax.Array:
    """Top-`n_keep` clustered keys by true attention + the exact tail.  -> bool [Hs, T, L]."""
    length = k.shape[1]
    lc = length - n_tail
    p = true_attention(q, k, scale, vote)[..., :lc]
    tail = jnp.ones(p.shape[:-1] + (length - lc,), bool)
    return jnp.concatenate([topk_mask(p, n_keep), tail], axis=-1)
