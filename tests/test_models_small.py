"""models/: numerics, KV cache, attention hook and generation on a tiny random-weight GQA model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import (
    KVCache,
    Llama,
    Llama3RopeScaling,
    LlamaConfig,
    apply_rope,
    decode_step,
    dense_attention,
    forward,
    forward_jit,
    full_logits,
    generate,
    left_pad,
    remove_rope,
    rope_frequencies,
)

TINY = LlamaConfig(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    max_position_embeddings=256, eos_token_id=2, bos_token_id=1, name="tiny",
)


def _randomize_norms(model: Llama, seed: int = 1):
    """Default init leaves norm weights at 1; make them non-trivial."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and var[...].ndim == 1:
            var[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(var[...].shape), var[...].dtype)


@pytest.fixture(scope="module")
def tiny():
    model = Llama(TINY, rngs=nnx.Rngs(0))
    _randomize_norms(model)
    graphdef, state = nnx.split(model)
    return graphdef, state


def _ids(seed, shape):
    return np.random.default_rng(seed).integers(3, TINY.vocab_size, size=shape).astype(np.int32)


# ----------------------------------------------------------------------------- config
def test_config_validation_and_hf_parsing():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3,
                    num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="even"):
        LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                    num_kv_heads=2, head_dim=5)
    with pytest.raises(ValueError, match=r"unsupported architecture.*gpt2.*llama"):
        LlamaConfig.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"unsupported architecture 'mamba'.*llama, qwen2"):
        LlamaConfig.from_gguf_metadata({"general.architecture": "mamba"})
    hf = {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    c = LlamaConfig.from_hf_config(hf)
    assert c.head_dim == 64 and c.group_size == 4 and c.eos_token_ids == (128001, 128008, 128009)
    assert c.rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
    assert LlamaConfig.from_dict(c.to_dict()) == c
    # transformers >= 5 style rope_parameters
    hf5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    hf5["rope_parameters"] = dict(hf["rope_scaling"], rope_theta=500000.0)
    assert LlamaConfig.from_hf_config(hf5).rope_scaling == c.rope_scaling
    q = LlamaConfig.from_hf_config(dict(hf, model_type="qwen2", rope_scaling=None))
    assert q.attention_bias and q.rope_scaling is None
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        LlamaConfig.from_hf_config(dict(hf, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


# ----------------------------------------------------------------------------- rope
def test_remove_rope_inverts_apply_rope():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 7, 3, 16)), jnp.float32)  # [B, T, H, d]
    pos = jnp.asarray([[0, 1, 2, 3, 100, 5000, 8191], [-1, -1, 0, 1, 2, 3, 4]], jnp.int32)
    y = apply_rope(x, pos, TINY)
    assert not np.allclose(y, x)
    np.testing.assert_allclose(remove_rope(y, pos, TINY), x, atol=2e-6)
    # cache layout [B, H, S, d] with positions [B, 1, S]
    xc = jnp.swapaxes(x, 1, 2)
    np.testing.assert_allclose(apply_rope(xc, pos[:, None, :], TINY), jnp.swapaxes(y, 1, 2), atol=1e-6)


def test_apply_rope_matches_numpy_rotate_half():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 5, 2, 8))
    pos = np.array([[0, 3, 17, 64, 1000]])
    inv = 1.0 / (500.0 ** (np.arange(0, 8, 2) / 8))
    ang = pos[..., None, None] * np.concatenate([inv, inv])  # [1, 5, 1, 8]
    rot = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    want = x * np.cos(ang) + rot * np.sin(ang)
    got = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), rope_frequencies(8, 500.0))
    np.testing.assert_allclose(got, want, atol=2e-5)


