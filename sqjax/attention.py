"""Reference attention (plain jnp, f32 softmax): partial results and log-sum-exp merging.

Sparse attention over a fixed context is exact attention over the union of disjoint key sets —
the retrieved fixed-context keys (exact tail included) and the user input's own causal keys —
computed as partial softmaxes and merged by log-sum-exp (Flash-Decoding):

    o = Σ_p exp(lse_p − lse) · o_p,   lse = log Σ_p exp(lse_p).

All functions are unbatched over the batch axis (vmap them); heads are grouped (GQA):
query head h reads KV head h // g, g = Hq / Hkv.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sqjax._checks import check_gqa, check_rank, check_same, shape_of


class Partial(NamedTuple):
    """Attention over one key set: normalised output and log-sum-exp of the scaled scores."""

    o: jax.Array    # [Hq, T, d] f32, softmax-normalised over this set (0 where the set is empty)
    lse: jax.Array  # [Hq, T] f32, −inf where no key of this set is visible


def expand_heads(x: jax.Array, n_heads: int) -> jax.Array:
    """Repeat axis 0 of `x` [H, ...] so it has `n_heads` rows (H divides n_heads; 1 broadcasts)."""
    h = x.shape[0]
    if h == n_heads:
        return x
    if h == 0 or n_heads % h:
        raise ValueError(f"cannot expand {h} heads to {n_heads}")
    return jnp.repeat(x, n_heads // h, axis=0)


def attend_partial(
    q: jax.Array,      # [Hq, T, d]
    k: jax.Array,      # [Hkv, S, d]
    v: jax.Array,      # [Hkv, S, d]
    mask: jax.Array | None,  # [Hm, Tm, S] bool, Hm ∈ {1, Hkv, Hq}, Tm ∈ {1, T}; None = all visible
    scale: float,
) -> Partial:
    """Softmax attention of each query over the visible keys of one set (f32)."""
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("k", k, 3, "[Hkv, S, d]")
    check_rank("v", v, 3, "[Hkv, S, d]")
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    check_same("head dim", [("q", d), ("k", k.shape[-1]), ("v", v.shape[-1])])
    check_same("KV length", [("k", s), ("v", v.shape[1])])
    g = check_gqa(hq, hkv)
    if mask is not None:
        check_rank("mask", mask, 3, "[H, T, S]")
        if mask.shape[-1] != s:
            raise ValueError(f"mask covers {mask.shape[-1]} keys but k has {s} (mask {mask.shape}, k {k.shape})")
        if mask.shape[0] not in (1, hkv, hq) or mask.shape[1] not in (1, t):
            raise ValueError(f"mask must have shape [H, T, S] with H in (1, Hkv={hkv}, Hq={hq}) and T in (1, {t}); "
                             f"got mask {shape_of(mask)}, q {shape_of(q)}, k {shape_of(k)}")
    if s == 0:  # no key at all: nothing visible
        return Partial(jnp.zeros((hq, t, d), jnp.float32), jnp.full((hq, t), -jnp.inf, jnp.float32))
    qg = q.astype(jnp.float32).reshape(hkv, g, t, d)
    scores = jnp.einsum("kgtd,ksd->kgts", qg, k.astype(jnp.float32)) * scale
    if mask is not None:
        m = expand_heads(mask, hq).reshape(hkv, g, mask.shape[1], s)
        scores = jnp.where(m, scores, -jnp.inf)
    mx = jnp.max(scores, axis=-1, keepdims=True)
    mx_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(scores - mx_safe)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("kgts,ksd->kgtd", p, v.astype(jnp.float32)) / jnp.maximum(denom, 1e-30)
    lse = jnp.where(denom[..., 0] > 0, mx_safe[..., 0] + jnp.log(jnp.maximum(denom[..., 0], 1e-30)), -jnp.inf)
    return Partial(o.reshape(hq, t, d), lse.reshape(hq, t))


def merge_partials(*parts: Partial) -> Partial:
    """Log-sum-exp merge of partial results over disjoint key sets."""
    lses = jnp.stack([p.lse for p in parts])  # [P, Hq, T]
    mx = jnp.max(lses, axis=0)
    mx_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lses - mx_safe)  # 0 for empty sets
    tot = jnp.sum(w, axis=0)
    o = sum(wi[..., None] * p.o for wi, p in zip(w, parts)) / jnp.maximum(tot, 1e-30)[..., None]
    lse = jnp.where(tot > 0, mx_safe + jnp.log(jnp.maximum(tot, 1e-30)), -jnp.inf)
    return Partial(o, lse)


def _check_positions(q, k, q_pos, kv_pos, k_name: str) -> None:
    """q_pos [T] for q [Hq, T, d] and kv_pos [S] for the keys k [Hkv, S, d]."""
    check_rank("q_pos", q_pos, 1, "[T]")
    check_rank("kv_pos", kv_pos, 1, "[S]")
    check_same("query tokens", [("q", np.shape(q)[1]), ("q_pos", np.shape(q_pos)[0])])
    check_same("keys", [(k_name, np.shape(k)[1]), ("kv_pos", np.shape(kv_pos)[0])])


def causal_mask(q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
    """[1, T, S] bool: key visible iff 0 <= kv_pos <= q_pos (kv_pos = −1 marks an empty slot)."""
    return ((kv_pos[None, :] >= 0) & (kv_pos[None, :] <= q_pos[:, None]))[None]


def fixed_context_attention(
    q: jax.Array,           # [Hq, T, d] roped queries of the user input
    k_fixed: jax.Array,     # [Hkv, L, d] fixed-context keys (roped)
    v_fixed: jax.Array,     # [Hkv, L, d]
    fixed_mask: jax.Array | None,  # [Hs, Ts, L] bool: keys retrieved (exact tail included); None = all
    k_new: jax.Array,       # [Hkv, S, d] the user input's own keys (a cache; S may exceed T)
    v_new: jax.Array,       # [Hkv, S, d]
    q_pos: jax.Array,       # [T] int32 absolute positions of the queries
    kv_pos: jax.Array,      # [S] int32 absolute positions of the new keys (−1 = empty slot)
    scale: float,
) -> jax.Array:
    """Exact attention over the retrieved fixed keys ∪ the causal user-input keys.  -> [Hq, T, d]."""
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("k_new", k_new, 3, "[Hkv, S, d]")
    _check_positions(q, k_new, q_pos, kv_pos, "k_new")
    fixed = attend_partial(q, k_fixed, v_fixed, fixed_mask, scale)
    new = attend_partial(q, k_new, v_new, causal_mask(q_pos, kv_pos), scale)
    return merge_partials(fixed, new).o.astype(q.dtype)


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array, scale: float
) -> jax.Array:
    """Plain causal attention over one key set by positions.  q [Hq,T,d], k/v [Hkv,S,d] -> [Hq,T,d]."""
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("k", k, 3, "[Hkv, S, d]")
    _check_positions(q, k, q_pos, kv_pos, "k")
    return attend_partial(q, k, v, causal_mask(q_pos, kv_pos), scale).o.astype(q.dtype)
