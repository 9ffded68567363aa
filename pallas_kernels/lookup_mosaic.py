"""The prefill centroid lookup's two passes as Mosaic GPU kernels (Hopper: TMA + wgmma).

Same contract and arithmetic as ``centroid_lookup.lookup_prefill_scores`` (Eq. 1 averaged
over a block of T query tokens, App. D), base-2 logits ``s = log2(e) * scale * q.C``:

* pass 1 (statistics), one program per (token block of ``block_t``, query head): the
  running max ``m_t`` and denominator ``l_t = sum_j N_j exp2(s_tj - m_t)`` over the head's
  centroids (rows ``[0, n_valid[g])`` of a bounded call), a [block_t, block_c] logit tile
  per step from one ``wgmma`` of the query tile against a centroid block that TMA brings
  into a ring of ``stages`` shared-memory slots;
* pass 2 (scoring), one program per (centroid block, group, split): the centroid block
  stays in shared memory and the program streams its share of the group's (head, token
  block) query tiles through the ring, summing ``exp2(min(s - m_t - log2 l_t, 0))`` over
  the tokens (the tile is [block_c, block_t]: centroids on the wgmma's M side, so the sum
  over tokens is a row reduction).

No [H, C, T] tensor reaches HBM.  The per-column vectors (counts, ``m_t + log2 l_t``) ride
the same TMA ring as the tiles they belong to.  Requires d % 64 == 0 and bf16 or
f16 inputs; ``centroid_lookup`` keeps the Triton passes for everything else.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common as cm

_LOG2E = 1.4426950408889634
_BIG = 1e30          # m + log2 l of a padding token: exp2(s - BIG) = 0


@dataclasses.dataclass(frozen=True)
class MosaicLookupConfig:
  """Tiling of the Mosaic GPU prefill lookup passes.

  stats_block_t / stats_block_c: tokens x centroids per wgmma tile of pass 1 (block_t a
    multiple of 64, block_c of 64 and at most 256).
  score_block_c / score_block_t: centroids x tokens per tile of pass 2 (block_c a
    multiple of 64).
  stages: shared-memory slots of each pass's TMA ring (>= 1).
  """
  stats_block_t: int = 64
  stats_block_c: int = 128
  score_block_c: int = 64
  score_block_t: int = 128
  stages: int = 2

  def __post_init__(self):
    for name in ("stats_block_t", "stats_block_c", "score_block_c", "score_block_t"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 64 or v % 64 or v > 256:
        raise ValueError(f"{name} must be a multiple of 64 in [64, 256], got {v!r}")
    if not isinstance(self.stages, int) or self.stages < 1:
      raise ValueError(f"stages must be a positive int, got {self.stages!r}")


def supported(q_dtype, d: int) -> bool:
  """Whether these kernels take inputs of this dtype and head dim."""
  return jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and d % 64 == 0


def _smem_tile(shape, dtype):
  """A shared-memory buffer laid out for TMA and wgmma (128-byte swizzle)."""
  swizzle = 128
  minor = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, minor)),
                                              plgpu.SwizzleTransform(swizzle)))


def _compiler(interpret):
  kw = dict(compiler_params=plgpu.CompilerParams(approx_math=True))
  if interpret:
    kw["interpret"] = plgpu.InterpretGPUParams()
  return kw


def _stats_pass(q, c, cnt, nv, *, scale2, group, r, num_c, seq_tiles, bt, bc, stages, interpret):
  """q [Hq, Tp, d]; c [Hkv, Cp, d]; cnt [Hkv, Cp] f32 (0 = no part); nv [G] int32 or None.
  -> (m, l) [Hq, Tp] f32, base-2 units."""
  hq, tp, d = q.shape
  bounded = nv is not None

  def body(*refs):
    if bounded:
      q_ref, c_ref, n_ref, nv_ref, m_ref, l_ref, q_s, c_s, n_s, v_s, q_bar, c_bar, n_bar = refs
    else:
      q_ref, c_ref, n_ref, m_ref, l_ref, q_s, c_s, n_s, v_s, q_bar, c_bar, n_bar = refs
    tb = lax.axis_index("t")
    h = lax.axis_index("h")
    kv = lax.div(h, jnp.int32(group))
    n = jnp.clip(nv_ref[lax.div(h, jnp.int32(r))], 0, num_c) if bounded else jnp.int32(num_c)
    steps = lax.div(n + (bc - 1), jnp.int32(bc))

    def fetch(k, slot):   # centroid block k and its counts into ring slot ``slot``
      plgpu.copy_gmem_to_smem(c_ref.at[kv, pl.ds(k * bc, bc)], c_s.at[slot], c_bar.at[slot])
      plgpu.copy_gmem_to_smem(n_ref.at[kv, pl.ds(k * bc, bc)], n_s.at[slot], n_bar.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(tb * bt, bt)], q_s, q_bar.at[0])
    for i in range(min(stages, c.shape[1] // bc)):   # static starts: none past the array
      pl.when(i < steps)(functools.partial(fetch, i, i))
    plgpu.barrier_wait(q_bar.at[0])
    col = plgpu.broadcasted_iota(jnp.int32, (bt, bc), 1, layout=plgpu.Layout.WGMMA)

    def step(k, carry):
      m_i, l_i = carry
      slot = lax.rem(k, jnp.int32(stages))
      plgpu.barrier_wait(c_bar.at[slot])
      plgpu.barrier_wait(n_bar.at[slot])

      def mm(acc):
        plgpu.wgmma(acc, q_s, c_s.at[slot].transpose((1, 0)))
        return acc[...]
      s = pl.run_scoped(mm, plgpu.ACC((bt, bc), jnp.float32))          # [bt, bc]
      cv = plgpu.load(n_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      plgpu.commit_smem()          # every thread's reads of the slot done before TMA refills it
      pl.when(k + stages < steps)(functools.partial(fetch, k + stages, slot))
      cb = lax.broadcast_in_dim(cv, (bt, bc), [1])
      if bounded:
        cb = jnp.where(col + k * bc < n, cb, 0.0)
      s = jnp.where(cb > 0, s * scale2, cm.MASK_VALUE)
      m_new = jnp.maximum(m_i, s.max(axis=1))
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bt, bc), [0]))
      l_new = l_i * jnp.exp2(m_i - m_new) + (p * cb).sum(axis=1)
      return m_new, l_new

    row = plgpu.Layout.WGMMA.reduce(1)
    m0 = plgpu.layout_cast(jnp.full((bt,), cm.MASK_VALUE, jnp.float32), row)
    l0 = plgpu.layout_cast(jnp.full((bt,), 0.0, jnp.float32), row)
    m_i, l_i = lax.fori_loop(0, steps, step, (m0, l0))
    v_s.at[0][...] = m_i
    v_s.at[1][...] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_s.at[0], m_ref.at[h, pl.ds(tb * bt, bt)])
    plgpu.copy_smem_to_gmem(v_s.at[1], l_ref.at[h, pl.ds(tb * bt, bt)])
    plgpu.wait_smem_to_gmem(0)

  out = [jax.ShapeDtypeStruct((hq, tp), jnp.float32)] * 2
  args = (q, c, cnt) + ((nv,) if bounded else ())
  return plgpu.kernel(
      body, out_type=out, grid=(seq_tiles, hq), grid_names=("t", "h"),
      scratch_types=[_smem_tile((bt, d), q.dtype), _smem_tile((stages, bc, d), c.dtype),
                     plgpu.SMEM((stages, bc), jnp.float32), plgpu.SMEM((2, bt), jnp.float32),
                     plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=stages),
                     plgpu.Barrier(num_barriers=stages)],
      **_compiler(interpret))(*args)


def _score_pass(q, c, cnt, mt, nv, *, scale2, r, group, num_c, groups, n_tb, splits, bt, bc,
                stages, interpret):
  """q [Hq, Tp, d]; c [Hkv, Cp, d]; cnt [Hkv, Cp] f32; mt [Hq, Tp] f32 = m + log2 l (BIG on
  padding tokens).  -> sums [G, splits, Cp] f32 of exp2(min(s - mt, 0)) over the tokens."""
  hq, tp, d = q.shape
  cp = c.shape[1]
  nb = cp // bc
  bounded = nv is not None
  total = r * n_tb
  chunk = cm.cdiv(total, splits)

  def body(*refs):
    if bounded:
      q_ref, c_ref, n_ref, mt_ref, nv_ref, o_ref, q_s, t_s, c_s, n_s, v_s, q_bar, t_bar, c_bar = refs
    else:
      q_ref, c_ref, n_ref, mt_ref, o_ref, q_s, t_s, c_s, n_s, v_s, q_bar, t_bar, c_bar = refs
    cb = lax.axis_index("c")
    grp = lax.axis_index("g")
    z = lax.axis_index("z")
    kv = lax.div(grp * r, jnp.int32(group))
    n = jnp.clip(nv_ref[grp], 0, num_c) if bounded else jnp.int32(num_c)
    active = cb * bc < n
    start = z * chunk
    stop = jnp.where(active, jnp.minimum(start + chunk, total), start)
    steps = jnp.maximum(stop - start, 0)

    def fetch(k, slot):   # query tile k of this program and its thresholds into ring slot ``slot``
      it = start + k
      h = grp * r + lax.div(it, jnp.int32(n_tb))
      t0 = lax.rem(it, jnp.int32(n_tb)) * bt
      plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(t0, bt)], q_s.at[slot], q_bar.at[slot])
      plgpu.copy_gmem_to_smem(mt_ref.at[h, pl.ds(t0, bt)], t_s.at[slot], t_bar.at[slot])

    @pl.when(active)
    def _():
      plgpu.copy_gmem_to_smem(c_ref.at[kv, pl.ds(cb * bc, bc)], c_s, c_bar.at[0])
      plgpu.copy_gmem_to_smem(n_ref.at[kv, pl.ds(cb * bc, bc)], n_s, c_bar.at[1])
    for i in range(stages):
      pl.when(i < steps)(functools.partial(fetch, i, i))

    def step(k, acc_sum):
      slot = lax.rem(k, jnp.int32(stages))
      plgpu.barrier_wait(q_bar.at[slot])
      plgpu.barrier_wait(t_bar.at[slot])

      def mm(acc):
        plgpu.wgmma(acc, c_s, q_s.at[slot].transpose((1, 0)))
        return acc[...]
      s = pl.run_scoped(mm, plgpu.ACC((bc, bt), jnp.float32))          # [bc, bt]
      thr = plgpu.load(t_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      plgpu.commit_smem()          # every thread's reads of the slot done before TMA refills it
      pl.when(k + stages < steps)(functools.partial(fetch, k + stages, slot))
      p = jnp.exp2(jnp.minimum(s * scale2 - lax.broadcast_in_dim(thr, (bc, bt), [1]), 0.0))
      return acc_sum + p

    acc0 = plgpu.layout_cast(jnp.full((bc, bt), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(active)
    def _():
      plgpu.barrier_wait(c_bar.at[0])
      plgpu.barrier_wait(c_bar.at[1])
    acc = lax.fori_loop(0, steps, step, acc0)
    colsum = acc.sum(axis=1)                                           # [bc] over the tokens
    j = plgpu.broadcasted_iota(jnp.int32, (bc,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    ok = active & (j + cb * bc < n)
    cv = plgpu.load(n_s, layout=plgpu.Layout.WGMMA.reduce(1))
    v_s[...] = jnp.where(ok & (cv > 0), colsum, 0.0) * (1.0 / (r * (n_tb * bt)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_s, o_ref.at[grp, z, pl.ds(cb * bc, bc)])
    plgpu.wait_smem_to_gmem(0)

  args = (q, c, cnt, mt) + ((nv,) if bounded else ())
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((groups, splits, cp), jnp.float32),
      grid=(nb, groups, splits), grid_names=("c", "g", "z"),
      scratch_types=[_smem_tile((stages, bt, d), q.dtype), plgpu.SMEM((stages, bt), jnp.float32),
                     _smem_tile((bc, d), c.dtype), plgpu.SMEM((bc,), jnp.float32),
                     plgpu.SMEM((bc,), jnp.float32), plgpu.Barrier(num_barriers=stages),
                     plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2)],
      **_compiler(interpret))(*args)


def lookup_prefill_scores_mosaic(q, centroids, counts, n_valid=None, *, scale, groups,
                                 cfg: MosaicLookupConfig = MosaicLookupConfig(), splits=None,
                                 interpret=False):
  """Eq. 1 scores averaged over the T tokens and the R heads of each group (the contract of
  ``centroid_lookup.lookup_prefill_scores``).

  q [Hq, T, d] bf16/f16; centroids [Hkv, C, d] (same dtype); counts [Hkv, C]; n_valid [G]
  int32 or None (only rows ``[0, n_valid[g])`` of group g take part).  Returns avg [G, C]
  f32 (0 for empty clusters and rows past the bound).
  """
  hq, seq_len, d = q.shape
  hkv, num_c, _ = centroids.shape
  if not supported(q.dtype, d) or centroids.dtype != q.dtype:
    raise ValueError(f"the Mosaic GPU lookup takes bf16/f16 q and centroids of one dtype with "
                     f"d % 64 == 0; got q {q.dtype} {q.shape}, centroids {centroids.dtype}")
  r = hq // groups
  scale2 = float(scale) * _LOG2E
  bt_a, bc_a = cfg.stats_block_t, cfg.stats_block_c
  bc_b, bt_b = cfg.score_block_c, cfg.score_block_t
  t_blk = max(bt_a, bt_b)
  tp = cm.cdiv(seq_len, t_blk) * t_blk
  c_blk = max(bc_a, bc_b)
  cp = cm.cdiv(num_c, c_blk) * c_blk
  qp = cm.pad_axis(q, 1, tp)
  cpad = cm.pad_axis(centroids, 1, cp)
  cnt = cm.pad_axis(counts.astype(jnp.float32), 1, cp)
  nv = None if n_valid is None else jnp.asarray(n_valid, jnp.int32)
  common = dict(scale2=scale2, group=hq // hkv, r=r, num_c=num_c, interpret=interpret,
                stages=cfg.stages)
  m, l = _stats_pass(qp, cpad, cnt, nv, seq_tiles=tp // bt_a, bt=bt_a, bc=bc_a, **common)
  t = jnp.arange(tp)
  ok = (t < seq_len)[None, :] & (l > 0)
  mt = jnp.where(ok, m + jnp.log2(jnp.where(ok, l, 1.0)), _BIG)
  n_tb = tp // bt_b
  nb = cp // bc_b
  if splits is None:
    splits = max(1, min(r * n_tb, (8192 if nv is not None else 1024) // max(nb * groups, 1)))
  sums = _score_pass(qp, cpad, cnt, mt, nv, groups=groups, n_tb=n_tb, splits=splits, bt=bt_b,
                     bc=bc_b, **common)
  # the kernel divides by the padded token count; rescale to the real one
  return jnp.sum(sums, axis=1)[:, :num_c] * (tp / seq_len)