def _numpy_llama3_inv_freq(dim, theta, factor, low, high, old_ctx):
    """Independent scalar-loop version of Llama-3.1's frequency rule."""
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(f)
        elif wavelen > old_ctx / low:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def test_llama3_rope_scaling_matches_numpy():
    s = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    want = _numpy_llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    got = rope_frequencies(128, 500000.0, s)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (got < rope_frequencies(128, 500000.0)).any()  # scaling changed something
    # GGUF stores the same rule as per-frequency divisors (rope_freqs)
    factors = rope_frequencies(128, 500000.0).astype(np.float64) / want
    np.testing.assert_allclose(rope_frequencies(128, 500000.0, freq_factors=factors), want, rtol=1e-6)
    # and apply_rope uses them
    x = jnp.ones((1, 1, 1, 128))
    pos = jnp.asarray([[5000]])
    ang = 5000 * np.concatenate([want, want])
    np.testing.assert_allclose(apply_rope(x, pos, got)[0, 0, 0], np.cos(ang) + np.concatenate(
        [-np.sin(ang[:64]), np.sin(ang[64:])]), atol=2e-4)


# ----------------------------------------------------------------------------- attention
def test_dense_attention_padding_query_is_zero_not_nan():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 3, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 2, 5, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 2, 5, 8)), jnp.float32)
    q_pos = jnp.asarray([[-1, 0, 2]])
    kv_pos = jnp.asarray([[-1, 0, 1, 2, -1]])
    out = np.asarray(dense_attention(q, k, v, q_pos, kv_pos))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, 0], 0.0)
    # query at position 0 sees only slot 1: output = v of slot 1 for its KV head
    np.testing.assert_allclose(out[0, 1, :2], np.asarray(v)[0, 0, 1][None].repeat(2, 0), atol=1e-6)
    np.testing.assert_allclose(out[0, 1, 2:], np.asarray(v)[0, 1, 1][None].repeat(2, 0), atol=1e-6)


