"""Split-KV attention over gathered rows: the kernel shared by the sparse ops.

``sparse_attention``, ``quest`` (page-sparse decode) and ``saap_attention`` all
reduce to: for each *row group* (a selection head with its ``R`` query heads, or a
KV head with its ``g`` query heads), exact attention over a few *work items*, each
a bounded list of keys, then a log-sum-exp merge of the partial results
(Flash-Decoding).  A work item is one row of an int32 table built on device::

    (grp, kind, lo, hi, row, slot, 0, 0)

* kind 1 (list):  fixed-context positions ``lists[row, lo:hi]`` (with ``page_size``
  > 1 every list entry is a page ``p`` and the positions are ``p*ps .. p*ps+ps-1``;
  ``lo``/``hi`` then count rows, not pages).  Entries outside ``[0, L)`` (e.g. -1
  padding) are ignored.  With ``exclude=(n_sink, n_recent)`` positions of the dense
  part are skipped, so a key reached both from a list and from the dense part
  counts once.
* kind 2 (range): fixed-context positions ``lo .. hi-1``.
* kind 3 (new):   the user input's own keys ``k_new[:, lo:hi]``; key ``j`` is visible
  to query token ``t`` iff ``0 <= kv_pos_new[j] <= q_pos[t]``; a key tile that no
  query row of the program can see is skipped without loads (causal prefill).
* kind 0: nothing (padding of the flattened list).

Work items are packed so that active ones come first; the grid is sized by the
static capacity and the trailing programs exit at once, so heads with more keys
get more programs (balanced over SMs without any host synchronisation).  Each
program writes an unnormalised partial ``(o, m, l)`` to ``slot`` of a static
``[group, slots_per_group]`` layout; ``merge_partials`` (fused jnp) combines the
active slots.

Query rows: a program stacks the ``R`` query heads of its group times ``block_t``
query tokens (``R * block_t`` rows, padded to a power of two >= 16), so one
gathered K/V tile serves every query row that attends to it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as cm
from pallas_kernels._dispatch import pallas_call

KIND_SKIP, KIND_LIST, KIND_RANGE, KIND_NEW = 0, 1, 2, 3
TABLE_COLS = 8


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static tiling of the gathered-attention kernel.

  block_rows: stacked query rows per program (R * block_t) in prefill; decode uses
    R rows (padded to >= 16).  Power of two >= 16.
  block_k: keys gathered per tile (power of two >= 16).
  chunk_k: fixed-context keys per work item (multiple of block_k), or None to
    choose from the shapes so that about ``target_programs`` programs run.
  chunk_new: user-input keys per work item, or None (auto, same rule).
  """
  block_rows: int = 64
  block_k: int = 64
  chunk_k: int | None = None
  chunk_new: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  target_programs: int = 1024

  def __post_init__(self):
    cm.check_pow2("block_rows", self.block_rows)
    cm.check_pow2("block_k", self.block_k)
    for name in ("chunk_k", "chunk_new"):
      val = getattr(self, name)
      if val is not None and (not isinstance(val, int) or val < self.block_k
                              or val % self.block_k):
        raise ValueError(f"{name} must be None or a positive multiple of block_k="
                         f"{self.block_k}, got {val!r}")
    cm.check_warps_stages(self.num_warps, self.num_stages)
    if not isinstance(self.target_programs, int) or self.target_programs < 1:
      raise ValueError(f"target_programs must be a positive int, got {self.target_programs!r}")


