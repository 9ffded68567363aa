"""Training targets of SAAP's query classifier and the loss (pure JAX, per layer).

For a query at position t (roped q_t) and the prompt's roped keys k_j, the *true attention*
over the candidate keys ``n_sink <= j <= t`` (the attention sink, position 0, is excluded and
the rest renormalised, SAAP App. A) is

    A_tj = softmax_j(q_t · k_j / sqrt(d)),

the *nearest key* is its argmax j*, and the query is **long-range** when ``t − j* > min_distance``
(strictly, as in "more than 1024 tokens away"). With one-hot key buckets H_k [T, C] the target is
the attention mass per bucket, ``(A H_k)_tc = Σ_{j: label_j = c} A_tj``: a distribution over C
buckets for every query (sums to one).

Loss (`kl_loss`): row-wise KL(target ‖ f_q) = Σ_c t_c (log t_c − log p_c), 0·log 0 = 0, averaged
over rows. This is what the paper writes as ``KLDiv(f_q(Q), A H_k)`` in PyTorch's convention
(``nn.KLDivLoss(input=log f_q, target=A H_k)`` computes KL(target ‖ prediction)). The forward
direction is also the right one for retrieval: it is mass-covering, i.e. it punishes the
classifier for putting little probability on a bucket that holds attention mass (a recall
loss at search time), while putting probability on an empty-mass bucket only costs selectivity.
The reverse KL would be mode-seeking and would happily drop secondary buckets.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.rope import apply_rope


def rope_heads(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Apply RoPE to head-major vectors x [H, T, d] at positions [T] (float32 out)."""
    return apply_rope(x.astype(jnp.float32), jnp.asarray(positions)[None, :], inv_freq)


@functools.partial(jax.jit, static_argnames=("n_buckets", "n_sink"))
def _chunk_stats(qc, pc, k, labels, *, n_buckets: int, n_sink: int):
    """One query chunk against keys 0..S-1.  qc [Hq, m, d], pc [m], k [Hkv, S, d], labels [P, Hkv, S]."""
    hq, m, d = qc.shape
    hkv, s_len, _ = k.shape
    g = hq // hkv
    key_pos = jnp.arange(s_len)
    s = jnp.einsum("kgnd,ktd->kgnt", qc.reshape(hkv, g, m, d), k) * (1.0 / math.sqrt(d))
    visible = (key_pos[None, :] >= n_sink) & (key_pos[None, :] <= pc[:, None])  # [m, S]
    s = jnp.where(visible, s, -jnp.inf)
    any_vis = jnp.any(visible, axis=-1)
    arg = jnp.argmax(s, axis=-1)  # first maximum, like numpy
    dist = jnp.where(any_vis, pc - arg, -1).astype(jnp.int32)
    mx = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0))
    den = jnp.sum(e, axis=-1, keepdims=True)
    a = e / jnp.where(den > 0, den, 1.0)  # [Hkv, g, m, S]

    onehot = jax.nn.one_hot(labels, n_buckets, dtype=jnp.float32)  # [P, Hkv, S, C]
    mass = jnp.einsum("kxt,pktc->pkxc", a.reshape(hkv, g * m, s_len), onehot)  # [P, Hkv, g*m, C]
    return dist.reshape(hq, m), mass.reshape(labels.shape[0], hq, m, n_buckets)


@functools.partial(jax.jit, static_argnames=("n_buckets", "n_sink"))
def _prefix_counts(labels, q_pos, *, n_buckets: int, n_sink: int):
    t_len = labels.shape[-1]
    cand = (jnp.arange(t_len) >= n_sink).astype(jnp.int32)[None, None, :, None]
    cum = jnp.cumsum(jax.nn.one_hot(labels, n_buckets, dtype=jnp.int32) * cand, axis=2)  # [P, Hkv, T, C]
    idx = jnp.clip(q_pos, 0, t_len - 1)
    return jnp.where((q_pos >= n_sink)[None, None, :, None], cum[:, :, idx], 0)


