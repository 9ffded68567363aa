"""Small helpers shared by the kernels: validation, padding, head bookkeeping."""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.extend.core
import jax.interpreters.batching
import jax.interpreters.mlir
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu
# private, for exp2_ftz's lowering rule (jax is pinned to 0.11.x)
from jax._src.pallas.triton import lowering as _triton_lowering, primitives as _triton_primitives
import numpy as np

# Finite stand-in for -inf inside kernels: exp(MASK - MASK) = 1 never produces NaN.
MASK_VALUE = -1e30
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
VOTES = ("kv", "q")


def next_pow2(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def is_pow2(x: int) -> bool:
  return x >= 1 and (x & (x - 1)) == 0


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check_pow2(name: str, value: int, minimum: int = 16) -> None:
  if not isinstance(value, int) or not is_pow2(value) or value < minimum:
    raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")


def check_warps_stages(num_warps: int, num_stages: int) -> None:
  if num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps!r}")
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")


def shape_str(**arrays: Any) -> str:
  return ", ".join(f"{k}{tuple(np.shape(v))}" for k, v in arrays.items())


def check_float(name: str, x: jax.Array) -> None:
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_int32(name: str, x: jax.Array) -> None:
  if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
    raise ValueError(f"{name} must be int32, got {x.dtype} with shape {tuple(x.shape)}")


def check_same_dtype(**arrays: jax.Array) -> None:
  dts = {k: jnp.dtype(v.dtype) for k, v in arrays.items()}
  if len(set(dts.values())) != 1:
    raise ValueError("dtypes must match: " + ", ".join(f"{k}={d}" for k, d in dts.items()))


def check_attention_io(shapes: str, q, k, v, k_new, v_new, q_pos, kv_pos_new) -> None:
  """The checks every fixed-context attention op shares: q [Hq, T, d], k/v [Hkv, L, d],
  k_new/v_new [Hkv, S, d], q_pos [T], kv_pos_new [S] int32, one float dtype."""
  if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
    raise ValueError(f"need q [Hq, T, d] (or [Hq, d]), k and v [Hkv, L, d]; got {shapes}")
  hq, seq_len, d = q.shape
  hkv, num_l, dk = k.shape
  if dk != d or seq_len < 1 or num_l < 1:
    raise ValueError(f"head dims must match and T, L >= 1; got {shapes}")
  check_heads(hq, hkv, shapes)
  if k_new.ndim != 3 or v_new.shape != k_new.shape or k_new.shape[0] != hkv or k_new.shape[2] != d:
    raise ValueError(f"need k_new and v_new [Hkv, S, d]; got {shapes}")
  if q_pos.shape != (seq_len,) or kv_pos_new.shape != (k_new.shape[1],):
    raise ValueError(f"need q_pos [T] and kv_pos_new [S]; got {shapes}")
  check_float("q", q)
  check_same_dtype(q=q, k=k, v=v, k_new=k_new, v_new=v_new)
  check_int32("q_pos", q_pos)
  check_int32("kv_pos_new", kv_pos_new)


def check_vote(vote: str) -> None:
  if vote not in VOTES:
    raise ValueError(f"vote must be 'kv' (per KV head, group mean) or 'q' (per query head), got {vote!r}")


def check_scale(scale: Any) -> float:
  if scale is None:
    raise ValueError("scale is required (the model's softmax scale, e.g. 1/sqrt(d))")
  if isinstance(scale, jax.core.Tracer):
    raise ValueError(f"scale must be a concrete number (it is compiled into the kernel), got the traced value "
                     f"{scale!r}: compute it outside jax.jit, or make it a static argument of your function")
  if np.ndim(scale) != 0:
    raise ValueError(f"scale must be a scalar, got shape {np.shape(scale)}")
  try:
    s = float(scale)
  except (TypeError, ValueError) as e:
    raise ValueError(f"scale must be a number, got {scale!r}") from e
  if not math.isfinite(s):
    raise ValueError(f"scale must be finite, got {s}")
  return s


def static_jit(static_argnames: tuple[str, ...]):
  """``jax.jit`` with ``static_argnames`` for a kernel entry point whose ``scale`` is static.

  A static argument must be hashable, so ``scale=jnp.float32(0.125)`` would fail inside
  jax.jit with "Non-hashable static arguments"; this wrapper turns a concrete scalar
  ``scale`` into a Python float first (``check_scale``) and names a traced one.  The
  jitted function stays reachable as ``.jitted`` (``.lower`` / ``.trace`` pass through).
  """
  def wrap(fn):
    jitted = jax.jit(fn, static_argnames=static_argnames)
    if "scale" not in static_argnames:
      return jitted

    @functools.wraps(fn)
    def call(*args, **kwargs):
      if kwargs.get("scale") is not None:
        kwargs["scale"] = check_scale(kwargs["scale"])
      return jitted(*args, **kwargs)

    call.jitted, call.lower, call.trace = jitted, jitted.lower, jitted.trace
    return call
  return wrap