@pytest.mark.parametrize("T,S", [(3, 40), (300, 1100), (70, 512)])
def test_dense_attention_paths_match_reference(T, S):
    """Decode path (few rows) and blocked path (block skipping, padding) == one-shot reference."""
    from models.attention import dense_attention_reference

    rng = np.random.default_rng(T)
    B, Hq, Hkv, d = 2, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, Hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, d)), jnp.float32)
    kv_pos = rng.permutation(S)[None].repeat(B, 0).astype(np.int32)  # slots in any order
    kv_pos[:, rng.random(S) < 0.2] = -1  # holes
    kv_pos[1, S // 2:] = -1  # a row with an empty tail (unused capacity)
    q_pos = np.sort(rng.integers(0, S, size=(B, T)), axis=1).astype(np.int32)
    q_pos[1, : T // 3] = -1  # left padding
    ref = dense_attention_reference(q, k, v, jnp.asarray(q_pos), jnp.asarray(kv_pos))
    got = jax.jit(dense_attention)(q, k, v, jnp.asarray(q_pos), jnp.asarray(kv_pos))
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, ref, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[1, : T // 3], 0.0)


# ----------------------------------------------------------------------------- forward + cache
def test_forward_in_chunks_equals_one_pass_and_full(tiny):
    graphdef, state = tiny
    ids = _ids(0, (1, 24))
    pos = np.arange(24, dtype=np.int32)[None]
    full = np.asarray(full_logits(graphdef, state, jnp.asarray(ids)))
    one, cache1, _ = forward_jit(graphdef, state, ids, pos, KVCache.init(TINY, 1, 32))
    np.testing.assert_allclose(one, full, atol=2e-5)
    cache = KVCache.init(TINY, 1, 32)
    outs = []
    for s in range(0, 24, 8):
        lg, cache, _ = forward_jit(graphdef, state, ids[:, s:s + 8], pos[:, s:s + 8], cache)
        outs.append(np.asarray(lg))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5)
    assert int(cache.length[0]) == 24
    np.testing.assert_array_equal(cache.pos[0, :24], np.arange(24))
    np.testing.assert_array_equal(cache.pos[0, 24:], -1)
    np.testing.assert_allclose(cache.stacked()[0][:, :, :, :24], cache1.stacked()[0][:, :, :, :24], atol=1e-5)


def test_left_padded_batch_matches_unpadded_rows(tiny):
    graphdef, state = tiny
    a, b = _ids(1, (20,)).tolist(), _ids(2, (13,)).tolist()
    tokens, positions = left_pad([a, b], pad_id=0)
    assert positions[1, :7].tolist() == [-1] * 7 and positions[1, 7:].tolist() == list(range(13))
    lg, cache, _ = forward_jit(graphdef, state, tokens, positions, KVCache.init(TINY, 2, 32))
    lg = np.asarray(lg)
    assert np.isfinite(lg).all()  # padding queries do not produce NaN
    for row, ids in ((0, a), (1, b)):
        ref = np.asarray(full_logits(graphdef, state, jnp.asarray([ids], jnp.int32)))[0]
        np.testing.assert_allclose(lg[row, 20 - len(ids):], ref, atol=2e-5)


_HOOK_CALLS: list = []


def _recording_attn_fn(layer, q, cache_k, cache_v, q_pos, kv_pos, attn_state):
    _HOOK_CALLS.append((layer, q.shape, cache_k.shape, cache_v.shape, q_pos.shape, kv_pos.shape))
    return dense_attention(q, cache_k, cache_v, q_pos, kv_pos) * attn_state["scale"]


def test_attn_fn_hook_and_captures(tiny):
    graphdef, state = tiny
    ids, pos = _ids(3, (2, 6)), np.tile(np.arange(6, dtype=np.int32), (2, 1))
    ref, ref_cache, none = forward(graphdef, state, ids, pos, KVCache.init(TINY, 2, 16))
    assert none is None
    _HOOK_CALLS.clear()
    lg, cache, caps = forward_jit(
        graphdef, state, ids, pos, KVCache.init(TINY, 2, 16), attn_fn=_recording_attn_fn,
        attn_state={"scale": jnp.float32(1.0)}, capture_last=2,
    )
    assert [c[0] for c in _HOOK_CALLS] == [0, 1]  # layer is a Python int, layers unrolled
    assert _HOOK_CALLS[0][1:] == ((2, 6, 4, 16), (2, 2, 16, 16), (2, 2, 16, 16), (2, 6), (2, 16))
    np.testing.assert_allclose(lg, ref, atol=1e-5)
    assert len(caps) == TINY.num_layers
    for i, c in enumerate(caps):
        assert c["q"].shape == (2, 2, 4, 16) and c["q_pre"].shape == (2, 2, 4, 16)
        assert c["k_pre"].shape == (2, 6, 2, 16)
        np.testing.assert_allclose(c["q"], apply_rope(c["q_pre"], pos[:, -2:], TINY), atol=1e-5)
        # the cache holds the roped new keys at slots 0..5
        np.testing.assert_allclose(
            jnp.swapaxes(cache.k[i][:, :, :6], 1, 2), apply_rope(c["k_pre"], pos, TINY), atol=1e-5
        )
    # attn_state is traced: a different value reuses the executable and changes the result
    lg2, _, _ = forward_jit(graphdef, state, ids, pos, KVCache.init(TINY, 2, 16), attn_fn=_recording_attn_fn,
                            attn_state={"scale": jnp.float32(0.0)}, capture_last=2)
    assert len(_HOOK_CALLS) == 2 and not np.allclose(lg2, lg)
    _, _, all_caps = forward(graphdef, state, ids, pos, KVCache.init(TINY, 2, 16), capture_last=None)
    assert all_caps[0]["q"].shape == (2, 6, 4, 16)


# ----------------------------------------------------------------------------- generation
class _CompileCounter:
    def __init__(self):
        self.n = 0

    def __call__(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


def test_decode_step_compiles_once(tiny):
    from models.generate import _decode_step_carried

    graphdef, state = tiny
    lm = _Loaded(graphdef, state, TINY)
    before = _decode_step_carried._cache_size()
    r = generate(lm, _ids(4, (9,)).tolist(), 12, stop_ids=())
    assert len(r.ids) == 12 and r.decode_steps == 11
    assert _decode_step_carried._cache_size() == before + 1
    counter = _CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        r2 = generate(lm, _ids(5, (9,)).tolist(), 12, stop_ids=())  # same shapes, new content
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.n == 0 and _decode_step_carried._cache_size() == before + 1
    assert r2.ids != r.ids


def test_decode_loop_reuses_its_buffers_and_matches_decode_step(tiny):
    """`generate`'s step carries token, done, position and step on the device: each comes back
    in the buffer it came in (so XLA can replay the step's command buffer unchanged), and the
    sampled ids, masked ids and cache equal `decode_step`'s."""
    from models.generate import _decode_step_carried, _mask_stopped

    graphdef, state = tiny
    ids = _ids(6, (2, 5))
    pos = np.tile(np.arange(5, dtype=np.int32), (2, 1))
    _, cache, _ = forward_jit(graphdef, state, ids, pos, KVCache.init(TINY, 2, 16))
    key, temp, topp = jax.random.key(0), jnp.float32(1e-6), jnp.float32(1.0)
    stop, pad = jnp.asarray([2, 5], jnp.int32), jnp.int32(2)
    tok = jnp.asarray([7, 9], jnp.int32)
    done = jnp.asarray([False, True])
    position = jnp.asarray([5, 5], jnp.int32)
    step = jnp.ones((1,), jnp.int32)
    ref_cache = jax.tree.map(jnp.copy, cache)
    for i in range(3):
        ref_nxt, _, ref_cache = decode_step(graphdef, state, jnp.copy(tok), jnp.asarray([5 + i] * 2, jnp.int32),
                                            ref_cache, key, jnp.int32(1 + i), temp, topp)
        ref_tok, ref_done = _mask_stopped(ref_nxt, done, stop, pad)
        ptrs = [x.unsafe_buffer_pointer() for x in (tok, done, position, step)]
        tok, done, position, step, cache, nxt = _decode_step_carried(
            graphdef, state, tok, done, position, step, cache, key, temp, topp, stop, pad)
        assert [x.unsafe_buffer_pointer() for x in (tok, done, position, step)] == ptrs
        np.testing.assert_array_equal(np.asarray(nxt), np.asarray(ref_nxt))
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
        np.testing.assert_array_equal(np.asarray(done), np.asarray(ref_done))
        assert np.asarray(position).tolist() == [6 + i] * 2 and int(step[0]) == 2 + i
        np.testing.assert_array_equal(np.asarray(cache.stacked()[0]), np.asarray(ref_cache.stacked()[0]))
    assert bool(done[1])                      # a stopped row stays stopped, fed the pad id
    assert int(tok[1]) == 2


class _Loaded:
    """Minimal LoadedModel stand-in (no tokenizer)."""

    def __init__(self, graphdef, state, config):
        self.graphdef, self.state, self.config = graphdef, state, config
        self.tokenizer, self.dtype = None, jnp.float32


def _greedy_reference(graphdef, state, ids, n):
    """Greedy decoding by full re-computation (right-padded to 32 tokens: causal, so exact)."""
    seq = list(ids)
    for _ in range(n):
        padded = np.zeros((1, 32), np.int32)
        padded[0, :len(seq)] = seq
        logits = np.asarray(full_logits(graphdef, state, jnp.asarray(padded)))
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))
    return seq[len(ids):]


def test_generate_greedy_batch_left_padding_matches_single(tiny):
    graphdef, state = tiny
    lm = _Loaded(graphdef, state, TINY)
    a, b = _ids(6, (11,)).tolist(), _ids(7, (5,)).tolist()
    batch = generate(lm, [a, b], 6, stop_ids=())
    assert batch.token_ids[0] == _greedy_reference(graphdef, state, a, 6)
    assert batch.token_ids[1] == _greedy_reference(graphdef, state, b, 6)
    assert generate(lm, b, 6, stop_ids=()).ids == batch.token_ids[1]


def test_generate_after_cached_prefix_with_position_offset(tiny):
    graphdef, state = tiny
    lm = _Loaded(graphdef, state, TINY)
    doc, question = _ids(8, (14,)).tolist(), _ids(9, (5,)).tolist()
    cache = KVCache.init(TINY, 1, 64)
    _, cache, _ = forward_jit(graphdef, state, np.asarray([doc], np.int32),
                              np.arange(14, dtype=np.int32)[None], cache)
    r = generate(lm, question, 5, stop_ids=(), cache=cache, position_offset=len(doc))
    assert r.ids == generate(lm, doc + question, 5, stop_ids=()).ids
    with pytest.raises(ValueError, match="capacity"):
        generate(lm, question, 61, cache=KVCache.init(TINY, 1, 64), stop_ids=())  # 5 + 60 > 64


def test_generate_sampling_stop_and_streaming(tiny):
    graphdef, state = tiny
    lm = _Loaded(graphdef, state, TINY)
    prompt = _ids(10, (7,)).tolist()
    greedy = generate(lm, prompt, 6, stop_ids=()).ids
    # a vanishing nucleus keeps only the arg-max token
    assert generate(lm, prompt, 6, temperature=1.0, top_p=1e-6, stop_ids=()).ids == greedy
    s1 = generate(lm, prompt, 6, temperature=5.0, seed=3, stop_ids=()).ids
    assert s1 == generate(lm, prompt, 6, temperature=5.0, seed=3, stop_ids=()).ids
    assert s1 != generate(lm, prompt, 6, temperature=5.0, seed=4, stop_ids=()).ids
    # stop token: generation ends right after it (the stop id is included)
    stop = greedy[2]
    r = generate(lm, prompt, 6, stop_ids=(stop,))
    assert r.ids == greedy[: greedy.index(stop) + 1] and r.stopped == [True]
    seen = []
    r = generate(lm, prompt, 6, stop_ids=(), on_token=lambda step, ids: seen.append((step, ids.tolist())) or step == 3)
    assert [s for s, _ in seen] == [0, 1, 2, 3] and [i[0] for _, i in seen] == greedy[:4] and r.ids == greedy[:4]
    with pytest.raises(ValueError, match="stop_ids must be token ids .* got 'x'"):
        generate(lm, prompt, 2, stop_ids=["x"])


def test_bfloat16_model_runs_close_to_float32(tiny):
    graphdef, state = tiny
    model32 = nnx.merge(graphdef, state)
    model16 = Llama(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(model16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model32)))
    ids = jnp.asarray(_ids(11, (1, 10)))
    lg16 = full_logits(*nnx.split(model16), ids)
    assert lg16.dtype == jnp.float32 and np.isfinite(np.asarray(lg16)).all()
    np.testing.assert_allclose(lg16, full_logits(graphdef, state, ids), atol=0.1)


