"""The prefill centroid lookup's two passes as Mosaic GPU kernels (Hopper: TMA + wgmma).

Same contract and arithmetic as ``centroid_lookup.lookup_prefill_scores`` (Eq. 1 averaged
over a block of T query tokens, App. D), base-2 logits ``s = log2(e) * scale * q.C``:

* pass 1 (statistics), one program per (128 tokens, query head): the running max and
  denominator ``l_t = sum_j N_j exp2(s_tj - m_t)`` over the head's centroids (rows
  ``[0, n_valid[g])`` of a bounded call).  Two compute warpgroups each hold 64 tokens and
  share every centroid block, which a third warpgroup brings by TMA into a ring of
  ``stages`` shared-memory slots; each step is one ``wgmma`` [64, block_c] per warpgroup,
  and the counts enter the exponent (``s + log2 N``), so a logit costs one FFMA, a max, a
  subtraction, an exp2 and an add;
* pass 2 (scoring), one program per (centroid block, group, split): the centroid block stays
  in shared memory while the program's share of the group's (head, token block) query tiles
  is dealt alternately to two compute warpgroups, each streaming its tiles through its own TMA
  ring and summing ``exp2(s - m_t - log2 l_t)`` over the tokens (the tile is
  [block_c, block_t]: centroids on the wgmma's M side, so the sum over tokens is a row
  reduction).

FA3's schedule barrier alternates the two compute warpgroups, so that one's exp2s run while the
other's wgmma does.  Measured on an H200 (4K tokens over 512K) that overlap did not shorten a
step: across seven commands these passes took 0.85-1.00x the Triton passes' time for one level,
0.91-1.00x for a bounded level 2 and 1.02-1.04x for the whole hierarchical lookup (timed in two)
(benchmarks/results/gpu_h200_mosaic_lookup), so ``CentroidLookupConfig.prefill_engine``
defaults to the Triton passes.
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
  """Tiling of the Mosaic GPU prefill lookup passes.  Each program runs 2 compute warpgroups
  (64 tokens each in pass 1, fed by a third warpgroup that issues the TMA copies; alternate
  query tiles in pass 2, each warpgroup issuing its own).

  stats_block_c: centroids per pass-1 tile ([64 tokens, block_c] per warpgroup).
  score_block_c / score_block_t: centroids x tokens per pass-2 tile.
  stages: shared-memory slots of each TMA ring (per compute warpgroup in pass 2).
  All tile sizes: multiples of 64 in [64, 256].
  """
  stats_block_c: int = 128
  score_block_c: int = 64
  score_block_t: int = 128
  stages: int = 2

  def __post_init__(self):
    for name in ("stats_block_c", "score_block_c", "score_block_t"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 64 or v % 64 or v > 256:
        raise ValueError(f"{name} must be a multiple of 64 in [64, 256], got {v!r}")
    if not isinstance(self.stages, int) or self.stages < 1:
      raise ValueError(f"stages must be a positive int, got {self.stages!r}")


# The tiling measured fastest on an H200 at 4K tokens over 512K
# (benchmarks/results/gpu_h200_mosaic_lookup): 256-centroid statistics tiles.
DEFAULT_MOSAIC = MosaicLookupConfig(stats_block_c=256)


def is_hopper() -> bool:
  """Whether the default device is a Hopper GPU (compute capability 9.x: wgmma and TMA)."""
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return False
  return str(getattr(dev, "compute_capability", "")).startswith("9")


def supported(q_dtype, d: int) -> bool:
  """Whether these kernels take inputs of this dtype and head dim."""
  return jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and d % 64 == 0


def _smem_tile(shape, dtype):
  """A shared-memory buffer laid out for TMA and wgmma (128-byte swizzle)."""
  swizzle = 128
  minor = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, minor)),
                                              plgpu.SwizzleTransform(swizzle)))


_COMPUTE_WGS = 2     # warpgroups doing wgmma + softmax (pass 1 adds one that issues the TMA copies)


def _rendezvous(sched):
  """Both compute warpgroups meet here (FA3's schedule barrier): with warpgroup 1 one meeting
  ahead, each one's softmax runs while the other's wgmma occupies the tensor cores."""
  plgpu.barrier_arrive(sched)
  plgpu.barrier_wait(sched)


def _split_refs(refs, n_in, n_out, bounded):
  """A kernel's refs -> (inputs, n_valid ref or None, outputs, scratch); n_valid is the last
  input of a bounded call."""
  k = n_in + int(bounded)
  return refs[:n_in], (refs[n_in] if bounded else None), refs[k:k + n_out], refs[k + n_out:]


def _kernel(body, out_type, grid, names, scratch, *, threads, interpret):
  """``plgpu.kernel`` with ``threads`` warpgroups named "wg"; GPU interpret mode if asked."""
  return plgpu.kernel(body, out_type=out_type, grid=grid, grid_names=names, num_threads=threads,
                      thread_name="wg", scratch_types=scratch,
                      compiler_params=plgpu.CompilerParams(approx_math=True),
                      interpret=plgpu.InterpretGPUParams() if interpret else None)


def _stats_pass(q, c, bias, nv, *, scale2, group, r, num_c, bc, stages, interpret):
  """q [Hq, Tp, d]; c [Hkv, Cp, d]; bias [Hkv, Cp] f32 = log2 N (MASK where N = 0);
  nv [G] int32 or None.
  -> (m, l) [Hq, Tp] f32 with m + log2 l = log2 sum_j N_j exp2(s_tj) (m is a stabiliser
  that includes log2 N: the counts ride in the exponent, one FFMA per logit).

  A program = 2 compute warpgroups x 64 tokens of one head, sharing each centroid block."""
  hq, tp, d = q.shape
  bt = 64
  bounded = nv is not None
  n_blocks = c.shape[1] // bc

  def lookup_stats_mgpu(*refs):
    (q_ref, c_ref, n_ref), nv_ref, (m_ref, l_ref), scratch = _split_refs(refs, 3, 2, bounded)
    q_s, c_s, n_s, v_s, q_bar, c_bar, n_bar, done, sched = scratch
    wg = lax.axis_index("wg")
    tb = lax.axis_index("t")
    h = lax.axis_index("h")
    kv = lax.div(h, jnp.int32(group))
    n = jnp.clip(nv_ref[lax.div(h, jnp.int32(r))], 0, num_c) if bounded else jnp.int32(num_c)
    steps = lax.div(n + (bc - 1), jnp.int32(bc))

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      t0 = (tb * _COMPUTE_WGS + wg) * bt
      plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(t0, bt)], q_s.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      j = plgpu.broadcasted_iota(jnp.int32, (bc,), 0, layout=plgpu.Layout.WGMMA.reduce(0))

      def step(k, carry):
        m_i, l_i = carry
        slot = lax.rem(k, jnp.int32(stages))
        plgpu.barrier_wait(c_bar.at[slot])
        plgpu.barrier_wait(n_bar.at[slot])

        def mm(acc):
          plgpu.wgmma(acc, q_s.at[wg], c_s.at[slot].transpose((1, 0)))
          _rendezvous(sched)        # the other warpgroup's exp2s run while this wgmma does
          return acc[...]
        s = pl.run_scoped(mm, plgpu.ACC((bt, bc), jnp.float32))        # [bt, bc]
        bias = plgpu.load(n_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))   # [bc]
        plgpu.barrier_arrive(done.at[slot])
        if bounded:
          bias = jnp.where(j + k * bc < n, bias, cm.MASK_VALUE)
        s = s * scale2 + lax.broadcast_in_dim(bias, (bt, bc), [1])
        m_new = jnp.maximum(m_i, s.max(axis=1))
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bt, bc), [0]))
        return m_new, l_i * jnp.exp2(m_i - m_new) + p.sum(axis=1)

      row = plgpu.Layout.WGMMA.reduce(1)
      m0 = plgpu.layout_cast(jnp.full((bt,), cm.MASK_VALUE, jnp.float32), row)
      l0 = plgpu.layout_cast(jnp.full((bt,), 0.0, jnp.float32), row)
      pl.when(wg == 1)(functools.partial(_rendezvous, sched))
      m_i, l_i = lax.fori_loop(0, steps, step, (m0, l0))
      pl.when(wg == 0)(functools.partial(_rendezvous, sched))
      v_s.at[wg, 0][...] = m_i
      v_s.at[wg, 1][...] = l_i
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(v_s.at[wg, 0], m_ref.at[h, pl.ds(t0, bt)])
      plgpu.copy_smem_to_gmem(v_s.at[wg, 1], l_ref.at[h, pl.ds(t0, bt)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def fetch(k, slot):   # centroid block k and its log2 counts into ring slot ``slot``
        plgpu.copy_gmem_to_smem(c_ref.at[kv, pl.ds(k * bc, bc)], c_s.at[slot], c_bar.at[slot])
        plgpu.copy_gmem_to_smem(n_ref.at[kv, pl.ds(k * bc, bc)], n_s.at[slot], n_bar.at[slot])

      for i in range(min(stages, n_blocks)):   # static starts: none past the array
        pl.when(i < steps)(functools.partial(fetch, i, i))

      @pl.loop(0, steps)
      def _(k):   # refill each slot once both warpgroups are done with it; the last waits drain
        slot = lax.rem(k, jnp.int32(stages))
        plgpu.barrier_wait(done.at[slot])
        pl.when(k + stages < steps)(functools.partial(fetch, k + stages, slot))

  out = [jax.ShapeDtypeStruct((hq, tp), jnp.float32)] * 2
  args = (q, c, bias) + ((nv,) if bounded else ())
  scratch = [_smem_tile((_COMPUTE_WGS, bt, d), q.dtype), _smem_tile((stages, bc, d), c.dtype),
             plgpu.SMEM((stages, bc), jnp.float32), plgpu.SMEM((_COMPUTE_WGS, 2, bt), jnp.float32),
             plgpu.Barrier(num_barriers=_COMPUTE_WGS), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
             plgpu.Barrier(num_arrivals=_COMPUTE_WGS)]
  return _kernel(lookup_stats_mgpu, out, (tp // (bt * _COMPUTE_WGS), hq), ("t", "h"), scratch,
                 threads=_COMPUTE_WGS + 1, interpret=interpret)(*args)


def _score_pass(q, c, cnt, mt, nv, *, scale2, r, group, num_c, groups, n_tb, splits, bt, bc,
                stages, interpret):
  """q [Hq, Tp, d]; c [Hkv, Cp, d]; cnt [Hkv, Cp] f32; mt [Hq, Tp] f32 = m + log2 l (BIG on
  padding tokens).  -> sums [G, 2 * splits, Cp] f32 of exp2(s - mt) over the tokens (<= 1 for
  every valid centroid: no clamp needed; invalid rows are zeroed at the end).

  A program = one centroid block (kept in shared memory) and its share of the group's (head,
  token block) tiles, dealt alternately to 2 compute warpgroups; each keeps its own TMA ring
  of query tiles (refilled once all its threads have read a slot: ``commit_smem``)."""
  hq, tp, d = q.shape
  cp = c.shape[1]
  nb = cp // bc
  bounded = nv is not None
  total = r * n_tb
  chunk = cm.cdiv(total, splits)
  w_n = _COMPUTE_WGS

  def lookup_scores_mgpu(*refs):
    (q_ref, c_ref, n_ref, mt_ref), nv_ref, (o_ref,), scratch = _split_refs(refs, 4, 1, bounded)
    q_s, t_s, c_s, n_s, v_s, q_bar, t_bar, c_bar, sched = scratch
    wg = lax.axis_index("wg")
    cb = lax.axis_index("c")
    grp = lax.axis_index("g")
    z = lax.axis_index("z")
    kv = lax.div(grp * r, jnp.int32(group))
    n = jnp.clip(nv_ref[grp], 0, num_c) if bounded else jnp.int32(num_c)
    active = cb * bc < n
    start = z * chunk
    stop = jnp.where(active, jnp.minimum(start + chunk, total), start)
    steps = jnp.maximum(stop - start, 0)
    my_steps = lax.div(jnp.maximum(steps - wg, 0) + (w_n - 1), jnp.int32(w_n))  # tiles wg, wg+2, ...

    def fetch(k, b):   # this warpgroup's k-th query tile and its thresholds into slot b
      it = start + k * w_n + wg
      h = grp * r + lax.div(it, jnp.int32(n_tb))
      t0 = lax.rem(it, jnp.int32(n_tb)) * bt
      plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(t0, bt)], q_s.at[b], q_bar.at[b])
      plgpu.copy_gmem_to_smem(mt_ref.at[h, pl.ds(t0, bt)], t_s.at[b], t_bar.at[b])

    @pl.when(active & (wg == 0))
    def _():
      plgpu.copy_gmem_to_smem(c_ref.at[kv, pl.ds(cb * bc, bc)], c_s, c_bar.at[0])
      plgpu.copy_gmem_to_smem(n_ref.at[kv, pl.ds(cb * bc, bc)], n_s, c_bar.at[1])
    for i in range(stages):
      pl.when(i < my_steps)(functools.partial(fetch, i, wg * stages + i))

    @pl.when(active)
    def _():
      plgpu.barrier_wait(c_bar.at[0])
      plgpu.barrier_wait(c_bar.at[1])

    def step(k, acc_sum):
      b = wg * stages + lax.rem(k, jnp.int32(stages))
      plgpu.barrier_wait(q_bar.at[b])
      plgpu.barrier_wait(t_bar.at[b])

      def mm(acc):
        plgpu.wgmma(acc, c_s, q_s.at[b].transpose((1, 0)))
        _rendezvous(sched)          # the other warpgroup's exp2s run while this wgmma does
        return acc[...]
      s = pl.run_scoped(mm, plgpu.ACC((bc, bt), jnp.float32))          # [bc, bt]
      thr = plgpu.load(t_s.at[b], layout=plgpu.Layout.WGMMA.reduce(0))
      plgpu.commit_smem()          # every thread's reads of the slot done before TMA refills it
      pl.when(k + stages < my_steps)(functools.partial(fetch, k + stages, b))
      return acc_sum + jnp.exp2(s * scale2 - lax.broadcast_in_dim(thr, (bc, bt), [1]))

    acc0 = plgpu.layout_cast(jnp.full((bc, bt), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    pl.when(wg == 1)(functools.partial(_rendezvous, sched))
    acc = lax.fori_loop(0, my_steps, step, acc0)
    # as many rendezvous on both sides: warpgroup 1 may hold one tile fewer
    steps0 = lax.div(steps + (w_n - 1), jnp.int32(w_n))
    pl.loop(0, jnp.where(wg == 1, steps0 - my_steps, 0))(lambda _: _rendezvous(sched))
    pl.when(wg == 0)(functools.partial(_rendezvous, sched))
    colsum = acc.sum(axis=1)                                           # [bc] over the tokens
    j = plgpu.broadcasted_iota(jnp.int32, (bc,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    ok = active & (j + cb * bc < n)
    cv = plgpu.load(n_s, layout=plgpu.Layout.WGMMA.reduce(1))
    v_s.at[wg][...] = jnp.where(ok & (cv > 0), colsum, 0.0) * (1.0 / (r * (n_tb * bt)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_s.at[wg], o_ref.at[grp, z * w_n + wg, pl.ds(cb * bc, bc)])
    plgpu.wait_smem_to_gmem(0)

  args = (q, c, cnt, mt) + ((nv,) if bounded else ())
  scratch = [_smem_tile((w_n * stages, bt, d), q.dtype), plgpu.SMEM((w_n * stages, bt), jnp.float32),
             _smem_tile((bc, d), c.dtype), plgpu.SMEM((bc,), jnp.float32),
             plgpu.SMEM((w_n, bc), jnp.float32), plgpu.Barrier(num_barriers=w_n * stages),
             plgpu.Barrier(num_barriers=w_n * stages), plgpu.Barrier(num_barriers=2),
             plgpu.Barrier(num_arrivals=w_n)]
  return _kernel(lookup_scores_mgpu, jax.ShapeDtypeStruct((groups, w_n * splits, cp), jnp.float32),
                 (nb, groups, splits), ("c", "g", "z"), scratch, threads=w_n, interpret=interpret)(*args)


def lookup_prefill_scores_mosaic(q, centroids, counts, n_valid=None, *, scale, groups,
                                 cfg: MosaicLookupConfig = MosaicLookupConfig(), splits=None,
                                 interpret=False, stats_only=False):
  """Eq. 1 scores averaged over the T tokens and the R heads of each group (the contract of
  ``centroid_lookup.lookup_prefill_scores``).

  q [Hq, T, d] bf16/f16; centroids [Hkv, C, d] (same dtype); counts [Hkv, C]; n_valid [G]
  int32 or None (only rows ``[0, n_valid[g])`` of group g take part).  Returns avg [G, C]
  f32 (0 for empty clusters and rows past the bound).

  ``interpret=True`` (GPU interpret mode, CPU) runs each warpgroup as a host thread whose barrier
  waits block threads of XLA's CPU pool; with fewer pool threads than warpgroups (3) it can
  deadlock. Start the process with ``NPROC=16`` (read by XLA when jax starts) on small machines.
  """
  hq, seq_len, d = q.shape
  hkv, num_c, _ = centroids.shape
  if not supported(q.dtype, d) or centroids.dtype != q.dtype:
    raise ValueError(f"the Mosaic GPU lookup takes bf16/f16 q and centroids of one dtype with "
                     f"d % 64 == 0; got q {q.dtype} {q.shape}, centroids {centroids.dtype}")
  r = hq // groups
  scale2 = float(scale) * _LOG2E
  bt_a, bc_a = 64 * _COMPUTE_WGS, cfg.stats_block_c
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
  bias = jnp.where(cnt > 0, jnp.log2(jnp.where(cnt > 0, cnt, 1.0)), cm.MASK_VALUE)
  m, l = _stats_pass(qp, cpad, bias, nv, bc=bc_a, **common)
  if stats_only:   # pass 1 alone (benchmarks time the passes separately)
    return m, l
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
