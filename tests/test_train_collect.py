"""train_qclassifier activation collection on a tiny random Llama (not the 135M model)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import LlamaConfig, LoadedModel
from models.llama import Llama
from models.rope import config_frequencies
from train_qclassifier.data import prefill_activations
from train_qclassifier.targets import rope_heads


def _toy_model():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=256,
                      tie_word_embeddings=True, name="toy")
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    return LoadedModel(graphdef, state, cfg, None, source="toy")


def test_chunked_prefill_matches_one_pass_and_rope_roundtrips(rng):
    model = _toy_model()
    T = 45
    ids = rng.integers(0, 64, T).astype(np.int32)
    keep = np.array([3, 17, 30, 44])
    k_c, q_c = prefill_activations(model, ids, keep, chunk=16, capacity=48)  # 3 padded chunks
    assert k_c.shape == (2, 2, T, 8) and q_c.shape == (2, 4, len(keep), 8)
    cache = model.new_cache(1, T)
    _, cache, caps = model.forward(jnp.asarray(ids[None]), jnp.arange(T, dtype=jnp.int32)[None], cache,
                                   capture_last=None, logits="none")
    inv_freq = config_frequencies(model.config)
    for layer, cap in enumerate(caps):
        k_ref = np.asarray(cap["k_pre"][0]).transpose(1, 0, 2)  # [Hkv, T, d]
        q_ref = np.asarray(cap["q_pre"][0])[keep].transpose(1, 0, 2)
        np.testing.assert_allclose(k_c[layer], k_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(q_c[layer], q_ref, rtol=1e-4, atol=1e-5)
        # re-roping the stored de-roped vectors gives the model's roped queries and cached keys
        q_rope = np.asarray(cap["q"][0])[keep].transpose(1, 0, 2)
        np.testing.assert_allclose(np.asarray(rope_heads(jnp.asarray(q_c[layer]), keep, inv_freq)), q_rope,
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(rope_heads(jnp.asarray(k_c[layer]), np.arange(T), inv_freq)),
                                   np.asarray(cache.k[layer][0, :, :T]), rtol=1e-4, atol=1e-5)
