"""Balanced streaming engine of the clustered decode (kernel B in two launches).

``clustered_attention``'s kernel B gives each program a block of ~128 clusters: the
program reduces the statistics, selects (Eq. 1 against the threshold) and then streams the
rows of its selected clusters, ~3 tiles at 90% sparsity.  Its time has a large part that
does not scale with the rows read (on an H200 at 512K ~30 of 72 us): 1,700 programs each pay
the chain of selection loads, and the few programs that selected many rows set the end.
This engine (``ClusteredConfig(engine="balanced")``, vote "kv") splits the two jobs:

(B1) ``_select_kernel``, grid (Hkv, NB + 1): program ``b < NB`` selects among clusters
     ``[b Cs, (b + 1) Cs)`` (``Cs = select_clusters``, in sub-blocks of ``sub_clusters``)
     exactly as kernel B does, and writes the physical row of each selected row,
     compacted, to ``idx[kv, P_b + i]`` where ``P_b = offsets[b Cs]`` is the block's first
     row (a block's selected rows lie in ``[P_b, offsets[(b + 1) Cs])``, so blocks never
     overlap and no prefix over blocks is needed), and its count ``n_b``.  Program ``NB``
     writes the exact part ``[offsets[C], L)`` the same way (all of it).
(B2) ``_stream_kernel``, grid (Hkv, n_new + P): each KV head's selected rows form
     ``sum_b ceil(n_b / Bk)`` tiles (a tile never spans two blocks); program ``p`` takes
     tiles ``[p T / P, (p + 1) T / P)``: every program streams the same number of tiles,
     each tile one contiguous index load and one K/V row gather.  The first ``n_new``
     programs attend to the user input, as in kernel B.

The merge kernel then combines the ``n_new + P`` partials.  Same semantics and outputs as
kernel B up to float summation order.  The helpers below (statistics, the vote, the
virtual-row -> row map, the user-input loop) are shared with kernel B.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _attention_core as core
from pallas_kernels import _common as cm
from pallas_kernels._dispatch import pallas_call

_I32_MIN = jnp.iinfo(jnp.int32).min


# ----------------------------------------------------------------------------
# In-kernel helpers shared with clustered_attention's kernel B.
# ----------------------------------------------------------------------------
def clipped_ranges(offs_ref, kv, c, valid, *, num_c, num_l):
  """(lo, count) of clusters ``c`` of KV head ``kv``; offsets clipped to [0, L]."""
  base = kv * (num_c + 1)
  lo = cm.gather_vec(offs_ref, base + c, valid, other=0)
  hi = cm.gather_vec(offs_ref, base + c + 1, valid, other=0)
  lo = jnp.clip(lo, 0, num_l)
  hi = jnp.clip(hi, 0, num_l)
  return lo, jnp.maximum(hi - lo, 0)


def head_stats(ms_ref, ms_mask, ls_ref, kv, p, hv):
  """Eq. 1's global max M and 1 / D of the group's heads from the block statistics
  (m_b, l_b) [Hkv, g, nSA]: ``D = sum_b l_b exp(m_b - M)``.  -> (M, 1/D) [rp] f32 (1/D = 0
  where D = 0 or the row is padding)."""
  ms = plgpu.load(ms_ref.at[kv, pl.ds(0, p.rp), pl.ds(0, p.n_sa)], mask=ms_mask,
                  other=cm.MASK_VALUE)                                 # [rp, nSA]
  ls = plgpu.load(ls_ref.at[kv, pl.ds(0, p.rp), pl.ds(0, p.n_sa)], mask=ms_mask, other=0.0)
  big_m = jnp.max(ms, axis=1)                                          # [rp]
  den = jnp.sum(jnp.where(ms_mask, ls * jnp.exp(ms - big_m[:, None]), 0.0), axis=1)
  inv_den = jnp.where(hv & (den > 0), 1.0 / jnp.where(den > 0, den, 1.0), 0.0)
  return big_m, inv_den


def stats_mask(p, hv, active):
  cols = jnp.arange(p.n_sa, dtype=jnp.int32)
  return hv[:, None] & (cols < p.n_sv)[None, :] & active


def block_selection(x_ref, offs_ref, kv, c0, cv, big_m, inv_den, thr, p, hv):
  """Clusters ``c0 + [0, sub_clusters)`` (``cv``: which exist and belong to this program):
  ``S = exp(x - M) / D`` per head, then the vote.  -> (lo, cnt, sel [Bcs] bool (vote "kv"),
  selh [rp, Bcs] bool (vote "q": per head)); the other of the two is None."""
  c = c0 + jnp.arange(p.bcs, dtype=jnp.int32)
  lo, cnt = clipped_ranges(offs_ref, kv, c, cv, num_c=p.num_c, num_l=p.num_l)
  valid = cv & (cnt > 0)
  xmask = hv[:, None] & valid[None, :]
  # loaded by index (kernel A wrote MASK for empty clusters), so the load does not wait for
  # the offsets: 1-3 us less at 512K (gpu_h200_decode_stages/ab_index_loads.json)
  x = plgpu.load(x_ref.at[kv, pl.ds(0, p.rp), pl.ds(c0, p.bcs)], mask=hv[:, None] & cv[None, :],
                 other=cm.MASK_VALUE)                                  # [rp, Bcs]
  s = jnp.where(xmask, jnp.exp(x - big_m[:, None]) * inv_den[:, None], 0.0)
  if p.vote == "q":
    selh = xmask & (s > thr)                                           # [rp, Bcs]
    return lo, cnt, None, selh
  vsum = jnp.sum(s, axis=0) * (1.0 / p.g)                              # group mean
  return lo, cnt, valid & (vsum > thr), None


def virtual_rows(j, vstart, delta):
  """Row of each virtual row ``j`` [Bk] of a concatenation of ranges (``vstart`` [B] their
  starts in it, ``delta`` = range start - vstart).  {c : vstart_c <= j} is the prefix ending
  at j's range c*, and delta is non-decreasing over ranges laid out in row order (delta_{c+1}
  - delta_c = the rows skipped between them), so the max over the prefix is delta_{c*}."""
  return j + jnp.max(jnp.where(vstart[None, :] <= j[:, None], delta[None, :], _I32_MIN), axis=1)


def new_part(carry, q, kn_ref, vn_ref, kvpos_ref, qpos_ref, *, kv, prog, p, scale):
  """Programs ``prog < n_new``: the user input's chunk ``prog``, causal by position."""
  jj = jnp.arange(p.block_k, dtype=jnp.int32)
  is_new = prog < p.n_new
  new_lo = prog * p.chunk_new
  new_hi = jnp.minimum(new_lo + p.chunk_new, p.num_s)
  q_pos = qpos_ref[0]
  n_new_tiles = jnp.where(is_new, cm.kcdiv(jnp.maximum(new_hi - new_lo, 0), p.block_k),
                          jnp.int32(0)).astype(jnp.int32)

  def new_body(it, carry):
    j = new_lo + it * p.block_k + jj
    jv = j < new_hi
    kp = cm.gather_vec(kvpos_ref, j, jv, other=-1)
    vis = jv & (kp >= 0) & (kp <= q_pos)
    rows = kv * p.num_s + j
    kt = cm.gather_rows(kn_ref, rows, p.dp, vis)
    vt = cm.gather_rows(vn_ref, rows, p.dp, vis)
    mask = jnp.broadcast_to(vis[None, :], (p.rp, p.block_k))
    return core._online_update(carry, q, kt, vt, mask, scale)

  return lax.fori_loop(jnp.int32(0), n_new_tiles, new_body, carry)


