"""Every kernel lowers to Triton IR for an H100 (no GPU needed).

This runs the Pallas -> Triton MLIR lowering that ``backend="pallas"`` uses on a
GPU (power-of-two tile shapes, supported primitives, gathers, masked loads,
scalar work-table reads, dynamic loops), at the benchmark's Llama-3-8B head
shapes.  It does not run Triton's own compiler passes or the kernels: the GPU
script checks those.
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import gpu_info, pallas_call_registration as registration

from pallas_kernels import _dispatch
from pallas_kernels.centroid_lookup import centroid_lookup_decode, centroid_lookup_prefill
from pallas_kernels.hierarchical_lookup import (hierarchical_lookup_decode,
                                                hierarchical_lookup_prefill)
from pallas_kernels.quest import quest_decode_attention, quest_page_scores
from pallas_kernels.saap_attention import saap_attention
from pallas_kernels.sparse_attention import gather_live_rows, sparse_attention

HQ, HKV, D, L, S = 32, 8, 128, 4096, 64
BF = jnp.bfloat16


@pytest.fixture(autouse=True)
def fake_h100(monkeypatch):
  monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                      lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100))


def lower(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  return text


def sds(shape, dtype=BF):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_centroid_lookup_lowers(vote):
  c, n = sds((HKV, 205, D)), sds((HKV, 205), jnp.int32)
  lower(lambda q, c, n: centroid_lookup_prefill(q, c, n, jnp.float32(0.1), scale=D ** -0.5,
                                                vote=vote, backend="pallas"),
        sds((HQ, 100, D)), c, n)
  lower(lambda q, c, n: centroid_lookup_decode(q, c, n, jnp.float32(0.1), scale=D ** -0.5,
                                               vote=vote, backend="pallas"),
        sds((HQ, D)), c, n)


@pytest.mark.parametrize("seq_len,hs", [(1, HKV), (1, HQ), (100, HKV), (100, HQ)])
def test_sparse_attention_lowers(seq_len, hs):
  lower(lambda *a: sparse_attention(*a, scale=D ** -0.5, backend="pallas"),
        sds((HQ, seq_len, D)), sds((HKV, L, D)), sds((HKV, L, D)), sds((hs, 500), jnp.int32),
        sds((hs,), jnp.int32), sds((HKV, S, D)), sds((HKV, S, D)), sds((seq_len,), jnp.int32),
        sds((S,), jnp.int32))


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_hierarchical_lookup_lowers(vote):
  args = (sds((HKV, 41, D)), sds((HKV, 41), jnp.int32), sds((HKV, 205, D)),
          sds((HKV, 205), jnp.int32), sds((HKV, 205), jnp.int32))
  for q, fn in ((sds((HQ, 100, D)), hierarchical_lookup_prefill),
                (sds((HQ, D)), hierarchical_lookup_decode)):
    lower(lambda q, *a, fn=fn: fn(q, *a, jnp.float32(0.01), jnp.float32(0.01), scale=D ** -0.5,
                                  vote=vote, backend="pallas"), q, *args)


@pytest.mark.parametrize("unroll", [False, True])
def test_hierarchical_decode_blocks_per_program_lowers(unroll):
  from pallas_kernels import CentroidLookupConfig
  cfg = CentroidLookupConfig(level2_blocks=4, level2_unroll=unroll)
  args = (sds((HKV, 41, D)), sds((HKV, 41), jnp.int32), sds((HKV, 205, D)),
          sds((HKV, 205), jnp.int32), sds((HKV, 205), jnp.int32))
  lower(lambda q, *a: hierarchical_lookup_decode(q, *a, jnp.float32(0.01), jnp.float32(0.01), scale=D ** -0.5,
                                                 backend="pallas", config=cfg), sds((HQ, D)), *args)


def test_quest_lowers():
  for vote in ("kv", "q"):
    lower(lambda q, a, b: quest_page_scores(q, a, b, vote=vote, backend="pallas"),
          sds((HQ, D)), sds((HKV, L // 16, D)), sds((HKV, L // 16, D)))
  lower(lambda *a: quest_decode_attention(*a, scale=D ** -0.5, backend="pallas"),
        sds((HQ, D)), sds((HKV, L, D)), sds((HKV, L, D)), sds((HKV, 32), jnp.int32),
        sds((HKV, S, D)), sds((HKV, S, D)), sds((1,), jnp.int32), sds((S,), jnp.int32))


def test_saap_lowers():
  lower(lambda *a: saap_attention(*a, scale=D ** -0.5, n_sink=1, n_recent=255,
                                  backend="pallas"),
        sds((HQ, D)), sds((HKV, L, D)), sds((HKV, L, D)), sds((HKV, 65), jnp.int32),
        sds((HKV, L), jnp.int32), sds((HKV, 8), jnp.int32), sds((HKV, S, D)), sds((HKV, S, D)),
        sds((1,), jnp.int32), sds((S,), jnp.int32))


@pytest.mark.parametrize("seq_len", [1, 64])
def test_dense_decode_lowers(seq_len):
  from pallas_kernels.dense_attention import dense_decode_attention
  lower(lambda *a: dense_decode_attention(*a, scale=D ** -0.5, backend="pallas"),
        sds((HQ, seq_len, D)), sds((HKV, L, D)), sds((HKV, L, D)), sds((HKV, S, D)), sds((HKV, S, D)),
        sds((seq_len,), jnp.int32), sds((S,), jnp.int32))


@pytest.mark.parametrize("hs,splits", [(HKV, 1), (HQ, 1), (HKV, 4)])
def test_gather_live_rows_lowers(hs, splits):
  lower(lambda k, v, i, n: gather_live_rows(k, v, i, n, backend="pallas", splits=splits),
        sds((HKV, L, D)), sds((HKV, L, D)), sds((hs, 700), jnp.int32), sds((hs,), jnp.int32))


@pytest.mark.parametrize("ftz", [True, False])
def test_prefill_passes_lower_exp2_ftz_and_fma(ftz):
  """exp2_ftz and logits_fma (the defaults): both prefill passes, the 1-level call and the hierarchical one, carry
  the ex2.approx.ftz.f32 and fma.rn.f32 inline asm; off, none does (libdevice's exp2f instead)."""
  import dataclasses

  from pallas_kernels.centroid_lookup import DEFAULT_PREFILL, INT8_PREFILL
  for base in (DEFAULT_PREFILL, INT8_PREFILL):
    cfg = dataclasses.replace(base, exp2_ftz=ftz, logits_fma=ftz)
    texts = [lower(lambda q, c, n: centroid_lookup_prefill(q, c, n, jnp.float32(0.1), scale=D ** -0.5,
                                                           backend="pallas", config=cfg),
                   sds((HQ, 256, D)), sds((HKV, 300, D)), sds((HKV, 300), jnp.int32)),
             lower(lambda q, *a: hierarchical_lookup_prefill(q, *a, jnp.float32(0.01), jnp.float32(0.01),
                                                             scale=D ** -0.5, backend="pallas", config=cfg),
                   sds((HQ, 256, D)), sds((HKV, 41, D)), sds((HKV, 41), jnp.int32), sds((HKV, 205, D)),
                   sds((HKV, 205), jnp.int32), sds((HKV, 205), jnp.int32))]
    for text, n_kernels in zip(texts, (2, 4)):   # the hierarchical lookup: both passes at both levels
      kernels = len(re.findall(r'name = "centroid_lookup_(?:stats|scores)', text))   # one string table each
      assert kernels == n_kernels
      assert text.count("ex2.approx.ftz.f32") == (kernels if ftz else 0)
      assert text.count("fma.rn.f32") == (kernels if ftz else 0)
      assert ftz or "__nv_exp2f" in text


@pytest.mark.parametrize("int8", [None, "cvt", "magic"])
@pytest.mark.parametrize("anchor", ["rows", "tile"])
def test_anchored_statistics_pass_lowers(anchor, int8):
  """The anchored statistics pass (a loop without running max, the exact loop in an scf.if), with the
  inputs' logits or int8 ones: the 1-level call, a split short block, and the hierarchical prefill's
  bounded level 2."""
  import dataclasses

  from pallas_kernels.centroid_lookup import DEFAULT_PREFILL
  cfg = dataclasses.replace(DEFAULT_PREFILL, stats_anchor=anchor, prefill_int8=int8)   # int8: i8 x i8 -> i32 dots
  c, n = sds((HKV, 1311, D)), sds((HKV, 1311), jnp.int32)
  for seq_len in (4096, 100):
    lower(lambda q, c, n: centroid_lookup_prefill(q, c, n, jnp.float32(0.1), scale=D ** -0.5, backend="pallas",
                                                  config=cfg), sds((HQ, seq_len, D)), c, n)
  args = (sds((HKV, 41, D)), sds((HKV, 41), jnp.int32), sds((HKV, 205, D)),
          sds((HKV, 205), jnp.int32), sds((HKV, 205), jnp.int32))
  lower(lambda q, *a: hierarchical_lookup_prefill(q, *a, jnp.float32(0.01), jnp.float32(0.01), scale=D ** -0.5,
                                                  backend="pallas", config=cfg), sds((HQ, 512, D)), *args)