def num_selection_heads(hq: int, hkv: int, vote: str) -> int:
  check_vote(vote)
  return hkv if vote == "kv" else hq


def check_heads(hq: int, hkv: int, what: str) -> None:
  if hkv < 1 or hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv}); {what}")


def check_token_valid(q_valid, seq_len: int) -> None:
  """q_valid: None or a [T] bool mask of the query block's real tokens (padding: False)."""
  if q_valid is not None and (tuple(q_valid.shape) != (seq_len,) or q_valid.dtype != jnp.bool_):
    raise ValueError(f"q_valid must be bool [T] = [{seq_len}] (the query block's real tokens), "
                     f"got {q_valid.dtype} {tuple(q_valid.shape)}")


def token_mean(s: jax.Array, q_valid, axis: int) -> jax.Array:
  """Mean of ``s`` over its token axis, over the tokens ``q_valid`` [T] marks (all when None);
  0 when no token is valid."""
  if q_valid is None:
    return jnp.mean(s, axis=axis)
  shape = [1] * s.ndim
  shape[axis] = -1
  w = q_valid.astype(jnp.float32).reshape(shape)
  return jnp.sum(s * w, axis=axis) / jnp.maximum(jnp.sum(q_valid.astype(jnp.float32)), 1.0)


def pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
  """Pads ``x`` along ``axis`` up to ``size`` (no copy when already that size)."""
  n = x.shape[axis]
  if n == size:
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, size - n)
  return jnp.pad(x, pads, constant_values=value)


def padded_head_dim(d: int) -> int:
  """Triton needs power-of-two tiles (>= 16 for dots); head dims are zero-padded."""
  return max(16, next_pow2(d))


# ----------------------------------------------------------------------------
# In-kernel helpers (valid both in the Triton lowering and in the interpreter).
# ----------------------------------------------------------------------------
def kdiv(a, b):
  """Integer division for non-negative operands (lowers to a plain divide)."""
  return lax.div(a, jnp.asarray(b, a.dtype) if not hasattr(b, "dtype") else b)


def krem(a, b):
  return lax.rem(a, jnp.asarray(b, a.dtype) if not hasattr(b, "dtype") else b)


def kcdiv(a, b: int):
  """Ceil-division of a non-negative traced int by a static positive int."""
  return lax.div(a + (b - 1), jnp.asarray(b, a.dtype))


exp2_ftz_p = jax.extend.core.Primitive("sqjax_exp2_ftz")
exp2_ftz_p.def_impl(lax.exp2)
exp2_ftz_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
jax.interpreters.mlir.register_lowering(exp2_ftz_p, jax.interpreters.mlir.lower_fun(lax.exp2, multiple_results=False))
jax.interpreters.batching.primitive_batchers[exp2_ftz_p] = lambda args, dims: (exp2_ftz_p.bind(args[0]), dims[0])


@_triton_lowering.register_lowering(exp2_ftz_p)
def _exp2_ftz_triton(ctx, x):
  """``ex2.approx.ftz.f32``: one MUFU.EX2 per element, through Pallas' own inline-asm rule.  ``jnp.exp2``
  lowers to libdevice's ``__nv_exp2f``, which XLA's Triton pipeline compiles without flush-to-zero
  (``xla_gpu_ftz`` is off): ``ex2.approx.f32``, whose subnormal results (< 2^-126) cost extra instructions
  around the MUFU op (the SASS was not read here; the ftz form took 4.8-8.2% less lookup time,
  benchmarks/results/gpu_h100_ftz_exp2)."""
  [out] = _triton_lowering.triton_lowering_rules[_triton_primitives.elementwise_inline_asm_p](
      ctx, x, asm="ex2.approx.ftz.f32 $0, $1;", constraints="=f,f", pack=1, result_shape_dtypes=None)
  return out


def exp2_ftz(x):
  """``2**x`` for f32 with subnormal results flushed to zero: on the GPU one ``ex2.approx.ftz.f32``
  (see ``_exp2_ftz_triton``), elsewhere (the interpreter, other lowerings) ``lax.exp2``.  The two
  differ only where ``2**x < 2^-126``, which no softmax sum here can see."""
  if x.dtype != jnp.float32:
    raise TypeError(f"exp2_ftz takes float32, got {x.dtype} of shape {x.shape}")
  return exp2_ftz_p.bind(x)


def _mul_add(x, y, z):
  return x * y + z


fma_p = jax.extend.core.Primitive("sqjax_fma")
fma_p.def_impl(_mul_add)
fma_p.def_abstract_eval(lambda x, y, z: jax.core.ShapedArray(x.shape, x.dtype))
jax.interpreters.mlir.register_lowering(fma_p, jax.interpreters.mlir.lower_fun(_mul_add, multiple_results=False))


