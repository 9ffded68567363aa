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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as cm
from pallas_kernels.centroid_lookup import (DEFAULT_PREFILL, CentroidLookupConfig, Level1Raw,
                                            _level1_stats, _load_centroid_block, decode_scores_from_raw,
                                            lookup_decode_raw, lookup_prefill_scores)
from pallas_kernels._dispatch import pallas_call, resolve_backend

__all__ = ["hierarchical_lookup_prefill", "hierarchical_lookup_decode", "hierarchical_scores",
           "hierarchical_lookup_reference", "hierarchy_order", "HierarchyOrder", "CentroidLookupConfig"]


# ----------------------------------------------------------------------------
# Decode in tree order: each program walks the children of one block of level-1 clusters.
# ----------------------------------------------------------------------------
class HierarchyOrder(NamedTuple):
  """The level-2 clusters listed parent by parent (offline, once per index: ``hierarchy_order``).

  order[kv, child_lo[kv, p] : child_lo[kv, p + 1]] are the non-empty level-2 clusters whose parent
  is level-1 cluster p, in level-2 order; the empty ones and those without a parent follow from
  child_lo[kv, C1] on and are never candidates."""
  order: jax.Array     # [Hkv, C2] int32 a permutation of the level-2 ids
  child_lo: jax.Array  # [Hkv, C1 + 1] int32 non-decreasing, child_lo[:, 0] = 0


def hierarchy_order(parent: jax.Array, counts2: jax.Array, num_c1: int) -> HierarchyOrder:
  """parent [Hkv, C2] int32, counts2 [Hkv, C2] -> ``HierarchyOrder`` (a stable sort by parent)."""
  hkv = parent.shape[0]
  ok = (parent >= 0) & (parent < num_c1) & (counts2 > 0)
  key = jnp.where(ok, parent, num_c1).astype(jnp.int32)
  order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
  per = jnp.zeros((hkv, num_c1 + 1), jnp.int32).at[jnp.arange(hkv)[:, None], key].add(1)
  lo = jnp.concatenate([jnp.zeros((hkv, 1), jnp.int32), jnp.cumsum(per, axis=1)[:, :num_c1]], axis=1)
  return HierarchyOrder(order, lo.astype(jnp.int32))


