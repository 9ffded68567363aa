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


# f32 scores of one call above this many bytes are taken over key chunks with a running softmax
# (`attend_partial`). All at once, a 2048-token question block over a 128K fixed context with 32
# query heads holds 69 GB of temporaries per layer; in 2 GiB chunks 5.1 GB, at 82.8 instead of
# 72.8 ms on an H200. A 128-token block's scores fit (benchmarks/results/gpu_h200_mask_chunks/).
SCORE_BYTES = 1 << 31


def key_chunk(n_rows: int, n_keys: int, score_bytes: int | None = None) -> int:
    """Keys per chunk so that `n_rows` query rows' f32 scores fit in `score_bytes` (default
    `SCORE_BYTES`, read when called; at least 512, a multiple of 512; `n_keys` itself when all of
    them fit)."""
    budget = SCORE_BYTES if score_bytes is None else score_bytes
    c = max(512, budget // max(4 * n_rows, 1) // 512 * 512)
    return n_keys if c >= n_keys else c


def _finish(m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A running softmax's (max, sum, unnormalised output) -> (o, lse); o = 0, lse = −inf where no
    key was visible."""
    seen = l > 0
    o = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return o, lse


def attend_partial(
    q: jax.Array,      # [Hq, T, d]
    k: jax.Array,      # [Hkv, S, d]
    v: jax.Array,      # [Hkv, S, d]
    mask: jax.Array | None,  # [Hm, Tm, S] bool, Hm ∈ {1, Hkv, Hq}, Tm ∈ {1, T}; None = all visible
    scale: float,
    *,
    chunk: int | None = None,  # keys per step of the running softmax; None: `key_chunk` (all at once if they fit)
) -> Partial:
    """Softmax attention of each query over the visible keys of one set (f32).  When the scores of
    all keys at once would pass `SCORE_BYTES`, the keys are taken `chunk` at a time with
    Flash-Attention's running max and sum: the same result up to f32 rounding, memory bounded by
    the chunk."""
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
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    if s == 0:  # no key at all: nothing visible
        return Partial(jnp.zeros((hq, t, d), jnp.float32), jnp.full((hq, t), -jnp.inf, jnp.float32))
    qg = q.astype(jnp.float32).reshape(hkv, g, t, d)
    chunk = min(key_chunk(hq * t, s) if chunk is None else chunk, s)
    if chunk < s:
        return _attend_chunked(qg, k, v, mask, scale, chunk)
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


def _attend_chunked(qg, k, v, mask, scale, chunk: int) -> Partial:
    """`attend_partial` over key chunks [start, start + chunk): the last chunk starts at S − chunk
    (no padded copy of K/V) and sees only the keys no earlier chunk took."""
    from models.attention import online_softmax_step  # lazily: `models` pulls in flax

    hkv, g, t, d = qg.shape
    s = k.shape[1]
    hq = hkv * g

    def step(i, carry):
        m, l, acc = carry                                                   # [Hkv, g, T], .., [Hkv, g, T, d]
        start = jnp.minimum(i * chunk, s - chunk)
        kc = jax.lax.dynamic_slice_in_dim(k, start, chunk, axis=1).astype(jnp.float32)
        vc = jax.lax.dynamic_slice_in_dim(v, start, chunk, axis=1).astype(jnp.float32)
        sc = jnp.einsum("kgtd,kcd->kgtc", qg, kc) * scale                   # [Hkv, g, T, chunk]
        new = (start + jnp.arange(chunk)) >= i * chunk                      # keys an earlier chunk did not take
        if mask is None:
            vis = new[None, None, None, :]
        else:
            mc = jax.lax.dynamic_slice_in_dim(mask, start, chunk, axis=2)
            vis = expand_heads(mc, hq).reshape(hkv, g, mask.shape[1], chunk) & new
        sc = jnp.where(vis, sc, -jnp.inf)
        return online_softmax_step(m, l, acc, sc, lambda p: jnp.einsum("kgtc,kcd->kgtd", p, vc))

    zero = jnp.zeros((hkv, g, t), jnp.float32)
    m, l, acc = jax.lax.fori_loop(0, -(-s // chunk), step, (zero - jnp.inf, zero, jnp.zeros((hkv, g, t, d), jnp.float32)))
    o, lse = _finish(m, l, acc)
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


def retrieved_attention(
    q: jax.Array,        # [Hq, T, d]
    k_fixed: jax.Array,  # [Hkv, L, d]
    v_fixed: jax.Array,  # [Hkv, L, d]
    idx: jax.Array,      # [Hs, cap] int32 retrieved positions; Hkv divides Hs, Hs divides Hq
    count: jax.Array,    # [Hs] int32 valid entries of idx; entries past it (or outside [0, L)) are ignored
    k_new: jax.Array,    # [Hkv, S, d]
    v_new: jax.Array,    # [Hkv, S, d]
    q_pos: jax.Array,    # [T] int32
    kv_pos: jax.Array,   # [S] int32 (−1 = empty slot)
    scale: float,
    chunk: int = 512,
) -> jax.Array:
    """Exact attention over the retrieved fixed rows ∪ the causal user-input keys, gathering the
    retrieved rows `chunk` at a time with an online softmax (Flash-Attention's running max and sum)
    and stopping after the largest count: the work follows the rows retrieved, not the static
    capacity. The jnp route of a compact selection (`dispatch.attention` without a GPU); it computes
    what `pallas_kernels.sparse_attention_reference` does (duplicates counted). -> [Hq, T, d]."""
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("k_fixed", k_fixed, 3, "[Hkv, L, d]")
    check_rank("idx", idx, 2, "[Hs, cap]")
    check_rank("count", count, 1, "[Hs]")
    check_rank("k_new", k_new, 3, "[Hkv, S, d]")
    _check_positions(q, k_new, q_pos, kv_pos, "k_new")
    hq, t, d = q.shape
    hkv, n_fixed, _ = k_fixed.shape
    hs, cap = idx.shape
    check_same("selection heads", [("idx", hs), ("count", count.shape[0])])
    check_gqa(hq, hkv)
    check_gqa(hs, hkv, "selection heads of idx")
    if hq % hs:
        raise ValueError(f"query heads ({hq}) must be a multiple of the selection heads of idx ({hs})")
    r = hq // hs
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    from models.attention import online_softmax_step  # lazily: `models` pulls in flax

    chunk = min(chunk, max(cap, 1))
    n_chunks = -(-cap // chunk)
    kvh = (jnp.arange(hs, dtype=jnp.int32) * r) // (hq // hkv)                  # [Hs] KV head of each selection head
    idx = jnp.pad(idx.astype(jnp.int32), ((0, 0), (0, n_chunks * chunk - cap)))  # [Hs, n_chunks·chunk]
    cnt = jnp.clip(count.astype(jnp.int32), 0, cap)
    qs = q.astype(jnp.float32).reshape(hs, r * t, d) * scale                    # a selection head's query rows

    def step(i, carry):   # one chunk of every head's retrieval, merged into the running softmax
        m, l, acc = carry                                                        # [Hs, rT], [Hs, rT], [Hs, rT, d]
        ii = jax.lax.dynamic_slice_in_dim(idx, i * chunk, chunk, axis=1)         # [Hs, chunk]
        ok = ((i * chunk + jnp.arange(chunk))[None, :] < cnt[:, None]) & (ii >= 0) & (ii < n_fixed)
        ii = jnp.where(ok, ii, 0)
        kk = jnp.where(ok[..., None], k_fixed[kvh[:, None], ii], 0).astype(jnp.float32)   # [Hs, chunk, d]
        vv = jnp.where(ok[..., None], v_fixed[kvh[:, None], ii], 0).astype(jnp.float32)   # (rows not read: 0)
        s = jnp.where(ok[:, None, :], jnp.einsum("hrd,hcd->hrc", qs, kk), -jnp.inf)
        return online_softmax_step(m, l, acc, s, lambda p: jnp.einsum("hrc,hcd->hrd", p, vv))

    zero = jnp.zeros((hs, r * t), jnp.float32)
    n_live = (jnp.max(cnt, initial=0) + chunk - 1) // chunk                      # chunks holding a valid row
    m, l, acc = jax.lax.fori_loop(0, n_live, step, (zero - jnp.inf, zero, jnp.zeros((hs, r * t, d), jnp.float32)))
    o, lse = _finish(m, l, acc)
    fixed = Partial(o.reshape(hq, t, d), lse.reshape(hq, t))
    empty = (kv_pos < 0)[None, :, None]                                          # slots never written: not read
    new = attend_partial(q, jnp.where(empty, 0, k_new), jnp.where(empty, 0, v_new), causal_mask(q_pos, kv_pos), scale)
    return merge_partials(fixed, new).o.astype(q.dtype)


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array, scale: float
) -> jax.Array:
    """Plain causal attention over one key set by positions.  q [Hq,T,d], k/v [Hkv,S,d] -> [Hq,T,d]."""
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("k", k, 3, "[Hkv, S, d]")
    _check_positions(q, k, q_pos, kv_pos, "k")
    return attend_partial(q, k, v, causal_mask(q_pos, kv_pos), scale).o.astype(q.dtype)
