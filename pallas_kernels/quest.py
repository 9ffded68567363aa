"""QUEST page selection and page-sparse decode attention (Tang et al., Alg. 1, Section 3.4).

Keys are grouped in pages of ``page`` consecutive tokens; per page and channel the
minimum ``m`` and maximum ``M`` of the keys are kept.  For a query ``q`` the upper
bound of ``q.k`` over a page is::

    U = sum_d max(q_d M_d, q_d m_d)                                      (Alg. 1)

The top-K pages by ``U`` are attended exactly; the page holding the newest token
is always kept.  GQA (sqjax's choice): with ``vote="kv"`` a KV head's page score is
the max of ``U`` over its ``g`` query heads (a page is kept if any head of the group
would keep it, and every KV row is loaded once per group); ``vote="q"`` keeps one
page set per query head.

``page_idx [Hs, K]`` conventions: entries outside ``[0, P)`` (e.g. -1 padding) are
ignored; a page listed twice is attended twice (``quest_select`` never does that);
the ragged last page only contributes its ``L - (P-1)*page`` real rows.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm
from pallas_kernels import _attention_core as core
from pallas_kernels._attention_core import AttentionConfig
from pallas_kernels._dispatch import pallas_call, resolve_backend
from pallas_kernels.sparse_attention import sparse_attention_reference, _validate as _validate_attn

__all__ = ["QuestScoreConfig", "quest_page_minmax", "quest_page_scores",
           "quest_page_scores_reference", "quest_select", "quest_decode_attention",
           "quest_decode_attention_reference", "AttentionConfig"]


@dataclasses.dataclass(frozen=True)
class QuestScoreConfig:
  """block_p: pages per program (power of two >= 16)."""
  block_p: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    cm.check_pow2("block_p", self.block_p)
    cm.check_warps_stages(self.num_warps, self.num_stages)


@functools.partial(jax.jit, static_argnames=("page", "backend"))
def quest_page_minmax(k: jax.Array, page: int = 16, *,
                      backend: str = "auto") -> tuple[jax.Array, jax.Array]:
  """k [Hkv, L, d] -> (kmin, kmax) [Hkv, P, d], P = ceil(L / page), k's dtype.

  The ragged last page takes the min/max of its real rows only.  (Offline, once per
  document: plain jnp on every backend; ``backend`` is only validated.)
  """
  resolve_backend(backend)
  if k.ndim != 3 or k.shape[1] < 1:
    raise ValueError(f"k must be [Hkv, L, d] with L >= 1, got {tuple(k.shape)}")
  if not isinstance(page, int) or page < 1:
    raise ValueError(f"page must be a positive int, got {page!r}")
  hkv, num_l, d = k.shape
  num_p = cm.cdiv(num_l, page)
  pad = num_p * page - num_l
  kf = k.astype(jnp.float32)
  lo = jnp.pad(kf, ((0, 0), (0, pad), (0, 0)), constant_values=jnp.inf)
  hi = jnp.pad(kf, ((0, 0), (0, pad), (0, 0)), constant_values=-jnp.inf)
  kmin = jnp.min(lo.reshape(hkv, num_p, page, d), axis=2).astype(k.dtype)
  kmax = jnp.max(hi.reshape(hkv, num_p, page, d), axis=2).astype(k.dtype)
  return kmin, kmax


def _score_kernel(q_ref,     # [Hq, d]
                  mn_ref,    # [Hkv * P, d]
                  mx_ref,    # [Hkv * P, d]
                  o_ref,     # [Hs, nPB * Bp]
                  *, num_p, group, block_p, d, vote):
  kv = pl.program_id(0)
  pb = pl.program_id(1)
  p = pb * block_p + jnp.arange(block_p, dtype=jnp.int32)
  pv = p < num_p
  rows = kv * num_p + p
  mn = cm.gather_rows(mn_ref, rows, d, pv).astype(jnp.float32)    # [Bp, d]
  mx = cm.gather_rows(mx_ref, rows, d, pv).astype(jnp.float32)
  best = jnp.full((block_p,), -jnp.inf, jnp.float32)
  for r in range(group):                                          # static, g <= 16
    qh = q_ref[kv * group + r, :].astype(jnp.float32)              # [d]
    u = jnp.sum(jnp.maximum(qh[None, :] * mx, qh[None, :] * mn), axis=1)   # [Bp]
    if vote == "q":
      o_ref[kv * group + r, pl.ds(pb * block_p, block_p)] = u
    else:
      best = jnp.maximum(best, u)
  if vote == "kv":
    o_ref[kv, pl.ds(pb * block_p, block_p)] = best


def _check_scores_inputs(q, kmin, kmax, vote):
  shapes = cm.shape_str(q=q, kmin=kmin, kmax=kmax)
  if q.ndim != 2 or kmin.ndim != 3 or kmax.shape != kmin.shape or q.shape[1] != kmin.shape[2]:
    raise ValueError(f"need q [Hq, d] and kmin, kmax [Hkv, P, d]; got {shapes}")
  cm.check_heads(q.shape[0], kmin.shape[0], shapes)
  cm.check_float("q", q)
  cm.check_same_dtype(kmin=kmin, kmax=kmax)
  cm.check_vote(vote)


@functools.partial(jax.jit, static_argnames=("vote",))
def quest_page_scores_reference(q, kmin, kmax, *, vote="kv"):
  """Plain-jnp Alg. 1 page scores: [Hs, P] f32."""
  hq, d = q.shape
  hkv, num_p, _ = kmin.shape
  g = hq // hkv
  qf = q.astype(jnp.float32).reshape(hkv, g, 1, d)
  u = jnp.sum(jnp.maximum(qf * kmax.astype(jnp.float32)[:, None],
                          qf * kmin.astype(jnp.float32)[:, None]), axis=-1)   # [Hkv, g, P]
  return jnp.max(u, axis=1) if vote == "kv" else u.reshape(hq, num_p)


@functools.partial(jax.jit, static_argnames=("vote", "backend", "config"))
def quest_page_scores(
    q: jax.Array,      # [Hq, d]
    kmin: jax.Array,   # [Hkv, P, d]
    kmax: jax.Array,   # [Hkv, P, d]
    *,
    vote: str = "kv",
    backend: str = "auto",
    config: QuestScoreConfig | None = None,
) -> jax.Array:
  """Page upper bounds ``U = sum_d max(q_d M_d, q_d m_d)`` -> [Hs, P] f32.

  ``vote="kv"``: max over the g query heads of each KV head (Hs = Hkv);
  ``vote="q"``: one row per query head (Hs = Hq).  No softmax scale (ranking only).
  """
  _check_scores_inputs(q, kmin, kmax, vote)
  be = resolve_backend(backend)
  if be == "reference":
    return quest_page_scores_reference(q, kmin, kmax, vote=vote)
  cfg = config or QuestScoreConfig()
  hq, d = q.shape
  hkv, num_p, _ = kmin.shape
  dp = cm.padded_head_dim(d)
  hs = cm.num_selection_heads(hq, hkv, vote)
  block_p = min(cfg.block_p, max(16, cm.next_pow2(num_p)))
  n_pb = cm.cdiv(num_p, block_p)
  kernel = functools.partial(_score_kernel, num_p=num_p, group=hq // hkv, block_p=block_p,
                             d=dp, vote=vote)
  out = pallas_call(
      kernel, backend=be, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      grid=(hkv, n_pb),
      out_shape=jax.ShapeDtypeStruct((hs, n_pb * block_p), jnp.float32),
      name="quest_page_scores",
  )(cm.pad_axis(q, 1, dp), cm.pad_axis(kmin, 2, dp).reshape(hkv * num_p, dp),
    cm.pad_axis(kmax, 2, dp).reshape(hkv * num_p, dp))
  return out[:, :num_p]


@functools.partial(jax.jit, static_argnames=("k_pages", "backend"))
def quest_select(scores: jax.Array, k_pages: int, force_page=-1, *,
                 backend: str = "auto") -> jax.Array:
  """Top-``k_pages`` pages per row of ``scores [Hs, P]`` -> page_idx [Hs, k_pages] int32.

  ``force_page`` (int or traced scalar; the page holding the newest fixed-context
  token, normally P - 1) is always included; negative or >= P = none.  Rows are
  sorted by page id (ascending, for locality).  If ``k_pages > P`` the extra entries
  are -1 (ignored by ``quest_decode_attention``).  NaN scores rank last.  Plain jnp
  (``lax.top_k``) on every backend; ``backend`` is only validated.
  """
  resolve_backend(backend)
  if scores.ndim != 2:
    raise ValueError(f"scores must be [Hs, P], got {tuple(scores.shape)}")
  if not isinstance(k_pages, int) or k_pages < 1:
    raise ValueError(f"k_pages must be a positive int, got {k_pages!r}")
  hs, num_p = scores.shape
  kk = min(k_pages, num_p)
  s = jnp.where(jnp.isnan(scores), -jnp.inf, scores.astype(jnp.float32))
  s = jnp.where(jnp.arange(num_p)[None, :] == jnp.asarray(force_page), jnp.inf, s)
  _, idx = lax.top_k(s, kk)
  idx = jnp.sort(idx.astype(jnp.int32), axis=1)
  if kk < k_pages:
    idx = jnp.pad(idx, ((0, 0), (0, k_pages - kk)), constant_values=-1)
  return idx


def _as3(q, q_pos):
  return (q[:, None, :], True) if q.ndim == 2 else (q, False)


def _expand_pages(page_idx, page_size, num_l):
  """page_idx [Hs, K] -> token positions [Hs, K * ps] (-1 where invalid)."""
  num_p = cm.cdiv(num_l, page_size)
  pos = page_idx[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)
  ok = ((page_idx >= 0) & (page_idx < num_p))[:, :, None] & (pos < num_l)
  return jnp.where(ok, pos, -1).reshape(page_idx.shape[0], -1).astype(jnp.int32)


@cm.static_jit(("scale", "page_size", "return_lse"))
def quest_decode_attention_reference(q, k, v, page_idx, k_new, v_new, q_pos, kv_pos_new, *,
                                     scale, page_size=16, return_lse=False):
  """Plain-jnp page-sparse attention (pages expanded to positions)."""
  q3, squeeze = _as3(q, q_pos)
  idx = _expand_pages(page_idx, page_size, k.shape[1])
  counts = jnp.full((idx.shape[0],), idx.shape[1], jnp.int32)
  out = sparse_attention_reference(q3, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new,
                                   scale=scale, return_lse=True)
  o, lse = out
  if squeeze:
    o, lse = o[:, 0], lse[:, 0]
  return (o, lse) if return_lse else o


@cm.static_jit(("scale", "page_size", "return_lse", "backend", "config"))
def quest_decode_attention(
    q: jax.Array,            # [Hq, d] (or [Hq, T, d])
    k: jax.Array,            # [Hkv, L, d]
    v: jax.Array,            # [Hkv, L, d]
    page_idx: jax.Array,     # [Hs, K] int32 selected pages
    k_new: jax.Array,        # [Hkv, S, d]
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [T] int32 (T = 1 for q [Hq, d])
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty)
    *,
    scale: float,
    page_size: int = 16,
    return_lse: bool = False,
    backend: str = "auto",
    config: AttentionConfig | None = None,
):
  """Exact attention over whole selected pages + the causal new part.

  The kernel gathers whole ``page_size``-row pages (row ``j`` of a head's work is
  page ``page_idx[s, j // ps]``, row ``j % ps``), split over programs in chunks and
  merged by log-sum-exp like ``sparse_attention``.  Returns o with q's shape and
  dtype (+ lse f32 if ``return_lse``).
  """
  q3, squeeze = _as3(q, q_pos)
  if page_idx.ndim != 2:
    raise ValueError(f"page_idx must be [Hs, K], got {tuple(page_idx.shape)}")
  cm.check_int32("page_idx", page_idx)
  counts = jnp.zeros((page_idx.shape[0],), jnp.int32)
  _validate_attn(q3, k, v, page_idx, counts, k_new, v_new, q_pos, kv_pos_new)
  if not isinstance(page_size, int) or page_size < 1:
    raise ValueError(f"page_size must be a positive int, got {page_size!r}")
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return quest_decode_attention_reference(q, k, v, page_idx, k_new, v_new, q_pos, kv_pos_new,
                                            scale=scale, page_size=page_size,
                                            return_lse=return_lse)
  hq, seq_len, d = q3.shape
  hs, n_pages = page_idx.shape
  num_s = k_new.shape[1]
  n_rows = n_pages * page_size
  cfg, lay, chunk, chunk_new = core.work_plan(hq, seq_len, d, hs, n_rows, num_s, config)
  blocks, actives, wg = core.list_and_new_blocks(hs, n_rows, None, num_s, chunk, chunk_new)
  table, active = core.build_table(blocks, actives, hs)
  o, m, l = core.attention_partials(
      q3, k, v, k_new if num_s else None, v_new, q_pos, kv_pos_new, page_idx, table,
      lay=lay, n_slots=hs * wg, scale=scale, page_size=page_size, cfg=cfg, backend=be)
  out, lse = core.merge_partials(o, m, l, active, lay=lay, d=d)
  out = out.astype(q.dtype)
  if squeeze:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out