def test_generate_pipelined_halt_leaves_the_cache_as_if_it_stopped_there(tiny):
    """generate dispatches one step ahead; a halt rewinds that step, so the returned cache holds
    exactly prompt + fed tokens and continuing from it equals one longer generation."""
    graphdef, state = tiny
    lm = _Loaded(graphdef, state, TINY)
    prompt = _ids(12, (7,)).tolist()
    greedy = generate(lm, prompt, 8, stop_ids=()).ids
    r = generate(lm, prompt, 8, stop_ids=(), on_token=lambda step, ids: step == 3)
    assert r.ids == greedy[:4] and r.decode_steps == 3
    assert int(r.cache.length[0]) == len(prompt) + 3
    assert int((np.asarray(r.cache.pos[0]) >= 0).sum()) == len(prompt) + 3
    # continue: feed the 4th token and the rest must follow the uninterrupted generation
    more = generate(lm, [greedy[3]], 4, stop_ids=(), cache=r.cache, position_offset=len(prompt) + 3)
    assert more.ids == greedy[4:8]


def test_generate_batch_rows_stop_independently(tiny):
    graphdef, state = tiny
    lm = _Loaded(graphdef, state, TINY)
    a, b = _ids(13, (5,)).tolist(), _ids(14, (9,)).tolist()
    stop = generate(lm, a, 6, stop_ids=()).ids[1]
    batch = generate(lm, [a, b], 6, stop_ids=(stop,))
    for row, p in zip(batch.token_ids, (a, b)):
        assert row == generate(lm, p, 6, stop_ids=(stop,)).ids
    assert batch.stopped[0] and batch.token_ids[0][-1] == stop


