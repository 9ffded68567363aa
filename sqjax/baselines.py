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

from sqjax._checks import check_choice, check_count, check_gqa, check_rank, check_same
from sqjax.selection import topk_mask
from sqjax.squeezed import VOTES


def streaming_mask(length: int, n_sink: int, n_recent: int) -> jax.Array:
    """bool [L] of the sink + recent window."""
    check_count("n_sink", n_sink, 0)
    check_count("n_recent", n_recent, 0)
    pos = jnp.arange(length)
    return (pos < n_sink) | (pos >= length - n_recent)


def true_attention(q: jax.Array, k: jax.Array, scale: float, vote: str) -> jax.Array:
    """Softmax weights of each query on the fixed keys, voted per selection head.

    q [Hq, T, d], k [Hkv, L, d] -> [Hs, T, L] f32.
    """
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("k", k, 3, "[Hkv, L, d]")
    check_same("head dim", [("q", q.shape[-1]), ("k", k.shape[-1])])
    check_choice("vote", vote, VOTES)
    hq, t, d = q.shape
    hkv, length, _ = k.shape
    g = check_gqa(hq, hkv)
    logits = jnp.einsum("kgtd,kld->kgtl", q.astype(jnp.float32).reshape(hkv, g, t, d), k.astype(jnp.float32)) * scale
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.mean(p, axis=1) if vote == "kv" else p.reshape(hq, t, length)


def oracle_topk_mask(q: jax.Array, k: jax.Array, scale: float, n_keep: int, n_tail: int, vote: str) -> jax.Array:
    """Top-`n_keep` clustered keys by true attention + the exact tail.  -> bool [Hs, T, L].

    A tail longer than the context is the whole context (as `methods.Oracle` clamps it)."""
    check_rank("k", k, 3, "[Hkv, L, d]")
    check_count("n_keep", n_keep, 0)
    check_count("n_tail", n_tail, 0)
    length = k.shape[1]
    lc = length - min(n_tail, length)
    p = true_attention(q, k, scale, vote)[..., :lc]
    tail = jnp.ones(p.shape[:-1] + (length - lc,), bool)
    return jnp.concatenate([topk_mask(p, n_keep), tail], axis=-1)
