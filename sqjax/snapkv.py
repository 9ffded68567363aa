"""SnapKV (Li et al. 2024, §4, Listing 1): observation-window voting, pooling, per-head top-k.

At prefill of the fixed context, the last `window` queries attend (causally inside the
window) to all keys; their softmax weights on the prefix are summed over the window,
1-D pooled (kernel `kernel`, padding kernel//2, stride 1) and the top `cap − window` prefix
positions per head are kept, plus the window itself. Everything else is evicted.
GQA (the cache keeps Hkv heads): the group's votes are averaged per KV head.
With the document's own tail as window the selection is query-agnostic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sqjax._checks import check_choice, check_count, check_gqa, check_rank, check_same
from sqjax.selection import topk_mask

POOLS = ("max", "avg")


def check_kernel(kernel: int) -> None:
    """The pooling kernel: a positive odd int (a window centred on each position)."""
    check_count("kernel", kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (a window centred on each position); got {kernel}")


def window_votes(q_win: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """Σ over window queries of softmax(q·k·s) on prefix keys.  q_win [Hq,w,d], k [Hkv,L,d] -> [Hq, L−w]."""
    check_rank("q_win", q_win, 3, "[Hq, w, d]")
    check_rank("k", k, 3, "[Hkv, L, d]")
    check_same("head dim", [("q_win", q_win.shape[-1]), ("k", k.shape[-1])])
    hq, w, d = q_win.shape
    hkv, length, _ = k.shape
    g = check_gqa(hq, hkv)
    if w >= length:
        raise ValueError(f"window ({w}) must be shorter than the fixed context ({length})")
    logits = jnp.einsum("kgwd,kld->kgwl", q_win.astype(jnp.float32).reshape(hkv, g, w, d), k.astype(jnp.float32)) * scale
    q_pos = length - w + jnp.arange(w)
    causal = jnp.arange(length)[None, :] <= q_pos[:, None]  # [w, L]
    attn = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.sum(attn[..., : length - w], axis=2).reshape(hq, length - w)


def pool1d(x: jax.Array, kernel: int, pool: str) -> jax.Array:
    """Stride-1 pooling along the last axis with padding kernel//2 (odd `kernel`: length preserved)."""
    check_kernel(kernel)
    check_choice("pool", pool, POOLS)
    pad = kernel // 2
    if pool == "max":
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], constant_values=-jnp.inf)
        out = jax.lax.reduce_window(xp, -jnp.inf, jax.lax.max, (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim, "VALID")
    else:  # zero padding counted in the average (torch avg_pool1d default count_include_pad=True)
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
        out = jax.lax.reduce_window(xp, 0.0, jax.lax.add, (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim, "VALID") / kernel
    return out[..., : x.shape[-1]]


def snapkv_keep(
    q_win: jax.Array,  # [Hq, w, d] roped queries of the fixed context's last w tokens
    k: jax.Array,      # [Hkv, L, d] roped keys
    capacity: int,     # positions kept per KV head, window included
    scale: float,
    kernel: int = 7,
    pool: str = "max",
) -> jax.Array:
    """Kept positions per KV head (exactly `capacity` of them).  -> bool [Hkv, L]."""
    check_rank("q_win", q_win, 3, "[Hq, w, d]")
    check_rank("k", k, 3, "[Hkv, L, d]")
    hq, w, _ = q_win.shape
    hkv, length, _ = k.shape
    if not w <= capacity <= length:
        raise ValueError(f"capacity must lie in [window={w}, L={length}]; got {capacity}")
    votes = pool1d(window_votes(q_win, k, scale), kernel, pool)  # [Hq, L−w]
    votes = jnp.mean(votes.reshape(hkv, hq // hkv, -1), axis=1)   # [Hkv, L−w]
    n_keep = capacity - w
    keep = jnp.zeros((hkv, length), bool).at[:, length - w:].set(True)
    prefix = topk_mask(votes, n_keep)  # [Hkv, L−w]
    return keep.at[:, : length - w].set(prefix)
