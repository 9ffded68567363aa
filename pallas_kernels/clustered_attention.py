"""Squeezed Attention over a cluster-contiguous KV layout (DESIGN section 4).

Offline, the fixed context's keys/values are reordered per KV head by cluster
(``cluster_sort_layout``): ``k_sorted, v_sorted [Hkv, L, d]`` where cluster ``c`` of
KV head ``h`` occupies rows ``[offsets[h, c], offsets[h, c + 1])`` and rows
``[offsets[h, C], L)`` are the *exact part* (attention sink + exact tail + keys
without a cluster), always attended.  A retrieved cluster is then a contiguous row
range: no index list is ever built.

Semantics (Squeezed Attention Eq. 1 with ``N_c = offsets[c+1] - offsets[c]``)::

    S_c = exp(s q.C_c) / sum_j N_j exp(s q.C_j)           (max-subtracted)

clusters with ``N_c == 0`` take no part and are never selected (never NaN).
``vote="kv"``: the mean of ``S`` over the ``g`` query heads of each KV head selects
one set per KV head (``Hs = Hkv``); ``vote="q"``: one set per query head
(``Hs = Hq``).  Cluster ``c`` is selected iff ``S_c > threshold``.  Each query
head attends exactly (f32 accumulation) to the rows of its selected clusters, the
exact part, and the new keys ``j`` with ``0 <= kv_pos_new[j] <= q_pos``; a head
that sees nothing outputs 0.

Offsets are clipped into ``[0, L]`` inside the kernels (a cluster with
``hi < lo`` is empty) so that no out-of-bounds row is ever read; they must be
non-decreasing (``cluster_sort_layout`` makes them so) for the result to mean
anything.

Decode (``clustered_decode_attention``) = 3 Pallas kernels, no host synchronisation
and no index list:

(A) ``_score_kernel``, grid (Hkv, programs of ``score_blocks`` blocks of ``block_c``
    centroids): loads each centroid block once for the ``g`` query heads of the KV
    head, writes the scaled logits ``x = s q.C`` [Hkv, g, C] (f32) and per program the
    max ``m_b`` and ``l_b = sum N exp(x - m_b)``.
(B) ``_attn_kernel``, grid (Hkv, programs).  Programs are, in this order: the new
    part in chunks of ``chunk_new`` keys, the exact part split over
    ``exact_programs`` programs, then one program per ``block_clusters``
    clusters.  A cluster program reduces the block stats of its heads to the
    global max ``M`` and denominator ``D`` (``nA`` values per head), and for each
    sub-block of ``sub_clusters`` clusters forms ``S = exp(x - M) / D``, votes,
    prefix-sums the sizes of the selected clusters (vote "q": of the union over
    the group, with a per-cluster bit mask of the heads that selected it) and
    streams the concatenated row ranges in tiles of ``block_k`` rows -- one K/V
    tile load serves the ``g`` query heads stacked as rows.  Every program writes
    an unnormalised partial ``(o, m, l)``.
(C) ``_merge_kernel``, grid (Hkv, g, head-dim blocks): the log-sum-exp merge of the
    partials, written in the output dtype (reference: ``_merge``).

Hierarchical decode (``clustered_decode_hierarchical``, Eq. 2-3) = 4 Pallas kernels: the
level-1 lookup kernel (raw block outputs), the level-2 lookup kernel over the children of the
level-1 survivors writing the scaled logits (MASK elsewhere) and per-block (m, l) in kernel A's
output layout, then (B) and (C) unchanged: B's statistics reduction over the level-2 blocks is
Eq. 3's denominator over the candidates, and its vote is ``S2 > T2``.

Prefill (``clustered_prefill_attention``, a block of T tokens, one selection per
head for the block): scores by the existing ``centroid_lookup_prefill`` kernels,
the selected ranges (+ the exact part) expanded to a static-capacity row list,
then ``gather_then_dense_attention`` (cuDNN on GPU, bf16/f16) or
``sparse_attention`` (f32).  If a head wants more rows than ``capacity``, a
``lax.cond`` falls back to a full-capacity (= L) gather: never silently wrong.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _attention_core as core
from pallas_kernels import _common as cm
from pallas_kernels._dispatch import pallas_call, resolve_backend
from pallas_kernels.centroid_lookup import (CentroidLookupConfig, Level1Raw, centroid_lookup_prefill,
                                            centroid_lookup_reference, lookup_decode_raw)
from pallas_kernels.hierarchical_lookup import (_validate as _validate_tree, hierarchical_lookup_prefill,
                                                hierarchical_lookup_reference)
from pallas_kernels.sparse_attention import NEW_PART_MODES, gather_then_dense_attention, sparse_attention

__all__ = ["ClusteredConfig", "cluster_sort_layout", "clustered_decode_attention", "clustered_decode_batched",
           "clustered_decode_batched_reference",
           "clustered_decode_hierarchical", "clustered_decode_hierarchical_reference", "clustered_decode_partial",
           "clustered_decode_attention_reference", "clustered_prefill_attention",
           "clustered_prefill_attention_reference", "clustered_prefill_hierarchical",
           "clustered_prefill_hierarchical_reference"]

MAX_VOTE_Q_GROUP = 30     # vote="q" keeps one bit per query head of a group in an int32


@dataclasses.dataclass(frozen=True)
class ClusteredConfig:
  """Static tiling of the clustered decode kernels.

  block_c: centroids per scoring block (kernel A), power of two >= 16.
  score_blocks: blocks of ``block_c`` centroids per scoring program (a loop folding the
    softmax statistics online): fewer programs, and fewer (m, l) columns for every
    attention program to reduce.  None = the power of two nearest to
    ``Hkv * blocks / score_programs``, between 1 and ``max_score_blocks``.
  score_programs, max_score_blocks: the automatic choice when ``score_blocks`` is None.
  score_stages: pipeline stages of the scoring loop.
  block_clusters: clusters per attention program (kernel B), a multiple of
    ``sub_clusters``; None = power of two chosen so that about
    ``target_programs`` cluster programs run.
  sub_clusters: clusters prefix-summed together (the width of the per-tile
    row -> cluster search), power of two >= 16.
  block_k: K/V rows per tile (power of two >= 16).
  chunk_new: user-input keys per program (multiple of block_k) or None (auto).
  exact_programs: programs per KV head for the exact part (>= 1).
  reduce_stats_first: reduce the scoring kernel's per-block (m, l) to one (M, D)
    per head in XLA before kernel B (otherwise every cluster program reduces the
    block statistics itself).  Always done when statistics are combined across
    devices (``clustered_decode_partial(reduce_stats=...)``).
  """
  # block_c and num_stages: the fastest of 38 tilings timed by kernel time on an H200
  # (benchmarks/results/gpu_h200_decode_stages): a third pipeline stage takes the attention
  # kernel from 42 to 28 us at 128K; 128-centroid scoring blocks take scoring from 22 to 18 us at 512K.
  block_c: int = 128
  block_clusters: int | None = None
  sub_clusters: int = 128  # best measured on H200 at 512K (benchmarks/results/gpu_h200_kernels)
  block_k: int = 64
  chunk_new: int | None = None
  exact_programs: int = 2
  num_warps: int = 4
  num_stages: int = 3
  score_warps: int = 4
  # score_blocks / score_programs / score_stages: 4 blocks per program (2 stages) took the
  # scoring kernel from 18.0 to 16.9 us and the attention kernel from 69.4 to 66.7 us at 512K
  # on an H200, 1 block stayed fastest at 128K; with 32 KV heads 4 blocks beat 16 at 512K
  # (48.5 vs 55 us) and matched 2 at 128K (gpu_h200_decode_stages/score_blocks).
  score_blocks: int | None = None
  score_programs: int = 400
  max_score_blocks: int = 4
  score_stages: int = 2
  target_programs: int = 1536
  reduce_stats_first: bool = False

  def __post_init__(self):
    cm.check_pow2("block_c", self.block_c)
    cm.check_pow2("sub_clusters", self.sub_clusters)
    cm.check_pow2("block_k", self.block_k)
    bc = self.block_clusters
    if bc is not None and (not isinstance(bc, int) or bc < self.sub_clusters
                           or bc % self.sub_clusters):
      raise ValueError(f"block_clusters must be None or a positive multiple of sub_clusters="
                       f"{self.sub_clusters}, got {bc!r}")
    cn = self.chunk_new
    if cn is not None and (not isinstance(cn, int) or cn < self.block_k or cn % self.block_k):
      raise ValueError(f"chunk_new must be None or a positive multiple of block_k={self.block_k},"
                       f" got {cn!r}")
    if not isinstance(self.exact_programs, int) or self.exact_programs < 1:
      raise ValueError(f"exact_programs must be a positive int, got {self.exact_programs!r}")
    cm.check_warps_stages(self.num_warps, self.num_stages)
    cm.check_warps_stages(self.score_warps, self.score_stages)
    sb = self.score_blocks
    if sb is not None and (not isinstance(sb, int) or sb < 1):
      raise ValueError(f"score_blocks must be None or a positive int, got {sb!r}")
    for name in ("score_programs", "max_score_blocks"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(self.target_programs, int) or self.target_programs < 1:
      raise ValueError(f"target_programs must be a positive int, got {self.target_programs!r}")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static shapes of one decode call."""
  hq: int
  hkv: int
  g: int
  rp: int          # stacked query rows (g padded to a power of two >= 16)
  num_l: int
  num_c: int
  num_s: int
  dp: int
  block_c: int     # kernel A
  score_blocks: int  # blocks per kernel-A program
  n_a: int         # kernel-A programs per KV head (columns of its statistics)
  n_a2: int        # n_a padded to a power of two
  n_sa: int        # columns of the (m, l) statistics kernel B reads (power of two)
  n_sv: int        # ... of which valid: n_a (block stats) or 1 (one (M, D) per head)
  bc: int          # clusters per kernel-B program
  bcs: int         # sub-block
  n_cb: int        # cluster programs per KV head
  cx: int          # columns of the logits buffer
  block_k: int
  chunk_new: int
  n_new: int       # new-part programs per KV head
  n_ex: int        # exact-part programs per KV head
  vote: str
  n_seg: int = 1   # vote "kv": the g stacked rows are n_seg rows (questions) of g / n_seg heads, each voting alone
  new_seg: int = 1  # the g stacked rows are new_seg rows (questions), each with its own new keys and position

  @property
  def n_prog(self) -> int:
    return self.n_new * self.new_seg + self.n_ex + self.n_cb