def _tree_kernel(q_ref,       # [Hq, dp]
                 c_ref,       # [Hkv * C2, dp] level-2 centroids
                 n_ref,       # [Hkv * C2] counts, or [Hkv * (C2 + 1)] layout offsets (offsets_l)
                 e1_ref,      # [Hkv * nB1 * g * Bc1] f32 level-1 kernel: exp(s q.C1 - m_b)
                 m1_ref,      # [Hkv * nB1 * g] f32 its block maxima
                 l1_ref,      # [Hkv * nB1 * g] f32 its block denominators
                 n1_ref,      # [Hkv * C1] int32
                 t1_ref,      # [1] f32
                 order_ref,   # [Hkv * C2] int32 HierarchyOrder.order
                 lo_ref,      # [Hkv * (C1 + 1)] int32 HierarchyOrder.child_lo
                 x_in_ref,    # [Hq * Cx] f32 MASK (aliased with x_ref)
                 x_ref,       # out [Hq * Cx] f32 scaled logits of the candidates
                 m_ref,       # out [G, R, nP2] f32 program max
                 l_ref,       # out [G, R, nP2] f32 program sum N exp(x - m)
                 *, scale, num_c, num_p, group, r, rp, d, nb1, nb1p, bc1, splits, rows, cx, offsets_l):
  """Program (group, level-1 block b, split s): Eq. 2 for the block's Bc1 level-1 clusters (from the
  level-1 kernel's raw outputs), then the candidates -- the non-empty children of the survivors,
  listed contiguously per parent by ``order`` -- packed into virtual rows, and every
  ``splits``-th tile of ``rows`` of them scored (Eq. 3 logits and online (m, l))."""
  del x_in_ref
  i32 = jnp.int32
  grp = pl.program_id(0)
  pb = pl.program_id(1)
  b = cm.kdiv(pb, splits)
  sp = pb - b * splits
  kv = cm.kdiv(grp * r, group)
  hr = jnp.arange(rp, dtype=i32)
  hv = hr < r
  q = cm.gather_rows(q_ref, grp * r + hr, d, hv)                  # [rp, d]
  row1, hv2, mx, inv = _level1_stats((None, n1_ref, e1_ref, m1_ref, l1_ref, t1_ref), kv=kv, h0=grp * r,
                                     group=group, r=r, nb1=nb1, nb1p=nb1p)
  pj = jnp.arange(bc1, dtype=i32)
  par = b * bc1 + pj
  pv = par < num_p
  blk = (kv * nb1 + b) * group + row1                             # [r2]
  em = hv2[:, None] & pv[None, :]
  e1 = plgpu.load(e1_ref.at[jnp.where(em, blk[:, None] * bc1 + pj[None, :], 0)], mask=em, other=0.0)
  mb = plgpu.load(m1_ref.at[jnp.where(hv2, blk, 0)], mask=hv2, other=0.0)
  w = jnp.where(hv2, jnp.exp(mb - mx) * inv, 0.0)                 # padding rows: M = MASK
  s1 = jnp.sum(e1 * w[:, None], axis=0) * (1.0 / r)              # [Bc1] Eq. 2, group mean
  n1 = cm.gather_vec(n1_ref, kv * num_p + par, pv, other=0)
  alive = pv & (n1 > 0) & (s1 >= t1_ref[0])
  base = kv * (num_p + 1) + par
  lo = jnp.clip(cm.gather_vec(lo_ref, base, pv, other=0), 0, num_c)
  hi = jnp.clip(cm.gather_vec(lo_ref, base + 1, pv, other=0), 0, num_c)
  size = jnp.where(alive, jnp.maximum(hi - lo, 0), 0)
  vend = jnp.cumsum(size)                                         # candidates packed: virtual rows
  vstart = vend - size
  total = jnp.sum(size)
  delta = lo - vstart                                             # order position = virtual row + delta
  n_tiles = cm.kcdiv(jnp.maximum(cm.kcdiv(total, rows) - sp, 0), splits).astype(i32)
  jj = jnp.arange(rows, dtype=i32)
  xrow = (grp * r + hr)[:, None] * cx

  def tile(it, carry):
    m_run, l_run = carry
    j = (sp + it * splits) * rows + jj
    jv = j < total
    # {p : vstart_p <= j} is the prefix ending at j's parent, and delta is non-decreasing over it
    # (child ranges are contiguous), so its max is that parent's delta
    pos = j + jnp.max(jnp.where(vstart[None, :] <= j[:, None], delta[None, :], jnp.iinfo(jnp.int32).min),
                      axis=1)
    cid = cm.gather_vec(order_ref, kv * num_c + jnp.clip(pos, 0, num_c - 1), jv, other=-1)
    cv = jv & (cid >= 0) & (cid < num_c)
    cid = jnp.where(cv, cid, 0)
    # rows under cv alone: the order lists no empty cluster, so nothing waits for the counts
    valid, cnt, c = _load_centroid_block(c_ref, n_ref, kv=kv, j=cid, num_c=num_c, d=d, live=cv,
                                         offsets_l=offsets_l, rows_wait_counts=False)
    x = plgpu.dot(q, c, trans_b=True) * scale                     # [rp, rows] f32
    x = jnp.where(valid[None, :], x, cm.MASK_VALUE)
    # masked lanes aim at distinct padding columns (num_c + lane): a masked scatter with duplicate
    # targets may write back a stale value in the interpreter; on the GPU they store nothing
    plgpu.store(x_ref.at[xrow + jnp.where(cv, cid, num_c + jj)[None, :]], x, mask=hv[:, None] & cv[None, :])
    m_new = jnp.maximum(m_run, jnp.max(x, axis=1))
    e = jnp.where(valid[None, :], jnp.exp(x - m_new[:, None]), 0.0)
    return m_new, l_run * jnp.exp(m_run - m_new) + jnp.sum(e * cnt[None, :], axis=1)

  m, l = lax.fori_loop(i32(0), n_tiles, tile, (jnp.full((rp,), cm.MASK_VALUE, jnp.float32),
                                               jnp.zeros((rp,), jnp.float32)))
  plgpu.store(m_ref.at[grp, pl.ds(0, rp), pb], m, mask=hv)
  plgpu.store(l_ref.at[grp, pl.ds(0, rp), pb], l, mask=hv)


