"""Centroid lookup of Squeezed Attention (Hooper et al., Eq. 1, Section 4.1, App. D).

For a query ``q`` of query head ``h`` and the key centroids ``C_i`` of its KV head
(``N_i`` keys in cluster ``i``)::

    S_i = exp(s q.C_i) / sum_j N_j exp(s q.C_j)                          (Eq. 1)

computed with max-subtraction.  A cluster is retrieved when ``S_i > T``.  Clusters
with ``N_i == 0`` (empty or padding) take no part in the denominator, get
``S_i = 0`` and are never selected.  If a head has no valid cluster at all, every
score is 0 (never NaN).

Selection heads (``vote``): ``"kv"`` (default) averages ``S`` over the ``g`` query
heads of each KV head, giving one retrieved set per KV head (``Hs = Hkv``); ``"q"``
keeps one set per query head (``Hs = Hq``).

Prefill (``T`` query tokens): ``S`` is averaged over the ``T`` tokens (App. D).
Kernel A (grid: query head x token block) makes one pass over the centroids for the
per-token softmax statistics (running max and denominator); kernel B (grid:
centroid block x selection head x split) loads each centroid block once and
accumulates the normalised scores over the group's heads and tokens (its share of
them when a few centroid blocks are split over several programs; the partial sums are
added after).  No ``[H, C, T]`` tensor is ever written to HBM.

Decode (one token): a single pass, parallel over centroid blocks (grid: KV head x
centroid block) so that batch 1 fills the GPU.  Each program stores
``exp(s q.C_i - m_b)`` for its block with the block max ``m_b`` and the block
denominator ``l_b = sum N_i exp(s q.C_i - m_b)``; a cheap second reduction (fused
jnp) forms ``D = sum_b l_b exp(m_b - M)`` and ``S_i = e_i exp(m_b - M) / D`` (the
paper compares ``e_i`` with ``D T`` rescaled by ``exp(m_b - M)``; the group vote
needs the normalised ``S_i`` itself, one multiply more).

``hierarchical_lookup`` reuses these kernels for its level 2: the decode kernel takes
the level-1 kernel's raw outputs (``Level1Raw``) and reads only rows whose parent
survives; the prefill passes take a per-group row bound (``n_valid``) over a
compacted candidate set.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as cm
from pallas_kernels._dispatch import pallas_call, resolve_backend
from pallas_kernels.lookup_mosaic import (DEFAULT_MOSAIC, MosaicLookupConfig, is_hopper,
                                          lookup_prefill_scores_mosaic, supported as mosaic_supported)

PREFILL_ENGINES = ("triton", "mosaic", "auto")
INT8_MODES = (None, "cvt", "magic")


@dataclasses.dataclass(frozen=True)
class CentroidLookupConfig:
  """Static tiling of the lookup kernels.

  block_c: centroids per tile (power of two >= 16).
  block_t: query tokens per tile in the prefill kernels (power of two >= 16;
    clipped to the next power of two of T).
  tile_acc: the prefill scoring pass accumulates the normalised scores in a
    [block_t, block_c] tile and sums it over the tokens once at the end, instead of
    reducing every tile over its tokens (a cross-thread reduction per iteration).
  score_block_t, score_block_c, score_warps: the prefill scoring pass's own tiling
    (None = the values above, which the statistics pass and decode use).
  score_splits: programs sharing one centroid block's tiles in the prefill scoring pass
    (partial sums added after it); None = enough for ~1024 programs (``score_splits``).
  stats_splits: programs sharing one (token block, head)'s centroid blocks in the
    statistics pass, their (max, denominator) combined after; None = automatic
    (``stats_splits``): 2 for a bounded (compacted level-2) call, and for a short block
    (a question: one token block, 32 programs for 32 heads) as many as bring the pass to
    ~256 programs.  At 512K / 4K tokens on an H200 1, 2 and 4 measured the same
    (gpu_h200_hierarchical/prefill_splits_994a427); a 123-token question at 128K spent
    131 us per layer in the unsplit pass on an H100 (gpu_h100_kernels/).
  prefill_engine: which kernels run the two prefill passes when compiled: ``"triton"``;
    ``"mosaic"`` (``lookup_mosaic``: TMA + wgmma with warp-specialised programs, Hopper
    only, bf16/f16 with d % 64 == 0); ``"auto"`` = Mosaic where it applies on a Hopper GPU,
    else Triton.  Under ``backend="interpret"`` "auto" interprets the Triton passes and
    "mosaic" the Mosaic ones (GPU interpret mode).
  mosaic: the Mosaic passes' tiling (None = ``lookup_mosaic.DEFAULT_MOSAIC``).
  level2_blocks, level2_unroll: centroid blocks per program of the hierarchical
    level-2 decode kernel (a loop, or written out), to overlap the dependent loads
    (parent -> level-1 score -> row) of several blocks.  Every setting > 1 measured
    slower on an H200 at 512K (benchmarks/results/gpu_h200_hierarchical/decode_sweep_1f0414e);
    kept for sweeps on other GPUs.
  stats_anchor: the prefill statistics pass without a running max: each row's logits are taken
    relative to the max of its first centroid block (the anchor), so the loop over the other
    blocks is exp2 and a multiply-add per element with no per-block max, rescale or second
    reduction: ``"rows"`` sums each block's row, ``"tile"`` accumulates a [block_t, block_c]
    tile and sums it once.  A program whose sum leaves [0, 2^100] (a later logit ~100 log2
    units above the anchor, or no valid column in the first block) runs the exact running-max
    loop instead, so the result is the same up to rounding.  None: the running max throughout.
    Triton passes only (the Mosaic engine keeps its running max).  ``DEFAULT_PREFILL`` uses
    "rows": on an H100 at 512K / 4K tokens the statistics pass took 2.45-2.48 vs 2.71-2.74 ms
    (1-level) and the hierarchical lookup 3.35-3.36 vs 3.44-3.49 ms of kernels; "tile" spills at
    128 x 128 tiles and was slower (benchmarks/results/gpu_h100_stats_anchor).
  level2_rows: the most query rows one program of the hierarchical attention decode's level-2
    kernel takes when a KV head's rows vote in several segments (a batch of questions, or
    vote "q"): whole segments share a program, so each level-2 block is read once for all of
    them and the programs are that many times fewer; each row keeps its own segment's
    survivors.  1 = one segment per program (the layout before 2026-11-25).
  prefill_int8: the prefill passes' logits ``q.C`` on the int8 tensor cores (twice the bf16 rate on
    Hopper): q quantized per (head, token) row and the centroids per head to [-127, 127]
    (``quantize_int8``), the int32 dot scaled back per row.  ``"cvt"`` converts the int32 dot to
    f32 with a conversion instruction, ``"magic"`` by adding 1.5 * 2^23's bits and subtracting it
    in the row scale's multiply-add (exact for |dot| < 2^22, which 127^2 * d keeps for d <= 256;
    "cvt" above that).  "cvt" measured faster on an H100 (``INT8_PREFILL``).
    The scores are those of the quantized inputs (``quantized_inputs``): on captured SmolLM2
    keys the logits' error is ~0.07 (std, natural-log units; bf16 inputs: 0.02).  None: the
    inputs' dtype.  Triton passes only.
  exp2_ftz: the prefill passes' per-element ``exp2`` as one ``ex2.approx.ftz.f32``
    (``_common.exp2_ftz``) instead of ``jnp.exp2``, which XLA compiles without flush-to-zero
    (``ex2.approx.f32``: extra instructions per element for subnormal results).  Results
    differ only below 2^-126.  The interpreter computes both as ``lax.exp2``.
  stats_rows_wait: whether the prefill statistics pass loads a centroid row only once its count is read (an empty
    cluster's row is then not read); False: rows are read under the bound alone, without waiting.  None: False for an
    unbounded int8 pass, else True -- on an H200 at 512K / 4K tokens an unbounded int8 statistics pass took 0.302 vs
    0.325 ms (hierarchical level 1) and 1.48 vs 1.61 ms (1-level) without waiting, with the same scores; the bounded
    level 2 (+2%) and the bf16 passes (+3%) were slower that way (benchmarks/results/gpu_h100_lookup_limits).
  logits_fma: the prefill passes form ``s * multiplier - bias`` (the scoring pass's M + log2 D, the anchored
    statistics pass's anchor) as one ``fma.rn.f32`` per element (``_common.fma``): XLA's Triton pipeline does not
    contract a multiply and an add.  On an H100 at 512K / 4K tokens the hierarchical lookup took 2.29-2.32 vs
    2.47-2.48 ms (int8) and 2.89-2.91 vs 3.11 ms (bf16) of kernels, the 1-level one 3.20-3.21 vs 3.40-3.42 ms
    (int8) and 3.96 vs 4.30-4.31 ms (bf16); the scores moved by 2e-7 (one rounding fewer)
    (benchmarks/results/gpu_h100_lookup_limits).  Off the GPU both settings compute the same values.
  """
  block_c: int = 128
  block_t: int = 64
  num_warps: int = 4
  num_stages: int = 2
  tile_acc: bool = False
  score_block_t: int | None = None
  score_block_c: int | None = None
  score_warps: int | None = None
  level2_blocks: int = 1
  level2_unroll: bool = False
  level2_rows: int = 32
  stats_anchor: str | None = None
  score_splits: int | None = None
  stats_splits: int | None = None
  prefill_engine: str = "triton"
  mosaic: MosaicLookupConfig | None = None
  prefill_int8: str | None = None
  exp2_ftz: bool = True
  stats_rows_wait: bool | None = None
  logits_fma: bool = True

  def __post_init__(self):
    if self.prefill_engine not in PREFILL_ENGINES:
      raise ValueError(f"prefill_engine must be one of {PREFILL_ENGINES}, got {self.prefill_engine!r}")
    if self.mosaic is not None and not isinstance(self.mosaic, MosaicLookupConfig):
      raise ValueError(f"mosaic must be a MosaicLookupConfig or None, got {self.mosaic!r}")
    cm.check_pow2("block_c", self.block_c)
    cm.check_pow2("block_t", self.block_t)
    cm.check_warps_stages(self.num_warps, self.num_stages)
    for name in ("score_block_t", "score_block_c"):
      if getattr(self, name) is not None:
        cm.check_pow2(name, getattr(self, name))
    if self.score_warps is not None:
      cm.check_warps_stages(self.score_warps, self.num_stages)
    for name in ("score_splits", "stats_splits"):
      v = getattr(self, name)
      if v is not None and (not isinstance(v, int) or v < 1):
        raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    if not isinstance(self.level2_blocks, int) or self.level2_blocks < 1:
      raise ValueError(f"level2_blocks must be a positive int, got {self.level2_blocks!r}")
    if self.stats_anchor not in (None, "rows", "tile"):
      raise ValueError(f"stats_anchor must be None, 'rows' or 'tile', got {self.stats_anchor!r}")
    if not isinstance(self.level2_rows, int) or self.level2_rows < 1:
      raise ValueError(f"level2_rows must be a positive int, got {self.level2_rows!r}")
    if not isinstance(self.logits_fma, bool):
      raise ValueError(f"logits_fma must be a bool, got {self.logits_fma!r}")
    if self.stats_rows_wait not in (None, True, False):
      raise ValueError(f"stats_rows_wait must be None, True or False, got {self.stats_rows_wait!r}")
    if self.prefill_int8 not in INT8_MODES:
      raise ValueError(f"prefill_int8 must be one of {INT8_MODES}, got {self.prefill_int8!r}")
    if self.prefill_int8 is not None and self.prefill_engine == "mosaic":
      raise ValueError("prefill_int8 runs in the Triton passes; use prefill_engine='triton' or 'auto'")


_LOG2E = 1.4426950408889634
_MAGIC = 0x4B400000          # the bits of 1.5 * 2^23: (i + _MAGIC) read as f32 is 1.5 * 2^23 + i, |i| < 2^22
_MAGIC_F = 12582912.0


def quantize_int8(x: jax.Array, axes) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 quantization: x ~ values * scale with scale = max|x| / 127 over ``axes``
  (kept as size-1 dims; 1 where x is all zero).  -> (values int8, scale f32)."""
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
  sc = jnp.where(amax > 0, amax / 127.0, 1.0)
  return jnp.clip(jnp.round(xf / sc), -127, 127).astype(jnp.int8), sc


def _int8_q(q):
  """q [Hq, T, d] -> int8 values, scale [Hq, T, 1]: one scale per (head, token) row."""
  return quantize_int8(q, (-1,))


def _int8_c(centroids):
  """centroids [H, C, d] -> int8 values, scale [H, 1, 1]: one scale per head."""
  return quantize_int8(centroids, (1, 2))


def quantized_inputs(q: jax.Array, *centroids: jax.Array) -> tuple[jax.Array, ...]:
  """What ``prefill_int8`` computes with, as f32: q [Hq, T, d] per (head, token) row and each
  centroid array [H, C, d] per head, quantized to int8 and scaled back.  -> (q, *centroids)."""
  return tuple(v * sc for v, sc in (_int8_q(q), *map(_int8_c, centroids)))


def _logits(q, c, mult, int8, bias=None, fused=False):
  """[Bt, Bc] logits in log2 units: ``q.C * mult`` (mult: a scalar, or [Bt] per row), minus ``bias`` [Bt]
  per row when given.  ``int8``: q, c are int8 and the int32 dot is converted to f32 (``"cvt"``) or read
  through the magic bits (``"magic"``: one integer add, and the subtraction folded into the multiply-add).
  ``fused``: the multiply and the bias as one ``_common.fma`` per element (XLA's Triton pipeline does not
  contract them); the same values off the GPU."""
  acc = plgpu.dot(q, c, trans_b=True)
  shape = acc.shape
  m = mult if int8 is None else mult[:, None]
  if int8 == "magic":
    acc = lax.bitcast_convert_type(acc + jnp.int32(_MAGIC), jnp.float32)   # 1.5 * 2^23 + acc, exactly
    off = (_MAGIC_F * mult)[:, None]
  else:
    acc = acc if int8 is None else acc.astype(jnp.float32)
    off = None
  # "magic": the large offset first (folding the bias into it would round the bias away)
  sub = off if off is not None else None if bias is None else bias[:, None]
  if sub is None:
    x = acc * m
  elif fused:
    x = cm.fma(acc, jnp.broadcast_to(m, shape), jnp.broadcast_to(-sub, shape))
  else:
    x = acc * m - sub
  return x - bias[:, None] if off is not None and bias is not None else x


# The prefill kernels' tiling when none is given (decode: ``CentroidLookupConfig()``): the
# fastest of the tilings swept on an H200 at 512K / 4K tokens (``python -m
# benchmarks.lookup_sweep``; benchmarks/results/gpu_h200_lookup_sweep/exp2): 5.38 ms against
# 10.16 ms for the first kernels with one 64 x 128 tiling of both passes.
# The Triton passes stay the default: across seven H200 commands at that size the Mosaic GPU passes
# measured 0.85-1.00x their time for one level, 0.91-1.00x for a bounded level 2 and 1.02-1.04x
# for the whole hierarchical lookup (timed in two of them; benchmarks/results/gpu_h200_mosaic_lookup).
# The statistics pass anchored on each row's first block (``stats_anchor="rows"``): 4-5% less lookup
# time for one level, 3-4% for the hierarchical lookup, on an H100 (benchmarks/results/gpu_h100_stats_anchor).
DEFAULT_PREFILL = CentroidLookupConfig(block_c=128, block_t=128, num_warps=4, num_stages=2, tile_acc=True,
                                       score_block_t=64, score_block_c=128, score_warps=4, stats_anchor="rows")
# The int8 logits (``prefill_int8``; what ``SqueezedConfig.lookup_int8`` selects) with the fastest statistics tiling
# for them: on an H100 at 512K / 4K tokens the hierarchical lookup took 2.72 ms of kernels against 3.35 ms for
# DEFAULT_PREFILL (1-level 3.73 vs 4.70 ms; "cvt" at 128-token statistics blocks 2.83 / 3.97 ms, "magic" slower
# than "cvt"; benchmarks/results/gpu_h100_int8_lookup).
INT8_PREFILL = dataclasses.replace(DEFAULT_PREFILL, prefill_int8="cvt", block_t=64)
# Both take ``exp2_ftz`` (on by default since 2026-11-25): on an H100 at 512K / 4K tokens the hierarchical lookup
# took 2.49-2.50 vs 2.70-2.71 ms (int8) and 3.13 vs 3.35 ms (bf16) of kernels, nearly all of it in the
# statistics passes (level 2: 0.75 vs 0.88 ms int8, 1.01 vs 1.20 ms bf16); the scores were identical
# (benchmarks/results/gpu_h100_ftz_exp2).
# And ``logits_fma`` (on by default since 2026-11-25, see the field): a further 5-8% of lookup time on an H100.


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------
def _load_centroid_block(c_ref, n_ref, *, kv, j, num_c, d, live=None, offsets_l=None,
                         rows_wait_counts=True):
  """Rows ``j`` of KV head ``kv``: (validity, counts, rows).  ``live`` [Bc] bool: the
  rows that may be read at all (default ``j < num_c``); masked loads move no bytes.
  ``offsets_l`` = L: ``n_ref`` holds a cluster-contiguous layout's offsets [Hkv * (C + 1)]
  and the counts are their differences, offsets clipped to [0, L] (as the attention kernel
  reads them).  ``rows_wait_counts``: an empty cluster's row is not read (its load waits for
  the counts); False: rows are read under ``live`` alone and the load does not wait (the
  prefill scoring pass, which loads one block per program: measured 5% faster on an H200,
  benchmarks/results/gpu_h200_prefill_lookup; the decode scoring kernels measured slower)."""
  cv = j < num_c if live is None else live
  row = kv * num_c + j
  if offsets_l is None:
    cnt = cm.gather_vec(n_ref, row, cv, other=0)                  # [Bc] int32
  else:
    base = kv * (num_c + 1) + j
    lo = jnp.clip(cm.gather_vec(n_ref, base, cv, other=0), 0, offsets_l)
    hi = jnp.clip(cm.gather_vec(n_ref, base + 1, cv, other=0), 0, offsets_l)
    cnt = jnp.maximum(hi - lo, 0)
  valid = cv & (cnt > 0)
  c = cm.gather_rows(c_ref, row, d, valid if rows_wait_counts else cv)   # [Bc, d]
  return valid, cnt.astype(jnp.float32), c


def _level1_stats(refs, *, kv, h0, group, r, nb1, nb1p, r2=None):
  """Each head's level-1 softmax statistics from the level-1 decode kernel's block
  outputs: M = max_b m_b, 1 / D with D = sum_b l_b exp(m_b - M).  The group's query
  heads are h0 .. h0 + r - 1; tiles are [r2, ...] (default next_pow2(r): no dot here, no
  padding to 16).  Returns (row in the level-1 group [r2], real head [r2], M [r2], 1/D [r2])."""
  _, _, _, m1_ref, l1_ref, _ = refs
  hr = jnp.arange(r2 or cm.next_pow2(r), dtype=jnp.int32)
  hv = hr < r
  row1 = cm.krem(h0 + hr, group)
  b1 = jnp.arange(nb1p, dtype=jnp.int32)
  bm = (b1[:, None] < nb1) & hv[None, :]
  bi = jnp.where(bm, (kv * nb1 + b1[:, None]) * group + row1[None, :], 0)
  m1 = plgpu.load(m1_ref.at[bi], mask=bm, other=cm.MASK_VALUE)    # [nB1p, r2]
  l1 = plgpu.load(l1_ref.at[bi], mask=bm, other=0.0)
  mx = jnp.max(m1, axis=0)                                        # [r2]
  den = jnp.sum(l1 * jnp.exp(m1 - mx[None, :]), axis=0)
  return row1, hv, mx, jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)


def _level2_live(refs, stats, *, kv, j, num_c, num_p, group, r, nb1, bc1, seg_rows=None):
  """Level-2 rows ``j`` whose parent survives level 1 (Eq. 2 with the group vote:
  S1 = mean over the group's heads of e1 exp(m1_b - M) / D; kept: N1 > 0, S1 >= T1).
  -> [Bc] bool.  ``seg_rows``: the program's r rows vote in segments of that many
  consecutive rows, each its own S1 -> [r2, Bc] bool, each row its segment's survivors.

  refs = (parent [Hkv * C2], n1 [Hkv * C1], e1 [Hkv * nB1 * g * Bc1], m1, l1
  [Hkv * nB1 * g], t1 [1]): the level-1 kernel's raw outputs, read from L2.
  """
  parent_ref, n1_ref, e1_ref, m1_ref, _, t1_ref = refs
  row1, hv, mx, inv = stats
  cv = j < num_c
  par = cm.gather_vec(parent_ref, kv * num_c + j, cv, other=-1)  # [Bc]
  pv = cv & (par >= 0) & (par < num_p)
  pc = jnp.where(pv, par, 0)
  em = hv[:, None] & pv[None, :]                                  # [r2, Bc]
  blk = jnp.where(em, (kv * nb1 + cm.kdiv(pc, bc1))[None, :] * group + row1[:, None], 0)
  e1 = plgpu.load(e1_ref.at[blk * bc1 + cm.krem(pc, bc1)[None, :]], mask=em, other=0.0)
  mb = plgpu.load(m1_ref.at[blk], mask=em, other=0.0)
  w = jnp.where(em, jnp.exp(mb - mx[:, None]) * inv[:, None], 0.0)  # padding rows: M = MASK
  n1 = cm.gather_vec(n1_ref, kv * num_p + pc, pv, other=0)
  ok = pv & (n1 > 0)                                              # [Bc]
  if seg_rows is None:
    s1 = jnp.sum(e1 * w, axis=0) * (1.0 / r)                      # [Bc]
    return ok & (s1 >= t1_ref[0])
  ew = e1 * w                                                     # [r2, Bc] each row's S1 term
  if seg_rows == 1:                                               # vote "q": every row alone
    return em & ok[None, :] & (ew >= t1_ref[0])
  seg = cm.kdiv(jnp.arange(ew.shape[0], dtype=jnp.int32), seg_rows)
  live = jnp.zeros(ew.shape, jnp.bool_)
  for k in range(r // seg_rows):                                  # static: a few segments
    ins = seg == k
    s1 = jnp.sum(jnp.where(ins[:, None], ew, 0.0), axis=0) * (1.0 / seg_rows)   # [Bc]
    live = jnp.where(ins[:, None], (ok & (s1 >= t1_ref[0]))[None, :], live)
  return live & hv[:, None]


def _decode_kernel(q_ref,      # [Hq, d]
                   c_ref,      # [Hkv * C, d]
                   n_ref,      # [Hkv * C] int32
                   *refs,      # (the six Level1Raw inputs)?, e, m, l (, live [G, nB * Bc])
                   scale, num_c, group, r, rp, block_c, d, level1=None, blocks=1, unroll=False,
                   logits=False, offsets_l=None, seg_rows=None):
  """One program per (group, ``blocks`` centroid blocks).  ``level1`` = (nB1, nB1p, Bc1,
  C1): level 2 of a hierarchical lookup; rows are live only where their parent survives
  (computed here from the level-1 kernel's raw outputs) and the live rows are
  reported.  ``blocks`` > 1: a loop (``unroll``: written out) over that many blocks.
  ``logits``: write the scaled logits (MASK off the live rows) as x [G, R, Cx] and the block
  statistics as m, l [G, R, nBp] -- the layout the clustered attention kernel reads -- instead
  of e, m, l [G, nB, R, ...] and the live rows.  ``seg_rows`` (level 2 with ``logits``): the
  program's r rows are segments of that many rows voting apart (``_level2_live``); a block's rows
  live for any segment are loaded once and each query row's logits are MASK off its own."""
  grp = pl.program_id(0)
  pb = pl.program_id(1)
  kv = cm.kdiv(grp * r, group)
  hr = jnp.arange(rp, dtype=jnp.int32)
  hv = hr < r
  q = cm.gather_rows(q_ref, grp * r + hr, d, hv)                  # [rp, d]
  if level1 is not None:
    nb1, nb1p, bc1, num_p = level1
    e_ref, m_ref, l_ref = refs[6:9]
    live_ref = None if logits else refs[9]
    stats = _level1_stats(refs[:6], kv=kv, h0=grp * r, group=group, r=r, nb1=nb1, nb1p=nb1p,
                          r2=rp if seg_rows is not None else None)
  else:
    (e_ref, m_ref, l_ref), live_ref = refs, None

  def one(cb):
    j = cb * block_c + jnp.arange(block_c, dtype=jnp.int32)
    live = rows_live = None
    if level1 is not None:
      live = _level2_live(refs[:6], stats, kv=kv, j=j, num_c=num_c, num_p=num_p, group=group, r=r,
                          nb1=nb1, bc1=bc1, seg_rows=seg_rows)
      if seg_rows is not None:                                    # [rp, Bc]: the union is loaded
        rows_live, live = live, jnp.max(live.astype(jnp.int32), axis=0) > 0
    valid, cnt, c = _load_centroid_block(c_ref, n_ref, kv=kv, j=j, num_c=num_c, d=d, live=live,
                                         offsets_l=offsets_l)
    vm = valid[None, :] if rows_live is None else rows_live & valid[None, :]   # [rp | 1, Bc]
    s = plgpu.dot(q, c, trans_b=True) * scale                     # [rp, Bc] f32
    s = jnp.where(vm, s, cm.MASK_VALUE)
    m = jnp.max(s, axis=1)                                        # [rp]
    e = jnp.where(vm, jnp.exp(s - m[:, None]), 0.0)               # [rp, Bc]
    l = jnp.sum(e * cnt[None, :], axis=1)                         # [rp]
    # Only the r real query rows are stored (outputs are [G, nB, r, ...], or [G, r, ...]).
    if logits:
      plgpu.store(e_ref.at[grp, pl.ds(0, rp), pl.ds(cb * block_c, block_c)], s, mask=hv[:, None])
      plgpu.store(m_ref.at[grp, pl.ds(0, rp), cb], m, mask=hv)
      plgpu.store(l_ref.at[grp, pl.ds(0, rp), cb], l, mask=hv)
      return
    plgpu.store(e_ref.at[grp, cb, pl.ds(0, rp), :], e, mask=hv[:, None])
    plgpu.store(m_ref.at[grp, cb, pl.ds(0, rp)], m, mask=hv)
    plgpu.store(l_ref.at[grp, cb, pl.ds(0, rp)], l, mask=hv)
    if live_ref is not None:
      live_ref[grp, pl.ds(cb * block_c, block_c)] = valid.astype(jnp.int32)

  if blocks == 1:
    one(pb)
  elif unroll:
    for u in range(blocks):
      one(pb * blocks + u)
  else:
    def body(u, carry):
      one(pb * blocks + u)
      return carry
    lax.fori_loop(0, blocks, body, jnp.int32(0))


_ANCHOR_MAX_SUM = 2.0 ** 100   # an anchored sum above this (or NaN) is redone with the running max


def _anchored_stats(start, stop, block, exact, *, tile, ex2=jnp.exp2):
  """The statistics pass's (M, D) with M = the max of the first block's logits (base 2):
  D = sum_j N_j exp2(s_j - M) over blocks [start, stop), no running max.  ``block(b)`` ->
  (valid, counts, logits [Bt, Bc]) of centroid block b.  Falls back to ``exact()`` for the
  whole program when D is not in [0, 2^100] (an overflow, or no valid column in the first
  block: M = MASK)."""
  valid, cnt, s = block(start)
  s = jnp.where((valid[None, :]) & (start < stop), s, cm.MASK_VALUE)
  m = jnp.max(s, axis=1)                                          # [Bt] the anchor
  first = ex2(s - m[:, None]) * cnt[None, :]                      # masked columns: cnt 0 or exp2(-1e30)

  def body(b, acc):
    _, cnt_b, x_b = block(b, m)                                   # s - M
    # invalid columns: cnt 0 (rows read as 0 give exp2(-M), finite unless M < -128: then NaN -> exact)
    p = ex2(x_b) * cnt_b[None, :]
    return acc + p if tile else acc + jnp.sum(p, axis=1)

  acc0 = first if tile else jnp.sum(first, axis=1)
  acc = lax.fori_loop(start + 1, max(stop, start + 1) if isinstance(stop, int) else jnp.maximum(stop, start + 1),
                      body, acc0)
  l = jnp.sum(acc, axis=1) if tile else acc
  bad = jnp.max(jnp.where((l >= 0.0) & (l <= _ANCHOR_MAX_SUM), 0, 1)) > 0   # NaN fails both
  return lax.cond(bad, exact, lambda: (m, l))


def _stats_kernel(q_ref,      # [Hq * T, d]
                  c_ref,      # [Hkv * C, d]
                  n_ref,      # [Hkv * C] int32
                  *refs,      # (row multipliers [Hq * T])?, (n_valid [G])?, m [S, Hq, Tp], l [S, Hq, Tp]
                  scale, seq_len, num_c, group, r, block_t, block_c, d, bounded, splits=1, anchor=None,
                  int8=None, ex2=jnp.exp2, rows_wait=None, fused=False):
  if int8 is not None:
    rm_ref, refs = refs[0], refs[1:]
  if bounded:
    nv_ref, m_ref, l_ref = refs
  else:
    m_ref, l_ref = refs
  tb = pl.program_id(0)   # token blocks fastest: concurrent programs share the centroids
  h = pl.program_id(1)
  z = pl.program_id(2)    # which share of the centroid blocks (bounded calls)
  grp = cm.kdiv(h, r)
  kv = cm.kdiv(h, group)
  t = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
  q = cm.gather_rows(q_ref, h * seq_len + t, d, t < seq_len)      # [Bt, d]
  n = jnp.clip(nv_ref[grp], 0, num_c) if bounded else num_c       # rows [0, n) only
  # base-2 logits: exp2 is the hardware's exp (int8: the row's scales times this, from the caller)
  mult = scale * _LOG2E if int8 is None else cm.gather_vec(rm_ref, h * seq_len + t, t < seq_len, other=0.0)

  rows_wait = (bounded or int8 is None) if rows_wait is None else rows_wait   # see CentroidLookupConfig.stats_rows_wait

  def block(b, bias=None):
    j = b * block_c + jnp.arange(block_c, dtype=jnp.int32)
    valid, cnt, c = _load_centroid_block(c_ref, n_ref, kv=kv, j=j, num_c=num_c, d=d,
                                         live=(j < n) if bounded else None, rows_wait_counts=rows_wait)
    return valid, cnt, _logits(q, c, mult, int8, bias, fused)    # [Bt, Bc] log2 units (minus bias [Bt])

  def body(b, carry):
    m_prev, l_prev = carry
    valid, cnt, s = block(b)
    s = jnp.where(valid[None, :], s, cm.MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # invalid columns: cnt = 0 zeroes them (exp2 of a masked logit is 0 or, while every
    # column so far is masked, 1 times 0)
    p = ex2(s - m_next[:, None])
    # the block's sum first, then the rescale of the running one: this order measured 8% faster
    # for the level-2 pass on an H200 (benchmarks/results/gpu_h200_prefill_lookup)
    lsum = jnp.sum(p * cnt[None, :], axis=1)
    l_next = l_prev * jnp.exp2(m_prev - m_next) + lsum
    return m_next, l_next

  m0 = jnp.full((block_t,), cm.MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((block_t,), jnp.float32)
  if bounded or splits > 1:  # traced trip count: int32 bounds on both ends (see the scoring pass)
    nblk = cm.kcdiv(n, block_c) if bounded else jnp.int32(cm.cdiv(num_c, block_c))
    chunk = cm.kcdiv(nblk, splits)
    start = (z * chunk).astype(jnp.int32)
    stop = jnp.maximum(jnp.minimum(start + chunk, nblk), start).astype(jnp.int32)
  else:   # static trip count
    start, stop = 0, cm.cdiv(num_c, block_c)

  def exact():
    return lax.fori_loop(start, stop, body, (m0, l0))

  if anchor is None:
    m, l = exact()
  else:
    m, l = _anchored_stats(start, stop, block, exact, tile=anchor == "tile", ex2=ex2)
  m_ref[z, h, pl.ds(tb * block_t, block_t)] = m
  l_ref[z, h, pl.ds(tb * block_t, block_t)] = l


def _score_kernel(q_ref,      # [Hq * T, d]
                  c_ref,      # [Hkv * C, d]
                  n_ref,      # [Hkv * C] int32
                  ms_ref,     # [Hq, Tp] f32 (kernel A)
                  ls_ref,     # [Hq, Tp] f32 (kernel A)
                  *refs,      # (row multipliers [Hq * T])?, (n_valid [G])?, out [G, splits, nB * Bc]
                  scale, seq_len, num_c, group, r, n_tb, block_t, block_c, d, bounded,
                  tile_acc=False, splits=1, int8=None, ex2=jnp.exp2, clamp=True, contiguous=False, fused=False):
  # clamp: exp2's argument capped at 0 (a valid column's is <= 0 up to rounding; padded columns are zeroed after
  # the loop).  Without it the 1-level lookup measured the same with the same scores (H100,
  # gpu_h100_ftz_exp2/clamp_prefill_f5d0951; that run's hierarchical rows hit a jit cache and compare nothing).
  # contiguous (seq_len % block_t == 0 only): each token block's q rows and multipliers as one aligned slice instead
  # of the masked row gather.  Measured within ~2% either way (hierarchical -0.5%, 1-level bf16 -2.2% / int8
  # +1.3%, H100, gpu_h100_ftz_exp2/contiguous_int8_99ab83d), so the gather stays; kept for sweeps on other GPUs.
  if contiguous and seq_len % block_t:
    raise ValueError(f"contiguous q loads need seq_len % block_t == 0, got {seq_len} % {block_t}")
  rm_ref = None
  if int8 is not None:
    rm_ref, refs = refs[0], refs[1:]
  (nv_ref, o_ref) = refs if bounded else (None, refs[0])
  cb = pl.program_id(0)   # centroid blocks fastest: concurrent programs share the queries
  grp = pl.program_id(1)
  z = pl.program_id(2)    # which share of the (head, token block) tiles this program sums
  kv = cm.kdiv(grp * r, group)
  j = cb * block_c + jnp.arange(block_c, dtype=jnp.int32)
  n = jnp.clip(nv_ref[grp], 0, num_c) if bounded else num_c
  valid, _, c = _load_centroid_block(c_ref, n_ref, kv=kv, j=j, num_c=num_c, d=d,
                                     live=(j < n) if bounded else None,
                                     rows_wait_counts=False)    # c: [Bc, d]
  scale2 = scale * _LOG2E   # the statistics pass's base-2 units

  def body(it, acc):
    rr = cm.kdiv(it, n_tb)
    tb = cm.krem(it, n_tb)
    h = grp * r + rr
    t = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
    tv = t < seq_len
    row0 = pl.multiple_of(h * seq_len + tb * block_t, block_t) if contiguous else None
    q = q_ref[pl.ds(row0, block_t), :] if contiguous else cm.gather_rows(q_ref, h * seq_len + t, d, tv)  # [Bt, d]
    mt = ms_ref[h, pl.ds(tb * block_t, block_t)]                  # [Bt]
    lt = ls_ref[h, pl.ds(tb * block_t, block_t)]
    # Eq. 1 normalised in the exponent: exp2(s - M - log2 D) = exp2(s - M) / D, no multiply
    # per element (D >= 1: the max column counts N >= 1).  Padding tokens and D = 0: exp2 of
    # -1e30 = 0.
    ok = tv & (lt > 0)
    mt = jnp.where(ok, mt + jnp.log2(jnp.where(ok, lt, 1.0)), -cm.MASK_VALUE)
    mult = (scale2 if rm_ref is None else rm_ref[pl.ds(row0, block_t)] if contiguous
            else cm.gather_vec(rm_ref, h * seq_len + t, tv, other=0.0))
    x = _logits(q, c, mult, int8, mt, fused)                      # [Bt, Bc] s - M - log2 D
    p = ex2(jnp.minimum(x, 0.0) if clamp else x)                  # invalid columns: zeroed below
    if tile_acc:
      return acc + p                                                # [Bt, Bc]
    return acc + jnp.sum(p, axis=0)

  # a block past the group's bound does no work (its output is zero)
  active = cb * block_c < n
  total = r * n_tb
  chunk = cm.cdiv(total, splits)
  # explicit int32 bounds: a Python-int branch of jnp.where lowers to a different integer
  # type than the loop's lower bound and Triton rejects the scf.for (seen on H200)
  start = (z * chunk).astype(jnp.int32)
  stop = jnp.where(active, jnp.minimum(start + chunk, jnp.int32(total)), start).astype(jnp.int32)
  acc0 = jnp.zeros((block_t, block_c) if tile_acc else (block_c,), jnp.float32)
  acc = lax.fori_loop(start, jnp.maximum(stop, start), body, acc0)
  if tile_acc:
    acc = jnp.sum(acc, axis=0)
  acc = jnp.where(valid, acc, 0.0)   # once per program instead of once per tile
  o_ref[grp, z, pl.ds(cb * block_c, block_c)] = acc * (1.0 / (r * seq_len))


# ----------------------------------------------------------------------------
# Builders (shared with hierarchical_lookup).
# ----------------------------------------------------------------------------
def _flat_inputs(centroids, counts, d_pad):
  hkv, num_c, d = centroids.shape
  c = cm.pad_axis(centroids, 2, d_pad).reshape(hkv * num_c, d_pad)
  return c, counts.reshape(hkv * num_c)


class Level1Raw(NamedTuple):
  """The level-1 decode kernel's raw outputs (``lookup_decode_raw`` over the level-1
  centroids with one group per KV head), from which the level-2 decode kernel decides
  itself which rows are live: Eq. 2 with the group vote and ``S1 >= T1``."""
  e: jax.Array        # [Hkv, nB1, g, Bc1] f32 exp(s q.C1 - m_b)
  m: jax.Array        # [Hkv, nB1, g] f32 block maxima
  l: jax.Array        # [Hkv, nB1, g] f32 block denominators
  counts: jax.Array   # [Hkv, C1] int32 N1
  parent: jax.Array   # [Hkv, C2] int32 level-1 parent of each level-2 centroid
  t1: jax.Array       # [] f32


def lookup_decode_raw(q, centroids, counts, level1, *, scale, groups, cfg, backend, logits_cols=None,
                      offsets_l=None):
  """The decode kernel: (e [G, nB, R, Bc], m [G, nB, R], l [G, nB, R], live [G, nB * Bc]
  int32 or None).  ``level1``: None, or a ``Level1Raw`` (level 2 of a hierarchical
  lookup: only rows whose parent survives are read, and ``live`` reports them).

  ``logits_cols`` (level 2 only): instead, (x [G, R, >= logits_cols] scaled logits, MASK off the
  live rows, m, l [G, R, nBp] block statistics, nB): the inputs of the clustered attention
  kernel, which then forms Eq. 3 and votes itself.  Here the rows of ``cfg.level2_rows // R``
  groups of one KV head may share a program (the groups' row order kept: reshape the outputs
  to [Hkv, Hq / Hkv, ...]).  ``offsets_l`` = L: ``counts`` is a
  cluster-contiguous layout's offsets [Hkv, C + 1] (rows in [0, L)), the counts their differences."""
  hq, d = q.shape
  hkv, num_c, _ = centroids.shape
  r = hq // groups
  dp = cm.padded_head_dim(d)
  block_c = min(cfg.block_c, max(16, cm.next_pow2(num_c)))
  blocks = cfg.level2_blocks if level1 is not None else 1
  nb = cm.cdiv(cm.cdiv(num_c, block_c), blocks) * blocks      # padded blocks hold no row
  if offsets_l is None:
    c_flat, n_flat = _flat_inputs(centroids, counts, dp)
  else:
    c_flat, n_flat = cm.pad_axis(centroids, 2, dp).reshape(hkv * num_c, dp), counts.reshape(-1)
  logits = logits_cols is not None
  if logits and (level1 is None or blocks != 1):
    raise ValueError("logits_cols is for level 2 with one block per program")
  seg_rows = None
  if logits and r < hq // hkv and cfg.level2_rows > r:
    # whole vote segments of a KV head's rows share a program (each its own survivors)
    per_kv = hq // hkv // r                                     # segments per KV head
    k = max(u for u in range(1, per_kv + 1) if per_kv % u == 0 and u * r <= cfg.level2_rows)
    if k > 1:
      seg_rows, r, groups = r, r * k, groups // k
  rp = max(16, cm.next_pow2(r))
  nbp = max(16, cm.next_pow2(nb))
  outs = [
      jax.ShapeDtypeStruct((groups, nb, r, block_c), jnp.float32),    # e
      jax.ShapeDtypeStruct((groups, nb, r), jnp.float32),             # m_b
      jax.ShapeDtypeStruct((groups, nb, r), jnp.float32),             # l_b
  ] if not logits else [
      jax.ShapeDtypeStruct((groups, r, max(logits_cols, nb * block_c)), jnp.float32),   # x
      jax.ShapeDtypeStruct((groups, r, nbp), jnp.float32),            # m_b
      jax.ShapeDtypeStruct((groups, r, nbp), jnp.float32),            # l_b
  ]
  extra, lv = [], None
  if level1 is not None:
    nb1, bc1 = level1.e.shape[1], level1.e.shape[3]
    lv = (nb1, max(16, cm.next_pow2(nb1)), bc1, level1.counts.shape[1])
    extra = [level1.parent.reshape(-1), level1.counts.reshape(-1), level1.e.reshape(-1),
             level1.m.reshape(-1), level1.l.reshape(-1), jnp.asarray(level1.t1, jnp.float32).reshape(1)]
    if not logits:
      outs.append(jax.ShapeDtypeStruct((groups, nb * block_c), jnp.int32))   # live rows
  kernel = functools.partial(
      _decode_kernel, scale=scale, num_c=num_c, group=hq // hkv, r=r, rp=rp,
      block_c=block_c, d=dp, level1=lv, blocks=blocks, unroll=cfg.level2_unroll, logits=logits,
      offsets_l=offsets_l, seg_rows=seg_rows)
  res = pallas_call(
      kernel, backend=backend, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      grid=(groups, nb // blocks), out_shape=outs,
      name="centroid_lookup_decode" if level1 is None else "centroid_lookup_decode_level2",
  )(cm.pad_axis(q, 1, dp), c_flat, n_flat, *extra)
  if logits:
    return (*res, nb)
  return (*res, None) if len(res) == 3 else tuple(res)


def decode_scores_from_raw(e, m, l, num_c):
  """Second, cheap reduction across centroid blocks (fused by XLA): S [G, R, C]."""
  groups, nb, r, block_c = e.shape
  mx = jnp.max(m, axis=1, keepdims=True)                          # [G, 1, r]
  w = jnp.exp(m - mx)                                             # [G, nB, r]
  den = jnp.sum(l * w, axis=1, keepdims=True)                     # D
  f = jnp.where(den > 0, w / jnp.where(den > 0, den, 1.0), 0.0)
  s = e * f[..., None]                                            # [G, nB, r, Bc]
  s = jnp.transpose(s, (0, 2, 1, 3)).reshape(groups, r, nb * block_c)
  return s[:, :, :num_c]


def lookup_decode_scores(q, centroids, counts, *, scale, groups, cfg, backend):
  """Per-head Eq. 1 scores, one query token; grid (group x centroid block).

  q [Hq, d]; centroids [Hkv, C, d]; counts [Hkv, C] int32.
  Returns S [G, R, C] f32 (R = Hq // G); 0 for empty clusters.
  """
  e, m, l, _ = lookup_decode_raw(q, centroids, counts, None, scale=scale, groups=groups, cfg=cfg,
                                 backend=backend)
  return decode_scores_from_raw(e, m, l, centroids.shape[1])


def prefill_block_c(cfg: CentroidLookupConfig, num_c: int, seq_len: int) -> tuple[int, int, int, int]:
  """(statistics Bc, Bt, scoring Bc, Bt) that ``lookup_prefill_scores`` uses for these sizes."""
  fit_c = lambda b: min(b, max(16, cm.next_pow2(num_c)))            # noqa: E731
  fit_t = lambda b: min(b, max(16, cm.next_pow2(seq_len)))          # noqa: E731
  return (fit_c(cfg.block_c), fit_t(cfg.block_t), fit_c(cfg.score_block_c or cfg.block_c),
          fit_t(cfg.score_block_t or cfg.block_t))


def lookup_prefill_scores(q, centroids, counts, n_valid=None, *, scale, groups, cfg, backend, q_valid=None,
                          q_int8=None, c_int8=None):
  """Eq. 1 scores averaged over the T tokens and the R heads of each group.

  q [Hq, T, d]; centroids [Hkv, C, d]; counts [Hkv, C]; n_valid [G] int32 or None: only
  rows ``[0, n_valid[g])`` of group g's centroids take part (both passes stop there:
  a compacted candidate set costs its size, not C).  q_valid [T] bool or None: the mean
  is over these tokens only (a left-padded question block): the statistics pass's
  denominator of a padding token is set to 0, which the scoring pass reads as "no
  contribution", and the sum is divided by the number of valid tokens instead of T (always
  the Triton passes: the Mosaic ones take no mask).
  q_int8 / c_int8: with an int8 config, ``_int8_q(q)`` / ``_int8_c(centroids)`` made by the caller
  (a hierarchical lookup quantizes q once for both levels, and the level-2 centroids before it
  gathers the candidates); ``centroids`` may then be the int8 values.
  Returns avg [G, C] f32 (0 for empty clusters and rows past the bound).
  """
  hq, seq_len, d = q.shape
  hkv, num_c, _ = centroids.shape
  if q_valid is None and _mosaic_engine(cfg, q, centroids, backend):
    return lookup_prefill_scores_mosaic(q, centroids, counts, n_valid, scale=scale, groups=groups,
                                        cfg=cfg.mosaic or DEFAULT_MOSAIC, interpret=backend == "interpret")
  r = hq // groups
  dp = cm.padded_head_dim(d)
  bc_a, bt_a, bc_b, bt_b = prefill_block_c(cfg, num_c, seq_len)
  t_pad = cm.cdiv(seq_len, max(bt_a, bt_b)) * max(bt_a, bt_b)     # m, l rows: both passes' blocks fit
  nb = cm.cdiv(num_c, bc_b)
  extra = [] if n_valid is None else [n_valid.astype(jnp.int32)]
  if cfg.prefill_int8 is None:
    c_flat, n_flat = _flat_inputs(centroids, counts, dp)
    q_flat = cm.pad_axis(q, 2, dp).reshape(hq * seq_len, dp)
  else:   # int8 rows; each query row's multiplier = its scale x its head's centroid scale x log2(e) scale
    qi, qs = _int8_q(q) if q_int8 is None else q_int8            # [Hq, T, d], [Hq, T, 1]
    ci, cs = _int8_c(centroids) if c_int8 is None else c_int8    # [H, C, d], [H, 1, 1]
    c_flat, n_flat = _flat_inputs(ci, counts, dp)
    q_flat = cm.pad_axis(qi, 2, dp).reshape(hq * seq_len, dp)
    mult = qs[..., 0] * jnp.repeat(cs[:, :, 0], hq // hkv, axis=0) * (scale * _LOG2E)
    extra = [mult.reshape(hq * seq_len)] + extra
  int8 = cfg.prefill_int8
  if int8 == "magic" and 127 * 127 * dp >= 2 ** 22:   # the magic bits hold |dot| < 2^22 only (d <= 256)
    int8 = "cvt"
  common = dict(scale=scale, seq_len=seq_len, num_c=num_c, group=hq // hkv, r=r, d=dp,
                bounded=n_valid is not None, int8=int8, ex2=cm.exp2_ftz if cfg.exp2_ftz else jnp.exp2,
                fused=cfg.logits_fma)
  ssplits = stats_splits(cfg, (t_pad // bt_a) * hq, cm.cdiv(num_c, bc_a), n_valid is not None)
  m, l = pallas_call(
      functools.partial(_stats_kernel, block_t=bt_a, block_c=bc_a, splits=ssplits, anchor=cfg.stats_anchor,
                        rows_wait=cfg.stats_rows_wait, **common),
      backend=backend, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      grid=(t_pad // bt_a, hq, ssplits),
      out_shape=[jax.ShapeDtypeStruct((ssplits, hq, t_pad), jnp.float32)] * 2,
      name="centroid_lookup_stats",
  )(q_flat, c_flat, n_flat, *extra)
  if ssplits == 1:
    m, l = m[0], l[0]
  else:  # combine the shares' (max, denominator), base-2 units
    mx = jnp.max(m, axis=0)
    l = jnp.sum(l * jnp.exp2(m - mx[None]), axis=0)
    m = mx
  if q_valid is not None:  # padding tokens: D = 0, the scoring pass skips them
    l = jnp.where(cm.pad_axis(q_valid, 0, t_pad, False)[None, :], l, 0.0)
  n_tb = cm.cdiv(seq_len, bt_b)
  splits = score_splits(cfg, nb * groups, r * n_tb, n_valid is not None)
  avg = pallas_call(
      functools.partial(_score_kernel, n_tb=n_tb, tile_acc=cfg.tile_acc, splits=splits,
                        block_t=bt_b, block_c=bc_b, **common), backend=backend,
      num_warps=cfg.score_warps or cfg.num_warps, num_stages=cfg.num_stages,
      grid=(nb, groups, splits),
      out_shape=jax.ShapeDtypeStruct((groups, splits, nb * bc_b), jnp.float32),
      name="centroid_lookup_scores",
  )(q_flat, c_flat, n_flat, m, l, *extra)
  avg = jnp.sum(avg, axis=1)[:, :num_c]
  if q_valid is not None:  # the kernel divided by T
    avg = avg * (seq_len / jnp.maximum(jnp.sum(q_valid.astype(jnp.float32)), 1.0))
  return avg


def mosaic_applies(dtype, d: int, backend: str) -> bool:
  """Whether the Mosaic GPU passes run compiled here: ``backend="pallas"`` on a Hopper GPU, with
  inputs they take (bf16/f16, d % 64 == 0).  What ``prefill_engine="auto"`` picks them by."""
  return backend == "pallas" and mosaic_supported(dtype, d) and is_hopper()


def _mosaic_engine(cfg: CentroidLookupConfig, q, centroids, backend: str) -> bool:
  """Whether ``lookup_prefill_scores`` runs the Mosaic GPU passes (see ``prefill_engine``)."""
  ok = mosaic_supported(q.dtype, q.shape[-1]) and centroids.dtype == q.dtype
  if cfg.prefill_engine == "triton" or cfg.prefill_int8 is not None:
    return False
  if cfg.prefill_engine == "auto":
    return ok and mosaic_applies(q.dtype, q.shape[-1], backend)
  if not ok:
    raise ValueError(f"prefill_engine='mosaic' takes bf16/f16 q and centroids of one dtype with d % 64 == 0;"
                     f" got q {q.dtype} {q.shape}, centroids {centroids.dtype}; use 'triton' or 'auto'")
  if backend == "pallas" and not is_hopper():
    raise ValueError("prefill_engine='mosaic' needs a Hopper GPU (wgmma, TMA); use 'triton' or 'auto'")
  return True


STATS_PROGRAMS = 256   # the statistics pass's automatic splits aim at about this many programs


def stats_splits(cfg: CentroidLookupConfig, programs: int, blocks: int, bounded: bool) -> int:
  """Shares of the centroid blocks per (token block, head) in the statistics pass: the
  configured number, else 2 for a bounded call and, when the (token block, head) grid has
  fewer than ``STATS_PROGRAMS`` programs (a short block), enough to reach about that many
  (at most one block per share)."""
  if cfg.stats_splits is not None:
    return cfg.stats_splits
  auto = cm.cdiv(STATS_PROGRAMS, programs) if programs < STATS_PROGRAMS else 1
  return max(2 if bounded else 1, min(auto, blocks))


def score_splits(cfg: CentroidLookupConfig, programs: int, tiles: int, bounded: bool) -> int:
  """How many programs share one centroid block's (head, token block) tiles in the scoring
  pass.  ``cfg.score_splits`` if set; else enough for ~1024 programs (8192 for a bounded,
  compacted candidate set, where most of the grid is past the bound and exits at once),
  so that a few centroid blocks (a level-1 pass, a hierarchical level 2) still fill the GPU."""
  if cfg.score_splits is not None:
    return max(1, min(cfg.score_splits, tiles))
  return max(1, min(tiles, (8192 if bounded else 1024) // max(programs, 1)))


# ----------------------------------------------------------------------------
# Validation and public API.
# ----------------------------------------------------------------------------
def _validate(q, centroids, counts, threshold, vote, q_rank):
  shapes = cm.shape_str(q=q, centroids=centroids, counts=counts)
  if q.ndim != q_rank:
    want = "[Hq, T, d]" if q_rank == 3 else "[Hq, d]"
    raise ValueError(f"q must be {want}; got {shapes}")
  if centroids.ndim != 3 or counts.shape != centroids.shape[:2]:
    raise ValueError(f"centroids must be [Hkv, C, d] and counts [Hkv, C]; got {shapes}")
  if q.shape[-1] != centroids.shape[2]:
    raise ValueError(f"head dims differ; got {shapes}")
  if q_rank == 3 and q.shape[1] < 1:
    raise ValueError(f"need at least one query token; got {shapes}")
  if centroids.shape[1] < 1:
    raise ValueError(f"need at least one centroid slot; got {shapes}")
  cm.check_heads(q.shape[0], centroids.shape[0], shapes)
  cm.check_float("q", q)
  cm.check_same_dtype(q=q, centroids=centroids)
  cm.check_int32("counts", counts)
  cm.check_vote(vote)
  if jnp.ndim(threshold) != 0:
    raise ValueError(f"threshold must be a scalar, got shape {jnp.shape(threshold)}")


def _finish(scores, counts, threshold, vote, hq):
  """scores [Hs, C] -> (selected, scores) with invalid clusters zeroed/unselected."""
  hkv = counts.shape[0]
  valid = counts > 0
  if vote == "q":
    valid = jnp.repeat(valid, hq // hkv, axis=0)
  scores = jnp.where(valid, scores, 0.0)
  selected = valid & (scores > jnp.asarray(threshold, jnp.float32))
  return selected, scores


@cm.static_jit(("scale", "vote", "reduce_stats"))
def centroid_lookup_reference(q, centroids, counts, threshold, *, scale, vote="kv",
                              reduce_stats=None, q_valid=None):
  """Plain-jnp Eq. 1.  q [Hq, T, d] (prefill: mean over T, or over the tokens q_valid [T]
  marks) or [Hq, d] (decode).

  ``reduce_stats`` (optional, static): maps this call's softmax statistics
  ``(max, denominator)`` [Hkv, g, T, 1] to the global ones (e.g. combined over the
  devices holding other slices of the context), so that ``S`` is normalised by
  the denominator of Eq. 1 over *all* clusters.

  Returns (selected [Hs, C] bool, scores [Hs, C] f32).
  """
  if q.ndim == 2:
    q = q[:, None, :]
  hq, seq_len, d = q.shape
  hkv, num_c, _ = centroids.shape
  g = hq // hkv
  qf = q.astype(jnp.float32).reshape(hkv, g, seq_len, d)
  logits = scale * jnp.einsum("kgtd,kcd->kgtc", qf, centroids.astype(jnp.float32))
  valid = (counts > 0)[:, None, None, :]
  logits = jnp.where(valid, logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.where(valid, jnp.exp(logits - mx), 0.0)
  den = jnp.sum(e * counts[:, None, None, :].astype(jnp.float32), axis=-1, keepdims=True)
  if reduce_stats is not None:
    mx, den = reduce_stats(mx, den)
    e = jnp.where(valid, jnp.exp(logits - mx), 0.0)
  s = jnp.where(den > 0, e / jnp.where(den > 0, den, 1.0), 0.0)   # [Hkv, g, T, C]
  s = cm.token_mean(s, q_valid, axis=2)
  s = jnp.mean(s, axis=1) if vote == "kv" else s.reshape(hq, num_c)
  return _finish(s, counts, threshold, vote, hq)


@cm.static_jit(("scale", "vote", "backend", "config"))
def centroid_lookup_prefill(
    q: jax.Array,            # [Hq, T, d]
    centroids: jax.Array,    # [Hkv, C, d]
    counts: jax.Array,       # [Hkv, C] int32 (N_i; 0 = empty / padding cluster)
    threshold: jax.Array,    # [] f32 (traced)
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
    q_valid: jax.Array | None = None,   # [T] bool: the block's real tokens (None: all)
) -> tuple[jax.Array, jax.Array]:
  """Prefill centroid lookup: Eq. 1 averaged over the T query tokens (those ``q_valid`` marks).

  ``scores[s, i] = mean_{h in group(s)} mean_t S_i(q[h, t])`` and
  ``selected = (scores > threshold) & (counts > 0)``.  ``vote="kv"``: Hs = Hkv,
  group(s) = the g query heads of KV head s; ``vote="q"``: Hs = Hq, group(h) = {h}.

  Returns (selected [Hs, C] bool, scores [Hs, C] f32).
  """
  _validate(q, centroids, counts, threshold, vote, 3)
  cm.check_token_valid(q_valid, q.shape[1])
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  cfg = config or DEFAULT_PREFILL
  if be == "reference":
    if cfg.prefill_int8 is not None:   # the kernels' arithmetic: the scores of the int8 inputs
      q, centroids = quantized_inputs(q, centroids)
    return centroid_lookup_reference(q, centroids, counts, threshold, scale=scale, vote=vote, q_valid=q_valid)
  hq = q.shape[0]
  hs = cm.num_selection_heads(hq, centroids.shape[0], vote)
  avg = lookup_prefill_scores(q, centroids, counts, scale=scale, groups=hs,
                              cfg=cfg, backend=be, q_valid=q_valid)
  return _finish(avg, counts, threshold, vote, hq)


@cm.static_jit(("scale", "vote", "backend", "config"))
def centroid_lookup_decode(
    q: jax.Array,            # [Hq, d]
    centroids: jax.Array,    # [Hkv, C, d]
    counts: jax.Array,       # [Hkv, C] int32
    threshold: jax.Array,    # [] f32 (traced)
    *,
    scale: float,
    vote: str = "kv",
    backend: str = "auto",
    config: CentroidLookupConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Decode centroid lookup for one query token (Eq. 1, App. D single-pass form).

  ``vote="kv"``: ``scores[s] = mean over the g heads of KV head s of S``;
  ``vote="q"``: one row per query head.  Returns (selected [Hs, C] bool,
  scores [Hs, C] f32) with ``selected = (scores > threshold) & (counts > 0)``.
  """
  _validate(q, centroids, counts, threshold, vote, 2)
  scale = cm.check_scale(scale)
  be = resolve_backend(backend)
  if be == "reference":
    return centroid_lookup_reference(q, centroids, counts, threshold, scale=scale, vote=vote)
  cfg = config or CentroidLookupConfig()
  hq = q.shape[0]
  hkv, num_c, _ = centroids.shape
  # Programs per (KV head, centroid block): each centroid row is read once for the group.
  s = lookup_decode_scores(q, centroids, counts, scale=scale, groups=hkv,
                           cfg=cfg, backend=be)                   # [Hkv, g, C]
  s = jnp.mean(s, axis=1) if vote == "kv" else s.reshape(hq, num_c)
  return _finish(s, counts, threshold, vote, hq)
