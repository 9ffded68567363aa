"""Exact attention over retrieved fixed-context keys + the user input's causal part.

Squeezed Attention, Section 4.2: after the centroid lookup, each selection head
``s`` attends exactly to the fixed-context keys it retrieved and, as every query
does, to the user input's own keys causally.  With ``K_s`` the retrieved positions
of selection head ``s`` (the one query head ``h`` uses) and ``N_t`` the new keys
visible to query token ``t``::

    o[h, t] = sum_{j in K_s u N_t} softmax_j(scale q[h,t].k_j) v_j

computed as two (or more) partial softmaxes merged by log-sum-exp.

Index conventions (shared with every sparse op in this package):

* ``idx [Hs, cap]`` int32, ``counts [Hs]`` int32.  Entries ``idx[s, :counts[s]]`` are
  positions in ``[0, L)``; entries at or past ``counts[s]`` are ignored whatever they
  hold.  ``counts`` is clipped to ``[0, cap]`` (overflow: a producer that found more
  than ``cap`` keys must report it itself -- this op cannot know about keys that are
  not in ``idx``; ``clusters_to_indices`` returns ``wanted`` for that).  Entries
  inside the count that fall outside ``[0, L)`` (e.g. -1 padding) are ignored too.
* Duplicates are NOT removed: a position listed twice is attended twice, in the
  kernel and in the reference alike (it doubles that key's softmax weight).
  Producers should emit unique positions (cluster -> key lists are disjoint).
* ``Hs`` is ``Hkv`` (per-KV-head selection, the default) or ``Hq``; selection head
  ``s`` uses KV head ``s // (Hs // Hkv)``, query head ``h`` uses selection head
  ``h // (Hq // Hs)``.
* New keys ``k_new, v_new [Hkv, S, d]`` at absolute positions ``kv_pos_new [S]``
  (-1 = empty slot); query token ``t`` at ``q_pos[t]`` sees new key ``j`` iff
  ``0 <= kv_pos_new[j] <= q_pos[t]``.  Fixed-context keys are always visible.
* ``counts`` may be 0 for a head; if a query sees nothing at all its output is 0
  and its ``lse`` is ``-inf`` (never NaN).

Kernel: Flash-Decoding over a flattened work list (see ``_attention_core``): each
selection head's retrieved list is split in chunks of ``chunk_k`` keys, the new part
in chunks of ``chunk_new``; one program per (query block, chunk) with the group's
query heads stacked so one gathered K/V tile serves all of them; partial
``(o, m, l)`` merged by log-sum-exp.  The same kernel serves decode (T = 1) and
prefill (T > 1: rows = R heads x block_t tokens).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as cm
from pallas_kernels import _attention_core as core
from pallas_kernels._attention_core import AttentionConfig
from pallas_kernels._dispatch import pallas_call, resolve_backend

__all__ = ["AttentionConfig", "sparse_attention", "sparse_attention_reference",
           "gather_then_dense_attention", "gather_live_rows", "gather_live_rows_reference", "interleaved_rows",
           "clusters_to_indices"]


def _validate(q, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new):
  shapes = cm.shape_str(q=q, k=k, v=v, idx=idx, counts=counts, k_new=k_new, v_new=v_new,
                        q_pos=q_pos, kv_pos_new=kv_pos_new)
  cm.check_attention_io(shapes, q, k, v, k_new, v_new, q_pos, kv_pos_new)
  hq, hkv = q.shape[0], k.shape[0]
  if idx.ndim != 2 or idx.shape[0] not in (hkv, hq) or counts.shape != (idx.shape[0],):
    raise ValueError(f"need idx [Hs, cap] and counts [Hs] with Hs in (Hkv={hkv}, Hq={hq}); got {shapes}")
  cm.check_int32("idx", idx)
  cm.check_int32("counts", counts)


def dense_reference(q, keys, values, mask, *, scale):
  """Masked softmax attention in f32.  q [Hs, r, T, d]; keys/values [Hs, n, d];
  mask [Hs, T, n] bool.  Returns out [Hs, r, T, d] f32, lse [Hs, r, T] (-inf if empty)."""
  logits = scale * jnp.einsum("srtd,snd->srtn", q.astype(jnp.float32), keys.astype(jnp.float32))
  mask = mask[:, None]
  logits = jnp.where(mask, logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  p = jnp.where(mask, jnp.exp(logits - mx), 0.0)
  den = jnp.sum(p, axis=-1)
  ok = den > 0
  safe = jnp.where(ok, den, 1.0)
  out = jnp.einsum("srtn,snd->srtd", p, values.astype(jnp.float32)) / safe[..., None]
  out = jnp.where(ok[..., None], out, 0.0)
  lse = jnp.where(ok, mx[..., 0] + jnp.log(safe), -jnp.inf)
  return out, lse


def merge_lse(parts):
  """Log-sum-exp merge of normalised partial results over disjoint key sets: parts = [(o [..., d],
  lse [...])], lse = -inf where a part saw nothing (its o is then ignored, whatever it holds).
  -> (o [..., d] f32, 0 where no part saw anything; lse [...] f32, -inf there)."""
  mx = functools.reduce(jnp.maximum, [lse for _, lse in parts])
  ok = jnp.isfinite(mx)
  m0 = jnp.where(ok, mx, 0.0)
  den, out = 0.0, 0.0
  for o, lse in parts:
    w = jnp.where(ok, jnp.exp(lse - m0), 0.0)
    den = den + w
    out = out + jnp.where((w > 0)[..., None], o.astype(jnp.float32), 0.0) * w[..., None]
  live = den > 0
  safe = jnp.where(live, den, 1.0)
  return (jnp.where(live[..., None], out / safe[..., None], 0.0),
          jnp.where(live, m0 + jnp.log(safe), -jnp.inf))


def _kv_head_of_selection(hq, hkv, hs):
  r = hq // hs
  return (jnp.arange(hs, dtype=jnp.int32) * r) // (hq // hkv)


@cm.static_jit(("scale", "return_lse"))
def sparse_attention_reference(q, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new, *,
                               scale, return_lse=False):
  """Plain-jnp version of ``sparse_attention`` (same conventions, duplicates counted)."""
  hq, seq_len, d = q.shape
  hkv, num_l, _ = k.shape
  hs, cap = idx.shape
  r = hq // hs
  kvh = _kv_head_of_selection(hq, hkv, hs)
  cnt = jnp.clip(counts, 0, cap)
  valid = (jnp.arange(cap)[None, :] < cnt[:, None]) & (idx >= 0) & (idx < num_l)
  sidx = jnp.where(valid, idx, 0)
  ks = jnp.where(valid[..., None], k[kvh[:, None], sidx], 0)      # [Hs, cap, d]
  vs = jnp.where(valid[..., None], v[kvh[:, None], sidx], 0)
  vis = (kv_pos_new >= 0)[None, :] & (kv_pos_new[None, :] <= q_pos[:, None])   # [T, S]
  kn = jnp.where((kv_pos_new >= 0)[None, :, None], k_new, 0)[kvh]
  vn = jnp.where((kv_pos_new >= 0)[None, :, None], v_new, 0)[kvh]
  keys = jnp.concatenate([ks, kn], axis=1)
  vals = jnp.concatenate([vs, vn], axis=1)
  mask = jnp.concatenate([jnp.broadcast_to(valid[:, None, :], (hs, seq_len, cap)),
                          jnp.broadcast_to(vis[None], (hs,) + vis.shape)], axis=2)
  out, lse = dense_reference(q.reshape(hs, r, seq_len, d), keys, vals, mask, scale=scale)
  out = out.reshape(hq, seq_len, d).astype(q.dtype)
  lse = lse.reshape(hq, seq_len)
  return (out, lse) if return_lse else out


@cm.static_jit(("scale", "return_lse", "backend", "config"))
def sparse_attention(
    q: jax.Array,            # [Hq, T, d]
    k: jax.Array,            # [Hkv, L, d]  fixed-context keys
    v: jax.Array,            # [Hkv, L, d]
    idx: jax.Array,          # [Hs, cap] int32 retrieved positions
    counts: jax.Array,       # [Hs] int32 valid entries per selection head
    k_new: jax.Array,        # [Hkv, S, d]  user-input keys
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [T] int32
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty)
    *,
    scale: float,
    return_lse: bool = False,
    backend: str = "auto",
    config: AttentionConfig | None = None,
):
  """Attention over retrieved keys + causal new part; see the module docstring.

  Returns o [Hq, T, d] in q's dtype (and lse [Hq, T] f32, natural log, -inf where a
  query sees nothing, if ``return_lse``).
  """
  _validate(q, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return sparse_attention_reference(q, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new,
                                      scale=scale, return_lse=return_lse)
  hq, seq_len, d = q.shape
  hs, cap = idx.shape
  num_s = k_new.shape[1]
  cfg, lay, chunk, chunk_new = core.work_plan(hq, seq_len, d, hs, cap, num_s, config)
  cnt = jnp.clip(counts, 0, cap)
  blocks, actives, wg = core.list_and_new_blocks(hs, cap, cnt, num_s, chunk, chunk_new)
  table, active = core.build_table(blocks, actives, hs)
  o, m, l = core.attention_partials(
      q, k, v, k_new if num_s else None, v_new, q_pos, kv_pos_new, idx if cap else None, table,
      lay=lay, n_slots=hs * wg, scale=scale, cfg=cfg, backend=be)
  out, lse = core.merge_partials(o, m, l, active, lay=lay, d=d)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("cap", "backend"))
def clusters_to_indices(
    selected: jax.Array,         # [Hs, C] bool retrieved clusters
    cluster_offsets: jax.Array,  # [Hkv, C + 1] int32 CSR offsets into cluster_keys
    cluster_keys: jax.Array,     # [Hkv, N] int32 key positions grouped by cluster
    *,
    cap: int,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Retrieved clusters -> the ``(idx, counts)`` that ``sparse_attention`` takes.

  The keys of cluster ``c`` of KV head ``kv`` are
  ``cluster_keys[kv, cluster_offsets[kv, c] : cluster_offsets[kv, c + 1]]``;
  selection head ``s`` reads KV head ``s // (Hs // Hkv)``.  Returns
  ``idx [Hs, cap]`` (selected clusters' keys concatenated in cluster order, -1
  padded), ``counts [Hs] = min(wanted, cap)`` and ``wanted [Hs]`` (keys the
  selection asked for).  **Overflow**: ``wanted > cap`` means keys were dropped
  (the last clusters' keys); the caller must check ``wanted`` (e.g. raise the
  capacity, calibrated from the sparsity target) -- nothing is dropped silently
  as long as it does.  Fully on device (scatter + cumsum, fused XLA on every
  backend; ``backend`` is only validated), no host sync.
  """
  resolve_backend(backend)
  if selected.ndim != 2 or cluster_offsets.ndim != 2 or cluster_keys.ndim != 2:
    raise ValueError("need selected [Hs, C], cluster_offsets [Hkv, C + 1], cluster_keys "
                     f"[Hkv, N]; got {cm.shape_str(selected=selected, cluster_offsets=cluster_offsets, cluster_keys=cluster_keys)}")
  hs, num_c = selected.shape
  hkv = cluster_offsets.shape[0]
  if cluster_offsets.shape[1] != num_c + 1 or cluster_keys.shape[0] != hkv or hs % hkv:
    raise ValueError("shape mismatch: "
                     + cm.shape_str(selected=selected, cluster_offsets=cluster_offsets,
                                    cluster_keys=cluster_keys))
  if not isinstance(cap, int) or cap < 1:
    raise ValueError(f"cap must be a positive int, got {cap!r}")
  rows = jnp.arange(hs, dtype=jnp.int32) // (hs // hkv)
  return cm.expand_ranges(selected, cluster_offsets, cluster_keys, rows, cap)