def tree_level2_decode(q, c1, n1, c2, counts2, t1, tree: HierarchyOrder, *, scale, groups, cfg, backend,
                       cols=None, offsets_l=None):
  """Decode Eq. 2-3 in two launches: the level-1 lookup kernel (raw block outputs, and the logits
  buffer filled with MASK), then ``_tree_kernel`` scoring only the candidates.

  q [Hq, d]; c1 [Hkv, C1, d]; n1 [Hkv, C1]; c2 [Hkv, C2, d]; counts2 [Hkv, C2] (or the layout's
  offsets [Hkv, C2 + 1] with ``offsets_l`` = L).  Returns (x [G, R, Cx] f32 scaled level-2 logits,
  MASK off the candidates; m, l [G, R, nP2] f32 per-program statistics; nP valid columns) with
  Cx = max(C2 + tree_rows, cols); and the level-1 kernel's raw (e, m, l))."""
  hq, d = q.shape
  hkv, num_c, _ = c2.shape
  num_p = c1.shape[1]
  r = hq // groups
  rp = max(16, cm.next_pow2(r))
  dp = cm.padded_head_dim(d)
  cx = max(num_c + cfg.tree_rows, cols or 0)      # >= tree_rows padding columns: see _tree_kernel
  e1, m1, l1, _, x0 = lookup_decode_raw(q, c1, n1, None, scale=scale, groups=hkv, cfg=cfg, backend=backend,
                                        fill_cols=cx)
  nb1, bc1 = e1.shape[1], e1.shape[3]
  n_prog = nb1 * cfg.tree_splits
  np2 = max(16, cm.next_pow2(n_prog))
  c_flat = cm.pad_axis(c2, 2, dp).reshape(hkv * num_c, dp)
  kernel = functools.partial(
      _tree_kernel, scale=scale, num_c=num_c, num_p=num_p, group=hq // hkv, r=r, rp=rp, d=dp, nb1=nb1,
      nb1p=max(16, cm.next_pow2(nb1)), bc1=bc1, splits=cfg.tree_splits, rows=cfg.tree_rows, cx=cx,
      offsets_l=offsets_l)
  x, m, l = pallas_call(
      kernel, backend=backend, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      grid=(groups, n_prog),
      out_shape=[jax.ShapeDtypeStruct((hq * cx,), jnp.float32),
                 jax.ShapeDtypeStruct((groups, r, np2), jnp.float32),
                 jax.ShapeDtypeStruct((groups, r, np2), jnp.float32)],
      input_output_aliases={10: 0},
      name="centroid_lookup_decode_tree",
  )(cm.pad_axis(q, 1, dp), c_flat, counts2.reshape(-1), e1.reshape(-1), m1.reshape(-1), l1.reshape(-1),
    n1.reshape(-1), jnp.asarray(t1, jnp.float32).reshape(1), tree.order.reshape(-1), tree.child_lo.reshape(-1),
    x0)
  return x.reshape(groups, r, cx), m, l, n_prog, (e1, m1, l1)


