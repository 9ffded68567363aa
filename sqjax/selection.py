"""What a method's lookup hands to attention: which fixed-context keys each head reads.

`Selection.mask` [Hs, Ts, L] marks the fixed-context keys attended (Ts = 1: one set for the
whole query block; Ts = T: one set per token). `kv_rows` and `meta_rows` count what the
lookup and the attention read, in key-sized rows, for the KV-budget accounting (`budget.py`).
`retrieval` carries the compact form a GPU kernel reads, when the method has one: positions +
counts (`squeezed.Retrieval`), QUEST's selected pages (`Pages`) or SAAP's visited buckets
(`Buckets`); `sqjax.dispatch.attention` picks the kernel by its type. Without a GPU, QUEST's
decode pages and SnapKV's kept rows come as a `Retrieval` of their positions, which
`dispatch.attention` gathers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Selection(NamedTuple):
    mask: jax.Array | None   # [Hs, Ts, L] bool; None = every fixed key (dense)
    kv_rows: jax.Array       # [Hs, Ts] int32 fixed-context K/V rows read
    meta_rows: jax.Array     # [Hs, Ts] f32 key-sized metadata rows read (centroids, page bounds, ...)
    overflow: jax.Array      # [Hs] bool: a capacity was exceeded (see the method's overflow policy)
    retrieval: object = None  # squeezed.Retrieval (idx [Hs,cap], count [Hs]), Pages, Buckets or None


class Pages(NamedTuple):
    """QUEST decode on the Pallas path: the selected pages of each selection head."""

    page_idx: jax.Array  # [Hs, K] int32 page ids (-1 = none)
    page_size: int


class Buckets(NamedTuple):
    """SAAP decode on the Pallas path: CSR inverted lists and the visited buckets."""

    off: jax.Array         # [Hkv, C + 1] int32
    lst: jax.Array         # [Hkv, N] int32 key positions grouped by bucket
    bucket_idx: jax.Array  # [Hkv, l] int32 visited buckets
    n_sink: int            # the dense part: the first n_sink and the last n_recent positions
    n_recent: int


def topk_mask(scores: jax.Array, k: int) -> jax.Array:
    """bool mask of the top-k entries along the last axis (exactly k set when k <= n)."""
    n = scores.shape[-1]
    k = max(0, min(k, n))
    if k == 0:
        return jnp.zeros(scores.shape, bool)
    _, idx = jax.lax.top_k(scores, k)
    flat_idx = idx.reshape(-1, k)
    out = jax.vmap(lambda i: jnp.zeros((n,), bool).at[i].set(True))(flat_idx)
    return out.reshape(scores.shape)


def dense_selection(n_heads: int, length: int) -> Selection:
    return Selection(
        None,
        jnp.full((n_heads, 1), length, jnp.int32),
        jnp.zeros((n_heads, 1), jnp.float32),
        jnp.zeros((n_heads,), bool),
    )


def from_mask(mask: jax.Array, meta_rows=0.0) -> Selection:
    """Selection from a mask [Hs, Ts, L] (rows read = keys set)."""
    rows = jnp.sum(mask, axis=-1).astype(jnp.int32)
    meta = jnp.broadcast_to(jnp.asarray(meta_rows, jnp.float32), rows.shape)
    return Selection(mask, rows, meta, jnp.zeros(mask.shape[:1], bool))
