"""Backend dispatch and static configuration validation (pallas_kernels._dispatch)."""
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _dispatch


def test_resolve_backend_on_cpu():
  assert _dispatch.resolve_backend("auto") == "reference"
  assert _dispatch.resolve_backend("interpret") == "interpret"
  assert _dispatch.resolve_backend("reference") == "reference"
  with pytest.raises(ValueError, match="needs a GPU"):
    _dispatch.resolve_backend("pallas")
  with pytest.raises(ValueError, match="backend must be one of"):
    _dispatch.resolve_backend("triton")


def test_resolve_backend_on_gpu(monkeypatch):
  monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
  assert _dispatch.resolve_backend("auto") == "pallas"
  assert _dispatch.resolve_backend("pallas") == "pallas"


def test_pallas_call_rejects_reference():
  with pytest.raises(ValueError, match="pallas_call needs"):
    _dispatch.pallas_call(lambda *r: None, backend="reference", num_warps=4, num_stages=2)


def test_configs_are_frozen_and_hashable():
  cfgs = [pk.CentroidLookupConfig(), pk.AttentionConfig(), pk.QuestScoreConfig()]
  for c in cfgs:
    hash(c)
    with pytest.raises(Exception):
      c.num_warps = 8  # frozen
  assert pk.AttentionConfig(chunk_k=128, block_k=64).chunk_k == 128
  with pytest.raises(ValueError, match="num_stages"):
    pk.AttentionConfig(num_stages=0)
  with pytest.raises(ValueError, match="target_programs"):
    pk.AttentionConfig(target_programs=0)


def test_auto_equals_reference_on_cpu():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(4, 3, 16)), jnp.float32)
  c = jnp.asarray(rng.normal(size=(2, 9, 16)), jnp.float32)
  n = jnp.asarray(rng.integers(0, 4, size=(2, 9)), jnp.int32)
  a = pk.centroid_lookup_prefill(q, c, n, 0.05, scale=0.25)
  b = pk.centroid_lookup_reference(q, c, n, 0.05, scale=0.25)
  np.testing.assert_array_equal(a[1], b[1])


def test_scale_must_be_static_float():
  q = jnp.zeros((4, 16))
  c = jnp.zeros((2, 9, 16))
  n = jnp.ones((2, 9), jnp.int32)
  with pytest.raises(ValueError, match="scale"):
    pk.centroid_lookup_decode(q, c, n, 0.0, scale=None)
  with pytest.raises(ValueError, match="scale"):
    pk.centroid_lookup_decode(q, c, n, 0.0, scale=float("nan"))