def _make_plan(hq, hkv, num_l, num_c, num_s, d, vote, cfg: ClusteredConfig, n_seg: int = 1) -> _Plan:
  g = hq // hkv
  rp = max(16, cm.next_pow2(g))
  cpow = max(16, cm.next_pow2(num_c))
  block_c = min(cfg.block_c, cpow)
  blocks = cm.cdiv(num_c, block_c)
  score_blocks = cfg.score_blocks
  if score_blocks is None:
    score_blocks = 1 << max(0, round(np.log2(max(1.0, hkv * blocks / cfg.score_programs))))
    score_blocks = min(score_blocks, cfg.max_score_blocks)
  score_blocks = min(score_blocks, blocks)
  n_a = cm.cdiv(num_c, block_c * score_blocks)
  bcs = min(cfg.sub_clusters, cpow)
  if cfg.block_clusters is not None:
    bc = max(bcs, min(cfg.block_clusters, cm.cdiv(cpow, bcs) * bcs))
  else:
    want = max(1.0, hkv * num_c / cfg.target_programs)
    bc = 1 << max(0, round(np.log2(want)))       # nearest power of two in log scale
    bc = max(bcs, min(bc, 1024, cpow))
  n_cb = cm.cdiv(num_c, bc)
  cx = max(n_a * score_blocks * block_c, n_cb * bc)
  bk = cfg.block_k
  if num_s:
    if cfg.chunk_new is not None:
      chunk_new = cfg.chunk_new
    else:
      n = cm.cdiv(num_s, 256)
      chunk_new = cm.cdiv(cm.cdiv(num_s, n), bk) * bk
    n_new = cm.cdiv(num_s, chunk_new)
  else:
    chunk_new, n_new = bk, 0
  return _Plan(hq=hq, hkv=hkv, g=g, rp=rp, num_l=num_l, num_c=num_c, num_s=num_s,
               dp=cm.padded_head_dim(d), block_c=block_c, score_blocks=score_blocks, n_a=n_a,
               n_a2=max(16, cm.next_pow2(n_a)), n_sa=max(16, cm.next_pow2(n_a)), n_sv=n_a, bc=bc, bcs=bcs, n_cb=n_cb, cx=cx,
               block_k=bk, chunk_new=chunk_new, n_new=n_new, n_ex=cfg.exact_programs,
               vote=vote, n_seg=n_seg)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------
def _clipped_ranges(offs_ref, kv, c, valid, *, num_c, num_l):
  """(lo, count) of clusters ``c`` of KV head ``kv``; offsets clipped to [0, L]."""
  base = kv * (num_c + 1)
  lo = cm.gather_vec(offs_ref, base + c, valid, other=0)
  hi = cm.gather_vec(offs_ref, base + c + 1, valid, other=0)
  lo = jnp.clip(lo, 0, num_l)
  hi = jnp.clip(hi, 0, num_l)
  return lo, jnp.maximum(hi - lo, 0)


def _score_kernel(q_ref,      # [Hq, dp]
                  c_ref,      # [Hkv * C, dp]
                  offs_ref,   # [Hkv * (C + 1)] int32
                  x_ref,      # out [Hkv, g, Cx] f32 scaled logits (MASK on invalid)
                  m_ref,      # out [Hkv, g, nA2] f32 program max
                  l_ref,      # out [Hkv, g, nA2] f32 program sum N exp(x - m)
                  *, p: _Plan, scale, exact_dot):
  """One program per (KV head, ``score_blocks`` blocks of ``block_c`` centroids): the
  logits of each block, and the program's (m, l) folded online over its blocks."""
  kv = pl.program_id(0)
  sp = pl.program_id(1)
  hr = jnp.arange(p.rp, dtype=jnp.int32)
  hv = hr < p.g
  q = cm.gather_rows(q_ref, kv * p.g + hr, p.dp, hv)                  # [rp, dp]

  def block(b, carry):
    m_run, l_run = carry                                               # [rp]
    cb = sp * p.score_blocks + b
    j = cb * p.block_c + jnp.arange(p.block_c, dtype=jnp.int32)
    jv = j < p.num_c
    _, cnt = _clipped_ranges(offs_ref, kv, j, jv, num_c=p.num_c, num_l=p.num_l)
    valid = jv & (cnt > 0)
    c = cm.gather_rows(c_ref, kv * p.num_c + j, p.dp, valid)          # [Bc, dp]
    if exact_dot:
      x = plgpu.dot(q, c, trans_b=True, allow_tf32=False)
    else:
      x = plgpu.dot(q, c, trans_b=True)
    x = jnp.where(valid[None, :], x * scale, cm.MASK_VALUE)           # [rp, Bc]
    plgpu.store(x_ref.at[kv, pl.ds(0, p.rp), pl.ds(cb * p.block_c, p.block_c)], x,
                mask=hv[:, None])
    m_new = jnp.maximum(m_run, jnp.max(x, axis=1))
    e = jnp.where(valid[None, :], jnp.exp(x - m_new[:, None]), 0.0)
    l_new = l_run * jnp.exp(m_run - m_new) + jnp.sum(e * cnt.astype(jnp.float32)[None, :], axis=1)
    return m_new, l_new

  init = (jnp.full((p.rp,), cm.MASK_VALUE, jnp.float32), jnp.zeros((p.rp,), jnp.float32))
  if p.score_blocks == 1:
    m, l = block(0, init)
  else:
    m, l = lax.fori_loop(0, p.score_blocks, block, init)
  plgpu.store(m_ref.at[kv, pl.ds(0, p.rp), sp], m, mask=hv)
  plgpu.store(l_ref.at[kv, pl.ds(0, p.rp), sp], l, mask=hv)


