"""SAAP bucket attention (Mazaré et al., App. F, Algorithms 1-2).

Keys of each KV head are assigned to ``C`` buckets, stored CSR-style: the key
positions of bucket ``b`` are ``lst[kv, off[kv, b] : off[kv, b + 1]]``.  A query
(the ``g`` query heads of a KV head together, as in SAAP's GQA kernel) visits the
buckets ``bucket_idx[kv, :]`` and attends exactly to::

    dense part  = the first n_sink positions + the n_recent most recent fixed positions
                  ([0, n_sink) u [L - n_recent, L))
    bucket keys = all keys of the visited buckets
    new part    = the user input's keys, causally (0 <= kv_pos_new <= q_pos)

One program per visited bucket, the dense part split in ``chunk_k``-key programs
(the paper uses one block for it; more programs only shorten the critical path),
the new part in ``chunk_new``-key programs, then a log-sum-exp merge.

Semantics of overlaps (tested):
* a key of the dense part that is also in a visited bucket is counted once (the
  bucket programs skip dense positions);
* a bucket id listed twice in ``bucket_idx[kv]`` is visited once; ids outside
  ``[0, C)`` (e.g. -1 padding) are skipped;
* ``lst`` is assumed to hold each key at most once (a partition, as built from
  an assignment); list entries outside ``[0, L)`` are ignored.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from pallas_kernels import _common as cm
from pallas_kernels import _attention_core as core
from pallas_kernels._attention_core import AttentionConfig
from pallas_kernels._dispatch import resolve_backend
from pallas_kernels.sparse_attention import dense_reference

__all__ = ["saap_attention", "saap_attention_reference", "AttentionConfig"]


def _validate(q, k, v, off, lst, bucket_idx, k_new, v_new, q_pos, kv_pos_new, n_sink, n_recent):
  shapes = cm.shape_str(q=q, k=k, v=v, off=off, lst=lst, bucket_idx=bucket_idx, k_new=k_new,
                        v_new=v_new, q_pos=q_pos, kv_pos_new=kv_pos_new)
  cm.check_attention_io(shapes, q, k, v, k_new, v_new, q_pos, kv_pos_new)
  hkv = k.shape[0]
  if off.ndim != 2 or off.shape[0] != hkv or off.shape[1] < 2:
    raise ValueError(f"need off [Hkv, C + 1] with C >= 1; got {shapes}")
  if lst.ndim != 2 or lst.shape[0] != hkv or lst.shape[1] < 1:
    raise ValueError(f"need lst [Hkv, N] with N >= 1; got {shapes}")
  if bucket_idx.ndim != 2 or bucket_idx.shape[0] != hkv:
    raise ValueError(f"need bucket_idx [Hkv, l]; got {shapes}")
  for name, x in (("n_sink", n_sink), ("n_recent", n_recent)):
    if not isinstance(x, int) or x < 0:
      raise ValueError(f"{name} must be a static int >= 0, got {x!r}")
  for name, x in (("off", off), ("lst", lst), ("bucket_idx", bucket_idx)):
    cm.check_int32(name, x)


def _dense_ranges(num_l, n_sink, n_recent):
  """Static, disjoint dense ranges [(lo, hi)]."""
  a = min(n_sink, num_l)
  b = max(a, num_l - n_recent)
  return [(lo, hi) for lo, hi in ((0, a), (b, num_l)) if hi > lo]


def _visited(bucket_idx, num_buckets):
  """Valid, first-occurrence bucket visits [Hkv, l] bool."""
  ell = bucket_idx.shape[1]
  eq = bucket_idx[:, :, None] == bucket_idx[:, None, :]          # [Hkv, l, l]
  earlier = jnp.tril(jnp.ones((ell, ell), bool), k=-1)             # [j, i]: i < j
  dup = jnp.any(eq & earlier[None], axis=2)
  return (bucket_idx >= 0) & (bucket_idx < num_buckets) & ~dup


@cm.static_jit(("scale", "n_sink", "n_recent", "return_lse"))
def saap_attention_reference(q, k, v, off, lst, bucket_idx, k_new, v_new, q_pos, kv_pos_new, *,
                             scale, n_sink, n_recent, return_lse=False):
  """Plain-jnp SAAP attention over a dense key mask (same semantics)."""
  squeeze = q.ndim == 2
  q3 = q[:, None, :] if squeeze else q
  hq, seq_len, d = q3.shape
  hkv, num_l, _ = k.shape
  g = hq // hkv
  n_ent = lst.shape[1]
  num_b = off.shape[1] - 1
  visit = _visited(bucket_idx, num_b)                              # [Hkv, l]
  # Bucket of every list entry (-1 outside [off[0], off[C])).
  i = jnp.arange(n_ent)
  ent_b = jax.vmap(lambda o: jnp.searchsorted(o, i, side="right") - 1)(off)
  ent_b = jnp.where(ent_b < num_b, ent_b, -1)
  ent_vis = jnp.any((ent_b[:, :, None] == bucket_idx[:, None, :]) & visit[:, None, :], axis=2)
  ent_vis = ent_vis & (lst >= 0) & (lst < num_l)
  rows = jnp.broadcast_to(jnp.arange(hkv)[:, None], lst.shape)
  in_bucket = jnp.zeros((hkv, num_l), bool).at[rows, jnp.where(ent_vis, lst, num_l)].set(
      True, mode="drop")
  pos = jnp.arange(num_l)
  dense = (pos < n_sink) | (pos >= num_l - n_recent)
  fixed = in_bucket | dense[None, :]                               # [Hkv, L]
  vis = (kv_pos_new >= 0)[None, :] & (kv_pos_new[None, :] <= q_pos[:, None])   # [T, S]
  live = (kv_pos_new >= 0)[None, :, None]
  keys = jnp.concatenate([k, jnp.where(live, k_new, 0)], axis=1)
  vals = jnp.concatenate([v, jnp.where(live, v_new, 0)], axis=1)
  mask = jnp.concatenate([jnp.broadcast_to(fixed[:, None, :], (hkv, seq_len, num_l)),
                          jnp.broadcast_to(vis[None], (hkv,) + vis.shape)], axis=2)
  out, lse = dense_reference(q3.reshape(hkv, g, seq_len, d), keys, vals, mask, scale=scale)
  out = out.reshape(hq, seq_len, d).astype(q.dtype)
  lse = lse.reshape(hq, seq_len)
  if squeeze:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


@cm.static_jit(("scale", "n_sink", "n_recent", "return_lse", "backend", "config"))
def saap_attention(
    q: jax.Array,            # [Hq, d] (or [Hq, T, d]: one bucket set for all T tokens)
    k: jax.Array,            # [Hkv, L, d]
    v: jax.Array,            # [Hkv, L, d]
    off: jax.Array,          # [Hkv, C + 1] int32 CSR offsets into lst
    lst: jax.Array,          # [Hkv, N] int32 key positions grouped by bucket
    bucket_idx: jax.Array,   # [Hkv, l] int32 visited buckets
    k_new: jax.Array,        # [Hkv, S, d]
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [T] int32
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty)
    *,
    scale: float,
    n_sink: int = 1,
    n_recent: int = 2047,
    return_lse: bool = False,
    backend: str = "auto",
    config: AttentionConfig | None = None,
):
  """SAAP attention: visited buckets + dense part + causal new part, LSE-merged.

  Returns o with q's shape and dtype (+ lse f32 [Hq(, T)] if ``return_lse``).
  """
  squeeze = q.ndim == 2
  q3 = q[:, None, :] if squeeze else q
  _validate(q3, k, v, off, lst, bucket_idx, k_new, v_new, q_pos, kv_pos_new, n_sink, n_recent)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return saap_attention_reference(q, k, v, off, lst, bucket_idx, k_new, v_new, q_pos,
                                    kv_pos_new, scale=scale, n_sink=n_sink, n_recent=n_recent,
                                    return_lse=return_lse)
  hq, seq_len, d = q3.shape
  hkv, num_l, _ = k.shape
  n_ent = lst.shape[1]
  num_b = off.shape[1] - 1
  ell = bucket_idx.shape[1]
  num_s = k_new.shape[1]
  ranges = _dense_ranges(num_l, n_sink, n_recent)
  n_dense = sum(hi - lo for lo, hi in ranges)
  cfg, lay, chunk, chunk_new = core.work_plan(hq, seq_len, d, hkv, n_dense, num_s, config)
  wg = max(1, ell + core.n_range_and_new_items(ranges, num_s, chunk, chunk_new))
  kvs = jnp.arange(hkv, dtype=jnp.int32)[:, None]
  blocks, actives = [], []
  if ell:
    b = jnp.clip(bucket_idx, 0, num_b - 1)
    lo = jnp.clip(jnp.take_along_axis(off, b, axis=1), 0, n_ent)
    hi = jnp.clip(jnp.take_along_axis(off, b + 1, axis=1), 0, n_ent)
    c = jnp.arange(ell, dtype=jnp.int32)[None, :]
    blocks.append(core.make_items(kvs, core.KIND_LIST, lo, hi, kvs, kvs * wg + c))
    actives.append(_visited(bucket_idx, num_b) & (hi > lo))
  more = core.range_and_new_blocks(hkv, ranges, num_s, chunk, chunk_new, ell, wg)
  blocks += more[0]
  actives += more[1]
  table, active = core.build_table(blocks, actives, hkv)
  o, m, l = core.attention_partials(
      q3, k, v, k_new if num_s else None, v_new, q_pos, kv_pos_new, lst, table, lay=lay,
      n_slots=hkv * wg, scale=scale, exclude=(n_sink, n_recent), cfg=cfg, backend=be)
  out, lse = core.merge_partials(o, m, l, active, lay=lay, d=d)
  out = out.astype(q.dtype)
  if squeeze:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out
