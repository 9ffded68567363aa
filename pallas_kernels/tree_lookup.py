"""Level 2 of the hierarchical decode lookup, one program per block of level-1 parents (Eq. 2-3).

The level-1 decode kernel (``centroid_lookup.lookup_decode_raw`` over ``C^(1)``) leaves its raw
block outputs: ``e1 = exp(s q.C1 - m_b)`` [Hkv, nB1, g, Bc1] with the block maxima and
denominators.  This kernel gives each program ``parents`` consecutive level-1 clusters (a part
of one such block) of one selection head:

1. Eq. 2 for those parents: ``S1_p = mean_h e1_hp exp(m_hb - M_h) / D_h`` (``M, D`` reduced from
   all level-1 blocks of the heads), kept iff ``N1_p > 0`` and ``S1_p >= T1``;
2. the children of the kept parents -- contiguous row ranges of a ``TreeLayout``, level 2 stored
   parent by parent -- streamed as one concatenated row list in tiles of ``block_k`` rows (the
   row search of the clustered attention kernel), scored ``x = s q.C2``;
3. the logits written at their clusters' own columns of ``x`` [G, R, Cx] (every other column
   keeps ``MASK``: non-candidates), and the program's ``(m, l)`` with ``l = sum N2 exp(x - m)``,
   so that Eq. 3's denominator over the candidates is the log-sum-exp merge of the programs.

So only candidate rows are read, and the grid has one program per ``parents`` level-1 clusters
(164 per head at 512K with 1% / 5% centroids and 32 parents) instead of one per level-2 block.  The ``TreeLayout`` is built once
per layer (``tree_layout``: a sort, not for a decode step); any level-2 numbering works.
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
from pallas_kernels._dispatch import pallas_call

__all__ = ["TreeLayout", "tree_layout", "level2_logits"]

_ABLATE: set = set()   # EXPERIMENT ONLY (ablation run): parts of the kernel left out


class TreeLayout(NamedTuple):
  """Level-2 clusters stored parent by parent: the children of level-1 cluster ``p`` of KV head
  ``h`` are rows ``[child_off[h, p], child_off[h, p + 1])``.  Only non-empty clusters whose
  parent is in ``[0, C1)`` are anyone's children (they alone can be candidates); the others sit
  after ``child_off[h, C1]`` and are never read."""
  centroids: jax.Array   # [Hkv, C2, d] level-2 centroids, parent by parent
  counts: jax.Array      # [Hkv, C2] int32 keys in each row's cluster (0 past the children)
  child_off: jax.Array   # [Hkv, C1 + 1] int32
  cluster: jax.Array     # [Hkv, C2] int32 the level-2 cluster id of each row


def tree_layout(centroids2: jax.Array,   # [Hkv, C2, d]
                counts2: jax.Array,      # [Hkv, C2] int32
                parent: jax.Array,       # [Hkv, C2] int32 level-1 parent of each level-2 cluster
                num_c1: int) -> TreeLayout:
  """The ``TreeLayout`` of a two-level index (a stable sort by parent; once per layer)."""
  hkv, num_c2, _ = centroids2.shape
  child = (counts2 > 0) & (parent >= 0) & (parent < num_c1)
  key = jnp.where(child, parent, num_c1).astype(jnp.int32)
  order = jnp.argsort(key, axis=1, stable=True).astype(jnp.int32)                     # [Hkv, C2]
  n_child = jnp.zeros((hkv, num_c1 + 1), jnp.int32).at[jnp.arange(hkv)[:, None], key].add(1)
  child_off = jnp.concatenate([jnp.zeros((hkv, 1), jnp.int32), jnp.cumsum(n_child[:, :num_c1], axis=1)], axis=1)
  counts = jnp.take_along_axis(counts2, order, axis=1)
  counts = jnp.where(jnp.arange(num_c2)[None, :] < child_off[:, -1:], counts, 0).astype(jnp.int32)
  return TreeLayout(jnp.take_along_axis(centroids2, order[..., None], axis=1), counts, child_off, order)


def _level1_stats(m1_ref, l1_ref, *, kv, row1, hv, nb1, nb1p, group):
  """M = max_b m_b and 1 / D (D = sum_b l_b exp(m_b - M)) of the level-1 rows ``row1`` [r2]
  of KV head ``kv``, from the level-1 kernel's block outputs [Hkv, nB1, g]."""
  b1 = jnp.arange(nb1p, dtype=jnp.int32)
  bm = (b1[:, None] < nb1) & hv[None, :]
  bi = jnp.where(bm, (kv * nb1 + b1[:, None]) * group + row1[None, :], 0)
  m1 = plgpu.load(m1_ref.at[bi], mask=bm, other=cm.MASK_VALUE)      # [nB1p, r2]
  l1 = plgpu.load(l1_ref.at[bi], mask=bm, other=0.0)
  mx = jnp.max(m1, axis=0)                                          # [r2]
  den = jnp.sum(l1 * jnp.exp(m1 - mx[None, :]), axis=0)
  return mx, jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)