def _attn_kernel(thr_ref,      # [1] f32
                 qpos_ref,     # [new_seg] int32 (each row segment's position)
                 q_ref,        # [Hq, dp]
                 offs_ref,     # [Hkv * (C + 1)] int32
                 x_ref,        # [Hkv, g, Cx] f32
                 ms_ref,       # [Hkv, g, nSA] f32
                 ls_ref,       # [Hkv, g, nSA] f32
                 k_ref,        # [Hkv * L, dp]
                 v_ref,        # [Hkv * L, dp]
                 *refs,        # (k_new, v_new [new_seg * Hkv * S, dp], kv_pos [new_seg * S])?, (sel)?, o, m, l
                 p: _Plan, scale, return_stats):
  refs = list(refs)
  if p.num_s:
    kn_ref, vn_ref, kvpos_ref = refs[:3]
    refs = refs[3:]
  sel_ref = refs.pop(0) if return_stats else None
  o_ref, m_ref, l_ref = refs
  vote_q = p.vote == "q"
  seg_vote = not vote_q and p.n_seg > 1      # one group vote per row segment (batched questions)
  kv = pl.program_id(0)
  prog = pl.program_id(1)
  i32 = jnp.int32
  hr = jnp.arange(p.rp, dtype=i32)
  hv = hr < p.g
  if seg_vote:
    g_seg = p.g // p.n_seg
    seg = hr // g_seg                                                  # [rp] the row's segment
    row_bit = jnp.where(hv, seg, i32(31))     # padding rows read bit 31, never set (n_seg <= 30)
  else:
    row_bit = hr
  q = cm.gather_rows(q_ref, kv * p.g + hr, p.dp, hv)                  # [rp, dp]
  jj = jnp.arange(p.block_k, dtype=i32)
  carry = (jnp.zeros((p.rp, p.dp), jnp.float32),
           jnp.full((p.rp,), cm.MASK_VALUE, jnp.float32),
           jnp.zeros((p.rp,), jnp.float32))

  # --- the new part (user input), causal by position -------------------------------
  # n_new programs per row segment (new_seg > 1: batched rows, each with its own new keys,
  # seen by that segment's stacked rows only)
  n_new_all = p.n_new * p.new_seg
  if p.num_s:
    is_new = prog < n_new_all
    seg_n = jnp.where(is_new, cm.kdiv(prog, p.n_new), i32(0)).astype(i32)
    new_lo = (prog - seg_n * p.n_new) * p.chunk_new
    new_hi = jnp.minimum(new_lo + p.chunk_new, p.num_s)
    if p.new_seg > 1:
      q_pos = qpos_ref[seg_n]
      row_new = hv & (hr // (p.g // p.new_seg) == seg_n)                # [rp] this segment's rows
    else:
      q_pos = qpos_ref[0]
      row_new = jnp.ones((p.rp,), bool)
    n_new_tiles = jnp.where(is_new, cm.kcdiv(jnp.maximum(new_hi - new_lo, 0), p.block_k),
                            i32(0)).astype(i32)

    def new_body(it, carry):
      j = new_lo + it * p.block_k + jj
      jv = j < new_hi
      kp = cm.gather_vec(kvpos_ref, seg_n * p.num_s + j, jv, other=-1)
      vis = jv & (kp >= 0) & (kp <= q_pos)
      rows = (seg_n * p.hkv + kv) * p.num_s + j
      kt = cm.gather_rows(kn_ref, rows, p.dp, vis)
      vt = cm.gather_rows(vn_ref, rows, p.dp, vis)
      mask = row_new[:, None] & vis[None, :]
      return core._online_update(carry, q, kt, vt, mask, scale)

    carry = lax.fori_loop(i32(0), n_new_tiles, new_body, carry)

  # --- fixed context: exact-part programs and cluster programs ----------------------
  ex_i = prog - n_new_all
  cl_i = prog - n_new_all - p.n_ex
  is_ex = (ex_i >= 0) & (ex_i < p.n_ex)
  is_cl = cl_i >= 0
  off_c = jnp.clip(offs_ref[kv * (p.num_c + 1) + p.num_c], 0, p.num_l)
  ex_total = p.num_l - off_c
  ex_chunk = cm.kcdiv(ex_total, p.n_ex)
  ex_lo = off_c + ex_i * ex_chunk
  ex_n = jnp.clip(jnp.minimum(ex_total - ex_i * ex_chunk, ex_chunk), 0, p.num_l)

  # Global softmax statistics of this group's heads (cluster programs only).
  cols = jnp.arange(p.n_sa, dtype=i32)
  smask = hv[:, None] & (cols < p.n_sv)[None, :] & is_cl
  ms = plgpu.load(ms_ref.at[kv, pl.ds(0, p.rp), pl.ds(0, p.n_sa)], mask=smask,
                  other=cm.MASK_VALUE)                                 # [rp, nSA]
  ls = plgpu.load(ls_ref.at[kv, pl.ds(0, p.rp), pl.ds(0, p.n_sa)], mask=smask, other=0.0)
  big_m = jnp.max(ms, axis=1)                                          # [rp]
  den = jnp.sum(jnp.where(smask, ls * jnp.exp(ms - big_m[:, None]), 0.0), axis=1)
  inv_den = jnp.where(hv & (den > 0), 1.0 / jnp.where(den > 0, den, 1.0), 0.0)
  thr = thr_ref[0]
  all_bits = (1 << p.g) - 1 if vote_q else ((1 << p.n_seg) - 1 if seg_vote else 1)
  head_bit = jnp.left_shift(i32(1), hr)                                # [rp]
  slot = jnp.arange(p.bcs, dtype=i32)
  n_sub = p.bc // p.bcs
  n_sub_loop = jnp.where(is_cl, i32(n_sub), jnp.where(is_ex, i32(1), i32(0))).astype(i32)

  def sub_body(sb, carry):
    c0 = cl_i * p.bc + sb * p.bcs
    c = c0 + slot
    cv = is_cl & (c < p.num_c)
    lo, cnt = _clipped_ranges(offs_ref, kv, c, cv, num_c=p.num_c, num_l=p.num_l)
    valid = cv & (cnt > 0)
    xmask = hv[:, None] & valid[None, :]
    # loaded by index (kernel A wrote MASK for empty clusters), so the load does not wait for
    # the offsets: 1-3 us less at 512K (gpu_h200_decode_stages/ab_index_loads.json)
    x = plgpu.load(x_ref.at[kv, pl.ds(0, p.rp), pl.ds(c0, p.bcs)], mask=hv[:, None] & cv[None, :],
                   other=cm.MASK_VALUE)                                # [rp, Bcs]
    s = jnp.where(xmask, jnp.exp(x - big_m[:, None]) * inv_den[:, None], 0.0)
    if vote_q:
      selh = xmask & (s > thr)                                         # [rp, Bcs]
      bits = jnp.sum(jnp.where(selh, head_bit[:, None], 0), axis=0)   # [Bcs]
      sel = bits != 0
    elif seg_vote:
      bits = jnp.zeros((p.bcs,), i32)
      for r in range(p.n_seg):                                         # each segment's group mean
        vsum = jnp.sum(jnp.where((hv & (seg == r))[:, None], s, 0.0), axis=0) * (1.0 / g_seg)
        bits = bits | jnp.where(valid & (vsum > thr), i32(1 << r), i32(0))
      sel = bits != 0
    else:
      vsum = jnp.sum(s, axis=0) * (1.0 / p.g)                          # group mean
      sel = valid & (vsum > thr)
      bits = jnp.where(sel, i32(1), i32(0))
    if return_stats:
      if vote_q:
        plgpu.store(sel_ref.at[kv, pl.ds(0, p.rp), pl.ds(c0, p.bcs)], selh.astype(i32),
                    mask=hv[:, None] & cv[None, :])
      else:
        plgpu.store(sel_ref.at[kv, pl.ds(c0, p.bcs)], sel.astype(i32), mask=cv)
    # The exact-part program uses slot 0 for its chunk (always selected, every head).
    first = slot == 0
    start = jnp.where(is_ex, jnp.where(first, ex_lo, 0), lo)
    size = jnp.where(is_ex, jnp.where(first, ex_n, 0), jnp.where(sel, cnt, 0))
    bits = jnp.where(is_ex, jnp.where(first, i32(all_bits), 0), bits)
    vend = jnp.cumsum(size)                                            # inclusive
    vstart = vend - size
    total = jnp.sum(size)
    delta = start - vstart                                             # row = j + delta

    def tile_body(t, carry):
      j = t * p.block_k + jj                                           # virtual rows
      jv = j < total
      if vote_q or seg_vote:
        inr = (vstart[None, :] <= j[:, None]) & (j[:, None] < vend[None, :])   # [Bk, Bcs]
        row = j + jnp.sum(jnp.where(inr, delta[None, :], 0), axis=1)
        rb = jnp.sum(jnp.where(inr, bits[None, :], 0), axis=1)         # [Bk] head / segment bits
        mask = jv[None, :] & ((jnp.right_shift(rb[None, :], row_bit[:, None]) & 1) == 1)
      else:
        # {c : vstart_c <= j} is the prefix ending at j's cluster c*, and delta is
        # non-decreasing over real clusters (delta_{c+1} - delta_c = unselected rows of
        # c), so max over the prefix = delta_{c*}: one compare + select + max per slot.
        row = j + jnp.max(jnp.where(vstart[None, :] <= j[:, None], delta[None, :],
                                    jnp.iinfo(jnp.int32).min), axis=1)
        mask = jnp.broadcast_to(jv[None, :], (p.rp, p.block_k))
      # in bounds whatever the offsets hold (well-formed offsets never need the clip)
      rows = kv * p.num_l + jnp.clip(row, 0, p.num_l - 1)
      kt = cm.gather_rows(k_ref, rows, p.dp, jv)                       # [Bk, dp]
      vt = cm.gather_rows(v_ref, rows, p.dp, jv)
      return core._online_update(carry, q, kt, vt, mask, scale)

    n_tiles = cm.kcdiv(total, p.block_k).astype(i32)
    return lax.fori_loop(i32(0), n_tiles, tile_body, carry)

  carry = lax.fori_loop(i32(0), n_sub_loop, sub_body, carry)
  o, m, l = carry
  plgpu.store(o_ref.at[kv, prog, pl.ds(0, p.rp), :], o, mask=hv[:, None])
  plgpu.store(m_ref.at[kv, prog, pl.ds(0, p.rp)], m, mask=hv)
  plgpu.store(l_ref.at[kv, prog, pl.ds(0, p.rp)], l, mask=hv)


# ----------------------------------------------------------------------------
# Builders.
# ----------------------------------------------------------------------------
def _block_stats_to_head(ms, ls, n_a):
  """Per-block (m_b, l_b) [Hkv, g, nA2] -> one (M, D) per head [Hkv, g] (Eq. 1's
  max and denominator over this call's clusters; D = 0 when none is valid)."""
  ms, ls = ms[..., :n_a], ls[..., :n_a]
  big_m = jnp.max(jnp.where(ls > 0, ms, cm.MASK_VALUE), axis=-1)
  den = jnp.sum(jnp.where(ls > 0, ls * jnp.exp(ms - big_m[..., None]), 0.0), axis=-1)
  return big_m, den


def _head_stats_as_blocks(big_m, den, width):
  """(M, D) [Hkv, g] -> block-statistics arrays [Hkv, g, width] holding them in column 0."""
  pad = [(0, 0), (0, 0), (0, width - 1)]
  return (jnp.pad(big_m[..., None], pad, constant_values=cm.MASK_VALUE),
          jnp.pad(den[..., None], pad, constant_values=0.0))


def _score_call(q, centroids, offsets, *, num_l, num_s, scale, vote, cfg: ClusteredConfig,
                backend, n_seg: int = 1):
  """Kernel A.  -> (plan, qf [Hq, dp], offs [Hkv * (C + 1)], x [Hkv, g, Cx],
  ms, ls [Hkv, g, nA2] f32 block statistics)."""
  hq, d = q.shape
  hkv, num_c, _ = centroids.shape
  p = _make_plan(hq, hkv, num_l, num_c, num_s, d, vote, cfg, n_seg)
  dp = p.dp
  qf = cm.pad_axis(q, 1, dp)
  offs = offsets.reshape(-1)
  c_flat = cm.pad_axis(centroids, 2, dp).reshape(hkv * num_c, dp)
  x, ms, ls = pallas_call(
      functools.partial(_score_kernel, p=p, scale=scale,
                        exact_dot=jnp.dtype(q.dtype) == jnp.dtype(jnp.float32)),
      backend=backend, num_warps=cfg.score_warps, num_stages=cfg.score_stages,
      grid=(hkv, p.n_a),
      out_shape=[jax.ShapeDtypeStruct((hkv, p.g, p.cx), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, p.g, p.n_a2), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, p.g, p.n_a2), jnp.float32)],
      name="clustered_scores",
  )(qf, c_flat, offs)
  return p, qf, offs, x, ms, ls


def _attend_call(p: _Plan, qf, offs, x, ms, ls, k, v, threshold, k_new, v_new, q_pos,
                 kv_pos_new, *, scale, return_stats, cfg: ClusteredConfig, backend):
  """Kernel B.  k_new, v_new [Hkv, S, d] with q_pos [1], kv_pos_new [S]; or [B, Hkv, S, d] with
  q_pos [B], kv_pos_new [B, S]: the g stacked rows are B row segments, each seeing its own new
  keys.  -> (o [Hkv, P, g, dp], m, l [Hkv, P, g] f32 unnormalised partials, sel (int32 [Hkv, Cx]
  or [Hkv, g, Cx] for vote "q") | None)."""
  hkv, num_l, _ = k.shape
  num_s = k_new.shape[-2]
  p = dataclasses.replace(p, new_seg=k_new.shape[0] if k_new.ndim == 4 else 1)
  dp = p.dp
  args = [jnp.reshape(threshold, (1,)).astype(jnp.float32), q_pos.reshape(-1).astype(jnp.int32), qf, offs,
          x, ms, ls,
          cm.pad_axis(k, 2, dp).reshape(hkv * num_l, dp),
          cm.pad_axis(v, 2, dp).reshape(hkv * num_l, dp)]
  if num_s:
    args += [cm.pad_axis(k_new, k_new.ndim - 1, dp).reshape(-1, dp),
             cm.pad_axis(v_new, v_new.ndim - 1, dp).reshape(-1, dp),
             kv_pos_new.reshape(-1).astype(jnp.int32)]
  out_shape = []
  if return_stats:
    sel_shape = (hkv, p.g, p.cx) if p.vote == "q" else (hkv, p.cx)
    out_shape.append(jax.ShapeDtypeStruct(sel_shape, jnp.int32))
  out_shape += [jax.ShapeDtypeStruct((hkv, p.n_prog, p.g, dp), jnp.float32),
                jax.ShapeDtypeStruct((hkv, p.n_prog, p.g), jnp.float32),
                jax.ShapeDtypeStruct((hkv, p.n_prog, p.g), jnp.float32)]
  outs = pallas_call(
      functools.partial(_attn_kernel, p=p, scale=scale, return_stats=return_stats),
      backend=backend, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      grid=(hkv, p.n_prog), out_shape=out_shape, name="clustered_attention",
  )(*args)
  o, m, l = outs[-3:]
  return o, m, l, (outs[0] if return_stats else None)


def _decode_pallas(q, k, v, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos_new,
                   *, scale, vote, return_stats, reduce_stats, cfg: ClusteredConfig, backend,
                   out_dtype=jnp.float32, n_seg: int = 1):
  """-> (o [Hq, d] out_dtype, lse [Hq] f32, selected | None, rows | None).  ``n_seg`` > 1
  (vote "kv", no statistics returned): the g rows of each KV head are n_seg segments voting
  apart (`clustered_decode_batched`)."""
  hq, d = q.shape
  num_l = k.shape[1]
  num_c = centroids.shape[1]
  p, qf, offs, x, ms, ls = _score_call(q, centroids, offsets, num_l=num_l, num_s=k_new.shape[-2],
                                       scale=scale, vote=vote, cfg=cfg, backend=backend, n_seg=n_seg)
  if reduce_stats is not None or cfg.reduce_stats_first:
    big_m, den = _block_stats_to_head(ms, ls, p.n_a)
    if reduce_stats is not None:
      big_m, den = reduce_stats(big_m, den)
    ms, ls = _head_stats_as_blocks(big_m, den, 16)
    p = dataclasses.replace(p, n_sa=16, n_sv=1)
  o, m, l, sel = _attend_call(p, qf, offs, x, ms, ls, k, v, threshold, k_new, v_new, q_pos,
                              kv_pos_new, scale=scale, return_stats=return_stats, cfg=cfg,
                              backend=backend)
  out, lse = _merge_pallas(o, m, l, d=d, out_dtype=out_dtype, backend=backend)
  out, lse = out.reshape(hq, d), lse.reshape(hq)
  if not return_stats:
    return out, lse, None, None
  sel = (sel.reshape(hq, p.cx) if vote == "q" else sel)[:, :num_c] != 0
  return out, lse, sel, _rows_of_selection(sel, offsets, num_l)