# ----------------------------------------------------------------------------
# Gather, then dense attention (prefill fast path to compare with the kernel).
# ----------------------------------------------------------------------------
def _compact(idx, counts, num_l):
  """Moves the valid entries of each row to the front: (idx' [Hs, cap], n [Hs])."""
  hs, cap = idx.shape
  cnt = jnp.clip(counts, 0, cap)
  valid = (jnp.arange(cap)[None, :] < cnt[:, None]) & (idx >= 0) & (idx < num_l)
  pos = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1
  pos = jnp.where(valid, pos, cap)                                # cap = dropped
  rows = jnp.broadcast_to(jnp.arange(hs)[:, None], (hs, cap))
  out = jnp.zeros((hs, cap), jnp.int32).at[rows, pos].set(idx, mode="drop")
  return out, jnp.sum(valid, axis=1).astype(jnp.int32)


GATHER_ROWS = 128   # K/V rows per block of the live-row gather
GATHER_ZERO = 256   # rows past each head's count that the gather zeroes (>= cuDNN's key tile)
GATHER_PROGRAMS = 1024   # gather programs in all (at most): each loops over its head's written blocks


def _gather_kernel(n_ref,    # [Hs] int32 live rows per selection head
                   idx_ref,  # [Hs * cap] int32 compacted positions in [0, L)
                   k_ref,    # [Hkv * L, d]
                   v_ref,    # [Hkv * L, d]
                   ko_ref,   # out [Hs * cap_p, d]
                   vo_ref,   # out [Hs * cap_p, d]
                   *, num_l, cap, cap_p, d, dp, per_kv, splits, programs):
  """Program (s, i) writes blocks i, i + programs, ... of head s's written rows: in each of the
  ``splits`` chunks of ``cap_p // splits`` output rows, the chunk's live rows (live row j sits in
  chunk j % splits at slot j // splits) and a zeroed margin.  Blocks past them are not visited: the
  time goes with the rows kept, not with the buffer."""
  s = pl.program_id(0)
  i = pl.program_id(1)
  n = n_ref[s]
  chunk = cap_p // splits
  per = cm.kcdiv(n, splits)                                       # the longest chunk's live rows
  nb = cm.kcdiv(jnp.minimum(per + GATHER_ZERO, chunk), GATHER_ROWS)   # blocks written per chunk
  kv_base = lax.div(s, jnp.int32(per_kv)) * num_l
  cols = jnp.arange(dp, dtype=jnp.int32)
  dmask = (cols < d)[None, :]

  def block(it, carry):
    q = i + it * programs
    c, b = cm.kdiv(q, nb), cm.krem(q, nb)
    r = b * GATHER_ROWS + jnp.arange(GATHER_ROWS, dtype=jnp.int32)   # slots in the chunk (< chunk)
    j = r * splits + c                                            # the live row each slot holds
    live = j < n
    write = r < per + GATHER_ZERO
    pos = cm.gather_vec(idx_ref, s * cap + j, live)
    # clipped: in bounds whatever a caller's promise of compact rows holds
    rows = jnp.where(live, kv_base + jnp.clip(pos, 0, num_l - 1), 0)
    out_rows = s * cap_p + c * chunk + r                          # distinct and in bounds
    for src, dst in ((k_ref, ko_ref), (v_ref, vo_ref)):
      tile = plgpu.load(src.at[rows[:, None], cols[None, :]], mask=live[:, None] & dmask, other=0)
      plgpu.store(dst.at[out_rows[:, None], cols[None, :]], tile, mask=write[:, None] & dmask)
    return carry

  total = nb * splits
  lax.fori_loop(jnp.int32(0), cm.kcdiv(jnp.maximum(total - i, 0), programs), block, jnp.int32(0))