def _scores_from_logits(x, m, l, n_valid, num_c):
  """(x [G, R, Cx], per-program (m, l) [G, R, nP2]) -> (Eq. 3 scores averaged over R [G, C],
  candidates [G, C] bool)."""
  m, l = m[..., :n_valid], l[..., :n_valid]
  big_m = jnp.max(jnp.where(l > 0, m, cm.MASK_VALUE), axis=-1, keepdims=True)
  den = jnp.sum(jnp.where(l > 0, l * jnp.exp(m - big_m), 0.0), axis=-1, keepdims=True)
  x = x[..., :num_c]
  live = x > 0.5 * cm.MASK_VALUE
  s = jnp.where(live & (den > 0), jnp.exp(x - big_m) / jnp.where(den > 0, den, 1.0), 0.0)
  return jnp.mean(s, axis=1), live[:, 0]


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


def _validate_order(tree, c1, c2, q):
  if tree is None:
    return
  if q.ndim != 2:
    raise ValueError("tree (a HierarchyOrder) is for decode (q [Hq, d]); prefill compacts the candidates itself")
  hkv, num_c1 = c1.shape[:2]
  want = ((hkv, c2.shape[1]), (hkv, num_c1 + 1))
  got = (tuple(tree.order.shape), tuple(tree.child_lo.shape))
  if got != want:
    raise ValueError(f"tree must be hierarchy_order(parent, counts2, C1): order [Hkv, C2] = {list(want[0])}, "
                     f"child_lo [Hkv, C1 + 1] = {list(want[1])}; got {list(got[0])}, {list(got[1])}")
  cm.check_int32("tree.order", tree.order)
  cm.check_int32("tree.child_lo", tree.child_lo)


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


def _run(q, c1, n1, c2, n2, parent, t1, *, scale, vote, be, cfg, tree=None):
  """-> (s2 [Hs, C2], s1 [Hs, C1], candidates [Hs, C2], n_touched [Hs])."""
  hq = q.shape[0]
  hkv, num_c1, _ = c1.shape
  hs = cm.num_selection_heads(hq, hkv, vote)
  kvh = _kvh(hq, hkv, hs)
  if q.ndim == 2 and tree is not None:
    # Decode in tree order: the level-1 kernel, then the candidates alone.
    x, m, l, n_prog, raw1 = tree_level2_decode(q, c1, n1, c2, n2, t1, tree, scale=scale, groups=hs, cfg=cfg,
                                               backend=be)
    s2, cand = _scores_from_logits(x, m, l, n_prog, c2.shape[1])
    s1 = _vote_rows(decode_scores_from_raw(*raw1, num_c1), vote, hq)   # for callers; unused: dead code
    return s2, s1, cand, (num_c1 + jnp.sum(cand, axis=1)).astype(jnp.int32)
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
  s1 = lookup_prefill_scores(q, c1, n1, scale=scale, groups=hs, cfg=cfg, backend=be)
  cand = _candidates(_survivors(s1, n1, t1, kvh), parent, n2, kvh)
  order, n_cand = _candidates_first(cand)                          # [Hs, C2], [Hs]
  rows = kvh[:, None]
  cc = c2[rows, order]                                             # [Hs, C2, d]
  nc = jnp.where(jnp.arange(c2.shape[1])[None, :] < n_cand[:, None], n2[rows, order], 0)
  s2c = lookup_prefill_scores(q, cc, nc, n_cand, scale=scale, groups=hs, cfg=cfg, backend=be)
  s2 = jnp.zeros_like(s2c).at[jnp.arange(hs)[:, None], order].set(s2c)
  s2 = jnp.where(cand, s2, 0.0)
  return s2, s1, cand, (num_c1 + n_cand).astype(jnp.int32)