def _decode_selected_pallas(q, k, v, offsets, selected, k_new, v_new, q_pos, kv_pos_new, *, scale,
                            vote, cfg: ClusteredConfig, backend, out_dtype=jnp.float32):
  """Kernel B alone over a selection made elsewhere (e.g. the hierarchical lookup).

  The selection enters as indicator logits, x = 0 where a head's set holds the cluster and
  MASK elsewhere, with one (M, D) = (0, 1) per head: the kernel's S = exp(x - M) / D is then
  1 or 0 for every head of the set, and S > 1/2 (the group mean for vote "kv") selects
  exactly ``selected``.  -> (o [Hq, d] out_dtype, lse [Hq] f32)."""
  hq, d = q.shape
  hkv, num_l, _ = k.shape
  num_c = offsets.shape[1] - 1
  p = _make_plan(hq, hkv, num_l, num_c, k_new.shape[1], d, vote, cfg)
  p = dataclasses.replace(p, n_sa=16, n_sv=1)
  per_q = jnp.repeat(selected, hq // selected.shape[0], axis=0).reshape(hkv, p.g, num_c)
  x = cm.pad_axis(jnp.where(per_q, 0.0, cm.MASK_VALUE).astype(jnp.float32), 2, p.cx, cm.MASK_VALUE)
  ms, ls = _head_stats_as_blocks(jnp.zeros((hkv, p.g), jnp.float32), jnp.ones((hkv, p.g), jnp.float32), 16)
  return _attend_merge(p, q, k, v, offsets, x, ms, ls, jnp.float32(0.5), k_new, v_new, q_pos, kv_pos_new,
                       scale=scale, cfg=cfg, backend=backend, out_dtype=out_dtype)


def _attend_merge(p: _Plan, q, k, v, offsets, x, ms, ls, threshold, k_new, v_new, q_pos, kv_pos_new, *,
                  scale, cfg, backend, out_dtype):
  """Kernel B over given logits x [Hkv, g, Cx] and block statistics (ms, ls) [Hkv, g, >= nSA],
  then the merge.  -> (o [Hq, d] out_dtype, lse [Hq] f32)."""
  hq, d = q.shape
  o, m, l, _ = _attend_call(p, cm.pad_axis(q, 1, p.dp), offsets.reshape(-1), x, ms, ls, k, v,
                            threshold, k_new, v_new, q_pos, kv_pos_new, scale=scale,
                            return_stats=False, cfg=cfg, backend=backend)
  out, lse = _merge_pallas(o, m, l, d=d, out_dtype=out_dtype, backend=backend)
  return out.reshape(hq, d), lse.reshape(hq)


def _decode_hierarchical_pallas(q, k, v, c1, n1, c2, offsets, parent, t1, t2, k_new, v_new, q_pos,
                                kv_pos_new, *, scale, vote, cfg: ClusteredConfig,
                                lookup_cfg: CentroidLookupConfig, backend, n_seg: int = 1):
  """Hierarchical decode in four launches: the level-1 lookup kernel (Eq. 2, raw block
  outputs), the level-2 kernel writing Eq. 3's logits over the candidates (MASK elsewhere) and
  their block statistics in kernel B's layout, kernel B (which reduces those statistics, forms
  S2, votes and attends to S2 > T2) and the merge.  -> o [Hq, d] in q's dtype.

  ``n_seg`` > 1 (vote "kv"): the g stacked rows of each KV head are n_seg rows (questions) of
  g / n_seg heads (`clustered_decode_hierarchical_batched`).  Level 1 then runs with the KV
  head's g rows as one group -- softmax statistics are per row anyway -- and level 2 with one
  group per (KV head, row segment), so each segment keeps its own level-1 vote and survivors."""
  hq, d = q.shape
  hkv, num_l, _ = k.shape
  num_c = c2.shape[1]
  hs = cm.num_selection_heads(hq, hkv, vote) * (n_seg if vote == "kv" else 1)
  p = _make_plan(hq, hkv, num_l, num_c, k_new.shape[-2], d, vote, cfg, n_seg)
  e1, m1, l1, _ = lookup_decode_raw(q, c1, n1, None, scale=scale, groups=hkv, cfg=lookup_cfg,
                                    backend=backend)
  raw = Level1Raw(e1, m1, l1, n1, parent, jnp.asarray(t1, jnp.float32))
  # level-2 counts from the offsets inside the kernel (no launch to form them)
  x, ms, ls, nb = lookup_decode_raw(q, c2, offsets, raw, scale=scale, groups=hs, cfg=lookup_cfg,
                                    backend=backend, logits_cols=p.cx, offsets_l=num_l)
  # [Hs, r, .] -> [Hkv, g, .]: group s = (KV head, segment) or a query head, in row order
  x, ms, ls = (a.reshape(hkv, p.g, a.shape[-1]) for a in (x, ms, ls))
  p = dataclasses.replace(p, n_sa=ms.shape[-1], n_sv=nb)
  o, _ = _attend_merge(p, q, k, v, offsets, x, ms, ls, jnp.asarray(t2, jnp.float32), k_new, v_new, q_pos,
                       kv_pos_new, scale=scale, cfg=cfg, backend=backend, out_dtype=q.dtype)
  return o


MERGE_COLS = 32   # head-dim columns per merge program


def _merge_kernel(o_ref,     # [Hkv, P, g, dp] f32 unnormalised partials
                  m_ref,     # [Hkv, P, g] f32 partial maxima
                  l_ref,     # [Hkv, P, g] f32 partial denominators (0: the program saw nothing)
                  out_ref,   # out [Hkv, g, d] in the output dtype
                  lse_ref,   # out [Hkv, g] f32
                  *, n_prog, p2, d):
  kv, h, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  pr = jnp.arange(p2, dtype=jnp.int32)
  pv = pr < n_prog
  m = plgpu.load(m_ref.at[kv, pl.ds(0, p2), h], mask=pv, other=cm.MASK_VALUE)
  l = plgpu.load(l_ref.at[kv, pl.ds(0, p2), h], mask=pv, other=0.0)
  live = pv & (l > 0)
  mx = jnp.max(jnp.where(live, m, cm.MASK_VALUE))
  w = jnp.where(live, jnp.exp(m - mx), 0.0)                           # [P2]
  den = jnp.sum(w * l)
  cols = cb * MERGE_COLS + jnp.arange(MERGE_COLS, dtype=jnp.int32)
  o = plgpu.load(o_ref.at[kv, pl.ds(0, p2), h, pl.ds(cb * MERGE_COLS, MERGE_COLS)],
                 mask=pv[:, None], other=0.0)                          # [P2, MERGE_COLS]
  num = jnp.sum(jnp.where(live[:, None], o, 0.0) * w[:, None], axis=0)
  ok = den > 0
  out = jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)
  plgpu.store(out_ref.at[kv, h, pl.ds(cb * MERGE_COLS, MERGE_COLS)], out.astype(out_ref.dtype),
              mask=cols < d)
  lse = jnp.where(ok, mx + jnp.log(jnp.where(ok, den, 1.0)), -jnp.inf)
  plgpu.store(lse_ref.at[kv, pl.ds(h, 1)], jnp.full((1,), lse, jnp.float32))   # same value from every column block


def _merge_pallas(o, m, l, *, d, out_dtype, backend):
  """``_merge`` as one Pallas kernel writing [Hkv, g, d] in ``out_dtype`` (XLA made three
  reductions and a cast of it: four launches in every decode step).  Grid (Hkv, g, column
  blocks of ``MERGE_COLS``): each program reads its head's P partial statistics and a
  [P, MERGE_COLS] slab of the partial outputs.  -> (o [Hkv, g, d], lse [Hkv, g] f32)."""
  hkv, n_prog, g, dp = o.shape
  kern = functools.partial(_merge_kernel, n_prog=n_prog, p2=max(16, cm.next_pow2(n_prog)), d=d)
  return pallas_call(kern, backend=backend, num_warps=4, num_stages=1,
                     grid=(hkv, g, cm.cdiv(dp, MERGE_COLS)),
                     out_shape=[jax.ShapeDtypeStruct((hkv, g, d), out_dtype),
                                jax.ShapeDtypeStruct((hkv, g), jnp.float32)],
                     name="clustered_merge")(o, m, l)


def _merge(o, m, l):
  """Log-sum-exp merge over axis 1 of [Hkv, P, g, dp] partials (the reference of
  ``_merge_pallas``).

  -> (o [Hkv, g, dp] f32 normalised, lse [Hkv, g] f32; -inf where nothing was seen)."""
  mx = jnp.max(jnp.where(l > 0, m, cm.MASK_VALUE), axis=1, keepdims=True)
  w = jnp.where(l > 0, jnp.exp(m - mx), 0.0)                           # [Hkv, P, g]
  den = jnp.sum(w * l, axis=1)
  num = jnp.sum(o * w[..., None], axis=1)
  ok = den > 0
  out = jnp.where(ok[..., None], num / jnp.where(ok, den, 1.0)[..., None], 0.0)
  lse = jnp.where(ok, mx[:, 0] + jnp.log(jnp.where(ok, den, 1.0)), -jnp.inf)
  return out, lse


def _clipped_offsets(offsets, num_l):
  return jnp.clip(offsets, 0, num_l)


def _counts(offsets, num_l):
  off = _clipped_offsets(offsets, num_l)
  return jnp.maximum(off[:, 1:] - off[:, :-1], 0).astype(jnp.int32)


def _rows_of_selection(sel, offsets, num_l):
  """sel [Hs, C] -> rows [Hs] int32: retrieved clustered rows + exact rows."""
  hs = sel.shape[0]
  hkv = offsets.shape[0]
  kvh = jnp.arange(hs) // (hs // hkv)
  cnt = _counts(offsets, num_l)[kvh]
  exact = num_l - _clipped_offsets(offsets, num_l)[kvh, -1]
  return (jnp.sum(jnp.where(sel, cnt, 0), axis=1) + exact).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Reference (plain jnp).
# ----------------------------------------------------------------------------
def _row_cluster(offsets, num_l):
  """cid [Hkv, L]: cluster of each sorted row, C for the exact part, -1 for none."""
  off = _clipped_offsets(offsets, num_l)
  num_c = off.shape[1] - 1
  r = jnp.arange(num_l, dtype=jnp.int32)
  # rows in [off[c], off[c+1]) -> c (first such c: empty clusters are skipped)
  cid = jax.vmap(lambda o: jnp.searchsorted(o[1:], r, side="right", method="scan_unrolled"))(off).astype(jnp.int32)
  cid = jnp.minimum(cid, num_c)
  return jnp.where(r[None, :] < off[:, :1], -1, cid)