def test_kv_cache_rewind():
    c = KVCache.init(TINY, 2, 8).advance(jnp.asarray([[0, 1, 2], [-1, 5, 6]], jnp.int32))
    r = c.rewind(2)
    assert np.asarray(r.length).tolist() == [1, 1]
    assert np.asarray(r.pos).tolist() == [[0] + [-1] * 7, [-1] * 8]
    assert c.rewind(0) is c and np.asarray(c.rewind(5).length).tolist() == [0, 0]
    with pytest.raises(ValueError, match="n >= 0"):
        c.rewind(-1)


@pytest.mark.parametrize("bias,dtype", [(False, jnp.float32), (True, jnp.float32), (False, jnp.bfloat16)])
def test_fused_qkv_projection_equals_the_three_linears(bias, dtype):
    """`Attention.project` (on GPU one product over the Q, K, V kernels side by side) gives what the
    three `nnx.Linear` layers give, biases (Qwen2-style) and bf16 included, on both paths."""
    from models.llama import Attention
    import dataclasses

    cfg = dataclasses.replace(TINY, attention_bias=bias)
    att = Attention(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(3))
    if bias:
        for lin in (att.q_proj, att.k_proj, att.v_proj):
            lin.bias[...] = jnp.asarray(np.random.default_rng(4).normal(size=lin.bias[...].shape), dtype)
    from models.llama import _linears_side_by_side

    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 3, TINY.hidden_size)), dtype)
    q, k, v = att.project(x)                     # the backend's choice (CPU here: separate products)
    assert q.shape == (2, 3, 4, 16) and k.shape == v.shape == (2, 3, 2, 16) and q.dtype == dtype
    fq, fk, fv = _linears_side_by_side(x, (att.q_proj, att.k_proj, att.v_proj), fused=True)   # the GPU path
    assert fq.shape == (2, 3, 64) and fk.shape == fv.shape == (2, 3, 32) and fq.dtype == dtype
    for got, fgot, lin, h in ((q, fq, att.q_proj, 4), (k, fk, att.k_proj, 2), (v, fv, att.v_proj, 2)):
        want = np.asarray(lin(x).reshape(2, 3, h, 16), np.float32)
        tol = 1e-6 if dtype == jnp.float32 else 2e-2
        for g in (got, fgot.reshape(2, 3, h, 16)):
            np.testing.assert_allclose(np.asarray(g, np.float32), want, rtol=tol, atol=tol * float(np.abs(want).max()))