def empty_carry(p):
  return (jnp.zeros((p.rp, p.dp), jnp.float32), jnp.full((p.rp,), cm.MASK_VALUE, jnp.float32),
          jnp.zeros((p.rp,), jnp.float32))


def store_partial(o_ref, m_ref, l_ref, carry, kv, prog, hv, rp):
  o, m, l = carry
  plgpu.store(o_ref.at[kv, prog, pl.ds(0, rp), :], o, mask=hv[:, None])
  plgpu.store(m_ref.at[kv, prog, pl.ds(0, rp)], m, mask=hv)
  plgpu.store(l_ref.at[kv, prog, pl.ds(0, rp)], l, mask=hv)


# ----------------------------------------------------------------------------
# The balanced engine.
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StreamPlan:
  """Static shapes of the balanced engine for one decode call."""
  cs: int          # clusters per selection program
  nb: int          # selection programs over the clusters per KV head (+1 for the exact part)
  nbp: int         # nb + 1 padded to a power of two >= 16
  n_stream: int    # streaming programs per KV head

  @staticmethod
  def make(num_c: int, bcs: int, cfg) -> "StreamPlan":
    cs = max(bcs, min(cfg.select_clusters, cm.cdiv(num_c, bcs) * bcs))
    nb = cm.cdiv(num_c, cs)
    return StreamPlan(cs=cs, nb=nb, nbp=max(16, cm.next_pow2(nb + 1)), n_stream=cfg.stream_programs)