def _reference(q, k, v, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos_new, *,
               scale, vote, reduce_stats=None, q_valid=None):
  """q [Hq, T, d] (selection: S averaged over the tokens q_valid [T] marks, all when None)
  -> (o [Hq, T, d] f32, lse [Hq, T] f32, selected [Hs, C], rows [Hs])."""
  num_l = k.shape[1]
  counts = _counts(offsets, num_l)
  sel, _ = centroid_lookup_reference(q, centroids, counts, threshold, scale=scale, vote=vote,
                                     reduce_stats=reduce_stats, q_valid=q_valid)
  out, lse = _attend_selected(q, k, v, offsets, sel, k_new, v_new, q_pos, kv_pos_new, scale=scale)
  return out, lse, sel, _rows_of_selection(sel, offsets, num_l)


def _attend_selected(q, k, v, offsets, sel, k_new, v_new, q_pos, kv_pos_new, *, scale):
  """Exact attention of q [Hq, T, d] over the rows of the selected clusters sel [Hs, C], the
  exact part and the visible new keys.  -> (o [Hq, T, d] f32, lse [Hq, T] f32)."""
  hq, seq_len, d = q.shape
  hkv, num_l, _ = k.shape
  num_c = offsets.shape[1] - 1
  g = hq // hkv
  hs = sel.shape[0]
  r = hq // hs
  cid = _row_cluster(offsets, num_l)                                  # [Hkv, L]
  sel_ext = jnp.concatenate([sel, jnp.ones((hs, 1), bool), jnp.zeros((hs, 1), bool)], axis=1)
  kvh = jnp.arange(hs) // (hs // hkv)
  vis = jnp.take_along_axis(sel_ext, jnp.where(cid < 0, num_c + 1, cid)[kvh], axis=1)  # [Hs, L]
  vis_q = jnp.repeat(vis, r, axis=0).reshape(hkv, g, 1, num_l)        # per query head
  used = jnp.any(vis.reshape(hkv, hs // hkv, num_l), axis=1)          # rows anyone reads
  kf = jnp.where(used[..., None], k.astype(jnp.float32), 0.0)         # unread rows -> 0
  vf = jnp.where(used[..., None], v.astype(jnp.float32), 0.0)
  nvis = ((kv_pos_new >= 0)[None, :] & (kv_pos_new[None, :] <= q_pos[:, None]))   # [T, S]
  slot_ok = (kv_pos_new >= 0)[None, :, None]
  knf = jnp.where(slot_ok, k_new.astype(jnp.float32), 0.0)
  vnf = jnp.where(slot_ok, v_new.astype(jnp.float32), 0.0)
  qf = q.astype(jnp.float32).reshape(hkv, g, seq_len, d)
  lf = scale * jnp.einsum("kgtd,knd->kgtn", qf, kf)
  ln = scale * jnp.einsum("kgtd,ksd->kgts", qf, knf)
  mf = jnp.broadcast_to(vis_q, lf.shape)
  mn = jnp.broadcast_to(nvis[None, None], ln.shape)
  lf = jnp.where(mf, lf, -jnp.inf)
  ln = jnp.where(mn, ln, -jnp.inf)
  mx = jnp.maximum(jnp.max(lf, axis=-1), jnp.max(ln, axis=-1, initial=-jnp.inf))
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)[..., None]
  pf = jnp.where(mf, jnp.exp(lf - mx), 0.0)
  pn = jnp.where(mn, jnp.exp(ln - mx), 0.0)
  den = jnp.sum(pf, axis=-1) + jnp.sum(pn, axis=-1)
  num = jnp.einsum("kgtn,knd->kgtd", pf, vf) + jnp.einsum("kgts,ksd->kgtd", pn, vnf)
  ok = den > 0
  out = jnp.where(ok[..., None], num / jnp.where(ok, den, 1.0)[..., None], 0.0)
  lse = jnp.where(ok, mx[..., 0] + jnp.log(jnp.where(ok, den, 1.0)), -jnp.inf)
  return out.reshape(hq, seq_len, d), lse.reshape(hq, seq_len)


@cm.static_jit(("scale", "vote", "return_stats"))
def clustered_decode_attention_reference(q, k_sorted, v_sorted, centroids, offsets, threshold,
                                         k_new, v_new, q_pos, kv_pos_new, *, scale, vote="kv",
                                         return_stats=False):
  """Plain-jnp ``clustered_decode_attention``: score every cluster (Eq. 1), mask
  the sorted rows by their cluster's selection, dense masked attention."""
  o, _, sel, rows = _reference(q[:, None], k_sorted, v_sorted, centroids, offsets, threshold,
                               k_new, v_new, q_pos, kv_pos_new, scale=scale, vote=vote)
  o = o[:, 0].astype(q.dtype)
  return (o, sel, rows) if return_stats else o


@cm.static_jit(("scale", "vote", "return_stats"))
def clustered_prefill_attention_reference(q, k_sorted, v_sorted, centroids, offsets, threshold,
                                          k_new, v_new, q_pos, kv_pos_new, *, scale, vote="kv",
                                          return_stats=False, q_valid=None):
  """Plain-jnp ``clustered_prefill_attention`` (S averaged over the tokens q_valid [T] marks)."""
  o, _, sel, rows = _reference(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new,
                               v_new, q_pos, kv_pos_new, scale=scale, vote=vote, q_valid=q_valid)
  o = o.astype(q.dtype)
  return (o, sel, rows) if return_stats else o


@cm.static_jit(("scale", "vote", "return_stats"))
def clustered_prefill_hierarchical_reference(q, k_sorted, v_sorted, centroids1, counts1, centroids2, offsets,
                                             parent, threshold1, threshold2, k_new, v_new, q_pos, kv_pos_new, *,
                                             scale, vote="kv", return_stats=False, q_valid=None):
  """Plain jnp: ``hierarchical_lookup_reference`` over the block (Eq. 2-3 averaged over the tokens
  q_valid [T] marks; level-2 counts from the offsets), then exact attention over its selection."""
  num_l = k_sorted.shape[1]
  sel, _, _ = hierarchical_lookup_reference(q, centroids1, counts1, centroids2, _counts(offsets, num_l), parent,
                                            threshold1, threshold2, scale=scale, vote=vote, q_valid=q_valid)
  return _prefill_selected(q, k_sorted, v_sorted, offsets, sel, k_new, v_new, q_pos, kv_pos_new, scale=scale,
                           be="reference", return_stats=return_stats)


# ----------------------------------------------------------------------------
# Validation and public API.
# ----------------------------------------------------------------------------
def _validate(q, k, v, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos_new, q_rank,
              vote):
  shapes = cm.shape_str(q=q, k_sorted=k, v_sorted=v, centroids=centroids, offsets=offsets,
                        k_new=k_new, v_new=v_new, q_pos=q_pos, kv_pos_new=kv_pos_new)
  if q.ndim != q_rank:
    want = "[Hq, T, d]" if q_rank == 3 else "[Hq, d]"
    raise ValueError(f"q must be {want}; got {shapes}")
  if k.ndim != 3 or v.shape != k.shape:
    raise ValueError(f"need k_sorted and v_sorted [Hkv, L, d]; got {shapes}")
  hq, d = q.shape[0], q.shape[-1]
  hkv, num_l, dk = k.shape
  if dk != d or num_l < 1:
    raise ValueError(f"head dims must match and L >= 1; got {shapes}")
  cm.check_heads(hq, hkv, shapes)
  if centroids.ndim != 3 or centroids.shape[0] != hkv or centroids.shape[2] != d \
     or centroids.shape[1] < 1:
    raise ValueError(f"need centroids [Hkv, C >= 1, d]; got {shapes}")
  if offsets.shape != (hkv, centroids.shape[1] + 1):
    raise ValueError(f"need offsets [Hkv, C + 1]; got {shapes}")
  if (k_new.ndim != 3 or v_new.shape != k_new.shape or k_new.shape[0] != hkv
      or k_new.shape[2] != d):
    raise ValueError(f"need k_new and v_new [Hkv, S, d]; got {shapes}")
  seq_len = 1 if q_rank == 2 else q.shape[1]
  if q_rank == 3 and seq_len < 1:
    raise ValueError(f"need at least one query token; got {shapes}")
  if q_pos.shape != (seq_len,) or kv_pos_new.shape != (k_new.shape[1],):
    want = "[1]" if q_rank == 2 else "[T]"
    raise ValueError(f"need q_pos {want} and kv_pos_new [S]; got {shapes}")
  if jnp.ndim(threshold) != 0:
    raise ValueError(f"threshold must be a scalar, got shape {jnp.shape(threshold)}")
  cm.check_float("q", q)
  cm.check_same_dtype(q=q, k_sorted=k, v_sorted=v, centroids=centroids, k_new=k_new,
                      v_new=v_new)
  for name, x in (("offsets", offsets), ("q_pos", q_pos), ("kv_pos_new", kv_pos_new)):
    cm.check_int32(name, x)
  cm.check_vote(vote)


@cm.static_jit(("scale", "vote", "return_stats", "backend", "config"))
def clustered_decode_attention(
    q: jax.Array,            # [Hq, d]
    k_sorted: jax.Array,     # [Hkv, L, d]  cluster-contiguous fixed-context keys
    v_sorted: jax.Array,     # [Hkv, L, d]
    centroids: jax.Array,    # [Hkv, C, d]
    offsets: jax.Array,      # [Hkv, C + 1] int32 (rows [offsets[C], L) = exact part)
    threshold: jax.Array,    # [] f32 (traced)
    k_new: jax.Array,        # [Hkv, S, d]  user-input keys (S may be 0)
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [1] int32
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty)
    *,
    scale: float,
    vote: str = "kv",
    return_stats: bool = False,
    backend: str = "auto",
    config: ClusteredConfig | None = None,
):
  """Squeezed decode over the cluster-contiguous layout (see the module docstring).

  Returns o [Hq, d] in q's dtype; with ``return_stats`` also
  ``selected [Hs, C] bool`` and ``rows [Hs] int32`` (retrieved clustered rows +
  exact rows; the new part not included).  Three Pallas launches (scores, attention,
  merge); no capacity, no overflow, no host synchronisation.
  """
  _validate(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos,
            kv_pos_new, 2, vote)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return clustered_decode_attention_reference(
        q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos_new,
        scale=scale, vote=vote, return_stats=return_stats)
  _check_vote_q_group(q, k_sorted, vote)
  o, _, sel, rows = _decode_pallas(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new,
                                   v_new, q_pos, kv_pos_new, scale=scale, vote=vote,
                                   return_stats=return_stats, reduce_stats=None,
                                   cfg=config or ClusteredConfig(), backend=be, out_dtype=q.dtype)
  return (o, sel, rows) if return_stats else o


MAX_BATCH_ROWS = 30   # vote "kv": one bit per row (question) in an int32


