"""QUEST (Tang et al. 2024, §3.4, Alg. 1): query-aware page selection.

Keys are split into pages of `page` consecutive tokens; each page keeps the per-channel
minimum m and maximum M of its keys. A query scores a page with the upper bound

    U(q, page) = Σ_d max(q_d · M_d, q_d · m_d)  ≥  max_{k ∈ page} q·k,

and attends exactly to the top-K pages (K = token budget / page). GQA (our choice, stated in
the README): pages are chosen per KV head with the group's bound max-aggregated over its g
query heads, so one page set is read per KV head (vote="kv"); vote="q" chooses per query head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sqjax._checks import check_choice, check_count, check_float, check_gqa, check_rank, check_same, shape_of
from sqjax.selection import topk_mask
from sqjax.squeezed import VOTES


def page_bounds(k: jax.Array, page: int = 16) -> tuple[jax.Array, jax.Array]:
    """Per-page channel min/max.  k [Hkv, L, d] -> (kmin, kmax) [Hkv, P, d] f32, P = ceil(L / page).

    A ragged last page is bounded by its own keys only. The min/max run in k's own dtype (exact)
    and only the [Hkv, P, d] bounds are widened to f32: an f32 copy of bf16 keys was the 8 GiB
    request that failed at 32 KV heads x 512K on an 80 GB H100 (gpu_h100_suite_1f6c886/llama2_oom).
    """
    check_rank("k", k, 3, "[Hkv, L, d]")
    check_float("k", k)  # the ±inf padding of a ragged page needs a float dtype
    check_count("page", page, 1)
    hkv, length, d = k.shape
    n_pages = -(-length // page)
    pad = n_pages * page - length
    valid = jnp.arange(n_pages * page) < length
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0))).reshape(hkv, n_pages, page, d)
    vp = valid.reshape(n_pages, page)[None, :, :, None]
    inf = jnp.asarray(jnp.inf, k.dtype)
    kmin = jnp.min(jnp.where(vp, kp, inf), axis=2).astype(jnp.float32)
    kmax = jnp.max(jnp.where(vp, kp, -inf), axis=2).astype(jnp.float32)
    return kmin, kmax


def page_scores(q: jax.Array, kmin: jax.Array, kmax: jax.Array, vote: str = "kv") -> jax.Array:
    """Upper bound U per (selection head, token, page).  q [Hq, T, d] -> [Hs, T, P] f32."""
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("kmin", kmin, 3, "[Hkv, P, d]")
    check_same("page bounds shape", [("kmin", shape_of(kmin)), ("kmax", shape_of(kmax))])
    check_same("head dim", [("q", q.shape[-1]), ("kmin", kmin.shape[-1])])
    check_choice("vote", vote, VOTES)
    hq, t, d = q.shape
    hkv = kmin.shape[0]
    g = check_gqa(hq, hkv)
    # M_d >= m_d, so max(q_d M_d, q_d m_d) = max(q_d, 0) M_d + min(q_d, 0) m_d term by term: two f32
    # matmuls. The element-wise form's [Hkv, g, T, P, d] reduction took XLA's GPU compiler over 5
    # minutes for a 128-token block over 128K (benchmarks/results/gpu_h200_mask_chunks/)
    qg = q.astype(jnp.float32).reshape(hkv, g, t, d)
    hi = jax.lax.Precision.HIGHEST   # f32, not TF32: the bound ranks pages
    u = (jnp.einsum("kgtd,kpd->kgtp", jnp.maximum(qg, 0.0), kmax.astype(jnp.float32), precision=hi)
         + jnp.einsum("kgtd,kpd->kgtp", jnp.minimum(qg, 0.0), kmin.astype(jnp.float32), precision=hi))  # [Hkv,g,T,P]
    return jnp.max(u, axis=1) if vote == "kv" else u.reshape(hq, t, -1)


def _forced(scores: jax.Array, n_pages: int, forced_page: int | None) -> tuple[jax.Array, int]:
    """The scores with `forced_page` ranked first, and the number of pages kept (at most P)."""
    s = scores if forced_page is None else scores.at[..., forced_page].set(jnp.inf)
    return s, max(0, min(n_pages, scores.shape[-1]))


def select_pages(scores: jax.Array, n_pages: int, forced_page: int | None) -> jax.Array:
    """Top-`n_pages` pages per row, `forced_page` always included.  scores [..., P] -> bool [..., P]."""
    s, n_pages = _forced(scores, n_pages, forced_page)
    return topk_mask(s, n_pages)


def page_rows(scores: jax.Array, n_pages: int, forced_page: int | None, length: int, page: int = 16) -> jax.Array:
    """The key positions of `select_pages`' pages (the same `lax.top_k`), page by page: the compact
    form a gather reads.  scores [Hs, P] -> [Hs, K·page] int32; the last page's positions past the
    fixed context (L) are −1, which attention ignores."""
    check_rank("scores", scores, 2, "[Hs, P]")
    s, n_pages = _forced(scores, n_pages, forced_page)
    ids = jax.lax.top_k(s, n_pages)[1].astype(jnp.int32)                          # [Hs, K]
    pos = (ids[..., None] * page + jnp.arange(page, dtype=jnp.int32)).reshape(ids.shape[0], -1)
    return jnp.where(pos < length, pos, -1)


def pages_to_keys(page_mask: jax.Array, length: int, page: int = 16) -> jax.Array:
    """Expand a page mask [..., P] to a key mask [..., L] (P = ceil(L / page))."""
    check_count("page", page, 1)
    check_count("length", length, 0)
    if np.ndim(page_mask) < 1 or page_mask.shape[-1] != -(-length // page):
        raise ValueError(f"page_mask must have shape [..., P] with P = ceil(L / page) = {-(-length // page)} "
                         f"(L={length}, page={page}); got shape {shape_of(page_mask)}")
    return jnp.repeat(page_mask, page, axis=-1)[..., :length]
