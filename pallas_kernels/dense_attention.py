"""Dense attention over the whole fixed context, split-KV (Flash-Decoding).

The dense baseline in Pallas, and full attention's GPU decode path in `sqjax.dispatch`:
exact attention of ``q`` over all ``L`` fixed-context keys plus the user input's keys
``j`` with ``0 <= kv_pos_new[j] <= q_pos`` (f32 accumulation)::

    o = softmax(s q [K_fixed ; K_new]^T + causal mask) [V_fixed ; V_new]

The fixed context is cut into ``chunk_k``-key ranges per KV head (about
``target_programs`` programs in all, so batch 1 fills the GPU), the new keys into
``chunk_new``-key ranges; one program per range reads its K/V tiles once for the ``g``
query heads of its KV head and writes an unnormalised partial ``(o, m, l)``; a fused
log-sum-exp merge combines them.  The same work-item kernel as the sparse ops
(``_attention_core``, kind 2 = range), so nothing is gathered and the fixed K/V are
never concatenated with the new ones.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from pallas_kernels import _attention_core as core
from pallas_kernels import _common as cm
from pallas_kernels._attention_core import AttentionConfig
from pallas_kernels._dispatch import resolve_backend
from pallas_kernels.sparse_attention import dense_reference, fixed_plus_new

__all__ = ["dense_decode_attention", "dense_prefill_attention", "dense_attention_reference"]


def _validate(q, k, v, k_new, v_new, q_pos, kv_pos_new):
  shapes = cm.shape_str(q=q, k=k, v=v, k_new=k_new, v_new=v_new, q_pos=q_pos, kv_pos_new=kv_pos_new)
  cm.check_attention_io(shapes, q, k, v, k_new, v_new, q_pos, kv_pos_new)


@cm.static_jit(("scale", "return_lse"))
def dense_attention_reference(q, k, v, k_new, v_new, q_pos, kv_pos_new, *, scale, return_lse=False):
  """Plain jnp: masked softmax over [K_fixed ; K_new] in f32.  q [Hq, T, d] or [Hq, d]."""
  squeeze = q.ndim == 2
  q3 = q[:, None, :] if squeeze else q
  hq, seq_len, d = q3.shape
  hkv, num_l, _ = k.shape
  vis = (kv_pos_new >= 0)[None, :] & (kv_pos_new[None, :] <= q_pos[:, None])   # [T, S]
  live = (kv_pos_new >= 0)[None, :, None]
  keys = jnp.concatenate([k, jnp.where(live, k_new, 0)], axis=1)
  vals = jnp.concatenate([v, jnp.where(live, v_new, 0)], axis=1)
  mask = jnp.concatenate([jnp.ones((seq_len, num_l), bool), vis], axis=1)
  mask = jnp.broadcast_to(mask[None], (hkv,) + mask.shape)
  out, lse = dense_reference(q3.reshape(hkv, hq // hkv, seq_len, d), keys, vals, mask, scale=scale)
  out = out.reshape(hq, seq_len, d).astype(q.dtype)
  lse = lse.reshape(hq, seq_len)
  if squeeze:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


@cm.static_jit(("scale", "return_lse", "backend", "config"))
def dense_decode_attention(
    q: jax.Array,            # [Hq, d] or [Hq, T, d]
    k: jax.Array,            # [Hkv, L, d] fixed context
    v: jax.Array,            # [Hkv, L, d]
    k_new: jax.Array,        # [Hkv, S, d] the user input's keys (S may be 0)
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [T] int32
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty slot)
    *,
    scale: float,
    return_lse: bool = False,
    backend: str = "auto",
    config: AttentionConfig | None = None,
):
  """Dense split-KV attention over the fixed context + the causal new part.

  Returns o with q's shape and dtype (+ lse f32 [Hq(, T)] if ``return_lse``).
  """
  squeeze = q.ndim == 2
  q3 = q[:, None, :] if squeeze else q
  _validate(q3, k, v, k_new, v_new, q_pos, kv_pos_new)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return dense_attention_reference(q, k, v, k_new, v_new, q_pos, kv_pos_new, scale=scale,
                                     return_lse=return_lse)
  hq, seq_len, d = q3.shape
  hkv, num_l, _ = k.shape
  num_s = k_new.shape[1]
  cfg, lay, chunk, chunk_new = core.work_plan(hq, seq_len, d, hkv, num_l, num_s, config)
  ranges = [(0, num_l)]
  wg = max(1, core.n_range_and_new_items(ranges, num_s, chunk, chunk_new))
  blocks, actives = core.range_and_new_blocks(hkv, ranges, num_s, chunk, chunk_new, 0, wg)
  table, active = core.build_table(blocks, actives, hkv)
  o, m, l = core.attention_partials(
      q3, k, v, k_new if num_s else None, v_new, q_pos, kv_pos_new, None, table, lay=lay,
      n_slots=hkv * wg, scale=scale, cfg=cfg, backend=be)
  out, lse = core.merge_partials(o, m, l, active, lay=lay, d=d)
  out = out.astype(q.dtype)
  if squeeze:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


@cm.static_jit(("scale", "return_lse", "backend", "kv_splits", "new_part"))
def dense_prefill_attention(
    q: jax.Array,            # [Hq, T, d] a block of query tokens
    k: jax.Array,            # [Hkv, L, d] fixed context
    v: jax.Array,            # [Hkv, L, d]
    k_new: jax.Array,        # [Hkv, S, d] the user input's keys (S may be 0)
    v_new: jax.Array,        # [Hkv, S, d]
    q_pos: jax.Array,        # [T] int32
    kv_pos_new: jax.Array,   # [S] int32 (-1 = empty slot)
    *,
    scale: float,
    return_lse: bool = False,
    backend: str = "auto",
    kv_splits: int | None = None,
    new_part: str = "causal",
):
  """The same result as ``dense_decode_attention`` by flash attention, for blocks of many
  tokens: the split-KV kernel reads the fixed K/V once per block of query rows, which for a
  prefill block is many times; flash attention is compute-bound there.  The fixed part (no mask,
  the fixed K/V read in place, never gathered nor concatenated with the new keys; in ``kv_splits``
  contiguous chunks, None = ``sparse_attention.flash_kv_splits``) and the causal new part apart,
  merged by log-sum-exp (``sparse_attention.fixed_plus_new``; ``new_part``: the new part under
  cuDNN's causal mask when its positions allow it, see ``sparse_attention._new_part``).

  backend: "pallas" (and "auto" on GPU) = cuDNN (bf16/f16 only); "interpret" = the same
  plumbing with XLA's attention; "reference" (and "auto" elsewhere) = ``dense_attention_reference``.
  Returns o [Hq, T, d] in q's dtype (+ lse f32 [Hq, T] if ``return_lse``).
  """
  if q.ndim != 3:
    raise ValueError(f"q must be [Hq, T, d]; got {cm.shape_str(q=q)}")
  _validate(q, k, v, k_new, v_new, q_pos, kv_pos_new)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return dense_attention_reference(q, k, v, k_new, v_new, q_pos, kv_pos_new, scale=scale, return_lse=return_lse)
  if be == "pallas" and q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"dense_prefill_attention on GPU runs cuDNN, which takes bf16/fp16; got q {q.dtype} "
                     "(use dense_decode_attention for f32)")
  num_l = k.shape[1]
  if kv_splits is not None and (kv_splits < 1 or num_l % kv_splits):
    raise ValueError(f"kv_splits must be a positive divisor of L={num_l}; got {kv_splits}")
  return fixed_plus_new(q, k[:, :, None], v[:, :, None], None, k_new, v_new, q_pos, kv_pos_new, scale=scale,
                        implementation="cudnn" if be == "pallas" else "xla", return_lse=return_lse,
                        kv_splits=kv_splits, new_part=new_part)
