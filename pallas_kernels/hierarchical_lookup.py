"""Two-level (hierarchical) centroid lookup of Squeezed Attention (Eq. 2-3, App. D).

Level 1 (coarse centroids ``C^(1)``, ``N^(1)`` keys under each)::

    S1_i = exp(s q.C1_i) / sum_j N1_j exp(s q.C1_j)                      (Eq. 2)

clusters with ``S1 < T1`` are dropped; the non-empty level-2 children of the survivors
are the *candidates*, scored with the denominator restricted to the candidates::

    S2_l = exp(s q.C2_l) / sum_{m in candidates} N2_m exp(s q.C2_m)      (Eq. 3)

and ``selected = S2 > T2``.  Prefill averages each level's scores over the T query
tokens; ``vote`` works as in ``centroid_lookup`` (``"kv"``: mean over the group's
query heads, one candidate set per KV head; ``"q"``: per query head).  Invalid
clusters (count 0) are never candidates' parents, never in a denominator, never
selected.  The cost measure ``n_touched[s] = C1 + (number of candidates)`` is the
number of centroid rows scored for selection head ``s``.

Tree: ``parent[kv, l]`` is the level-1 cluster of level-2 cluster ``l`` (outside
``[0, C1)``: no parent, never a candidate).  Any numbering of level 2 is correct.  The
library keeps k-means' numbering: numbered parent by parent, the selected clusters of a
query sit together, and the clustered attention kernel (which gives each program a run
of cluster ids) then loads a few programs with most of the rows (measured on an H200 at
512K: 0.116 vs 0.071 ms for the attention kernel).

Kernels: the level-1 pass is the one-level lookup kernel over the level-1 centroids.
Decode: the level-2 kernel reads the level-1 kernel's raw block outputs and computes
each of its rows' parent score itself (``Level1Raw``), so decode is two kernels plus
the cheap final normalisation; each of its programs gathers the parents of its rows
and loads only the rows whose parent survived (masked loads: no traffic for the
rest).  (``clustered_attention.clustered_decode_hierarchical`` runs the same two kernels with the
level-2 one writing its logits for the attention kernel, which then normalises and votes.)
Prefill is compute-bound, so skipping rows inside a block would save nothing:
the candidates (in level-2 order) are gathered to the front of a per-head copy of the
level-2 centroids and the same two passes run over them, stopping after the last one
(``n_valid``); the scores are put back in level-2 order.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from pallas_kernels import _common as cm
from pallas_kernels.centroid_lookup import (DEFAULT_PREFILL, CentroidLookupConfig, Level1Raw, _int8_c, _int8_q,
                                            decode_scores_from_raw, lookup_decode_raw, lookup_prefill_scores,
                                            quantized_inputs)
from pallas_kernels._dispatch import resolve_backend

__all__ = ["hierarchical_lookup_prefill", "hierarchical_lookup_decode", "hierarchical_scores",
           "hierarchical_lookup_reference", "CentroidLookupConfig"]


def _validate(q, c1, n1, c2, n2, parent, t1, vote, q_ranks):
  shapes = cm.shape_str(q=q, c1=c1, n1=n1, c2=c2, n2=n2, parent=parent)
  if q.ndim not in q_ranks:
    raise ValueError(f"q must be {' or '.join({3: '[Hq, T, d]', 2: '[Hq, d]'}[k] for k in q_ranks)}; got {shapes}")
  if c1.ndim != 3 or c2.ndim != 3 or n1.shape != c1.shape[:2] or n2.shape != c2.shape[:2]:
    raise ValueError(f"need c1 [Hkv, C1, d], n1 [Hkv, C1], c2 [Hkv, C2, d], n2 [Hkv, C2]; got {shapes}")
  hkv, _, d = c1.shape
  if c2.shape[0] != hkv or c2.shape[2] != d or q.shape[-1] != d:
    raise ValueError(f"head counts / head dims differ; got {shapes}")
  if parent.shape != n2.shape:
    raise ValueError(f"need parent [Hkv, C2] (the level-1 parent of each level-2 cluster); got {shapes}")
  if c1.shape[1] < 1 or c2.shape[1] < 1:
    raise ValueError(f"need at least one cluster on each level; got {shapes}")
  if q.ndim == 3 and q.shape[1] < 1:
    raise ValueError(f"need at least one query token; got {shapes}")
  cm.check_heads(q.shape[0], hkv, shapes)
  cm.check_float("q", q)
  cm.check_same_dtype(q=q, c1=c1, c2=c2)
  for name, x in (("n1", n1), ("n2", n2), ("parent", parent)):
    cm.check_int32(name, x)
  cm.check_vote(vote)
  if jnp.ndim(t1) != 0:
    raise ValueError(f"t1 must be a scalar, got shape {jnp.shape(t1)}")


def _kvh(hq, hkv, hs):
  return (jnp.arange(hs, dtype=jnp.int32) * (hq // hs)) // (hq // hkv)


def _vote_rows(s, vote, hq):
  """[Hkv, g, C] per-head scores -> [Hs, C]."""
  return jnp.mean(s, axis=1) if vote == "kv" else s.reshape(hq, s.shape[-1])


def _survivors(s1, n1, t1, kvh):
  """Level-1 clusters kept: non-empty and S1 >= T1.  [Hs, C1] bool."""
  return (n1[kvh] > 0) & (s1 >= jnp.asarray(t1, jnp.float32))


def _candidates(keep1, parent, n2, kvh):
  """Non-empty level-2 clusters whose parent survived.  [Hs, C2] bool."""
  num_c1 = keep1.shape[1]
  par = parent[kvh]
  ok = (par >= 0) & (par < num_c1)
  return ok & jnp.take_along_axis(keep1, jnp.clip(par, 0, num_c1 - 1), axis=1) & (n2[kvh] > 0)


def _candidates_first(cand):
  """A permutation per row putting the candidates first, each part in level-2 order, and
  their count: ([Hs, C2] int32, [Hs] int32).  Two prefix sums and a scatter (no sort)."""
  hs, num_c2 = cand.shape
  c = cand.astype(jnp.int32)
  n_cand = jnp.sum(c, axis=1)
  pos = jnp.where(cand, jnp.cumsum(c, axis=1) - 1, n_cand[:, None] + jnp.cumsum(1 - c, axis=1) - 1)
  order = jnp.zeros((hs, num_c2), jnp.int32).at[jnp.arange(hs)[:, None], pos].set(
      jnp.broadcast_to(jnp.arange(num_c2, dtype=jnp.int32), (hs, num_c2)), unique_indices=True)
  return order, n_cand.astype(jnp.int32)


def _run(q, c1, n1, c2, n2, parent, t1, *, scale, vote, be, cfg, q_valid=None):
  """-> (s2 [Hs, C2], s1 [Hs, C1], candidates [Hs, C2], n_touched [Hs])."""
  hq = q.shape[0]
  hkv, num_c1, _ = c1.shape
  hs = cm.num_selection_heads(hq, hkv, vote)
  kvh = _kvh(hq, hkv, hs)
  if q.ndim == 2:
    # Decode: two kernels.  Level 1 (Eq. 2) leaves its raw block outputs; the level-2
    # kernel reduces them itself to each parent's S1, loads only the rows whose parent
    # survived and reports them (Eq. 3).  No level-1 pass in between.
    e1, m1, l1, _ = lookup_decode_raw(q, c1, n1, None, scale=scale, groups=hkv, cfg=cfg, backend=be)
    s1 = _vote_rows(decode_scores_from_raw(e1, m1, l1, num_c1), vote, hq)   # for callers; unused: dead code
    raw = Level1Raw(e1, m1, l1, n1, parent, jnp.asarray(t1, jnp.float32))
    e2, m2, l2, live = lookup_decode_raw(q, c2, n2, raw, scale=scale, groups=hs, cfg=cfg, backend=be)
    s2 = jnp.mean(decode_scores_from_raw(e2, m2, l2, c2.shape[1]), axis=1)
    cand = live[:, :c2.shape[1]] > 0
    return s2, s1, cand, (num_c1 + jnp.sum(live, axis=1)).astype(jnp.int32)
  # Prefill: level 1 (Eq. 2) and its survivors; the candidates are gathered to the front
  # of a per-head copy of the level-2 centroids (a few MB), so that the same two passes
  # run over them with affine, pipelined loads and stop after the last one (Eq. 3).
  # int8 logits: q quantized once for both levels; the level-2 centroids per KV head before the gather
  # (the same scale: each head's copy holds all of its centroids), so the gather moves int8 rows
  int8 = cfg.prefill_int8 is not None
  q8 = _int8_q(q) if int8 else None
  s1 = lookup_prefill_scores(q, c1, n1, scale=scale, groups=hs, cfg=cfg, backend=be, q_valid=q_valid, q_int8=q8)
  cand = _candidates(_survivors(s1, n1, t1, kvh), parent, n2, kvh)
  order, n_cand = _candidates_first(cand)                          # [Hs, C2], [Hs]
  rows = kvh[:, None]
  c2i, c2s = _int8_c(c2) if int8 else (c2, None)
  cc = c2i[rows, order]                                            # [Hs, C2, d]
  cc8 = (cc, c2s[kvh]) if int8 else None
  nc = jnp.where(jnp.arange(c2.shape[1])[None, :] < n_cand[:, None], n2[rows, order], 0)
  s2c = lookup_prefill_scores(q, cc, nc, n_cand, scale=scale, groups=hs, cfg=cfg, backend=be, q_valid=q_valid,
                              q_int8=q8, c_int8=cc8)
  s2 = jnp.zeros_like(s2c).at[jnp.arange(hs)[:, None], order].set(s2c)
  s2 = jnp.where(cand, s2, 0.0)
  return s2, s1, cand, (num_c1 + n_cand).astype(jnp.int32)


def _finish(s2, cand, t2):
  return cand & (s2 > jnp.asarray(t2, jnp.float32)), s2


def _eq1_masked(q, cent, counts, mask, scale, q_valid=None):
  """Eq. 1 with a per-(query head, centroid) validity mask, averaged over T (over the tokens
  q_valid [T] marks).  q [Hq, T, d]; cent [Hkv, C, d]; counts [Hkv, C]; mask [Hq, C] -> [Hq, C]."""
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
  return cm.token_mean(s, q_valid, axis=1)


@cm.static_jit(("scale", "vote"))
def _reference_scores(q, c1, n1, c2, n2, parent, t1, *, scale, vote, q_valid=None):
  if q.ndim == 2:
    q = q[:, None, :]
  hq = q.shape[0]
  hkv, num_c1, _ = c1.shape
  hs = cm.num_selection_heads(hq, hkv, vote)
  r = hq // hs
  kvh = _kvh(hq, hkv, hs)
  s1 = _eq1_masked(q, c1, n1, jnp.ones((hq, num_c1), bool), scale, q_valid)   # [Hq, C1]
  s1 = jnp.mean(s1.reshape(hs, r, num_c1), axis=1)
  cand = _candidates(_survivors(s1, n1, t1, kvh), parent, n2, kvh)     # [Hs, C2]
  s2 = _eq1_masked(q, c2, n2, jnp.repeat(cand, r, axis=0), scale, q_valid)   # denominators: candidates
  s2 = jnp.mean(s2.reshape(hs, r, -1), axis=1)
  return s2, s1, cand, (num_c1 + jnp.sum(cand, axis=1)).astype(jnp.int32)


def hierarchical_lookup_reference(q, c1, n1, c2, n2, parent, t1, t2, *, scale, vote="kv", q_valid=None):
  """Plain-jnp Eq. 2-3 over dense masks.  q [Hq, T, d] (mean over T, or over the tokens
  q_valid [T] marks) or [Hq, d].

  Returns (selected [Hs, C2] bool, scores [Hs, C2] f32, n_touched [Hs] int32).
  """
  s2, _, cand, touched = _reference_scores(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote,
                                           q_valid=q_valid)
  return (*_finish(s2, cand, t2), touched)


_STATIC = ("scale", "vote", "backend", "config")


@cm.static_jit(_STATIC)
def hierarchical_scores(
    q: jax.Array,        # [Hq, T, d] (prefill: scores averaged over T) or [Hq, d] (decode)
    c1: jax.Array,       # [Hkv, C1, d] level-1 centroids
    n1: jax.Array,       # [Hkv, C1] int32 keys under each level-1 cluster
    c2: jax.Array,       # [Hkv, C2, d] level-2 centroids
    n2: jax.Array,       # [Hkv, C2] int32 keys in each level-2 cluster
    parent: jax.Array,   # [Hkv, C2] int32 level-1 parent of each level-2 cluster
    t1: jax.Array,       # [] f32 level-1 threshold
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
    q_valid: jax.Array | None = None,   # [T] bool (prefill): the block's real tokens (None: all)
):
  """Eq. 2-3 scores before the level-2 threshold (prefill: averaged over the tokens q_valid marks).

  Returns (s2 [Hs, C2] f32 Eq. 3 scores (0 off the candidates), s1 [Hs, C1] f32 Eq. 2
  scores, candidates [Hs, C2] bool, n_touched [Hs] int32).
  """
  _validate(q, c1, n1, c2, n2, parent, t1, vote, (2, 3))
  if q_valid is not None and q.ndim == 2:
    raise ValueError("q_valid applies to a prefill block q [Hq, T, d], not to a decode query [Hq, d]")
  if q.ndim == 3:
    cm.check_token_valid(q_valid, q.shape[1])
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  cfg = config or (DEFAULT_PREFILL if q.ndim == 3 else CentroidLookupConfig())
  if be == "reference":
    if q.ndim == 3 and cfg.prefill_int8 is not None:   # the prefill kernels' int8 inputs
      q, c1, c2 = quantized_inputs(q, c1, c2)
    return _reference_scores(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote, q_valid=q_valid)
  return _run(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote, be=be, cfg=cfg, q_valid=q_valid)


def _lookup(q, c1, n1, c2, n2, parent, t1, t2, scale, vote, backend, config, rank, q_valid=None):
  _validate(q, c1, n1, c2, n2, parent, t1, vote, (rank,))
  if jnp.ndim(t2) != 0:
    raise ValueError(f"t2 must be a scalar, got shape {jnp.shape(t2)}")
  s2, _, cand, touched = hierarchical_scores(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote,
                                             backend=backend, config=config, q_valid=q_valid)
  return (*_finish(s2, cand, t2), touched)


@cm.static_jit(_STATIC)
def hierarchical_lookup_prefill(
    q: jax.Array,              # [Hq, T, d]
    c1: jax.Array,             # [Hkv, C1, d] level-1 centroids
    n1: jax.Array,             # [Hkv, C1] int32 keys under each level-1 cluster
    c2: jax.Array,             # [Hkv, C2, d] level-2 centroids
    n2: jax.Array,             # [Hkv, C2] int32 keys in each level-2 cluster
    parent: jax.Array,         # [Hkv, C2] int32 level-1 parent of each level-2 cluster
    t1: jax.Array,             # [] f32 level-1 threshold
    t2: jax.Array,             # [] f32 level-2 threshold
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
    q_valid: jax.Array | None = None,   # [T] bool: the block's real tokens (None: all)
):
  """Hierarchical lookup for a block of query tokens (scores averaged over T, or over the
  tokens q_valid marks).

  Returns (selected [Hs, C2] bool, scores [Hs, C2] f32 (0 for non-candidates),
  n_touched [Hs] int32 = C1 + number of level-2 candidates).
  """
  return _lookup(q, c1, n1, c2, n2, parent, t1, t2, scale, vote, backend, config, 3, q_valid)


@cm.static_jit(_STATIC)
def hierarchical_lookup_decode(
    q: jax.Array,              # [Hq, d]
    c1: jax.Array, n1: jax.Array, c2: jax.Array, n2: jax.Array, parent: jax.Array,
    t1: jax.Array, t2: jax.Array,
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
):
  """Hierarchical lookup for one query token; same outputs as the prefill variant."""
  return _lookup(q, c1, n1, c2, n2, parent, t1, t2, scale, vote, backend, config, 2)