def check_batched(n_rows: int, hq: int, hkv: int, vote: str) -> str | None:
  """Why ``clustered_decode_batched`` cannot take ``n_rows`` rows of ``hq`` heads, or None."""
  if n_rows < 1:
    return f"need at least one row; got {n_rows}"
  if vote == "q" and n_rows * (hq // hkv) > MAX_VOTE_Q_GROUP:
    return (f"vote='q' keeps one bit per query head of a KV head's rows: {n_rows} rows x {hq // hkv} heads "
            f"> {MAX_VOTE_Q_GROUP}; split the batch")
  if vote == "kv" and n_rows > MAX_BATCH_ROWS:
    return f"vote='kv' keeps one bit per row: {n_rows} rows > {MAX_BATCH_ROWS}; split the batch"
  return None


def _validate_batched(q, k, v, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos_new, vote):
  shapes = cm.shape_str(q=q, k_sorted=k, v_sorted=v, centroids=centroids, offsets=offsets,
                        k_new=k_new, v_new=v_new, q_pos=q_pos, kv_pos_new=kv_pos_new)
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, d]; got {shapes}")
  n_rows = q.shape[0]
  if k_new.ndim != 4 or k_new.shape[0] != n_rows or v_new.shape != k_new.shape:
    raise ValueError(f"need k_new and v_new [B, Hkv, S, d] (each row's own new keys); got {shapes}")
  if q_pos.shape != (n_rows,) or kv_pos_new.shape != (n_rows, k_new.shape[2]):
    raise ValueError(f"need q_pos [B] and kv_pos_new [B, S]; got {shapes}")
  # the shared checks on row 0 (dtypes, head counts, centroids, offsets, threshold, vote)
  _validate(q[0], k, v, centroids, offsets, threshold, k_new[0], v_new[0], q_pos[:1], kv_pos_new[0], 2, vote)
  why = check_batched(n_rows, q.shape[1], k.shape[0], vote)
  if why:
    raise ValueError(f"{why}; got {shapes}")


@cm.static_jit(("scale", "vote"))
def clustered_decode_batched_reference(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new,
                                       q_pos, kv_pos_new, *, scale, vote="kv"):
  """Plain-jnp ``clustered_decode_batched``: ``clustered_decode_attention_reference`` row by row."""
  def one(qb, kn, vn, qp, kp):
    return clustered_decode_attention_reference(qb, k_sorted, v_sorted, centroids, offsets, threshold, kn, vn,
                                                qp[None], kp, scale=scale, vote=vote)
  return jax.vmap(one)(q, k_new, v_new, q_pos, kv_pos_new)


@cm.static_jit(("scale", "vote", "backend", "config"))
def clustered_decode_batched(
    q: jax.Array,            # [B, Hq, d]  one token of each of B rows (questions)
    k_sorted: jax.Array,     # [Hkv, L, d] the ONE shared fixed context, cluster-contiguous
    v_sorted: jax.Array,     # [Hkv, L, d]
    centroids: jax.Array,    # [Hkv, C, d]
    offsets: jax.Array,      # [Hkv, C + 1] int32
    threshold: jax.Array,    # [] f32
    k_new: jax.Array,        # [B, Hkv, S, d] each row's own new keys (S may be 0)
    v_new: jax.Array,        # [B, Hkv, S, d]
    q_pos: jax.Array,        # [B] int32
    kv_pos_new: jax.Array,   # [B, S] int32 (-1 = empty)
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: ClusteredConfig | None = None,
):
  """B rows decoding over one shared fixed context in one set of launches: the same result as
  ``clustered_decode_attention`` row by row (Eq. 1 per row: each row's own softmax statistics,
  its own group vote -- vote "kv": the mean over the row's g heads --, its own new keys).

  The B rows' heads are stacked as the rows of their KV head ([Hkv, B, g]); the scoring kernel
  reads each centroid once for all of them, and the attention kernel streams the *union* of the
  rows' selected clusters once, each K/V tile masked per row by a bit per row (vote "kv") or per
  query head (vote "q"), as vote "q" does for one row. Each row's new keys are attended by
  new-part programs of that row in the same attention kernel (only its rows see them). At most
  30 rows (vote "kv") or 30 query heads per KV head (vote "q"): `check_batched`.
  -> o [B, Hq, d] in q's dtype.
  """
  _validate_batched(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos_new, vote)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return clustered_decode_batched_reference(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new,
                                              q_pos, kv_pos_new, scale=scale, vote=vote)
  def fixed_part(qf, kn, vn, qp, kp, n_seg):
    return _decode_pallas(qf, k_sorted, v_sorted, centroids, offsets, threshold, kn, vn, qp, kp, scale=scale,
                          vote=vote, return_stats=False, reduce_stats=None, cfg=config or ClusteredConfig(),
                          backend=be, out_dtype=q.dtype, n_seg=n_seg)[0]

  return _rows_stacked(q, k_new, v_new, q_pos, kv_pos_new, fixed_part, hkv=k_sorted.shape[0], vote=vote)


def _rows_stacked(q, k_new, v_new, q_pos, kv_pos_new, fixed_part, *, hkv, vote):
  """B rows [B, Hq, d] through one decode call over the shared fixed context: their heads stacked
  as the rows of their KV head ([Hkv, B, g]); ``fixed_part(qf [Hkv * B * g, d], k_new, v_new
  [B, Hkv, S, d], q_pos [B], kv_pos_new [B, S], n_seg)`` -> o [Hkv * B * g, d] (``n_seg`` = B for
  vote "kv": each row votes apart; the attention kernel gives each row segment its own new keys)."""
  n_rows, hq, d = q.shape
  g = hq // hkv
  qf = q.reshape(n_rows, hkv, g, d).swapaxes(0, 1).reshape(hkv * n_rows * g, d)   # [Hkv, B, g] rows
  o = fixed_part(qf, k_new, v_new, q_pos, kv_pos_new, n_rows if vote == "kv" else 1)
  return o.reshape(hkv, n_rows, g, d).swapaxes(0, 1).reshape(n_rows, hq, d)


@cm.static_jit(("scale",))
def clustered_decode_selected_reference(q, k_sorted, v_sorted, offsets, selected, k_new, v_new, q_pos,
                                        kv_pos_new, *, scale):
  """Plain-jnp ``clustered_decode_selected``: mask the sorted rows by their cluster's
  selection, dense masked attention."""
  o, _ = _attend_selected(q[:, None], k_sorted, v_sorted, offsets, selected, k_new, v_new, q_pos,
                          kv_pos_new, scale=scale)
  return o[:, 0].astype(q.dtype)


@cm.static_jit(("scale", "vote", "backend", "config"))
def clustered_decode_selected(
    q: jax.Array,            # [Hq, d]
    k_sorted: jax.Array,     # [Hkv, L, d]  cluster-contiguous fixed-context keys
    v_sorted: jax.Array,     # [Hkv, L, d]
    offsets: jax.Array,      # [Hkv, C + 1] int32 (rows [offsets[C], L) = exact part)
    selected: jax.Array,     # [Hs, C] bool: the clusters each selection head attends
    k_new: jax.Array,        # [Hkv, S, d]
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [1] int32
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty)
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: ClusteredConfig | None = None,
):
  """Decode attention over a cluster selection made elsewhere (the hierarchical lookup):
  each query head attends exactly to the rows of its selection head's clusters, the exact
  part and the visible new keys -- the attention kernel and merge of
  ``clustered_decode_attention`` without its scoring kernel.  ``vote``: "kv" (Hs = Hkv)
  or "q" (Hs = Hq).  Returns o [Hq, d] in q's dtype."""
  hq = q.shape[0]
  hkv, _, d = k_sorted.shape
  num_c = offsets.shape[1] - 1
  hs = cm.num_selection_heads(hq, hkv, vote)
  cent = jax.ShapeDtypeStruct((hkv, num_c, d), q.dtype)   # shapes only, for the shared checks
  _validate(q, k_sorted, v_sorted, cent, offsets, jnp.float32(0.0), k_new, v_new, q_pos, kv_pos_new, 2, vote)
  if selected.shape != (hs, num_c) or jnp.dtype(selected.dtype) != jnp.dtype(bool):
    raise ValueError(f"selected must be bool [Hs, C] = [{hs}, {num_c}] for vote={vote!r}; got "
                     f"{selected.dtype}{tuple(selected.shape)}")
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return clustered_decode_selected_reference(q, k_sorted, v_sorted, offsets, selected, k_new, v_new, q_pos,
                                               kv_pos_new, scale=scale)
  _check_vote_q_group(q, k_sorted, vote)
  o, _ = _decode_selected_pallas(q, k_sorted, v_sorted, offsets, selected, k_new, v_new, q_pos, kv_pos_new,
                                 scale=scale, vote=vote, cfg=config or ClusteredConfig(), backend=be,
                                 out_dtype=q.dtype)
  return o


@cm.static_jit(("scale", "vote"))
def clustered_decode_hierarchical_reference(q, k_sorted, v_sorted, centroids1, counts1, centroids2, offsets,
                                            parent, threshold1, threshold2, k_new, v_new, q_pos, kv_pos_new,
                                            *, scale, vote="kv"):
  """Plain jnp: ``hierarchical_lookup_reference`` (Eq. 2-3, level-2 counts from the offsets),
  then ``clustered_decode_selected_reference`` over its selection."""
  n2 = _counts(offsets, k_sorted.shape[1])
  selected, _, _ = hierarchical_lookup_reference(q, centroids1, counts1, centroids2, n2, parent, threshold1,
                                                 threshold2, scale=scale, vote=vote)
  return clustered_decode_selected_reference(q, k_sorted, v_sorted, offsets, selected, k_new, v_new, q_pos,
                                             kv_pos_new, scale=scale)


@cm.static_jit(("scale", "vote", "backend", "config", "lookup_config"))
def clustered_decode_hierarchical(
    q: jax.Array,            # [Hq, d]
    k_sorted: jax.Array,     # [Hkv, L, d]  cluster-contiguous fixed-context keys (level-2 clusters)
    v_sorted: jax.Array,     # [Hkv, L, d]
    centroids1: jax.Array,   # [Hkv, C1, d] level-1 centroids
    counts1: jax.Array,      # [Hkv, C1] int32 keys under each level-1 cluster
    centroids2: jax.Array,   # [Hkv, C, d] level-2 centroids
    offsets: jax.Array,      # [Hkv, C + 1] int32 (level-2 cluster c = rows [offsets[c], offsets[c+1]))
    parent: jax.Array,       # [Hkv, C] int32 level-1 parent of each level-2 cluster
    threshold1: jax.Array,   # [] f32 T1
    threshold2: jax.Array,   # [] f32 T2
    k_new: jax.Array,        # [Hkv, S, d]
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [1] int32
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty)
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: ClusteredConfig | None = None,
    lookup_config: CentroidLookupConfig | None = None,
):
  """Hierarchical Squeezed decode (Eq. 2-3) over the cluster-contiguous layout: the level-2
  clusters with ``S2 > T2`` among the children of the level-1 survivors (``S1 >= T1``), the exact
  part and the visible new keys, attended exactly.  Equal to ``hierarchical_lookup_decode``
  followed by ``clustered_decode_selected``, in four launches instead of those two calls' ten
  (profiler trace on an H200: benchmarks/results/gpu_h200_hierarchical/fused_decode_be805d6).
  The level-2 kernel hands its logits and block statistics to the attention kernel, which
  normalises (Eq. 3) and votes itself.  Level-2 counts are taken from ``offsets``.
  ``config`` tiles the attention kernel, ``lookup_config`` the two lookup kernels (with one
  level-2 block per program whatever its ``level2_blocks``).  Returns o [Hq, d] in q's dtype."""
  _validate(q, k_sorted, v_sorted, centroids2, offsets, threshold2, k_new, v_new, q_pos, kv_pos_new, 2, vote)
  _validate_level1(q, centroids1, counts1, centroids2, offsets, parent, threshold1, vote)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return clustered_decode_hierarchical_reference(q, k_sorted, v_sorted, centroids1, counts1, centroids2, offsets,
                                                   parent, threshold1, threshold2, k_new, v_new, q_pos, kv_pos_new,
                                                   scale=scale, vote=vote)
  _check_vote_q_group(q, k_sorted, vote)
  return _decode_hierarchical_pallas(q, k_sorted, v_sorted, centroids1, counts1, centroids2, offsets, parent,
                                     threshold1, threshold2, k_new, v_new, q_pos, kv_pos_new, scale=scale,
                                     vote=vote, cfg=config or ClusteredConfig(),
                                     lookup_cfg=_level2_one_block(lookup_config), backend=be)