def _kernel(t1_ref,      # [1] f32 T1
            q_ref,       # [Hq, dp]
            c_ref,       # [Hkv * C2, dp] tree-ordered level-2 centroids
            n_ref,       # [Hkv * C2] int32 their counts
            id_ref,      # [Hkv * C2] int32 their cluster ids
            off_ref,     # [Hkv * (C1 + 1)] int32 child offsets
            n1_ref,      # [Hkv * C1] int32 level-1 counts
            e1_ref,      # [Hkv * nB1 * g * Bc1] f32 level-1 exp(s q.C1 - m_b)
            m1_ref,      # [Hkv * nB1 * g] f32
            l1_ref,      # [Hkv * nB1 * g] f32
            x_in_ref,    # [G * R, Cx] f32, MASK (aliased to x_ref)
            x_ref,       # out [G * R, Cx] f32 scaled level-2 logits at the candidates' columns (Cx > C2)
            m_ref,       # out [G, R, nPp] f32 program max
            l_ref,       # out [G, R, nPp] f32 program sum N2 exp(x - m)
            *, scale, num_c1, num_c2, group, r, rp, bc1, nb1, nb1p, bp, block_k, d):
  del x_in_ref
  i32 = jnp.int32
  grp = pl.program_id(0)
  pb = pl.program_id(1)
  kv = cm.kdiv(grp * r, group)
  hr = jnp.arange(rp, dtype=i32)
  hv = hr < r
  q = cm.gather_rows(q_ref, grp * r + hr, d, hv)                   # [rp, dp]
  # Eq. 2 for this block's parents (the group's vote: mean over its r heads)
  r2 = cm.next_pow2(r)
  h2 = jnp.arange(r2, dtype=i32)
  hv2 = h2 < r
  row1 = cm.krem(grp * r + h2, group)                               # the heads' rows in e1
  mx, inv = _level1_stats(m1_ref, l1_ref, kv=kv, row1=row1, hv=hv2, nb1=nb1, nb1p=nb1p, group=group)
  p = pb * bp + jnp.arange(bp, dtype=i32)                          # this program's parents
  pv = p < num_c1
  b1 = cm.kdiv(pb * bp, bc1)                                        # their level-1 block (bp divides bc1)
  blk = (kv * nb1 + b1) * group + row1                              # [r2]
  em = hv2[:, None] & pv[None, :]
  e1 = plgpu.load(e1_ref.at[jnp.where(em, blk[:, None] * bc1 + (p - b1 * bc1)[None, :], 0)], mask=em, other=0.0)
  mb = plgpu.load(m1_ref.at[jnp.where(hv2, blk, 0)], mask=hv2, other=0.0)
  w = jnp.where(hv2, jnp.exp(mb - mx) * inv, 0.0)
  s1 = jnp.sum(e1 * w[:, None], axis=0) * (1.0 / r)                 # [Bc1]
  n1 = cm.gather_vec(n1_ref, kv * num_c1 + p, pv, other=0)
  keep = pv & (n1 > 0) & (s1 >= t1_ref[0])
  # the kept parents' children: concatenated row ranges of the tree layout
  base = kv * (num_c1 + 1) + p
  lo = jnp.clip(cm.gather_vec(off_ref, base, pv, other=0), 0, num_c2)
  hi = jnp.clip(cm.gather_vec(off_ref, base + 1, pv, other=0), 0, num_c2)
  size = jnp.where(keep, jnp.maximum(hi - lo, 0), 0)
  vend = jnp.cumsum(size)
  vstart = vend - size
  total = jnp.sum(size)
  delta = lo - vstart                                               # row = j + delta
  jj = jnp.arange(block_k, dtype=i32)
  xrow = grp * r + jnp.where(hv, hr, 0)
  lo0 = jnp.min(jnp.where(pv, lo, num_c2))
  if "noloop" in _ABLATE:
    total = total * 0

  def tile(t, carry):
    m_run, l_run = carry
    j = t * block_k + jj
    jv = j < total
    if "nosearch" in _ABLATE:
      row = jnp.clip(j + lo0, 0, num_c2 - 1)
    else:
      row = jnp.clip(j + cm.range_row_offset(j, vstart, delta), 0, num_c2 - 1)
    rows = kv * num_c2 + row
    c = cm.gather_rows(c_ref, rows, d, jv)                          # [Bk, dp]
    n = cm.gather_vec(n_ref, rows, jv, other=0)
    cid = cm.gather_vec(id_ref, rows, jv, other=0)
    valid = jv & (n > 0)
    s = plgpu.dot(q, c, trans_b=True) * scale                       # [rp, Bk] f32
    s = jnp.where(valid[None, :], s, cm.MASK_VALUE)
    # masked lanes point at the spare column C2 (never a cluster's): no two lanes of the store
    # share a cell with a live one (the interpreter writes masked lanes back)
    live = hv[:, None] & valid[None, :]
    if "nostore" not in _ABLATE:
      plgpu.store(x_ref.at[xrow[:, None], jnp.where(live, cid[None, :], num_c2)], s, mask=live)
    m_new = jnp.maximum(m_run, jnp.max(s, axis=1))
    e = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
    l_new = l_run * jnp.exp(m_run - m_new) + jnp.sum(e * n.astype(jnp.float32)[None, :], axis=1)
    return m_new, l_new

  init = (jnp.full((rp,), cm.MASK_VALUE, jnp.float32), jnp.zeros((rp,), jnp.float32))
  m, l = lax.fori_loop(i32(0), cm.kcdiv(total, block_k).astype(i32), tile, init)
  plgpu.store(m_ref.at[grp, pl.ds(0, rp), pb], m, mask=hv)
  plgpu.store(l_ref.at[grp, pl.ds(0, rp), pb], l, mask=hv)