def query_stats(q, k, q_pos, labels, *, n_buckets: int, n_sink: int = 1, chunk: int = 256,
                with_counts: bool = False, key_block: int = 512):
    """Nearest-key distances and bucket attention masses of sampled queries, for P partitions.

    q       [Hq, n, d]    roped queries at positions q_pos
    k       [Hkv, T, d]   roped keys at positions 0..T-1 (T >= max(q_pos) + 1)
    q_pos   int32 [n]     absolute query positions
    labels  int32 [P, Hkv, T]  bucket of every key under P partitions (entries for j < n_sink unused)

    Returns ``(dist int32 [Hq, n], mass float32 [P, Hq, n, C], counts int32 [P, Hkv, n, C] | None)``:
    dist = t − argmax_j A_tj (−1 when no candidate key is visible: t < n_sink), mass = A·H_k
    (rows sum to one; zero rows when nothing is visible), counts = number of candidate keys
    ``n_sink <= j <= t`` in each bucket (for selectivity).

    Queries are processed in chunks of `chunk` (sorted by position); a chunk only reads the
    keys up to its last position (rounded up to `key_block`, so few shapes get compiled):
    memory ~ Hq × chunk × T floats, and the causal half of the work is skipped.
    """
    q = jnp.asarray(q, jnp.float32)
    k = jnp.asarray(k, jnp.float32)
    labels = jnp.asarray(labels, jnp.int32)
    pos_np = np.asarray(q_pos, np.int64)
    hq, n, _ = q.shape
    t_len = k.shape[1]
    order = np.argsort(pos_np, kind="stable")
    inv = np.empty_like(order)
    inv[order] = np.arange(n)
    dists, masses = [], []
    for s in range(0, n, chunk):
        idx = order[s:s + chunk]
        m = len(idx)
        pc = np.full((chunk,), -1, np.int64)
        pc[:m] = pos_np[idx]
        qc = jnp.take(q, jnp.asarray(np.pad(idx, (0, chunk - m))), axis=1)
        kmax = int(min(t_len, -(-(int(pc.max()) + 1) // key_block) * key_block)) if m else key_block
        kmax = max(kmax, 1)
        d_c, m_c = _chunk_stats(qc, jnp.asarray(pc, jnp.int32), k[:, :kmax], labels[..., :kmax],
                                n_buckets=n_buckets, n_sink=n_sink)
        dists.append(d_c[:, :m])
        masses.append(m_c[:, :, :m])
    if n:
        inv_j = jnp.asarray(inv)
        dist = jnp.take(jnp.concatenate(dists, axis=1), inv_j, axis=1)
        mass = jnp.take(jnp.concatenate(masses, axis=2), inv_j, axis=2)
    else:
        dist = jnp.zeros((hq, 0), jnp.int32)
        mass = jnp.zeros((labels.shape[0], hq, 0, n_buckets), jnp.float32)
    counts = _prefix_counts(labels, jnp.asarray(q_pos, jnp.int32), n_buckets=n_buckets, n_sink=n_sink) if with_counts else None
    return dist, mass, counts


def long_range_mask(dist: jax.Array, min_distance: int) -> jax.Array:
    """bool: the query's argmax-attention key is more than `min_distance` tokens behind it."""
    return dist > min_distance


def kl_rows(target: jax.Array, logits: jax.Array) -> jax.Array:
    """Row-wise KL(target ‖ softmax(logits)) over the last axis, 0·log 0 = 0.  [..., C] -> [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    t = target.astype(jnp.float32)
    return jnp.sum(jax.scipy.special.xlogy(t, t) - t * logp, axis=-1)


def kl_loss(target: jax.Array, logits: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Weighted mean over rows of `kl_rows` (weights None = plain mean)."""
    rows = kl_rows(target, logits)
    if weights is None:
        return jnp.mean(rows)
    w = weights.astype(jnp.float32)
    return jnp.sum(rows * w) / jnp.maximum(jnp.sum(w), 1e-12)