def _finish(s2, cand, t2):
  return cand & (s2 > jnp.asarray(t2, jnp.float32)), s2


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
def _reference_scores(q, c1, n1, c2, n2, parent, t1, *, scale, vote):
  if q.ndim == 2:
    q = q[:, None, :]
  hq = q.shape[0]
  hkv, num_c1, _ = c1.shape
  hs = cm.num_selection_heads(hq, hkv, vote)
  r = hq // hs
  kvh = _kvh(hq, hkv, hs)
  s1 = _eq1_masked(q, c1, n1, jnp.ones((hq, num_c1), bool), scale)      # [Hq, C1]
  s1 = jnp.mean(s1.reshape(hs, r, num_c1), axis=1)
  cand = _candidates(_survivors(s1, n1, t1, kvh), parent, n2, kvh)     # [Hs, C2]
  s2 = _eq1_masked(q, c2, n2, jnp.repeat(cand, r, axis=0), scale)     # denominators: candidates
  s2 = jnp.mean(s2.reshape(hs, r, -1), axis=1)
  return s2, s1, cand, (num_c1 + jnp.sum(cand, axis=1)).astype(jnp.int32)


def hierarchical_lookup_reference(q, c1, n1, c2, n2, parent, t1, t2, *, scale, vote="kv"):
  """Plain-jnp Eq. 2-3 over dense masks.  q [Hq, T, d] or [Hq, d].

  Returns (selected [Hs, C2] bool, scores [Hs, C2] f32, n_touched [Hs] int32).
  """
  s2, _, cand, touched = _reference_scores(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote)
  return (*_finish(s2, cand, t2), touched)


_STATIC = ("scale", "vote", "backend", "config")


@functools.partial(jax.jit, static_argnames=_STATIC)
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
    tree: HierarchyOrder | None = None,
):
  """Eq. 2-3 scores before the level-2 threshold.

  ``tree`` (decode): ``hierarchy_order(parent, n2, C1)``, made once per index; with it level 2
  reads only the candidates (``_tree_kernel``).  It must come from this ``parent`` and ``n2``.

  Returns (s2 [Hs, C2] f32 Eq. 3 scores (0 off the candidates), s1 [Hs, C1] f32 Eq. 2
  scores, candidates [Hs, C2] bool, n_touched [Hs] int32).
  """
  _validate(q, c1, n1, c2, n2, parent, t1, vote, (2, 3))
  _validate_order(tree, c1, c2, q)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return _reference_scores(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote)
  cfg = config or (DEFAULT_PREFILL if q.ndim == 3 else CentroidLookupConfig())
  return _run(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote, be=be, cfg=cfg, tree=tree)


def _lookup(q, c1, n1, c2, n2, parent, t1, t2, scale, vote, backend, config, rank, tree=None):
  _validate(q, c1, n1, c2, n2, parent, t1, vote, (rank,))
  if jnp.ndim(t2) != 0:
    raise ValueError(f"t2 must be a scalar, got shape {jnp.shape(t2)}")
  s2, _, cand, touched = hierarchical_scores(q, c1, n1, c2, n2, parent, t1, scale=scale, vote=vote,
                                             backend=backend, config=config, tree=tree)
  return (*_finish(s2, cand, t2), touched)


@functools.partial(jax.jit, static_argnames=_STATIC)
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
):
  """Hierarchical lookup for a block of query tokens (scores averaged over T).

  Returns (selected [Hs, C2] bool, scores [Hs, C2] f32 (0 for non-candidates),
  n_touched [Hs] int32 = C1 + number of level-2 candidates).
  """
  return _lookup(q, c1, n1, c2, n2, parent, t1, t2, scale, vote, backend, config, 3)


@functools.partial(jax.jit, static_argnames=_STATIC)
def hierarchical_lookup_decode(
    q: jax.Array,              # [Hq, d]
    c1: jax.Array, n1: jax.Array, c2: jax.Array, n2: jax.Array, parent: jax.Array,
    t1: jax.Array, t2: jax.Array,
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
    tree: HierarchyOrder | None = None,
):
  """Hierarchical lookup for one query token; same outputs as the prefill variant.  ``tree``:
  as in ``hierarchical_scores``."""
  return _lookup(q, c1, n1, c2, n2, parent, t1, t2, scale, vote, backend, config, 2, tree)