def _validate_level1(q, centroids1, counts1, centroids2, offsets, parent, threshold1, vote):
  """The hierarchical decodes' level-1 inputs for one row's q [Hq, d] (level-2 counts come from
  the offsets: shapes only for the shared checks)."""
  hkv, num_c = offsets.shape[0], offsets.shape[1] - 1
  if parent.shape != (hkv, num_c):
    raise ValueError(f"need parent [Hkv, C] = [{hkv}, {num_c}] (the level-1 parent of each level-2 cluster, "
                     f"C from offsets [Hkv, C + 1]); got {cm.shape_str(parent=parent, offsets=offsets)}")
  _validate_tree(q, centroids1, counts1, centroids2, jax.ShapeDtypeStruct((hkv, num_c), jnp.int32), parent,
                 threshold1, vote, (2,))


def _level2_one_block(lookup_config: CentroidLookupConfig | None) -> CentroidLookupConfig:
  """One level-2 block per program: the layout the attention kernel reads."""
  return dataclasses.replace(lookup_config or CentroidLookupConfig(), level2_blocks=1)


@cm.static_jit(("scale", "vote"))
def clustered_decode_hierarchical_batched_reference(q, k_sorted, v_sorted, centroids1, counts1, centroids2,
                                                    offsets, parent, threshold1, threshold2, k_new, v_new,
                                                    q_pos, kv_pos_new, *, scale, vote="kv"):
  """Plain-jnp ``clustered_decode_hierarchical_batched``: the one-row reference row by row."""
  def one(qb, kn, vn, qp, kp):
    return clustered_decode_hierarchical_reference(qb, k_sorted, v_sorted, centroids1, counts1, centroids2,
                                                   offsets, parent, threshold1, threshold2, kn, vn, qp[None],
                                                   kp, scale=scale, vote=vote)
  return jax.vmap(one)(q, k_new, v_new, q_pos, kv_pos_new)


@cm.static_jit(("scale", "vote", "backend", "config", "lookup_config"))
def clustered_decode_hierarchical_batched(
    q: jax.Array,            # [B, Hq, d]  one token of each of B rows (questions)
    k_sorted: jax.Array,     # [Hkv, L, d] the ONE shared fixed context, cluster-contiguous (level-2 clusters)
    v_sorted: jax.Array,     # [Hkv, L, d]
    centroids1: jax.Array,   # [Hkv, C1, d] level-1 centroids
    counts1: jax.Array,      # [Hkv, C1] int32
    centroids2: jax.Array,   # [Hkv, C, d] level-2 centroids
    offsets: jax.Array,      # [Hkv, C + 1] int32
    parent: jax.Array,       # [Hkv, C] int32
    threshold1: jax.Array,   # [] f32 T1
    threshold2: jax.Array,   # [] f32 T2
    k_new: jax.Array,        # [B, Hkv, S, d] each row's own new keys (S may be 0)
    v_new: jax.Array,        # [B, Hkv, S, d]
    q_pos: jax.Array,        # [B] int32
    kv_pos_new: jax.Array,   # [B, S] int32 (-1 = empty)
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: ClusteredConfig | None = None,
    lookup_config: CentroidLookupConfig | None = None,
):
  """B rows of hierarchical Squeezed decode (Eq. 2-3) over one shared fixed context in the four
  launches of ``clustered_decode_hierarchical``: the same result as that function row by row
  (each row its own level-1 vote and survivors, its own Eq. 3 denominator over its candidates,
  its own new keys).  The rows' heads are stacked as in ``clustered_decode_batched``: each level's
  centroids are read once for all rows, and the attention kernel streams the union of the rows'
  selected clusters once, masked per row.  Row limits: ``check_batched``.  -> o [B, Hq, d]."""
  _validate_batched(q, k_sorted, v_sorted, centroids2, offsets, threshold2, k_new, v_new, q_pos, kv_pos_new,
                    vote)
  _validate_level1(q[0], centroids1, counts1, centroids2, offsets, parent, threshold1, vote)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return clustered_decode_hierarchical_batched_reference(q, k_sorted, v_sorted, centroids1, counts1,
                                                           centroids2, offsets, parent, threshold1, threshold2,
                                                           k_new, v_new, q_pos, kv_pos_new, scale=scale, vote=vote)

  def fixed_part(qf, kn, vn, qp, kp, n_seg):
    return _decode_hierarchical_pallas(qf, k_sorted, v_sorted, centroids1, counts1, centroids2, offsets, parent,
                                       threshold1, threshold2, kn, vn, qp, kp, scale=scale, vote=vote,
                                       cfg=config or ClusteredConfig(), lookup_cfg=_level2_one_block(lookup_config),
                                       backend=be, n_seg=n_seg)

  return _rows_stacked(q, k_new, v_new, q_pos, kv_pos_new, fixed_part, hkv=k_sorted.shape[0], vote=vote)


def _check_vote_q_group(q, k_sorted, vote):
  g = q.shape[0] // k_sorted.shape[0]
  if vote == "q" and g > MAX_VOTE_Q_GROUP:
    raise ValueError(f"vote='q' kernel supports at most {MAX_VOTE_Q_GROUP} query heads per KV "
                     f"head, got {g}; use vote='kv' or backend='reference'")


def clustered_decode_partial(
    q: jax.Array,            # [Hq, d]
    k_sorted: jax.Array,     # [Hkv, L, d]  this call's part of the fixed context
    v_sorted: jax.Array,     # [Hkv, L, d]
    centroids: jax.Array,    # [Hkv, C, d]
    offsets: jax.Array,      # [Hkv, C + 1] int32
    threshold: jax.Array,    # [] f32
    k_new: jax.Array,        # [Hkv, S, d]
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [1] int32
    kv_pos_new: jax.Array,   # [S] int32
    *,
    scale: float,
    vote: str = "kv",
    reduce_stats=None,
    backend: str = "auto",
    config: ClusteredConfig | None = None,
    out_dtype=jnp.float32,
):
  """``clustered_decode_attention`` over one slice of a larger fixed context.

  ``reduce_stats(M, D) -> (M, D)`` ([Hkv, g] f32 each, traced inside the caller's
  ``shard_map``) turns this slice's Eq. 1 softmax max and denominator into the
  global ones, so that ``S_c`` and the threshold mean what they mean on one
  device.  Returns ``(o [Hq, d] out_dtype, lse [Hq] f32)``: attention normalised over the
  keys this call attended (lse = -inf if none), ready for a log-sum-exp merge
  across slices (keep ``out_dtype`` f32 for that; a call that holds whole heads may
  ask for q's dtype, which the merge kernel then writes directly: no convert launch).
  Not jitted: call it inside ``jit``/``shard_map``.
  """
  _validate(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos,
            kv_pos_new, 2, vote)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    o, lse, _, _ = _reference(q[:, None], k_sorted, v_sorted, centroids, offsets, threshold,
                              k_new, v_new, q_pos, kv_pos_new, scale=scale, vote=vote,
                              reduce_stats=reduce_stats)
    return o[:, 0].astype(out_dtype), lse[:, 0]
  _check_vote_q_group(q, k_sorted, vote)
  o, lse, _, _ = _decode_pallas(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new,
                                v_new, q_pos, kv_pos_new, scale=scale, vote=vote,
                                return_stats=False, reduce_stats=reduce_stats,
                                cfg=config or ClusteredConfig(), backend=be, out_dtype=out_dtype)
  return o, lse


def _expand_positions(sel, offsets, num_l, cap):
  """Selected clusters' row ranges + the exact part -> positions [Hs, cap].

  Returns (idx [Hs, cap] int32, n [Hs] = min(wanted, cap), wanted [Hs]).  O(C + cap)
  per row: a marker at the output start of every non-empty range, a cumsum.
  """
  hs, num_c = sel.shape
  hkv = offsets.shape[0]
  off = _clipped_offsets(offsets, num_l)
  kvh = jnp.arange(hs) // (hs // hkv)
  starts_src = jnp.concatenate([off[:, :-1], off[:, -1:]], axis=1)[kvh]      # [Hs, C + 1]
  sizes = jnp.concatenate([jnp.maximum(off[:, 1:] - off[:, :-1], 0),
                           num_l - off[:, -1:]], axis=1)[kvh]
  take = jnp.concatenate([sel, jnp.ones((hs, 1), bool)], axis=1)
  sizes = jnp.where(take, sizes, 0)
  ends = jnp.cumsum(sizes, axis=1)
  starts = ends - sizes
  wanted = ends[:, -1].astype(jnp.int32)
  n = jnp.minimum(wanted, cap).astype(jnp.int32)
  live = sizes > 0
  nr = num_c + 1
  rank = jnp.cumsum(live.astype(jnp.int32), axis=1) - 1
  rid = jnp.arange(hs, dtype=jnp.int32)[:, None]
  range_of = jnp.zeros((hs, nr), jnp.int32).at[rid, jnp.where(live, rank, nr)].set(
      jnp.broadcast_to(jnp.arange(nr, dtype=jnp.int32), (hs, nr)), mode="drop")
  mark = jnp.zeros((hs, cap), jnp.int32).at[
      rid, jnp.where(live & (starts < cap), starts, cap)].add(1, mode="drop")
  kth = jnp.maximum(jnp.cumsum(mark, axis=1) - 1, 0)
  pr = jnp.take_along_axis(range_of, kth, axis=1)
  j = jnp.arange(cap, dtype=jnp.int32)[None, :]
  pos = jnp.take_along_axis(starts_src, pr, axis=1) + (j - jnp.take_along_axis(starts, pr, axis=1))
  pos = jnp.where(j < n[:, None], pos, -1)
  return pos.astype(jnp.int32), n, wanted