def _gather_capacity(cap: int, splits: int = 1) -> int:
  return cm.cdiv(cap, GATHER_ROWS * splits) * GATHER_ROWS * splits


def interleaved_rows(n, cap_p: int, splits: int):
  """Where ``gather_live_rows(..., splits=splits)`` puts live row j: chunk ``j % splits`` of the
  ``cap_p // splits`` rows, slot ``j // splits``, so every chunk holds ``ceil((n - c) / splits)`` of
  the n live rows.  -> (src [cap_p]: the live row each output row holds, lens [Hs, splits]: live rows
  per chunk, the key lengths a flash call over the chunks takes).  n [Hs] int32."""
  chunk = cap_p // splits
  p = jnp.arange(cap_p, dtype=jnp.int32)
  src = (p % chunk) * splits + p // chunk
  c = jnp.arange(splits, dtype=jnp.int32)
  lens = jnp.clip((n[:, None] - c[None, :] + splits - 1) // splits, 0, chunk).astype(jnp.int32)
  return src, lens


def gather_live_rows_reference(k, v, idx, n, splits: int = 1):
  """K and V rows ``idx[s, j]`` of KV head ``s // (Hs // Hkv)`` for ``j < n[s]``, zeros past
  ``n[s]``: [Hs, cap_p, d] each, ``cap_p`` = cap rounded up to ``GATHER_ROWS * splits``.
  idx [Hs, cap] int32, in [0, L) where live; n [Hs] int32 in [0, cap].  ``splits`` > 1: the rows
  dealt round-robin into that many equal chunks (``interleaved_rows``), zeros after each chunk's
  own rows, so that a flash call over the chunks gives every chunk a share of the keys."""
  hkv, num_l, d = k.shape
  hs, cap = idx.shape
  cap_p = _gather_capacity(cap, splits)
  idx = cm.pad_axis(idx, 1, cap_p)
  src = jnp.arange(cap_p, dtype=jnp.int32)
  if splits > 1:
    src = interleaved_rows(n, cap_p, splits)[0]
    idx = idx[:, src]
  kvh = jnp.arange(hs, dtype=jnp.int32) // (hs // hkv)
  rows = (kvh[:, None] * num_l + idx).reshape(-1)
  live = (src[None, :] < n[:, None]).reshape(-1, 1)
  take = lambda x: jnp.where(live, jnp.take(x.reshape(hkv * num_l, d), rows, axis=0), 0).reshape(hs, -1, d)  # noqa: E731
  return take(k), take(v)


def gather_live_rows(k, v, idx, n, *, backend: str, splits: int = 1):
  """``gather_live_rows_reference`` as a Pallas kernel that reads and writes only the live rows
  (plus ``GATHER_ZERO`` zeroed rows past each count, or past each chunk's rows with ``splits``).
  With a static capacity well above the rows a head keeps, the jnp gather writes all ``cap`` rows
  of every head (0.39 ms of 9.5 for 4K tokens over 512K on an H200).  Rows past that margin are
  left unwritten: only consumers bounded by the counts (cuDNN with per-head or per-chunk key
  lengths) may read this output."""
  be = resolve_backend(backend)
  if not isinstance(splits, int) or splits < 1:
    raise ValueError(f"splits must be a positive int, got {splits!r}")
  if be == "reference":
    return gather_live_rows_reference(k, v, idx, n, splits)
  hkv, num_l, d = k.shape
  hs, cap = idx.shape
  cap_p = _gather_capacity(cap, splits)
  programs = max(1, min(cap_p // GATHER_ROWS, GATHER_PROGRAMS // hs))
  kern = functools.partial(_gather_kernel, num_l=num_l, cap=cap, cap_p=cap_p, d=d,
                           dp=cm.padded_head_dim(d), per_kv=hs // hkv, splits=splits, programs=programs)
  shape = jax.ShapeDtypeStruct((hs * cap_p, d), k.dtype)
  ko, vo = pallas_call(kern, backend=be, num_warps=4, num_stages=1,
                       grid=(hs, programs), out_shape=[shape, shape],
                       name="gather_live_rows")(
      n.astype(jnp.int32), idx.reshape(-1), k.reshape(hkv * num_l, d), v.reshape(hkv * num_l, d))
  return ko.reshape(hs, cap_p, d), vo.reshape(hs, cap_p, d)


def _dense_attention(query, key, value, *, mask, kv_len, scale, implementation, layout="BTNH", q_len=None,
                     causal=False):
  """Dense attention in ``layout`` "BTNH" (-> out BTNH, lse [B, T, N] f32) or "BNTH" (-> out
  BNTH, lse [B, N, T] f32: what ``[H, T, d]`` arrays are with a unit batch, no transposes).
  mask: BNTS (cuDNN takes it as a bias it reads tile by tile); ``q_len`` / ``kv_len`` [B]: rows and
  keys past them are padding (cuDNN skips their tiles); ``causal``: query i sees keys 0..i (T = S)."""
  bnth = layout == "BNTH"
  b, t = query.shape[0], query.shape[2 if bnth else 1]
  if implementation == "cudnn":
    try:   # Private entry point: it returns the f32 softmax statistics (the public
      # jax.nn API casts them to the input dtype, too coarse for a bf16 LSE merge).
      from jax._src.cudnn import fused_attention_stablehlo as fa
      padded = kv_len is not None or q_len is not None
      mask_type = ((fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING) if padded else
                   (fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK))
      if padded:
        q_len = jnp.full((b,), t, jnp.int32) if q_len is None else q_len
        kv_len = jnp.full((b,), key.shape[2 if bnth else 1], jnp.int32) if kv_len is None else kv_len
      out, stats = fa.dot_product_attention(
          query, key, value, None, mask, q_len, kv_len, scale=scale, mask_type=mask_type,
          qkv_layout=layout, return_residual=True)
      stats = stats.astype(jnp.float32)                                # [B, N, T]
      return out, (stats if bnth else jnp.transpose(stats, (0, 2, 1)))
    except Exception:  # noqa: BLE001 - private API moved: fall back to the public one
      pass
  swap = (lambda x: jnp.swapaxes(x, 1, 2)) if bnth else (lambda x: x)  # noqa: E731 - BNTH <-> BTNH
  out, lse = jax.nn.dot_product_attention(
      swap(query), swap(key), swap(value), mask=mask, scale=scale, is_causal=causal, query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len, implementation=implementation, return_residual=True)
  return swap(out), swap(lse.astype(jnp.float32))


NEW_PART_MODES = ("causal", "causal_left_padded", "prefix_causal_left_padded", "mask")
PREFIX_MIN_CHUNK = 512   # keys per split of the prefix's flash call (`_new_part`, "prefix_causal_left_padded")


def causal_alignment(q_pos, kv_pos_new, left_padded: bool = False, prefix: bool = False):
  """Whether a block's new part is its own keys in order, the case `_new_part` hands to a causal mask.

  With m = min(T, S), the causal square is queries T-m .. T-1 against slots s0 .. s0+m-1 (s0 = 0);
  ``left_padded``: its first p rows (p = the square's leading queries at position -1) are padding,
  and query T-m+p+i should see exactly slots s0+p .. s0+p+i (the square rolled by p has its padding
  at the end, where cuDNN's padding lengths drop it). ``prefix``: slots 0 .. s0-1 before the square
  (a conversation's earlier turns) are seen by every real query, s0 found from the slot that holds
  the square's first real position (-> s0 - p). -> (vis [T, S]: slot j visible to query i, i.e.
  0 <= kv_pos_new[j] <= q_pos[i]; has [T]: query i sees a slot; aligned: every query that sees any
  sees exactly what the prefix and the (rolled) causal square give it; p: int32 scalar, 0 unless
  ``left_padded``; s0: int32 scalar in [0, S - m], 0 unless ``prefix``)."""
  seq_len, num_s = q_pos.shape[0], kv_pos_new.shape[0]
  vis = (kv_pos_new >= 0)[None, :] & (kv_pos_new[None, :] <= q_pos[:, None])
  has = jnp.any(vis, axis=1)
  m = min(seq_len, num_s)
  off = seq_len - m
  p = jnp.argmax(q_pos[off:] >= 0).astype(jnp.int32) if left_padded else jnp.int32(0)
  s0, fits = jnp.int32(0), True
  if prefix:
    first = q_pos[off + p]                                          # the square's first real position
    s0 = jnp.argmax(kv_pos_new == first).astype(jnp.int32) - p
    fits = (s0 >= 0) & (s0 <= num_s - m)
    s0 = jnp.clip(s0, 0, num_s - m)
  i, j = jnp.arange(seq_len)[:, None], jnp.arange(num_s)[None, :] - s0
  expect = (j < 0) | ((i >= off) & (j >= p) & (j < m) & (j - p <= i - off - p))
  return vis, has, fits & jnp.all((vis == expect) | ~has[:, None]), p, s0


def _new_part(q, k_new, v_new, q_pos, kv_pos_new, *, scale, implementation, new_part="causal"):
  """Attention of q [Hq, T, d] over the new part k_new, v_new [Hkv, S, d] by positions (slot j visible
  to query i iff 0 <= kv_pos_new[j] <= q_pos[i]) -> (o [Hq, T, d], lse [Hq, T] f32, has [Hq, T]: the
  query sees some new key; o and lse are meaningless where it does not).

  A block of tokens usually attends its own keys, in order: with m = min(T, S), the last m queries
  are slots 0..m-1 and see them causally (query T-m+i sees slots 0..i), nothing else is visible
  (`causal_alignment`). cuDNN's causal mask computes that and skips the tiles above the diagonal:
  4K tokens over their own 4K keys take 0.28 ms against 0.80 ms with the position mask as a bias
  (H100, benchmarks/results/gpu_h100_new_part).

  new_part: "causal": the alignment is checked on the device and both calls are made, the one not
  taken with zero-length padding (cuDNN then runs none of its tiles: 0.02 / 0.04 ms), so the result
  is exact for any positions with no host round trip. A block that is not aligned pays for it: cuDNN's
  masked call with padding lengths takes 1.03 instead of 0.80 ms. "causal_left_padded": the same
  for left-padded blocks (a question padded to a bucket length): the causal square is rolled by its
  padding rows before the call and back after (two gathers of q's and the output's size).
  "prefix_causal_left_padded": the same after a prefix every real query sees (a conversation's
  follow-up after its kept turns, `sqjax.fixed_context._TurnCache`): the prefix by a flash call
  with no mask, its keys cut into splits (`_flash_fixed`: a short block over a few thousand keys
  otherwise runs a few programs per head), merged with the square by log-sum-exp.
  "mask": the position mask alone."""
  if new_part not in NEW_PART_MODES:
    raise ValueError(f"new_part must be one of {NEW_PART_MODES}, got {new_part!r}")
  hq, seq_len, d = q.shape
  hkv, num_s = k_new.shape[:2]
  prefix = new_part == "prefix_causal_left_padded"
  vis, has, aligned, p, s0 = causal_alignment(q_pos, kv_pos_new, new_part != "causal", prefix)
  has = jnp.broadcast_to(has[None, :], (hq, seq_len))
  slot = (kv_pos_new >= 0)[None, :, None]                                      # empty slots -> 0
  masked = functools.partial(_dense_attention, q[None], jnp.where(slot, k_new, 0)[None],
                             jnp.where(slot, v_new, 0)[None], mask=vis[None, None], scale=scale,
                             implementation=implementation, layout="BNTH")      # [1, Hq, T, d], [1, Hq, T]
  if new_part == "mask":
    o_m, lse_m = masked(kv_len=None)
    return o_m[0], lse_m[0], has
  m = min(seq_len, num_s)
  off = seq_len - m
  qc = q[:, off:]                                                              # the causal square
  kc, vc = ((lax.dynamic_slice_in_dim(x, s0, m, axis=1) for x in (k_new, v_new)) if prefix else
            (k_new[:, :m], v_new[:, :m]))
  if new_part != "causal":                                                     # padding rows to the end
    roll = (jnp.arange(m) + p) % m
    qc, kc, vc = (jnp.take(x, roll, axis=1) for x in (qc, kc, vc))
  on = lambda n: jnp.where(aligned, n, 0).reshape(1).astype(jnp.int32)         # noqa: E731
  off_ = lambda n: jnp.where(aligned, 0, n).reshape(1).astype(jnp.int32)       # noqa: E731
  o_c, lse_c = _dense_attention(qc[None], kc[None], vc[None], mask=None, causal=True, scale=scale,
                                q_len=on(m - p), kv_len=on(m - p), implementation=implementation,
                                layout="BNTH")                                 # [1, Hq, m, d], [1, Hq, m]
  o_c, lse_c = o_c[0], lse_c[0]
  if new_part != "causal":                                                     # and back
    unroll = (jnp.arange(m) - p) % m
    o_c, lse_c = jnp.take(o_c, unroll, axis=1), jnp.take(lse_c, unroll, axis=1)
  o_m, lse_m = masked(q_len=off_(seq_len), kv_len=off_(num_s))
  o_c = jnp.pad(o_c, ((0, 0), (off, 0), (0, 0)))
  lse_c = jnp.pad(lse_c, ((0, 0), (off, 0)), constant_values=-jnp.inf)
  if prefix:   # the prefix's keys for every query (its r query heads per KV head as r T rows: no mask)
    r = hq // hkv
    n = jnp.full((hkv,), jnp.where(aligned, s0, 0), jnp.int32)
    splits = flash_kv_splits(hkv, r * seq_len, num_s, min_chunk=PREFIX_MIN_CHUNK)
    o_p, lse_p = _flash_fixed(q.reshape(hkv, r * seq_len, 1, d), k_new[:, :, None], v_new[:, :, None], n,
                              scale=scale, splits=splits, implementation=implementation)
    sq = (o_c, jnp.where(jnp.arange(seq_len)[None, :] >= off + p, lse_c, -jnp.inf))  # the square's real rows
    o_c, lse_c = merge_lse([(o_p.reshape(hq, seq_len, d), lse_p.reshape(hq, seq_len)), sq])
  return jnp.where(aligned, o_c, o_m[0]), jnp.where(aligned, lse_c, lse_m[0]), has


@cm.static_jit(("scale", "return_lse", "backend", "compact", "new_part"))
def gather_then_dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, idx: jax.Array, counts: jax.Array,
    k_new: jax.Array, v_new: jax.Array, q_pos: jax.Array, kv_pos_new: jax.Array, *,
    scale: float, return_lse: bool = False, backend: str = "auto", compact: bool = False,
    new_part: str = "causal"):
  """Same result as ``sparse_attention`` by a different route (prefill fast path).

  Compacts each selection head's valid entries (O(cap) cumsum + scatter; skipped with
  ``compact=True``, a promise that entries ``[0, counts)`` of each row are positions in
  ``[0, L)``, as ``sqjax.squeezed.retrieve`` and the clustered prefill build them),
  gathers the retrieved K/V rows into contiguous ``[Hs, cap_p, d]`` buffers
  (``gather_live_rows``), runs dense attention over them with per-head key lengths --
  the ``r = Hq / Hs`` query heads of a selection head folded into the query axis
  (``[Hs, r T, 1, d]``: a free reshape, no transposes) --, runs dense attention over the
  new part by positions (``[1, Hq, T, d]`` against ``[1, Hkv, S, d]`` in cuDNN's BNTH layout: no
  transposes either; under cuDNN's causal mask when the positions allow it, see ``new_part`` in
  `_new_part`), and merges both by log-sum-exp.  Same
  conventions as ``sparse_attention`` (duplicates counted).

  backend: "pallas" (and "auto" on GPU) = cuDNN flash attention
  (``implementation="cudnn"``, bf16/fp16 only); "interpret" = the same plumbing
  with XLA's dense attention (any device; its LSE is rounded to the input dtype);
  "reference" (and "auto" elsewhere) = ``sparse_attention_reference``.
  """
  _validate(q, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return sparse_attention_reference(q, k, v, idx, counts, k_new, v_new, q_pos, kv_pos_new,
                                      scale=scale, return_lse=return_lse)
  impl = "cudnn" if be == "pallas" else "xla"
  num_l = k.shape[1]
  cap = idx.shape[1]
  if compact:
    comp, n = idx, jnp.clip(counts, 0, cap).astype(jnp.int32)
  else:
    comp, n = _compact(idx, counts, num_l)
  # the flash call's key splits, chosen for the buffer; the gather deals the live rows round-robin
  # into them, so each split holds ~n / splits keys whatever n is (in contiguous chunks a capacity
  # well above n left the last splits empty: a tenth of the programs working)
  hs = idx.shape[0]
  splits = flash_kv_splits(hs, q.shape[0] // hs * q.shape[1], _gather_capacity(cap)) if cap else 1
  ks, vs = gather_live_rows(k, v, comp, n, backend=be, splits=splits)   # [Hs, cap_p >= cap, d]
  if impl == "xla":   # XLA's attention reads every row: zero what the kernel left unwritten
    live = (interleaved_rows(n, ks.shape[1], splits)[0][None, :] < n[:, None])[..., None]
    ks, vs = jnp.where(live, ks, 0), jnp.where(live, vs, 0)
  ks, vs = (ks[:, :, None], vs[:, :, None]) if cap else (ks[:, :0, None], vs[:, :0, None])
  return fixed_plus_new(q, ks, vs, n, k_new, v_new, q_pos, kv_pos_new, scale=scale, implementation=impl,
                        return_lse=return_lse, kv_splits=splits, interleaved=True, new_part=new_part)


FLASH_ROWS = 128        # query rows per flash-attention program (cuDNN's tile on Hopper)
FLASH_PROGRAMS = 264    # programs wanted: 2 per SM of an H100 / H200


def flash_kv_splits(heads: int, rows: int, num_l: int, min_chunk: int = 2048) -> int:
  """Key splits for a flash-attention call of ``heads`` heads x ``rows`` query rows over ``num_l``
  keys: flash attention runs one program per (head, tile of ``FLASH_ROWS`` rows), so a short block
  over a long context (128 tokens x 4 query heads per KV head: 4 tiles) leaves most SMs idle.  The
  smallest power of two giving about ``FLASH_PROGRAMS`` programs, dividing ``num_l``, chunks of at
  least ``min_chunk`` keys (measured on an H200, 128K keys, 128 tokens: 0.79 ms with 16 splits
  against 2.01 ms in one piece; benchmarks/results/gpu_h200_dense_prefill)."""
  want = FLASH_PROGRAMS / max(1, heads * cm.cdiv(rows, FLASH_ROWS))
  s = 1
  while s < want and num_l % (2 * s) == 0 and num_l // (2 * s) >= min_chunk:
    s *= 2
  return s


def _flash_fixed(qs, ks, vs, n, *, scale, splits, implementation, interleaved=False):
  """Flash attention of qs [Hs, R, 1, d] (BTNH, no mask) over ks, vs [Hs, Lk, 1, d] (the first
  ``n[s]`` keys of head s, all if n is None), the keys cut into ``splits`` contiguous chunks (a
  free reshape: chunks become batch entries, qs is repeated for each) whose partial results are
  merged by log-sum-exp.  ``interleaved``: the n keys were dealt round-robin into the chunks
  (``gather_live_rows(..., splits=splits)``), so chunk c holds its first ``ceil((n - c) / splits)``.
  -> (o [Hs, R, d], lse [Hs, R] f32, -inf where a head has no key)."""
  hs, rows, _, d = qs.shape
  lk = ks.shape[1]
  chunk = lk // splits
  if splits > 1:
    qs = jnp.broadcast_to(qs[:, None], (hs, splits) + qs.shape[1:]).reshape(hs * splits, rows, 1, d)
    ks, vs = ks.reshape(hs * splits, chunk, 1, d), vs.reshape(hs * splits, chunk, 1, d)
  lens = None
  if n is not None and interleaved:
    lens = interleaved_rows(n, lk, splits)[1].reshape(-1)
  elif n is not None:
    lens = jnp.clip(n[:, None] - chunk * jnp.arange(splits)[None, :], 0, chunk).reshape(-1).astype(jnp.int32)
  o, lse = _dense_attention(qs, ks, vs, mask=None, kv_len=lens, scale=scale, implementation=implementation)
  o, lse = o.reshape(hs, splits, rows, d), lse.reshape(hs, splits, rows)
  if lens is not None:                                   # a chunk with no key takes no part
    lse = jnp.where(lens.reshape(hs, splits, 1) > 0, jnp.nan_to_num(lse), -jnp.inf)
  if splits == 1:
    return o[:, 0], lse[:, 0]
  return merge_lse([(o[:, i], lse[:, i]) for i in range(splits)])


def fixed_plus_new(q, ks, vs, n, k_new, v_new, q_pos, kv_pos_new, *, scale, implementation, return_lse,
                   kv_splits=None, interleaved=False, new_part="causal"):
  """Dense attention (cuDNN or XLA) of q [Hq, T, d] over a fixed part ks, vs [Hs, Lk, 1, d]
  (BTNH; the first ``n[s]`` rows of selection head s, or all ``Lk`` if n is None; in ``kv_splits``
  contiguous chunks, None = ``flash_kv_splits``, the rows dealt round-robin into them with
  ``interleaved``) and over the causal new part, merged by
  log-sum-exp -> o [Hq, T, d] in q's dtype (, lse [Hq, T] f32). ``new_part``: see `_new_part`."""
  hq, seq_len, d = q.shape
  hs, lk = ks.shape[:2]
  num_s = k_new.shape[1]
  r = hq // hs
  # No mask on the fixed part: every query row is independent, so the r query heads of a
  # selection head can be r * T rows of one head (q is [Hs, r, T, d] in memory already).
  qs = q.reshape(hs, r * seq_len, 1, d)                          # [Hs, r T, 1, d] (BTNH)
  parts = []
  if lk:
    splits = flash_kv_splits(hs, r * seq_len, lk) if kv_splits is None else kv_splits
    o1, lse1 = _flash_fixed(qs, ks, vs, n, scale=scale, splits=splits, implementation=implementation,
                            interleaved=interleaved)
    parts.append((o1.reshape(hq, seq_len, d), lse1.reshape(hq, seq_len), jnp.isfinite(lse1.reshape(hq, seq_len))))
  if num_s:
    parts.append(_new_part(q, k_new, v_new, q_pos, kv_pos_new, scale=scale, implementation=implementation,
                           new_part=new_part))
  if not parts:
    out, lse = jnp.zeros((hq, seq_len, d), q.dtype), jnp.full((hq, seq_len), -jnp.inf)
    return (out, lse) if return_lse else out
  out, lse = merge_lse([(o_i, jnp.where(h, jnp.nan_to_num(x), -jnp.inf)) for o_i, x, h in parts])
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out
