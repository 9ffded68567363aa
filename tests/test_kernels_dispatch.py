"""Backend dispatch and static configuration validation (pallas_kernels._dispatch)."""
import functools

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


def test_scale_may_be_a_jax_scalar_but_not_a_traced_one():
  """Every public entry point with a ``scale`` takes a concrete JAX / numpy scalar like a
  float (it is a static argument of a jitted function, which must be hashable), and names a
  traced one instead of failing inside jax.jit with "Non-hashable static arguments"."""
  import inspect
  import jax
  for name in pk.__all__:
    fn = getattr(pk, name)
    if callable(fn) and not isinstance(fn, type) and "scale" in inspect.signature(fn).parameters:
      assert not isinstance(fn, type(jax.jit(lambda x: x))), f"{name}: a bare jax.jit with a static scale"
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(4, 3, 16)), jnp.float32)
  c = jnp.asarray(rng.normal(size=(2, 9, 16)), jnp.float32)
  n = jnp.asarray(rng.integers(1, 4, size=(2, 9)), jnp.int32)
  want = pk.centroid_lookup_prefill(q, c, n, 0.05, scale=0.25)
  for s in (jnp.float32(0.25), np.float64(0.25), jnp.asarray(0.25, jnp.bfloat16)):
    got = pk.centroid_lookup_prefill(q, c, n, 0.05, scale=s)
    np.testing.assert_array_equal(got[1], want[1])
  k = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
  kn = jnp.asarray(rng.normal(size=(2, 1, 16)), jnp.float32)
  pos = jnp.array([5], jnp.int32)
  dense = functools.partial(pk.dense_decode_attention, q[:, 0], k, k, kn, kn, pos, pos)
  np.testing.assert_array_equal(dense(scale=jnp.float32(0.25)), dense(scale=0.25))
  with pytest.raises(ValueError, match="concrete number.*outside jax.jit"):
    jax.jit(lambda s: dense(scale=s))(0.25)
  with pytest.raises(ValueError, match=r"scalar, got shape \(2,\)"):
    dense(scale=jnp.ones(2))