def default_config(seq_len: int, head_dim: int) -> AttentionConfig:
  """Decode (few query tokens): small row tiles; prefill: FA2-like 128-row tiles."""
  if seq_len <= 4:
    return AttentionConfig(block_rows=16, block_k=64, num_warps=4, num_stages=2)
  return AttentionConfig(block_rows=128, block_k=64,
                         num_warps=8 if head_dim >= 128 else 4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """How query rows are stacked in a program (all static)."""
  hq: int
  seq_len: int
  groups: int
  r: int          # query heads per group
  block_t: int    # query tokens per program
  rp: int         # stacked rows, padded power of two >= 16
  n_qb: int       # query blocks


def row_layout(hq: int, seq_len: int, groups: int, cfg: AttentionConfig) -> RowLayout:
  r = hq // groups
  if seq_len == 1:
    block_t = 1
  else:
    block_t = max(1, cfg.block_rows // cm.next_pow2(r))
    block_t = min(block_t, cm.next_pow2(seq_len))
  rp = max(16, cm.next_pow2(r * block_t))
  return RowLayout(hq, seq_len, groups, r, block_t, rp, cm.cdiv(seq_len, block_t))


def auto_chunk(n_keys: int, n_parallel: int, cfg: AttentionConfig, explicit: int | None,
               min_tiles: int = 4) -> int:
  """Keys per work item: ~target_programs programs overall, >= min_tiles tiles each."""
  if explicit is not None:
    return explicit
  bk = cfg.block_k
  if n_keys <= 0:
    return bk
  max_chunks = max(1, cm.cdiv(n_keys, bk * min_tiles))
  n_chunks = min(max(1, cm.cdiv(cfg.target_programs, max(1, n_parallel))), max_chunks)
  return cm.cdiv(cm.cdiv(n_keys, n_chunks), bk) * bk


def work_plan(hq: int, seq_len: int, d: int, groups: int, n_fixed: int, num_s: int,
              config: AttentionConfig | None):
  """(cfg, row layout, keys per fixed-context item, keys per new-key item) for an op with
  ``groups`` row groups and ``n_fixed`` fixed-context keys per group."""
  cfg = config or default_config(seq_len, d)
  lay = row_layout(hq, seq_len, groups, cfg)
  par = lay.n_qb * groups
  return cfg, lay, auto_chunk(n_fixed, par, cfg, cfg.chunk_k), auto_chunk(num_s, par, cfg, cfg.chunk_new)


def compact_items(items: jax.Array, active: jax.Array) -> jax.Array:
  """items [W, 8] int32, active [W] bool -> table [W, 8] with active rows first.

  Inactive rows get kind 0 (their programs do nothing).
  """
  items = items.at[:, 1].set(jnp.where(active, items[:, 1], KIND_SKIP))
  a = active.astype(jnp.int32)
  n_act = jnp.sum(a)
  pos = jnp.where(active, jnp.cumsum(a) - 1, n_act + jnp.cumsum(1 - a) - 1)
  return jnp.zeros_like(items).at[pos].set(items)


def make_items(grp, kind, lo, hi, row, slot):
  """Broadcasts int arrays into an item block [..., 8] (see the module docstring)."""
  cols = jnp.broadcast_arrays(*(jnp.asarray(x, jnp.int32) for x in (grp, kind, lo, hi, row, slot)))
  z = jnp.zeros_like(cols[0])
  return jnp.stack(list(cols) + [z, z], axis=-1)


def build_table(blocks, actives, groups: int):
  """Per-group item blocks [G, n_i, 8] (+ active [G, n_i]) -> (table [W, 8], active [G, Wg]).

  Slot numbers must be ``grp * Wg + local`` with the blocks concatenated in order.
  With no block at all, one inactive dummy slot per group is made.
  """
  if not blocks:
    z = jnp.zeros((groups, 1), jnp.int32)
    blocks, actives = [make_items(z, KIND_SKIP, 0, 0, 0, jnp.arange(groups)[:, None])], [z > 0]
  items = jnp.concatenate(blocks, axis=1)
  active = jnp.concatenate(actives, axis=1)
  table = compact_items(items.reshape(-1, TABLE_COLS), active.reshape(-1))
  return table, active


def _new_key_block(grp, num_s: int, chunk_new: int, first_slot: int, wg: int):
  """Items for the user input's keys in ``chunk_new``-key ranges (slots ``first_slot`` on)."""
  n_nc = cdiv_static(num_s, chunk_new) if num_s else 0
  if not n_nc:
    return [], []
  c = jnp.arange(n_nc, dtype=jnp.int32)[None, :]
  lo = c * chunk_new
  return ([make_items(grp, KIND_NEW, lo, jnp.minimum(lo + chunk_new, num_s), grp, grp * wg + first_slot + c)],
          [jnp.ones((grp.shape[0], n_nc), bool)])


def range_and_new_blocks(groups: int, ranges, num_s: int, chunk: int, chunk_new: int,
                         first_slot: int, wg: int):
  """Item blocks for static fixed-context ranges split in ``chunk``-key items, then the
  user input's keys in ``chunk_new``-key items, for every group (slots ``first_slot`` on).

  ranges: static disjoint [(lo, hi)].  Returns (blocks, actives) for ``build_table``.
  """
  items = [(a, min(a + chunk, hi)) for lo, hi in ranges for a in range(lo, hi, chunk)]
  grp = jnp.arange(groups, dtype=jnp.int32)[:, None]
  blocks, actives = [], []
  if items:
    arr = jnp.asarray(items, jnp.int32)                            # [n, 2]
    c = first_slot + jnp.arange(len(items), dtype=jnp.int32)[None, :]
    blocks.append(make_items(grp, KIND_RANGE, arr[None, :, 0], arr[None, :, 1], grp, grp * wg + c))
    actives.append(jnp.ones((groups, len(items)), bool))
  nb, na = _new_key_block(grp, num_s, chunk_new, first_slot + len(items), wg)
  return blocks + nb, actives + na


def list_and_new_blocks(groups: int, n_list: int, counts, num_s: int, chunk: int, chunk_new: int):
  """Item blocks for each group's list ``lists[g, :n_list]`` in ``chunk``-entry items (only
  the first ``counts[g]`` entries when ``counts`` [G] is given), then the user input's keys.

  Returns (blocks, actives, wg) for ``build_table`` (``wg`` slots per group).
  """
  n_sc = cdiv_static(n_list, chunk) if n_list else 0
  wg = max(1, n_sc + (cdiv_static(num_s, chunk_new) if num_s else 0))
  grp = jnp.arange(groups, dtype=jnp.int32)[:, None]
  blocks, actives = [], []
  if n_sc:
    c = jnp.arange(n_sc, dtype=jnp.int32)[None, :]
    lo = c * chunk
    if counts is None:
      hi, act = jnp.minimum(lo + chunk, n_list), jnp.ones((groups, n_sc), bool)
    else:
      hi, act = jnp.minimum(counts[:, None], lo + chunk), jnp.broadcast_to(lo < counts[:, None], (groups, n_sc))
    blocks.append(make_items(grp, KIND_LIST, lo, hi, grp, grp * wg + c))
    actives.append(act)
  nb, na = _new_key_block(grp, num_s, chunk_new, n_sc, wg)
  return blocks + nb, actives + na, wg


def n_range_and_new_items(ranges, num_s: int, chunk: int, chunk_new: int) -> int:
  """How many items ``range_and_new_blocks`` makes per group (static)."""
  n = sum(cdiv_static(hi - lo, chunk) for lo, hi in ranges)
  return n + (cdiv_static(num_s, chunk_new) if num_s else 0)


def cdiv_static(a: int, b: int) -> int:
  return -(-a // b)


def _online_update(carry, q, kt, vt, mask, scale):
  o, m, l = carry
  s = plgpu.dot(q, kt, trans_b=True) * scale                     # [rp, Bk] f32
  s = jnp.where(mask, s, cm.MASK_VALUE)
  m_next = jnp.maximum(m, jnp.max(s, axis=1))
  alpha = jnp.exp(m - m_next)
  p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
  l_next = l * alpha + jnp.sum(p, axis=1)
  o_next = o * alpha[:, None] + plgpu.dot(p.astype(vt.dtype), vt)
  return o_next, m_next, l_next


def _attn_kernel(tbl_ref,      # [W * 8] int32 work items
                 q_ref,        # [Hq * T, d]
                 qpos_ref,     # [T] int32
                 k_ref,        # [Hkv * L, d]
                 v_ref,        # [Hkv * L, d]
                 *refs,        # lists [rows * N]?, (k_new, v_new [Hkv * S, d], kv_pos [S])?, o, m, l
                 scale, lay: RowLayout, group, num_l, num_s, list_n, page_size,
                 exclude, block_k, d, has_list, has_new):
  refs = list(refs)
  lst_ref = refs.pop(0) if has_list else None
  if has_new:
    kn_ref, vn_ref, kvpos_ref = refs[:3]
    refs = refs[3:]
  o_ref, m_ref, l_ref = refs
  qb = pl.program_id(0)   # query blocks vary fastest: programs running together share
  w = pl.program_id(1)    # one work item's K/V rows, which then stream through L2 once
  base = w * TABLE_COLS
  grp = tbl_ref[base]
  kind = tbl_ref[base + 1]
  lo = tbl_ref[base + 2]
  hi = tbl_ref[base + 3]
  row = tbl_ref[base + 4]
  slot = tbl_ref[base + 5]
  kv = cm.kdiv(grp * lay.r, group)

  i = jnp.arange(lay.rp, dtype=jnp.int32)
  rr = lax.div(i, jnp.int32(lay.block_t))
  tt = lax.rem(i, jnp.int32(lay.block_t))
  t = qb * lay.block_t + tt
  rv = (rr < lay.r) & (t < lay.seq_len)
  q = cm.gather_rows(q_ref, (grp * lay.r + rr) * lay.seq_len + t, d, rv)   # [rp, d]
  n_tiles = cm.kcdiv(jnp.maximum(hi - lo, 0), block_k)
  jj = jnp.arange(block_k, dtype=jnp.int32)

  def fixed_body(it, carry):
    j = lo + it * block_k + jj
    jv = j < hi
    if has_list:
      is_list = kind == KIND_LIST
      if page_size > 1:
        lv = cm.gather_vec(lst_ref, row * list_n + lax.div(j, jnp.int32(page_size)),
                           jv & is_list, other=-1)
        lv_ok = (lv >= 0) & (lv < cm.cdiv(num_l, page_size))      # no int32 wrap-around
        lpos = jnp.where(lv_ok, lv * page_size + lax.rem(j, jnp.int32(page_size)), -1)
      else:
        lpos = cm.gather_vec(lst_ref, row * list_n + j, jv & is_list, other=-1)
      pos = jnp.where(is_list, lpos, j)
    else:
      pos = j
    valid = jv & (pos >= 0) & (pos < num_l)
    if exclude is not None and has_list:
      n_sink, n_recent = exclude
      dense = (pos < n_sink) | (pos >= num_l - n_recent)
      valid = valid & ~(is_list & dense)
    rows = kv * num_l + pos
    kt = cm.gather_rows(k_ref, rows, d, valid)                     # [Bk, d]
    vt = cm.gather_rows(v_ref, rows, d, valid)
    mask = jnp.broadcast_to(valid[None, :], (lay.rp, block_k))
    return _online_update(carry, q, kt, vt, mask, scale)

  carry = (jnp.zeros((lay.rp, d), jnp.float32),
           jnp.full((lay.rp,), cm.MASK_VALUE, jnp.float32),
           jnp.zeros((lay.rp,), jnp.float32))
  is_fixed = (kind == KIND_LIST) | (kind == KIND_RANGE)
  carry = lax.fori_loop(0, jnp.where(is_fixed, n_tiles, 0), fixed_body, carry)

  if has_new:
    qp = cm.gather_vec(qpos_ref, t, rv, other=-1)                  # [rp]
    q_last = jnp.max(qp)                                           # newest query position

    def new_body(it, carry):
      j = lo + it * block_k + jj
      jv = j < hi
      kp = cm.gather_vec(kvpos_ref, j, jv, other=-1)
      kvalid = jv & (kp >= 0)
      first = jnp.min(jnp.where(kvalid, kp, jnp.iinfo(jnp.int32).max))

      def update(carry):
        rows = kv * num_s + j
        kt = cm.gather_rows(kn_ref, rows, d, kvalid)
        vt = cm.gather_rows(vn_ref, rows, d, kvalid)
        mask = kvalid[None, :] & (kp[None, :] <= qp[:, None])
        return _online_update(carry, q, kt, vt, mask, scale)

      # Causal: a tile no query of this block can see is skipped (no loads, no dots).
      return lax.cond(first <= q_last, update, lambda c: c, carry)

    carry = lax.fori_loop(0, jnp.where(kind == KIND_NEW, n_tiles, 0), new_body, carry)

  o, m, l = carry

  @pl.when(kind != KIND_SKIP)
  def _store():
    n_real = lay.r * lay.block_t                                   # rows that are queries
    if n_real == lay.rp:
      o_ref[qb, slot, :, :] = o
      m_ref[qb, slot, :] = m
      l_ref[qb, slot, :] = l
    else:                                                          # padding rows not stored
      live = i < n_real
      plgpu.store(o_ref.at[qb, slot, pl.ds(0, lay.rp), :], o, mask=live[:, None])
      plgpu.store(m_ref.at[qb, slot, pl.ds(0, lay.rp)], m, mask=live)
      plgpu.store(l_ref.at[qb, slot, pl.ds(0, lay.rp)], l, mask=live)


def attention_partials(q, k, v, k_new, v_new, q_pos, kv_pos_new, lists, table, *,
                       lay: RowLayout, n_slots: int, scale: float, page_size: int = 1,
                       exclude=None, cfg: AttentionConfig, backend: str):
  """Runs the kernel over the work-item table.

  q [Hq, T, d]; k, v [Hkv, L, d]; k_new, v_new [Hkv, S, d] or None; q_pos [T];
  kv_pos_new [S] or None; lists [rows, N] int32 or None; table [W, 8] int32.
  Returns unnormalised partials o [nQB, n_slots, R * block_t, dp], m, l
  [nQB, n_slots, R * block_t] (only real query rows are stored).
  """
  hq, seq_len, d = q.shape
  hkv, num_l, _ = k.shape
  dp = cm.padded_head_dim(d)
  has_list = lists is not None
  has_new = k_new is not None and k_new.shape[1] > 0
  num_s = k_new.shape[1] if has_new else 0
  args = [table.reshape(-1),
          cm.pad_axis(q, 2, dp).reshape(hq * seq_len, dp),
          q_pos.astype(jnp.int32),
          cm.pad_axis(k, 2, dp).reshape(hkv * num_l, dp),
          cm.pad_axis(v, 2, dp).reshape(hkv * num_l, dp)]
  list_n = 0
  if has_list:
    list_n = lists.shape[1]
    args.append(lists.reshape(-1))
  if has_new:
    args += [cm.pad_axis(k_new, 2, dp).reshape(hkv * num_s, dp),
             cm.pad_axis(v_new, 2, dp).reshape(hkv * num_s, dp),
             kv_pos_new.astype(jnp.int32)]
  kernel = functools.partial(
      _attn_kernel, scale=scale, lay=lay, group=hq // hkv, num_l=num_l, num_s=num_s,
      list_n=list_n, page_size=page_size, exclude=exclude, block_k=cfg.block_k, d=dp,
      has_list=has_list, has_new=has_new)
  n_items = table.shape[0]
  n_real = lay.r * lay.block_t
  return pallas_call(
      kernel, backend=backend, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      grid=(lay.n_qb, n_items),
      out_shape=[
          jax.ShapeDtypeStruct((lay.n_qb, n_slots, n_real, dp), jnp.float32),  # o
          jax.ShapeDtypeStruct((lay.n_qb, n_slots, n_real), jnp.float32),      # m
          jax.ShapeDtypeStruct((lay.n_qb, n_slots, n_real), jnp.float32),      # l
      ],
      name="gathered_attention",
  )(*args)


def merge_partials(o, m, l, active, *, lay: RowLayout, d: int):
  """Log-sum-exp merge of the active slots of every group.

  o [nQB, G * Wg, rows, dp], m/l [nQB, G * Wg, rows]; active [G, Wg] bool (slots whose
  programs ran; the others hold uninitialised memory and are never read).
  Returns out [Hq, T, d] f32 (0 where nothing is visible) and lse [Hq, T] f32
  (-inf where nothing is visible).
  """
  n_qb, _, rp, dp = o.shape
  groups, wg = active.shape
  o = o.reshape(n_qb, groups, wg, rp, dp)
  m = m.reshape(n_qb, groups, wg, rp)
  l = l.reshape(n_qb, groups, wg, rp)
  act = active[None, :, :, None]
  m = jnp.where(act, m, cm.MASK_VALUE)
  l = jnp.where(act, l, 0.0)
  mx = jnp.max(m, axis=2)                                          # [nQB, G, rp]
  w = jnp.where(act & (l > 0), jnp.exp(m - mx[:, :, None]), 0.0)
  den = jnp.sum(w * l, axis=2)
  num = jnp.sum(jnp.where(act[..., None], o, 0.0) * w[..., None], axis=2)
  ok = den > 0
  safe = jnp.where(ok, den, 1.0)
  out = jnp.where(ok[..., None], num / safe[..., None], 0.0)       # [nQB, G, rp, dp]
  lse = jnp.where(ok, mx + jnp.log(safe), -jnp.inf)
  return _rows_to_heads(out, lay)[..., :d], _rows_to_heads(lse, lay)


def _rows_to_heads(x, lay: RowLayout):
  """[nQB, G, R * bt, ...] -> [Hq, T, ...] (row i of a program = head i // bt, token i % bt)."""
  n_qb, groups = x.shape[:2]
  tail = x.shape[3:]
  x = x.reshape((n_qb, groups, lay.r, lay.block_t) + tail)
  x = jnp.moveaxis(x, 0, 2)                                        # [G, r, nQB, bt, ...]
  x = x.reshape((groups * lay.r, n_qb * lay.block_t) + tail)
  return x[:, : lay.seq_len]
