"""Two-level (hierarchical) centroid lookup of Squeezed Attention (Eq. 2-3, App. D).

Level 1 (coarse centroids ``C^(1)``, ``N^(1)`` keys under each)::

    S1_i = exp(s q.C1_i) / sum_j N1_j exp(s q.C1_j)                      (Eq. 2)

clusters with ``S1 <= T1`` are dropped; the level-2 children of the survivors are
the *candidates*, scored with the denominator restricted to the candidates::

    S2_l = exp(s q.C2_l) / sum_{m in candidates} N2_m exp(s q.C2_m)      (Eq. 3)

and ``selected = S2 > T2``.  Prefill averages each level's scores over the T query
tokens; ``vote`` works as in ``centroid_lookup`` (``"kv"``: mean over the group's
query heads, one candidate set per KV head; ``"q"``: per query head).  Invalid
clusters (count 0) are never candidates' parents, never in a denominator, never
selected.  The cost measure ``n_touched[s] = C1 + (number of candidates)`` is the
number of centroid rows scored for selection head ``s``.

Tree layout: level-2 clusters grouped by parent, CSR style, per KV head:
``children[kv, child_offsets[kv, p] : child_offsets[kv, p + 1]]`` are the level-2
ids under level-1 cluster ``p`` (``children_csr`` builds it from a parent array).
A surviving parent's children are one contiguous range, so the candidate list is a
concatenation of ranges.

Kernels: the level-1 pass is the one-level lookup kernel over the level-1
centroids; a tiny fused jnp step (cumsum + searchsorted over C1 entries) turns the
survivors into a compact candidate list ``[Hs, C2]`` + count per head (static
capacity C2); the level-2 pass is the same lookup kernel driven by the candidate
list: its grid is (selection head x candidate block) and blocks past a head's count
do no loads, so the candidates are spread evenly over programs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common as cm
from pallas_kernels.centroid_lookup import (DEFAULT_PREFILL, CentroidLookupConfig, lookup_decode_scores,
                                            lookup_prefill_scores)
from pallas_kernels._dispatch import resolve_backend

__all__ = ["children_csr", "hierarchical_lookup_prefill", "hierarchical_lookup_decode",
           "hierarchical_lookup_reference", "CentroidLookupConfig"]


@functools.partial(jax.jit, static_argnames=("num_level1", "backend"))
def children_csr(parent: jax.Array, num_level1: int, *,
                 backend: str = "auto") -> tuple[jax.Array, jax.Array]:
  """parent [Hkv, C2] int32 (level-1 parent of each level-2 cluster) ->
  (child_offsets [Hkv, C1 + 1] int32, children [Hkv, C2] int32).

  Level-2 clusters whose parent is outside ``[0, C1)`` belong to no range.  Offline
  (once per index): plain jnp on every backend; ``backend`` is only validated.
  """
  resolve_backend(backend)
  if parent.ndim != 2:
    raise ValueError(f"parent must be [Hkv, C2], got {tuple(parent.shape)}")
  cm.check_int32("parent", parent)
  order = jnp.argsort(parent, axis=1, stable=True).astype(jnp.int32)
  sp = jnp.take_along_axis(parent, order, axis=1)
  bounds = jnp.arange(num_level1 + 1, dtype=parent.dtype)
  offs = jax.vmap(lambda row: jnp.searchsorted(row, bounds, side="left", method="scan_unrolled"))(sp)
  return offs.astype(jnp.int32), order


def _validate(q, c1, n1, c2, n2, child_offsets, children, t1, t2, vote, q_rank):
  shapes = cm.shape_str(q=q, c1=c1, n1=n1, c2=c2, n2=n2, child_offsets=child_offsets,
                        children=children)
  if q.ndim != q_rank:
    raise ValueError(f"q must be {'[Hq, T, d]' if q_rank == 3 else '[Hq, d]'}; got {shapes}")
  if c1.ndim != 3 or c2.ndim != 3 or n1.shape != c1.shape[:2] or n2.shape != c2.shape[:2]:
    raise ValueError(f"need c1 [Hkv, C1, d], n1 [Hkv, C1], c2 [Hkv, C2, d], n2 [Hkv, C2]; got {shapes}")
  hkv, num_c1, d = c1.shape
  num_c2 = c2.shape[1]
  if c2.shape[0] != hkv or c2.shape[2] != d or q.shape[-1] != d:
    raise ValueError(f"head counts / head dims differ; got {shapes}")
  if child_offsets.shape != (hkv, num_c1 + 1) or children.shape != (hkv, num_c2):
    raise ValueError(f"need child_offsets [Hkv, C1 + 1] and children [Hkv, C2]; got {shapes}")
  if q_rank == 3 and q.shape[1] < 1:
    raise ValueError(f"need at least one query token; got {shapes}")
  cm.check_heads(q.shape[0], hkv, shapes)
  cm.check_float("q", q)
  cm.check_same_dtype(q=q, c1=c1, c2=c2)
  for name, x in (("n1", n1), ("n2", n2), ("child_offsets", child_offsets), ("children", children)):
    cm.check_int32(name, x)
  cm.check_vote(vote)
  for name, t in (("t1", t1), ("t2", t2)):
    if jnp.ndim(t) != 0:
      raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(t)}")


def _kvh(hq, hkv, hs):
  return (jnp.arange(hs, dtype=jnp.int32) * (hq // hs)) // (hq // hkv)


def _vote_rows(s, vote, hq):
  """[Hkv, g, C] per-head scores -> [Hs, C]."""
  return jnp.mean(s, axis=1) if vote == "kv" else s.reshape(hq, s.shape[-1])


def _candidates(sel1, child_offsets, children, kvh):
  """Survivors -> compact candidate list (cand [Hs, C2], -1 padded; n_cand [Hs])."""
  cand, n_cand, _ = cm.expand_ranges(sel1, child_offsets, children, kvh, children.shape[1])
  return cand, n_cand


def _scatter(slot_scores, cand, n_cand, num_c2):
  hs = cand.shape[0]
  j = jnp.arange(cand.shape[1])[None, :]
  ok = (j < n_cand[:, None]) & (cand >= 0) & (cand < num_c2)
  cols = jnp.where(ok, cand, num_c2)
  rows = jnp.broadcast_to(jnp.arange(hs)[:, None], cand.shape)
  scores = jnp.zeros((hs, num_c2), jnp.float32).at[rows, cols].set(slot_scores, mode="drop")
  is_cand = jnp.zeros((hs, num_c2), bool).at[rows, cols].set(True, mode="drop")
  return scores, is_cand


def _level2_finish(scores, is_cand, n2, kvh, t2, n_cand, num_c1):
  valid = is_cand & (n2[kvh] > 0)
  scores = jnp.where(valid, scores, 0.0)
  selected = valid & (scores > jnp.asarray(t2, jnp.float32))
  return selected, scores, (num_c1 + n_cand).astype(jnp.int32)


def _run(q, c1, n1, c2, n2, child_offsets, children, t1, t2, *, scale, vote, be, cfg,
         prefill):
  hq = q.shape[0]
  hkv, num_c1, _ = c1.shape
  num_c2 = c2.shape[1]
  hs = cm.num_selection_heads(hq, hkv, vote)
  kvh = _kvh(hq, hkv, hs)
  # Level 1 (Eq. 2).
  if prefill:
    s1 = lookup_prefill_scores(q, c1, n1, None, None, scale=scale, groups=hs, cfg=cfg,
                               backend=be)
  else:
    s1 = _vote_rows(lookup_decode_scores(q, c1, n1, None, None, scale=scale, groups=hkv,
                                         cfg=cfg, backend=be), vote, hq)
  sel1 = (n1[kvh] > 0) & (s1 > jnp.asarray(t1, jnp.float32))
  cand, n_cand = _candidates(sel1, child_offsets, children, kvh)
  # Level 2 (Eq. 3) over each head's candidates only.
  if prefill:
    s2 = lookup_prefill_scores(q, c2, n2, cand, n_cand, scale=scale, groups=hs, cfg=cfg,
                               backend=be)
  else:
    s2 = jnp.mean(lookup_decode_scores(q, c2, n2, cand, n_cand, scale=scale, groups=hs,
                                       cfg=cfg, backend=be), axis=1)
  scores, is_cand = _scatter(s2, cand, n_cand, num_c2)
  return _level2_finish(scores, is_cand, n2, kvh, t2, n_cand, num_c1)


def _eq1_masked(q, cent, counts, mask, scale):
  """Eq. 1 with a per-(query head, centroid) validity mask, averaged over T.
  q [Hq, T, d]; cent [Hkv, C, d]; counts [Hkv, C]; mask [Hq, C] -> [Hq, C]."""
  hq, seq_len, d = q.shape
  hkv = cent.shape[0]
  g = hq // hkv
  c = jnp.repeat(cent.astype(jnp.float32), g, axis=0)
  n = jnp.repeat(counts, g, axis=0).astype(jnp.float32)
  valid = mask & (n > 0)
  logits = scale * jnp.einsum("htd,hcd->htc", q.astype(jnp.float32), c)
  logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.where(valid[:, None, :], jnp.exp(logits - mx), 0.0)
  den = jnp.sum(e * n[:, None, :], axis=-1, keepdims=True)
  s = jnp.where(den > 0, e / jnp.where(den > 0, den, 1.0), 0.0)
  return jnp.mean(s, axis=1)


@functools.partial(jax.jit, static_argnames=("scale", "vote"))
def hierarchical_lookup_reference(q, c1, n1, c2, n2, child_offsets, children, t1, t2, *,
                                  scale, vote="kv"):
  """Plain-jnp Eq. 2-3 over dense masks.  q [Hq, T, d] or [Hq, d].

  Returns (selected [Hs, C2] bool, scores [Hs, C2] f32, n_touched [Hs] int32).
  """
  if q.ndim == 2:
    q = q[:, None, :]
  hq = q.shape[0]
  hkv, num_c1, _ = c1.shape
  num_c2 = c2.shape[1]
  hs = cm.num_selection_heads(hq, hkv, vote)
  r = hq // hs
  kvh = _kvh(hq, hkv, hs)
  # Level 1.
  s1 = _eq1_masked(q, c1, n1, jnp.ones((hq, num_c1), bool), scale)      # [Hq, C1]
  s1 = jnp.mean(s1.reshape(hs, r, num_c1), axis=1)
  sel1 = (n1[kvh] > 0) & (s1 > t1)                                       # [Hs, C1]
  # Parent of each level-2 cluster from the CSR ranges (-1 if in no range).
  i = jnp.arange(num_c2)
  rng_of = jax.vmap(lambda o: jnp.searchsorted(o, i, side="right", method="scan_unrolled") - 1)(child_offsets)
  in_rng = (rng_of >= 0) & (rng_of < num_c1)
  parent = jnp.full((hkv, num_c2), -1, jnp.int32).at[
      jnp.arange(hkv)[:, None], children].set(jnp.where(in_rng, rng_of, -1).astype(jnp.int32),
                                              mode="drop")
  par = parent[kvh]                                                      # [Hs, C2]
  is_cand = (par >= 0) & jnp.take_along_axis(sel1, jnp.maximum(par, 0), axis=1)
  # Level 2, denominators over each selection head's candidates.
  s2 = _eq1_masked(q, c2, n2, jnp.repeat(is_cand, r, axis=0), scale)
  s2 = jnp.mean(s2.reshape(hs, r, num_c2), axis=1)
  n_cand = jnp.sum(is_cand, axis=1)
  return _level2_finish(s2, is_cand, n2, kvh, t2, n_cand, num_c1)


_STATIC = ("scale", "vote", "backend", "config")


@functools.partial(jax.jit, static_argnames=_STATIC)
def hierarchical_lookup_prefill(
    q: jax.Array,              # [Hq, T, d]
    c1: jax.Array,             # [Hkv, C1, d] level-1 centroids
    n1: jax.Array,             # [Hkv, C1] int32 keys under each level-1 cluster
    c2: jax.Array,             # [Hkv, C2, d] level-2 centroids
    n2: jax.Array,             # [Hkv, C2] int32 keys in each level-2 cluster
    child_offsets: jax.Array,  # [Hkv, C1 + 1] int32 CSR offsets into children
    children: jax.Array,       # [Hkv, C2] int32 level-2 ids grouped by parent
    t1: jax.Array,             # [] f32 level-1 threshold
    t2: jax.Array,             # [] f32 level-2 threshold
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
):
  """Hierarchical lookup for a block of query tokens (scores averaged over T).

  Returns (selected [Hs, C2] bool, scores [Hs, C2] f32 (0 for non-candidates),
  n_touched [Hs] int32 = C1 + number of level-2 candidates).
  """
  _validate(q, c1, n1, c2, n2, child_offsets, children, t1, t2, vote, 3)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return hierarchical_lookup_reference(q, c1, n1, c2, n2, child_offsets, children, t1, t2,
                                         scale=scale, vote=vote)
  return _run(q, c1, n1, c2, n2, child_offsets, children, t1, t2, scale=scale, vote=vote,
              be=be, cfg=config or DEFAULT_PREFILL, prefill=True)


@functools.partial(jax.jit, static_argnames=_STATIC)
def hierarchical_lookup_decode(
    q: jax.Array,              # [Hq, d]
    c1: jax.Array, n1: jax.Array, c2: jax.Array, n2: jax.Array,
    child_offsets: jax.Array, children: jax.Array, t1: jax.Array, t2: jax.Array,
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
):
  """Hierarchical lookup for one query token; same outputs as the prefill variant."""
  _validate(q, c1, n1, c2, n2, child_offsets, children, t1, t2, vote, 2)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return hierarchical_lookup_reference(q, c1, n1, c2, n2, child_offsets, children, t1, t2,
                                         scale=scale, vote=vote)
  return _run(q, c1, n1, c2, n2, child_offsets, children, t1, t2, scale=scale, vote=vote,
              be=be, cfg=config or CentroidLookupConfig(), prefill=False)
