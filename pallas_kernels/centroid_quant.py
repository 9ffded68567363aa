"""Int8 centroids for the decode lookup: half the bytes of bf16 centroids.

The decode lookup reads every centroid once per token (Eq. 1), so at 512K tokens with 5%
centroids it streams 54 MB of bf16 rows, 20% of the decode's bytes.  Stored as int8, a
centroid row ``c_i`` of KV head ``h`` is::

    c_ij ~= r_i s_j c8_ij,   s_j  = max_i |c_ij|               (per channel: LLM keys have
                             r_i  = max_j |c_ij / s_j| / 127    outlier channels)
                             c8_ij = round(c_ij / (r_i s_j))  in [-127, 127]

The channel scale folds into the query, ``q.c_i ~= r_i ((q * s) . c8_i)``, so a lookup kernel
reads the int8 rows and one f32 per row.  Eq. 1 is then evaluated on the logits::

    x_i = scale r_i (q' . c8_i),   q' = (q * s_h) rounded to q's dtype

and everything after the logits (max, denominator, vote, threshold) is unchanged.
``scoring_operands`` gives the float pair (q', r * c8) whose product is exactly these
logits, which is how the references evaluate it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _common as cm

__all__ = ["Int8Centroids", "quantize_centroids", "dequantize_centroids", "scoring_operands"]

_QMAX = 127.0


class Int8Centroids(NamedTuple):
  """Centroids as int8 rows with a per-row and a per-(KV head, channel) scale."""
  values: jax.Array      # [Hkv, C, d] int8
  row_scale: jax.Array   # [Hkv, C] f32 (r)
  col_scale: jax.Array   # [Hkv, d] f32 (s)

  @property
  def shape(self) -> tuple[int, int, int]:
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return self.values.ndim


@jax.jit
def quantize_centroids(centroids: jax.Array) -> Int8Centroids:
  """[Hkv, C, d] float centroids -> ``Int8Centroids`` (zero rows and channels stay zero)."""
  if centroids.ndim != 3:
    raise ValueError(f"centroids must be [Hkv, C, d]; got {cm.shape_str(centroids=centroids)}")
  cm.check_float("centroids", centroids)
  c = centroids.astype(jnp.float32)
  s = jnp.max(jnp.abs(c), axis=1)                                     # [Hkv, d]
  s = jnp.where(s > 0, s, 1.0)
  cs = c / s[:, None, :]                                              # |cs| <= 1
  r = jnp.max(jnp.abs(cs), axis=2) / _QMAX                            # [Hkv, C]
  r = jnp.where(r > 0, r, 1.0)
  c8 = jnp.clip(jnp.round(cs / r[..., None]), -_QMAX, _QMAX).astype(jnp.int8)
  return Int8Centroids(c8, r.astype(jnp.float32), s.astype(jnp.float32))


def check_int8_centroids(qc: Int8Centroids, shapes: str) -> None:
  """Shapes and dtypes of an ``Int8Centroids`` (``shapes`` names the call's other inputs)."""
  v, r, s = qc
  if v.ndim != 3 or r.shape != v.shape[:2] or s.shape != (v.shape[0], v.shape[2]):
    raise ValueError("Int8Centroids needs values [Hkv, C, d], row_scale [Hkv, C], col_scale "
                     f"[Hkv, d]; got {cm.shape_str(values=v, row_scale=r, col_scale=s)} ({shapes})")
  if jnp.dtype(v.dtype) != jnp.dtype(jnp.int8):
    raise ValueError(f"Int8Centroids.values must be int8, got {v.dtype}")
  for name, x in (("row_scale", r), ("col_scale", s)):
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
      raise ValueError(f"Int8Centroids.{name} must be float32, got {x.dtype}")


@jax.jit
def dequantize_centroids(qc: Int8Centroids) -> jax.Array:
  """-> [Hkv, C, d] f32 ``r_i s_j c8_ij`` (what the int8 centroids stand for)."""
  v, r, s = qc
  return v.astype(jnp.float32) * r[..., None] * s[:, None, :]


@functools.partial(jax.jit, static_argnames=("hkv",))
def scaled_query(q: jax.Array, col_scale: jax.Array, *, hkv: int) -> jax.Array:
  """q' = (q * s_h) in q's dtype, for q [Hq, ..., d]; query head h reads KV head h // g."""
  g = q.shape[0] // hkv
  s = jnp.repeat(col_scale, g, axis=0).reshape((q.shape[0],) + (1,) * (q.ndim - 2) + (q.shape[-1],))
  return (q.astype(jnp.float32) * s).astype(q.dtype)


def scoring_operands(q: jax.Array, qc: Int8Centroids) -> tuple[jax.Array, jax.Array]:
  """(q' [Hq, ..., d] in q's dtype, r * c8 [Hkv, C, d] f32): Eq. 1 on this pair is Eq. 1 on
  the int8 logits ``x_i = scale r_i (q' . c8_i)`` (up to f32 rounding)."""
  v, r, s = qc
  return scaled_query(q, s, hkv=v.shape[0]), v.astype(jnp.float32) * r[..., None]