def _select_kernel(thr_ref,     # [1] f32
                   offs_ref,    # [Hkv * (C + 1)] int32
                   x_ref,       # [Hkv, g, Cx] f32 scaled logits
                   ms_ref,      # [Hkv, g, nSA] f32
                   ls_ref,      # [Hkv, g, nSA] f32
                   *refs,       # (sel [Hkv, Cx])?, idx [Hkv * L] int32, n [Hkv, nbp] int32
                   p, sp: StreamPlan, return_stats):
  sel_ref, idx_ref, n_ref = refs if return_stats else (None, *refs)
  i32 = jnp.int32
  kv = pl.program_id(0)
  b = pl.program_id(1)
  base = kv * (p.num_c + 1)
  is_cl = b < sp.nb
  first = jnp.clip(offs_ref[base + jnp.minimum(b * sp.cs, p.num_c)], 0, p.num_l)
  end = jnp.where(is_cl, jnp.clip(offs_ref[base + jnp.minimum((b + 1) * sp.cs, p.num_c)], 0, p.num_l),
                  i32(p.num_l))
  span = jnp.maximum(end - first, 0)        # the block's rows: its selection never exceeds them
  hr = jnp.arange(p.rp, dtype=i32)
  hv = hr < p.g
  big_m, inv_den = head_stats(ms_ref, stats_mask(p, hv, is_cl), ls_ref, kv, p, hv)
  thr = thr_ref[0]
  slot = jnp.arange(p.bcs, dtype=i32)
  jj = jnp.arange(p.block_k, dtype=i32)
  dst0 = kv * p.num_l + first

  def write(pos, total, vstart, delta):
    """idx[first + pos + j] = row of virtual row j < total (masked inside the block)."""
    def tile(t, c):
      j = t * p.block_k + jj
      ok = (j < total) & (pos + j < span)
      row = virtual_rows(j, vstart, delta)
      # masked lanes keep their own (wrapped) slots: the interpreter writes every lane back,
      # so a masked lane must not share a slot with a written one
      plgpu.store(idx_ref.at[lax.rem(dst0 + pos + j, i32(p.hkv * p.num_l))], row, mask=ok)
      return c
    lax.fori_loop(i32(0), cm.kcdiv(total, p.block_k).astype(i32), tile, i32(0))

  def sub_body(s, pos):
    c0 = b * sp.cs + s * p.bcs
    cv = (c0 + slot) < p.num_c
    lo, cnt, sel, _ = block_selection(x_ref, offs_ref, kv, c0, cv, big_m, inv_den, thr, p, hv)
    if return_stats:
      plgpu.store(sel_ref.at[kv, pl.ds(c0, p.bcs)], sel.astype(i32), mask=cv)
    size = jnp.where(sel, cnt, 0)
    vend = jnp.cumsum(size)
    vstart = vend - size
    total = jnp.sum(size)
    write(pos, total, vstart, lo - vstart)
    return pos + total

  n_sub = jnp.where(is_cl, i32(sp.cs // p.bcs), i32(0)).astype(i32)
  pos = lax.fori_loop(i32(0), n_sub, sub_body, i32(0))
  # the exact part: every row, identity map (one range starting at `first`)
  ex_total = jnp.where(is_cl, i32(0), span)
  one = slot == 0
  write(i32(0), ex_total, jnp.where(one, 0, ex_total + 1), jnp.where(one, first, 0))
  n_rows = jnp.where(is_cl, jnp.minimum(pos, span), span)
  plgpu.store(n_ref.at[kv, pl.ds(b, 1)], jnp.full((1,), n_rows, i32))


def _stream_kernel(qpos_ref,    # [1] int32
                   q_ref,       # [Hq, dp]
                   offs_ref,    # [Hkv * (C + 1)] int32
                   idx_ref,     # [Hkv * L] int32 (kernel B1)
                   n_ref,       # [Hkv, nbp] int32 (kernel B1)
                   k_ref,       # [Hkv * L, dp]
                   v_ref,       # [Hkv * L, dp]
                   *refs,       # (k_new, v_new [Hkv * S, dp], kv_pos [S])?, o, m, l
                   p, sp: StreamPlan, scale):
  refs = list(refs)
  new_refs = refs[:3] if p.num_s else None
  o_ref, m_ref, l_ref = refs[-3:]
  i32 = jnp.int32
  kv = pl.program_id(0)
  prog = pl.program_id(1)
  hr = jnp.arange(p.rp, dtype=i32)
  hv = hr < p.g
  q = cm.gather_rows(q_ref, kv * p.g + hr, p.dp, hv)                  # [rp, dp]
  carry = empty_carry(p)
  if p.num_s:
    carry = new_part(carry, q, *new_refs, qpos_ref, kv=kv, prog=prog, p=p, scale=scale)

  # Each block's rows form ceil(n_b / Bk) tiles; this program's share of all of them.
  bi = jnp.arange(sp.nbp, dtype=i32)
  bv = bi <= sp.nb
  n_b = plgpu.load(n_ref.at[kv, pl.ds(0, sp.nbp)], mask=bv, other=0)  # [nbp]
  first = jnp.clip(cm.gather_vec(offs_ref, kv * (p.num_c + 1) + jnp.minimum(bi * sp.cs, p.num_c), bv),
                   0, p.num_l)
  tiles = cm.kcdiv(n_b, p.block_k)
  t_end = jnp.cumsum(tiles)
  t_start = t_end - tiles
  n_tiles = jnp.sum(tiles)
  share = jnp.maximum(prog - p.n_new, 0)
  is_st = prog >= p.n_new
  t0 = jnp.where(is_st, cm.kdiv(share * n_tiles, sp.n_stream), 0).astype(i32)
  t1 = jnp.where(is_st, cm.kdiv((share + 1) * n_tiles, sp.n_stream), 0).astype(i32)
  jj = jnp.arange(p.block_k, dtype=i32)

  def tile_body(t, carry):
    blk = jnp.sum((t_end <= t).astype(i32))                            # the tile's block
    at = bi == blk
    j = (t - jnp.sum(jnp.where(at, t_start, 0))) * p.block_k + jj      # rows of the block
    jv = j < jnp.sum(jnp.where(at, n_b, 0))
    src = kv * p.num_l + jnp.clip(jnp.sum(jnp.where(at, first, 0)) + j, 0, p.num_l - 1)
    row = cm.gather_vec(idx_ref, src, jv, other=0)
    rows = kv * p.num_l + jnp.clip(row, 0, p.num_l - 1)
    kt = cm.gather_rows(k_ref, rows, p.dp, jv)                         # [Bk, dp]
    vt = cm.gather_rows(v_ref, rows, p.dp, jv)
    mask = jnp.broadcast_to(jv[None, :], (p.rp, p.block_k))
    return core._online_update(carry, q, kt, vt, mask, scale)

  carry = lax.fori_loop(t0, jnp.maximum(t1, t0), tile_body, carry)
  store_partial(o_ref, m_ref, l_ref, carry, kv, prog, hv, p.rp)


def attend_balanced(p, qf, offs, x, ms, ls, k, v, threshold, k_new, v_new, q_pos, kv_pos_new, *,
                    scale, return_stats, cfg, backend):
  """Kernels B1 + B2 (see the module docstring); kernel B's contract: -> (o [Hkv, P, g, dp],
  m, l [Hkv, P, g] f32 unnormalised partials, sel int32 [Hkv, Cx] | None)."""
  if p.vote != "kv":
    raise ValueError("ClusteredConfig(engine='balanced') streams one row set per KV head: it needs "
                     "vote='kv'; use engine='clusters' for vote='q'")
  hkv, num_l, _ = k.shape
  sp = StreamPlan.make(p.num_c, p.bcs, cfg)
  thr = jnp.reshape(threshold, (1,)).astype(jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((hkv, p.cx), jnp.int32)] if return_stats else []
  out_shape += [jax.ShapeDtypeStruct((hkv * num_l,), jnp.int32),
                jax.ShapeDtypeStruct((hkv, sp.nbp), jnp.int32)]
  outs = pallas_call(
      functools.partial(_select_kernel, p=p, sp=sp, return_stats=return_stats),
      backend=backend, num_warps=cfg.select_warps, num_stages=1,
      grid=(hkv, sp.nb + 1), out_shape=out_shape, name="clustered_select",
  )(thr, offs, x, ms, ls)
  sel = outs[0] if return_stats else None
  idx, n_b = outs[-2:]
  args = [q_pos.astype(jnp.int32), qf, offs, idx, n_b,
          cm.pad_axis(k, 2, p.dp).reshape(hkv * num_l, p.dp),
          cm.pad_axis(v, 2, p.dp).reshape(hkv * num_l, p.dp)]
  num_s = k_new.shape[1]
  if num_s:
    args += [cm.pad_axis(k_new, 2, p.dp).reshape(hkv * num_s, p.dp),
             cm.pad_axis(v_new, 2, p.dp).reshape(hkv * num_s, p.dp),
             kv_pos_new.astype(jnp.int32)]
  n_prog = p.n_new + sp.n_stream
  o, m, l = pallas_call(
      functools.partial(_stream_kernel, p=p, sp=sp, scale=scale),
      backend=backend, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      grid=(hkv, n_prog),
      out_shape=[jax.ShapeDtypeStruct((hkv, n_prog, p.g, p.dp), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_prog, p.g), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_prog, p.g), jnp.float32)],
      name="clustered_stream",
  )(*args)
  return o, m, l, sel