def level2_logits(q, tree: TreeLayout, n1, e1, m1, l1, t1, *, scale, groups, cols, parents=32, block_k=64,
                  num_warps=4, num_stages=2, backend):
  """Eq. 3's logits over the candidates, one program per (group, level-1 block).

  q [Hq, d]; tree: the ``TreeLayout``; n1 [Hkv, C1]; (e1 [Hkv, nB1, g, Bc1], m1, l1 [Hkv, nB1, g]):
  the level-1 decode kernel's raw outputs (one group per KV head); t1 [] f32.  ``groups``: Hkv
  (vote "kv") or Hq (vote "q").  Returns (x [G, R, max(cols, C2)] f32: ``s q.C2`` at the
  candidates, MASK elsewhere; m, l [G, R, nBp] f32: each program's max and ``sum N2 exp(x - m)``,
  columns ``[0, nB1)`` written; nB1).
  """
  hq, d = q.shape
  hkv, num_c2, _ = tree.centroids.shape
  num_c1 = n1.shape[1]
  _, nb1, group, bc1 = e1.shape
  r = hq // groups
  rp = max(16, cm.next_pow2(r))
  dp = cm.padded_head_dim(d)
  bp = min(parents, bc1)        # parents per program (powers of two: bp divides bc1)
  npb = cm.cdiv(num_c1, bp)
  nbp = max(16, cm.next_pow2(npb))
  cx = max(cols, num_c2 + 1)   # column C2: where masked lanes point
  x0 = jnp.full((groups * r, cx), cm.MASK_VALUE, jnp.float32)
  kernel = functools.partial(_kernel, scale=scale, num_c1=num_c1, num_c2=num_c2, group=group, r=r, rp=rp,
                             bc1=bc1, nb1=nb1, nb1p=max(16, cm.next_pow2(nb1)), bp=bp, block_k=block_k, d=dp)
  x, m, l = pallas_call(
      kernel, backend=backend, num_warps=num_warps, num_stages=num_stages, grid=(groups, npb),
      out_shape=[jax.ShapeDtypeStruct((groups * r, cx), jnp.float32),
                 jax.ShapeDtypeStruct((groups, r, nbp), jnp.float32),
                 jax.ShapeDtypeStruct((groups, r, nbp), jnp.float32)],
      input_output_aliases={10: 0},
      name="tree_lookup_level2",
  )(jnp.asarray(t1, jnp.float32).reshape(1), cm.pad_axis(q, 1, dp),
    cm.pad_axis(tree.centroids, 2, dp).reshape(hkv * num_c2, dp), tree.counts.reshape(-1), tree.cluster.reshape(-1),
    tree.child_off.reshape(-1), n1.reshape(-1), e1.reshape(-1), m1.reshape(-1), l1.reshape(-1), x0)
  return x.reshape(groups, r, cx), m, l, npb