def _fma_batch(args, dims):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)
          for a, d in zip(args, dims)]
  return fma_p.bind(*args), 0


jax.interpreters.batching.primitive_batchers[fma_p] = _fma_batch


@_triton_lowering.register_lowering(fma_p)
def _fma_triton(ctx, x, y, z):
  """``fma.rn.f32``: one FFMA per element.  XLA's Triton pipeline does not contract a multiply and an add
  (ncu counted 177M unfused and 20M fused FP32 instructions in the level-2 scoring pass,
  benchmarks/results/gpu_h100_lookup_limits), so the kernels ask for it."""
  [out] = _triton_lowering.triton_lowering_rules[_triton_primitives.elementwise_inline_asm_p](
      ctx, x, y, z, asm="fma.rn.f32 $0, $1, $2, $3;", constraints="=f,f,f,f", pack=1, result_shape_dtypes=None)
  return out


def fma(x, y, z):
  """``x * y + z`` for f32 arrays of one shape: on the GPU one ``fma.rn.f32`` (a single rounding; see
  ``_fma_triton``), elsewhere (the interpreter, other lowerings) a multiply and an add."""
  for a in (x, y, z):
    if a.dtype != jnp.float32 or a.shape != x.shape:
      raise TypeError(f"fma takes float32 arrays of one shape, got {[(v.dtype, v.shape) for v in (x, y, z)]}")
  return fma_p.bind(x, y, z)


def gather_rows(ref, rows, ncols: int, mask, other=0):
  """Masked row gather ``ref[rows, :ncols]`` from a 2-D ref -> [len(rows), ncols].

  ``rows`` must be in bounds wherever ``mask`` is true; elsewhere it is never read.
  """
  rows = jnp.where(mask, rows, 0)
  cols = jnp.arange(ncols, dtype=jnp.int32)
  return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask[:, None], other=other)


def gather_vec(ref, idx, mask, other=0):
  """Masked element gather ``ref[idx]`` from a 1-D ref."""
  idx = jnp.where(mask, idx, 0)
  return plgpu.load(ref.at[idx], mask=mask, other=other)


def expand_ranges(sel, offsets, items, rows, cap: int):
  """Concatenates the CSR ranges of the selected entries, per selection row.

  sel [Hs, P] bool; offsets [H, P + 1] int32 (range p of row h is
  ``items[h, offsets[h, p] : offsets[h, p + 1]]``); items [H, N] int32; rows [Hs]
  int32 (which CSR row each selection row reads).  Returns
  (out [Hs, cap] int32 padded with -1, n [Hs] = min(wanted, cap), wanted [Hs]):
  ``wanted > cap`` means the selection overflowed the static capacity (the entries
  past ``cap`` are dropped; callers must check).

  O(P + cap) per row with no search: a +1 marker at the output start of every
  non-empty selected range, a cumsum (CUB on GPU) gives the range covering each
  output slot.  No host synchronisation.
  """
  hs, num_p = sel.shape
  n_items = items.shape[1]
  offs = offsets[rows]                                            # [Hs, P + 1]
  sizes = jnp.where(sel, jnp.maximum(offs[:, 1:] - offs[:, :-1], 0), 0)
  ends = jnp.cumsum(sizes, axis=1)
  starts = ends - sizes
  wanted = ends[:, -1].astype(jnp.int32)
  n = jnp.minimum(wanted, cap).astype(jnp.int32)
  row_ids = jnp.arange(hs, dtype=jnp.int32)[:, None]
  live = sizes > 0
  rank = jnp.cumsum(live.astype(jnp.int32), axis=1) - 1           # k-th live range
  range_of = jnp.zeros((hs, num_p), jnp.int32).at[
      row_ids, jnp.where(live, rank, num_p)].set(
          jnp.broadcast_to(jnp.arange(num_p, dtype=jnp.int32), (hs, num_p)), mode="drop")
  mark = jnp.zeros((hs, cap), jnp.int32).at[
      row_ids, jnp.where(live & (starts < cap), starts, cap)].add(1, mode="drop")
  k = jnp.maximum(jnp.cumsum(mark, axis=1) - 1, 0)                # [Hs, cap]
  p = jnp.take_along_axis(range_of, k, axis=1)
  j = jnp.arange(cap, dtype=jnp.int32)[None, :]
  src = jnp.take_along_axis(offs[:, :-1], p, axis=1) + (j - jnp.take_along_axis(starts, p, axis=1))
  src = jnp.clip(src, 0, n_items - 1) + rows[:, None] * n_items
  out = jnp.take(items.reshape(-1), src, axis=0)
  out = jnp.where(j < n[:, None], out, -1)
  return out.astype(jnp.int32), n, wanted