def test_fused_gate_up_equals_the_two_linears():
    """`MLP.__call__` (on GPU gate and up from one product) gives down(silu(gate(x)) * up(x)), on both paths."""
    from models.llama import MLP

    mlp = MLP(TINY, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(6))
    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 5, TINY.hidden_size)), jnp.float32)
    want = mlp.down_proj(jax.nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    np.testing.assert_allclose(np.asarray(mlp(x)), np.asarray(want), rtol=1e-5, atol=1e-6)
    from models.llama import _linears_side_by_side

    gate, up = _linears_side_by_side(x, (mlp.gate_proj, mlp.up_proj), fused=True)   # the GPU path
    np.testing.assert_allclose(np.asarray(mlp.down_proj(jax.nn.silu(gate) * up)), np.asarray(want),
                               rtol=1e-5, atol=1e-6)


def test_decode_step_updates_the_cache_in_place(tiny):
    """The compiled decode step neither copies a layer's cache (one array per layer, written in
    place) nor leaves the donated cache unaliased: on the CPU, XLA once copied every layer's
    cache four times per step (decode at 4K context 5x slower)."""
    import re

    graphdef, state = tiny
    cache = KVCache.init(TINY, 1, 160)
    assert len(cache.k) == len(cache.v) == TINY.num_layers
    assert cache.k[0].shape == (1, TINY.num_kv_heads, 160, TINY.head_dim)
    args = (graphdef, state, jnp.zeros((1,), jnp.int32), jnp.asarray([7], jnp.int32), cache, jax.random.key(0),
            jnp.int32(0), jnp.float32(1), jnp.float32(1))
    compiled = decode_step.lower(*args).compile()
    layer_shape = rf"f32\[1,{TINY.num_kv_heads},160,{TINY.head_dim}\]"
    assert not re.search(layer_shape + r"\{[0-9,]*\} copy\(", compiled.as_text())
    cache_bytes = 2 * TINY.num_layers * 160 * TINY.num_kv_heads * TINY.head_dim * 4
    assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes
    k_stacked, v_stacked = cache.stacked()
    assert k_stacked.shape == v_stacked.shape == (TINY.num_layers, 1, TINY.num_kv_heads, 160, TINY.head_dim)
