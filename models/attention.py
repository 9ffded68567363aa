"""Dense causal attention over a KV cache: the default ``attn_fn`` of `models.forward`.

Shapes: B batch, T query tokens, S cache slots, Hq query heads, Hkv KV heads, g = Hq / Hkv,
d head dim. Keys/queries are roped. A key is visible to a query iff ``0 <= kv_pos <= q_pos``
(``kv_pos = -1`` marks an empty or padding slot). A query with no visible key (a padding
query, ``q_pos = -1``) gets a zero output, never NaN. Softmax in float32, scale 1/sqrt(d).

`dense_attention` picks one of two exact implementations (same math, f32 rounding apart):
  * few query rows (decode): one pass, the cache as the row-major left operand of the dots
    (XLA:CPU then reads it in place instead of transposing it every step);
  * many query rows (prefill): flash-style blocks of queries x keys with an online softmax;
    a key block none of whose slots is visible to the query block (empty capacity, future
    positions) is skipped by `lax.cond`, so a chunk costs what its visible keys cost.
`dense_attention_reference` is the plain one-shot version the tests compare against.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_SMALL_QUERY_ROWS = 16  # T * g up to which the one-pass decode path is used
_BLOCK_Q = 256
_BLOCK_K = 512


def causal_mask(q_pos, kv_pos):
    """bool [B, T, S]: key slot s visible to query t."""
    kv = kv_pos[:, None, :]  # [B, 1, S]
    return (kv >= 0) & (kv <= q_pos[:, :, None])


def _check(q, k):
    Hq, Hkv = q.shape[2], k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    return Hq // Hkv


def _masked_softmax(s, mask):
    """Softmax over the last axis of s where mask, exact zeros for rows with nothing visible."""
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def dense_attention_reference(q, k, v, q_pos, kv_pos, *, scale: float | None = None):
    """One-shot masked GQA attention (the reference). Shapes as `dense_attention`."""
    B, T, Hq, d = q.shape
    g = _check(q, k)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(B, T, k.shape[1], g, d)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    p = _masked_softmax(s * jnp.float32(scale), causal_mask(q_pos, kv_pos)[:, None, None])
    o = jnp.einsum("bkgts,bksd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, Hq, d).astype(q.dtype)


def _decode_attention(q, k, v, q_pos, kv_pos, scale):
    B, T, Hq, d = q.shape
    Hkv, g = k.shape[1], Hq // k.shape[1]
    dims = (((3,), (2,)), ((0, 1), (0, 1)))  # contract d (resp. S), batch over (B, Hkv)
    qk = jnp.transpose(q.reshape(B, T, Hkv, g, d), (0, 2, 4, 3, 1)).reshape(B, Hkv, d, g * T)
    s = jax.lax.dot_general(k, qk.astype(k.dtype), dims, preferred_element_type=jnp.float32)  # [B,Hkv,S,gT]
    s = jnp.transpose(s.reshape(B, Hkv, -1, g, T), (0, 1, 3, 4, 2))  # [B, Hkv, g, T, S]
    p = _masked_softmax(s * jnp.float32(scale), causal_mask(q_pos, kv_pos)[:, None, None])
    pv = p.reshape(B, Hkv, g * T, -1).astype(v.dtype)
    o = jax.lax.dot_general(pv, v, dims, preferred_element_type=jnp.float32)  # [B, Hkv, gT, d]
    return jnp.transpose(o.reshape(B, Hkv, g, T, d), (0, 3, 1, 2, 4)).reshape(B, T, Hq, d)


def _pick_block(n: int, preferred: int) -> tuple[int, int]:
    """(block, padded n): n itself if small, a block dividing n if one of preferred/2/4 does, else pad."""
    if n <= preferred:
        return n, n
    for b in (preferred, preferred // 2, preferred // 4):
        if b and n % b == 0:
            return min(b, n), n
    b = min(preferred, -(-n // 128) * 128)
    return b, -(-n // b) * b


def online_softmax_step(m, l, acc, s, weighted_values):
    """One more block of keys in Flash-Attention's running softmax.

    m, l [...]: running max and sum of exp(s − m); acc [..., d]: the unnormalised output; s [..., n]
    f32 scaled scores of the block (−inf = not visible); weighted_values: p [..., n] -> [..., d]
    (the block's values weighted by p). -> (m, l, acc) after the block; o = acc / l once l > 0.
    """
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])  # 0 where not visible
    corr = jnp.exp(m - m_safe)          # 0 while nothing was seen
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + weighted_values(p)


def _blocked_attention(q, k, v, q_pos, kv_pos, scale):
    B, T, Hq, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    bq, Tp = _pick_block(T, _BLOCK_Q)
    bk, Sp = _pick_block(S, _BLOCK_K)
    if Tp != T:  # padding queries: position -1, zero output, sliced away
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, Tp - T)), constant_values=-1)
    if Sp != S:  # padding slots: position -1, never visible
        k = jnp.pad(k, ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
        kv_pos = jnp.pad(kv_pos, ((0, 0), (0, Sp - S)), constant_values=-1)
    nq, nk = Tp // bq, Sp // bk
    # [nq, B, Hkv, g, bq, d] query blocks, [nq, B, bq] their positions
    qb = jnp.transpose(q.reshape(B, nq, bq, Hkv, g, d), (1, 0, 3, 4, 2, 5))
    qpb = jnp.transpose(q_pos.reshape(B, nq, bq), (1, 0, 2))
    kv_valid = kv_pos >= 0
    # per key block: smallest valid position (a block is visible iff some query reaches it)
    blk_min = jnp.min(jnp.where(kv_valid, kv_pos, jnp.iinfo(jnp.int32).max).reshape(B, nk, bk), axis=-1)

    def one_query_block(args):
        qi, qpi = args  # [B, Hkv, g, bq, d], [B, bq]
        reach = jnp.max(qpi, axis=-1)  # [B] largest query position in the block

        def body(carry, j):
            def compute(carry):
                m, l, acc = carry  # [B,Hkv,g,bq], [B,Hkv,g,bq], [B,Hkv,g,bq,d]
                kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)  # [B, Hkv, bk, d]
                vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
                pj = jax.lax.dynamic_slice_in_dim(kv_pos, j * bk, bk, axis=1)  # [B, bk]
                s = jnp.einsum("bkgtd,bksd->bkgts", qi, kj.astype(qi.dtype), preferred_element_type=jnp.float32)
                mask = ((pj >= 0)[:, None, :] & (pj[:, None, :] <= qpi[:, :, None]))[:, None, None]
                s = jnp.where(mask, s * jnp.float32(scale), -jnp.inf)
                return online_softmax_step(m, l, acc, s, lambda p: jnp.einsum(
                    "bkgts,bksd->bkgtd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32))

            visible = jnp.any(blk_min[:, j] <= reach)
            return jax.lax.cond(visible, compute, lambda c: c, carry), None

        init = (
            jnp.full((B, Hkv, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((B, Hkv, g, bq), jnp.float32),
            jnp.zeros((B, Hkv, g, bq, d), jnp.float32),
        )
        (_, l, acc), _ = jax.lax.scan(body, init, jnp.arange(nk))
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    out = jax.lax.map(one_query_block, (qb, qpb))  # [nq, B, Hkv, g, bq, d]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, Tp, Hq, d)
    return out[:, :T]


def dense_attention(q, k, v, q_pos, kv_pos, *, scale: float | None = None):
    """Masked GQA attention.

    q: [B, T, Hq, d]; k, v: [B, Hkv, S, d]; q_pos: int32 [B, T]; kv_pos: int32 [B, S].
    Returns [B, T, Hq, d] in q's dtype.
    """
    B, T, Hq, d = q.shape
    g = _check(q, k)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if T * g <= _SMALL_QUERY_ROWS:
        out = _decode_attention(q, k, v, q_pos, kv_pos, scale)
    else:
        out = _blocked_attention(q, k, v, q_pos, kv_pos, scale)
    return out.astype(q.dtype)


def default_attn_fn(layer: int, q, cache_k, cache_v, q_pos, kv_pos, attn_state):
    """`attn_fn` hook signature, dense causal attention (ignores ``layer`` and ``attn_state``)."""
    del layer, attn_state
    return dense_attention(q, cache_k, cache_v, q_pos, kv_pos)
