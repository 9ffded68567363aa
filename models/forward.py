"""Pure functional forward pass with a KV cache and a per-layer attention hook.

    logits, new_cache, captures = forward(graphdef, state, tokens, positions, cache,
                                          attn_fn=None, attn_state=None, capture_last=False)

``graphdef, state = nnx.split(model)``. Everything is a pytree; the function is jittable
(`forward_jit` is the jitted version: ``attn_fn``, ``capture_last`` and ``logits`` static,
``cache`` donated).

Shapes: B batch, T new tokens, S cache capacity, Hq / Hkv query / KV heads, d head dim.

    tokens     int32 [B, T]
    positions  int32 [B, T]   absolute positions; -1 for (left) padding tokens
    cache      KVCache        k, v: per layer [B, Hkv, S, d]; pos int32 [B, S]; length int32 [B]
    logits     float32 [B, T, V]   (``logits="last"``: [B, 1, V]; ``"none"``: None)

The new tokens' keys/values are written at slots ``length .. length+T`` of each row, their
positions recorded in ``pos``, and ``length`` grows by T. Padding convention for B > 1: left
padding, pad tokens at position -1 (their slots stay invisible).

Attention hook (how sparse methods plug in). For every layer ``i`` (a Python int: the layer
loop is unrolled, so a hook may do different things per layer), attention is

    out = attn_fn(i, q, cache_k, cache_v, q_pos, kv_pos, attn_state)   # -> [B, T, Hq, d]

    q        [B, T, Hq, d]    roped queries of the new tokens (model dtype)
    cache_k  [B, Hkv, S, d]   layer i's cache AFTER writing the new tokens (roped keys)
    cache_v  [B, Hkv, S, d]
    q_pos    int32 [B, T]     absolute query positions (-1 = padding query)
    kv_pos   int32 [B, S]     absolute position of each slot (-1 = invalid slot)
    attn_state                any pytree, traced (e.g. a document's KV and its index)

``attn_fn`` must be hashable (it is a static jit argument); ``attn_fn=None`` is dense causal
attention (`models.attention.dense_attention`): a key is visible iff ``0 <= kv_pos <= q_pos``,
softmax in float32, scale 1/sqrt(d); a query with nothing visible returns zeros, not NaN.

Captures (``capture_last`` not False; None = all T tokens, n = the last n): a list over layers
of dicts ``{"q": [B, n, Hq, d] roped, "q_pre": [B, n, Hq, d] pre-RoPE, "k_pre": [B, T, Hkv, d]
pre-RoPE keys of the new tokens}``. Without captures the third result is None.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import default_attn_fn
from .kv_cache import KVCache
from .rope import config_frequencies

AttnFn = Callable[..., jax.Array]


def forward(
    graphdef,
    state,
    tokens,
    positions,
    cache: KVCache,
    *,
    attn_fn: AttnFn | None = None,
    attn_state: Any = None,
    capture_last: int | None | Literal[False] = False,
    logits: Literal["all", "last", "none"] = "all",
):
    """Run ``tokens`` [B, T] at ``positions`` [B, T] against ``cache``; see the module docstring.

    Returns ``(logits, new_cache, captures)``.
    """
    model = nnx.merge(graphdef, state)
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    B, T = tokens.shape
    if positions.shape != (B, T):
        raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
    if cache.batch != B:
        raise ValueError(f"cache batch {cache.batch} != tokens batch {B}")
    if cache.num_layers != len(model.layers):
        raise ValueError(f"cache has {cache.num_layers} layers, model {len(model.layers)}")
    if T > cache.capacity:
        raise ValueError(f"{T} tokens do not fit a cache of capacity {cache.capacity}")
    if capture_last is not False and capture_last is not None and capture_last <= 0:
        raise ValueError(f"capture_last must be False, None or a positive int, got {capture_last}")
    attn_fn = default_attn_fn if attn_fn is None else attn_fn
    inv_freq = config_frequencies(model.config)
    kv_pos = cache.advance(positions).pos  # [B, S] including the new tokens
    n_cap = None if capture_last is False else (T if capture_last is None else min(capture_last, T))

    captures = [] if n_cap is not None else None
    x = model.embed(tokens)  # [B, T, D]
    for i, layer in enumerate(model.layers):

        def attend(q, k, v, i=i):
            nonlocal cache
            cache = cache.write(i, k, v)
            out = attn_fn(i, q, cache.k[i], cache.v[i], positions, kv_pos, attn_state)
            if out.shape != q.shape:
                raise ValueError(f"attn_fn returned shape {out.shape} for layer {i}, expected {q.shape}")
            return out.astype(q.dtype)

        def capture(q_pre, q, k_pre):
            captures.append({"q": q[:, T - n_cap:], "q_pre": q_pre[:, T - n_cap:], "k_pre": k_pre})

        x = layer(x, positions, inv_freq, attend, capture if n_cap is not None else None)

    cache = cache.replace(pos=kv_pos, length=cache.length + T)
    if logits == "none":
        return None, cache, captures
    h = x[:, -1:] if logits == "last" else x
    return model.logits(model.norm(h)), cache, captures


# On GPU XLA records an executable's kernels into a CUDA graph (a command buffer), which it updates when
# the buffers change. A prefill runs once per call on a fresh cache, so an earlier stop compiled
# prefills without command buffers (an H200 then paid a graph creation / update per question:
# benchmarks/results/gpu_h200_ask/first_call/). Measured again inside `FixedContext.ask` on an H100 and
# an H200 (8B-shaped model, 128K context; benchmarks/results/gpu_ttft/): with command buffers the host
# enqueues Squeezed's ~1780-kernel question prefill in ~6 instead of ~25 ms, no later call in an `ask`
# loop pays an update (the allocator hands the same buffers back), and the time to first token drops
# from 28.4-28.7 to 21.3-22.7 ms (full attention 26.5-28.6 -> 25.6-27.7). The first call after a
# compile pays the graph's creation once. So no forward here turns command buffers off.
_JIT_ARGS = dict(static_argnames=("attn_fn", "capture_last", "logits"), donate_argnames=("cache",))
forward_jit = jax.jit(forward, **_JIT_ARGS)
forward_jit.__doc__ = "`forward` under jax.jit (attn_fn, capture_last, logits static; cache donated)."


def forward_new_cache(graphdef, state, tokens, positions, *, config, batch: int, capacity: int, dtype, **kwargs):
    """`forward` on an empty cache (`KVCache.init(config, batch, capacity, dtype)`) made inside the
    same program: one dispatch and no cache arguments, for a prefill that starts a cache. ->
    (logits, cache, captures) as `forward`."""
    cache = KVCache.init(config, batch, capacity, dtype)
    return forward(graphdef, state, tokens, positions, cache, **kwargs)


# A question's prefill started its cache with a dispatch of its own (`KVCache.init`); made inside
# the prefill's program the first token comes 0.7-0.9 ms sooner on an H100 (benchmarks/results/gpu_ttft/).
forward_new_cache_jit = jax.jit(forward_new_cache,
                                static_argnames=_JIT_ARGS["static_argnames"] + ("config", "batch", "capacity", "dtype"))


@partial(jax.jit)
def full_logits(graphdef, state, input_ids):
    """int32 [B, T] -> float32 [B, T, V] with full causal attention (no cache), jitted."""
    return nnx.merge(graphdef, state)(input_ids)