def _prefill_selected(q, k_sorted, v_sorted, offsets, sel, k_new, v_new, q_pos, kv_pos_new, *, scale, be,
                      capacity=None, new_part="causal", return_stats=False):
  """Exact attention of a block over the selected clusters' row ranges sel [Hs, C] + the exact part
  + the new part: the Pallas route, or under ``be="reference"`` the plain-jnp attention.
  -> o [Hq, T, d] in q's dtype (, sel, rows [Hs] wanted with ``return_stats``)."""
  num_l = k_sorted.shape[1]
  cap = num_l if capacity is None else min(capacity, num_l)
  # cuDNN takes bf16/f16 only: f32 goes through the in-kernel gather (same on "interpret",
  # where gather_then_dense uses XLA's dense attention, so both routes are tested on CPU).
  cudnn_ok = jnp.dtype(q.dtype) != jnp.dtype(jnp.float32)

  def attend(c):
    idx, n, _ = _expand_positions(sel, offsets, num_l, c)
    if cudnn_ok:
      return gather_then_dense_attention(q, k_sorted, v_sorted, idx, n, k_new, v_new, q_pos,
                                         kv_pos_new, scale=scale, backend=be, compact=True, new_part=new_part)
    return sparse_attention(q, k_sorted, v_sorted, idx, n, k_new, v_new, q_pos, kv_pos_new,
                            scale=scale, backend=be)

  rows = _rows_of_selection(sel, offsets, num_l)
  if be == "reference":
    out = _attend_selected(q, k_sorted, v_sorted, offsets, sel, k_new, v_new, q_pos, kv_pos_new, scale=scale)[0]
    out = out.astype(q.dtype)
  elif cap >= num_l:
    out = attend(num_l)
  else:
    out = lax.cond(jnp.any(rows > cap), lambda: attend(num_l), lambda: attend(cap))
  return (out, sel, rows) if return_stats else out


_PREFILL_STATIC = ("scale", "vote", "capacity", "return_stats", "backend", "config", "new_part")


@cm.static_jit(_PREFILL_STATIC)
def clustered_prefill_attention(
    q: jax.Array,            # [Hq, T, d]
    k_sorted: jax.Array,     # [Hkv, L, d]
    v_sorted: jax.Array,     # [Hkv, L, d]
    centroids: jax.Array,    # [Hkv, C, d]
    offsets: jax.Array,      # [Hkv, C + 1] int32
    threshold: jax.Array,    # [] f32 (traced)
    k_new: jax.Array,        # [Hkv, S, d]
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [T] int32
    kv_pos_new: jax.Array,   # [S] int32
    *,
    scale: float,
    vote: str = "kv",
    capacity: int | None = None,
    return_stats: bool = False,
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
    q_valid: jax.Array | None = None,   # [T] bool: the block's real tokens (None: all)
    new_part: str = "causal",
):
  """Squeezed prefill over the cluster-contiguous layout: one selection per head
  for the T-token block (Eq. 1 per token, mean over the tokens ``q_valid`` marks, then over
  the group for ``vote="kv"``), exact attention over selected rows + exact part + causal
  new part (``new_part``: how cuDNN takes it, see ``gather_then_dense_attention``).

  ``capacity`` (static): fixed-context rows per selection head gathered for the
  dense attention (None = L: every selected row, no branch, never overflows).  If a head
  wants more, the call takes a ``lax.cond`` branch with capacity L (same result, slower):
  never silently wrong.  ``config``: the lookup kernels' (``INT8_PREFILL``: int8 logits).
  With ``return_stats`` also ``selected [Hs, C]`` and ``rows [Hs]`` (wanted rows:
  clustered + exact; > capacity = the slow branch ran).
  """
  _validate(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos,
            kv_pos_new, 3, vote)
  scale, be = _prefill_options(q, q_valid, scale, backend, capacity, new_part)
  if be == "reference" and (config is None or config.prefill_int8 is None):
    return clustered_prefill_attention_reference(
        q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos_new,
        scale=scale, vote=vote, return_stats=return_stats, q_valid=q_valid)
  num_l = k_sorted.shape[1]
  sel, _ = centroid_lookup_prefill(q, centroids, _counts(offsets, num_l), threshold, scale=scale, vote=vote,
                                   backend=be, config=config, q_valid=q_valid)
  return _prefill_selected(q, k_sorted, v_sorted, offsets, sel, k_new, v_new, q_pos, kv_pos_new, scale=scale,
                           be=be, capacity=capacity, new_part=new_part, return_stats=return_stats)


@cm.static_jit(_PREFILL_STATIC)
def clustered_prefill_hierarchical(
    q: jax.Array,            # [Hq, T, d]
    k_sorted: jax.Array,     # [Hkv, L, d]  cluster-contiguous fixed-context keys (level-2 clusters)
    v_sorted: jax.Array,     # [Hkv, L, d]
    centroids1: jax.Array,   # [Hkv, C1, d] level-1 centroids
    counts1: jax.Array,      # [Hkv, C1] int32 keys under each level-1 cluster
    centroids2: jax.Array,   # [Hkv, C, d] level-2 centroids
    offsets: jax.Array,      # [Hkv, C + 1] int32 (level-2 cluster c = rows [offsets[c], offsets[c+1]))
    parent: jax.Array,       # [Hkv, C] int32 level-1 parent of each level-2 cluster
    threshold1: jax.Array,   # [] f32 T1
    threshold2: jax.Array,   # [] f32 T2
    k_new: jax.Array,        # [Hkv, S, d]
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [T] int32
    kv_pos_new: jax.Array,   # [S] int32
    *,
    scale: float,
    vote: str = "kv",
    capacity: int | None = None,
    return_stats: bool = False,
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
    q_valid: jax.Array | None = None,   # [T] bool: the block's real tokens (None: all)
    new_part: str = "causal",
):
  """Hierarchical Squeezed prefill (Eq. 2-3 averaged over the tokens ``q_valid`` marks) over the
  cluster-contiguous layout: the hierarchical lookup kernels select the level-2 clusters, then the
  same attention as ``clustered_prefill_attention`` (level-2 counts from ``offsets``; ``capacity``,
  ``config``, ``new_part`` and ``return_stats`` as there)."""
  _validate(q, k_sorted, v_sorted, centroids2, offsets, threshold2, k_new, v_new, q_pos, kv_pos_new, 3, vote)
  _validate_level1(q[:, 0], centroids1, counts1, centroids2, offsets, parent, threshold1, vote)
  scale, be = _prefill_options(q, q_valid, scale, backend, capacity, new_part)
  if be == "reference" and (config is None or config.prefill_int8 is None):
    return clustered_prefill_hierarchical_reference(
        q, k_sorted, v_sorted, centroids1, counts1, centroids2, offsets, parent, threshold1, threshold2, k_new,
        v_new, q_pos, kv_pos_new, scale=scale, vote=vote, return_stats=return_stats, q_valid=q_valid)
  sel, _, _ = hierarchical_lookup_prefill(q, centroids1, counts1, centroids2, _counts(offsets, k_sorted.shape[1]),
                                          parent, threshold1, threshold2, scale=scale, vote=vote, backend=be,
                                          config=config, q_valid=q_valid)
  return _prefill_selected(q, k_sorted, v_sorted, offsets, sel, k_new, v_new, q_pos, kv_pos_new, scale=scale,
                           be=be, capacity=capacity, new_part=new_part, return_stats=return_stats)


def _prefill_options(q, q_valid, scale, backend, capacity, new_part):
  """The block prefills' shared checks -> (scale, resolved backend)."""
  cm.check_token_valid(q_valid, q.shape[1])
  if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
    raise ValueError(f"capacity must be None or a positive int, got {capacity!r}")
  if new_part not in NEW_PART_MODES:
    raise ValueError(f"new_part must be one of {NEW_PART_MODES}, got {new_part!r}")
  return cm.check_scale(scale), resolve_backend(backend)


# ----------------------------------------------------------------------------
# Offline layout.
# ----------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("n_sink", "num_clusters"))
def _sort_layout(k, v, labels, *, n_sink, num_clusters):
  hkv, num_l, _ = k.shape
  lc = labels.shape[1]
  lab = labels.astype(jnp.int32)
  ok = (lab >= 0) & (lab < num_clusters)
  key = jnp.full((hkv, num_l), num_clusters, jnp.int32)           # exact part sorts last
  key = key.at[:, n_sink:n_sink + lc].set(jnp.where(ok, lab, num_clusters))
  perm = jnp.argsort(key, axis=1, stable=True).astype(jnp.int32)  # sorted row -> position
  counts = jax.vmap(lambda x, o: jnp.zeros(num_clusters, jnp.int32).at[
      jnp.where(o, x, num_clusters)].add(1, mode="drop"))(lab, ok)
  offsets = jnp.concatenate([jnp.zeros((hkv, 1), jnp.int32), jnp.cumsum(counts, axis=1)],
                            axis=1).astype(jnp.int32)
  k_sorted = jnp.take_along_axis(k, perm[..., None], axis=1)
  v_sorted = jnp.take_along_axis(v, perm[..., None], axis=1)
  return k_sorted, v_sorted, offsets, perm


def cluster_sort_layout(k, v, labels, n_sink: int, n_exact_tail: int, *,
                        num_clusters: int | None = None):
  """Builds the cluster-contiguous layout (offline, once per fixed context).

  k, v [Hkv, L, d]; labels [Hkv, Lc] int: the cluster of each clustered key, the
  clustered keys being positions ``n_sink .. n_sink + Lc - 1`` (so
  ``L = n_sink + Lc + n_exact_tail``).  Labels outside ``[0, num_clusters)`` put
  that key in the exact part (always attended; never dropped).  ``num_clusters``
  defaults to ``max(labels) + 1`` (needs concrete labels).

  Returns ``(k_sorted, v_sorted, offsets [Hkv, C + 1] int32, perm [Hkv, L] int32)``:
  sorted row ``i`` of head ``h`` is original position ``perm[h, i]``; clusters in
  order ``0..C-1``, each in position order, then the exact part (sink, unlabelled
  keys, tail, in position order).
  """
  if k.ndim != 3 or v.shape != k.shape or labels.ndim != 2 or labels.shape[0] != k.shape[0]:
    raise ValueError("need k, v [Hkv, L, d] and labels [Hkv, Lc]; got "
                     + cm.shape_str(k=k, v=v, labels=labels))
  n_sink, n_exact_tail = int(n_sink), int(n_exact_tail)
  if n_sink < 0 or n_exact_tail < 0 or n_sink + labels.shape[1] + n_exact_tail != k.shape[1]:
    raise ValueError(f"need n_sink + Lc + n_exact_tail == L, got {n_sink} + {labels.shape[1]} "
                     f"+ {n_exact_tail} != {k.shape[1]}")
  if num_clusters is None:
    try:
      lab = np.asarray(labels)
    except Exception as e:  # noqa: BLE001 - traced labels
      raise ValueError("num_clusters is required when labels are traced") from e
    num_clusters = int(lab.max()) + 1 if lab.size else 1
  if not isinstance(num_clusters, int) or num_clusters < 1:
    raise ValueError(f"num_clusters must be a positive int, got {num_clusters!r}")
  return _sort_layout(k, v, jnp.asarray(labels), n_sink=n_sink, num_clusters=num_clusters)
