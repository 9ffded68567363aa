"""Prefill, decode step and a generation loop (greedy / temperature / top-p, stop tokens, batch).

`prefill` and `decode_step` are jitted pure functions on ``nnx.split`` state with the KV cache
donated; `generate` drives them from the host. The cache has a fixed capacity, so the decode
step compiles once per (model, batch, capacity, attn_fn, sampling mode) and a whole generation
reuses that one executable.

Batches: prompts of different lengths are LEFT padded; pad tokens get position -1 and never
take part in attention. ``position_offset`` shifts every position (e.g. to continue after a
fixed document whose KV lives in ``attn_state``).
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .forward import forward
from .kv_cache import KVCache


# --------------------------------------------------------------------------- jitted pieces
# The prompt's prefill keeps XLA's command buffers, as every forward does (see models.forward).
@partial(jax.jit, static_argnames=("attn_fn",), donate_argnames=("cache",))
def prefill(graphdef, state, tokens, positions, cache: KVCache, attn_state=None, *, attn_fn=None):
    """tokens/positions int32 [B, T] -> (float32 logits of the last token [B, V], cache)."""
    logits, cache, _ = forward(
        graphdef, state, tokens, positions, cache, attn_fn=attn_fn, attn_state=attn_state, logits="last"
    )
    return logits[:, 0], cache


def sample_logits(logits, key, temperature, top_p, *, greedy: bool, use_top_p: bool):
    """logits float32 [B, V] -> int32 [B]. Greedy argmax, or temperature (+ nucleus) sampling."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits.astype(jnp.float32) / temperature
    if use_top_p:
        sorted_x = jnp.sort(x, axis=-1)[:, ::-1]  # descending [B, V]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # smallest prefix with mass >= top_p
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= cutoff, x, -jnp.inf)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


_sample_jit = jax.jit(sample_logits, static_argnames=("greedy", "use_top_p"))


def _mask_stopped_fn(nxt, done, stop, pad_id):
    """int32 [B] sampled ids -> (the next step's input ids [B], done [B]): rows that have hit a
    stop id (now or before) are fed ``pad_id`` from here on."""
    done = done | jnp.isin(nxt, stop)
    return jnp.where(done, pad_id, nxt).astype(jnp.int32), done


_mask_stopped = jax.jit(_mask_stopped_fn)


@partial(
    jax.jit, static_argnames=("attn_fn", "greedy", "use_top_p"), donate_argnames=("cache",)
)
def decode_step(
    graphdef,
    state,
    token,
    position,
    cache: KVCache,
    key,
    step,
    temperature,
    top_p,
    attn_state=None,
    *,
    attn_fn=None,
    greedy: bool = True,
    use_top_p: bool = False,
):
    """One token per row: token/position int32 [B] -> (next int32 [B], logits f32 [B, V], cache).

    ``key`` is the generation's base PRNG key, ``step`` an int32 scalar folded into it;
    ``temperature``/``top_p`` are traced float32 scalars (changing them does not recompile).
    """
    logits, cache, _ = forward(
        graphdef, state, token[:, None], position[:, None], cache,
        attn_fn=attn_fn, attn_state=attn_state, logits="last",
    )
    logits = logits[:, 0]
    nxt = sample_logits(
        logits, jax.random.fold_in(key, step), temperature, top_p, greedy=greedy, use_top_p=use_top_p
    )
    return nxt, logits, cache


@partial(
    jax.jit, static_argnames=("attn_fn", "greedy", "use_top_p"),
    donate_argnames=("token", "done", "position", "step", "cache"),
)
def _decode_step_carried(
    graphdef, state, token, done, position, step, cache, key, temperature, top_p, stop, pad_id,
    attn_state=None, *, attn_fn=None, greedy: bool = True, use_top_p: bool = False,
):
    """`decode_step` for `generate`'s loop with its per-step inputs carried on the device.

    token, done, position [B] and step [1] are donated and come back (in that order, before any
    other output of their shape) as the next step's: the masked next ids, done, position + 1 and
    step + 1 (a [1] array: a donated 0-d step did not come back in its buffer on CPU). Every step
    then runs on the same buffer addresses. Carrying token and position so took an 8B-shaped
    model's host time per step from 4.6-7.8 to 1.0-1.1 ms in the speed suite's e2e section, and
    this loop from 5.79-8.13 to 5.56-5.72 ms per token (benchmarks/results/gpu_h200_e2e_stable/).
    -> (token', done', position', step', cache, sampled ids [B] for the host).
    """
    nxt, _, cache = decode_step(
        graphdef, state, token, position, cache, key, step[0], temperature, top_p, attn_state,
        attn_fn=attn_fn, greedy=greedy, use_top_p=use_top_p,
    )
    token, done = _mask_stopped_fn(nxt, done, stop, pad_id)
    return token, done, position + 1, step + 1, cache, nxt


# --------------------------------------------------------------------------- host loop
@dataclasses.dataclass
class Generation:
    """Result of `generate`: new tokens per row (stop token included if one was hit)."""

    token_ids: list[list[int]]
    texts: list[str] | None
    cache: KVCache
    prompt_lengths: list[int]
    stopped: list[bool]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int

    @property
    def ids(self) -> list[int]:
        """Token ids of row 0 (convenience for single prompts)."""
        return self.token_ids[0]

    @property
    def text(self) -> str | None:
        """Decoded text of row 0 (special tokens skipped), None without a tokenizer."""
        return None if self.texts is None else self.texts[0]

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode-step throughput (rows x steps / second, first step's compile included)."""
        n = self.decode_steps * len(self.token_ids)
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _unpack_model(model):
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
        return graphdef, state, model.config, None, getattr(model, "dtype", jnp.float32)
    for attr in ("graphdef", "state", "config"):
        if not hasattr(model, attr):
            raise TypeError(f"generate() needs a LoadedModel or an nnx Llama, got {type(model).__name__}")
    return model.graphdef, model.state, model.config, getattr(model, "tokenizer", None), getattr(
        model, "dtype", jnp.float32
    )


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, position_offset: int = 0):
    """Ragged prompts -> tokens int32 [B, T] (left padded) and positions int32 [B, T] (-1 on pads)."""
    lengths = [len(p) for p in prompts]
    if not lengths or min(lengths) == 0:
        raise ValueError("every prompt needs at least one token")
    B, T = len(prompts), max(lengths)
    tokens = np.full((B, T), pad_id, np.int32)
    positions = np.full((B, T), -1, np.int32)
    for b, p in enumerate(prompts):
        n = len(p)
        tokens[b, T - n:] = np.asarray(p, np.int32)
        positions[b, T - n:] = position_offset + np.arange(n, dtype=np.int32)
    return tokens, positions


def _normalize_prompts(prompt_ids) -> tuple[list[list[int]], bool]:
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            return [arr.astype(np.int64).tolist()], True
        if arr.ndim == 2:
            return arr.astype(np.int64).tolist(), False
        raise ValueError(f"prompt_ids must be 1-D or 2-D, got shape {arr.shape}")
    prompt_ids = list(prompt_ids)
    if prompt_ids and all(isinstance(t, (int, np.integer)) for t in prompt_ids):
        return [[int(t) for t in prompt_ids]], True
    return [[int(t) for t in p] for p in prompt_ids], False


def stop_id_set(stop_ids, default) -> set[int]:
    """The token ids a row stops at: `stop_ids` (an iterable of ints; empty: never stops), or `default`
    when it is None. ValueError names the first value that is not a token id."""
    if stop_ids is None:
        stop_ids = default
    if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
        raise ValueError(f"stop_ids must be a list of token ids (ints), such as the tokenizer's eos_ids; "
                         f"got {stop_ids!r:.80}")
    ids = list(stop_ids)
    for s in ids:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise ValueError(f"stop_ids must be token ids (ints), such as the tokenizer's eos_ids; got {s!r:.80} "
                             f"({type(s).__name__})")
    return {int(s) for s in ids}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] | None = None,
    seed: int = 0,
    attn_fn=None,
    attn_state: Any = None,
    position_offset: int = 0,
    cache: KVCache | None = None,
    on_token: Callable[[int, np.ndarray], Any] | None = None,
    cache_dtype=None,
    prefill_chunk: int | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    model: a `LoadedModel` (or an nnx `Llama`). prompt_ids: one list of ids, a list of lists
    (ragged: left padded) or an int array [T] / [B, T]. temperature 0 = greedy; otherwise
    sampling at ``temperature`` restricted to the top-``top_p`` nucleus, PRNG ``seed``.
    stop_ids: a row stops after emitting one of them (default: the tokenizer's / config's EOS
    ids; ``()`` never stops). ``cache``: an existing cache to append to (it is donated, i.e.
    consumed); default a fresh cache sized for prompt + new tokens. ``on_token(step, ids)`` is
    called after every step with int32 [B] new ids (-1 for rows already stopped); returning
    True stops generation. ``prefill_chunk``: prefill long prompts in chunks of this many tokens.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not (0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    graphdef, state, config, tokenizer, dtype = _unpack_model(model)
    prompts, _ = _normalize_prompts(prompt_ids)
    eos = tuple(tokenizer.eos_ids) if tokenizer is not None else config.eos_token_ids
    stop = np.asarray(sorted(stop_id_set(stop_ids, eos)), np.int64)
    pad_id = int(stop[0]) if len(stop) else 0
    tokens, positions = left_pad(prompts, pad_id, position_offset)
    B, T = tokens.shape

    if cache is None:
        cache = KVCache.init(config, B, _round_up(T + max_new_tokens, 128), cache_dtype or dtype)
    else:
        if cache.batch != B:
            raise ValueError(f"cache batch {cache.batch} != number of prompts {B}")
        used = int(np.max(np.asarray(cache.length)))
        if used + T + max_new_tokens - 1 > cache.capacity:
            raise ValueError(
                f"cache capacity {cache.capacity} too small: {used} used + {T} prompt + "
                f"{max_new_tokens - 1} decode tokens"
            )

    greedy = temperature == 0.0
    use_top_p = (not greedy) and top_p < 1.0
    key = jax.random.key(seed)
    temp = jnp.float32(max(temperature, 1e-6))
    topp = jnp.float32(top_p)

    t0 = time.perf_counter()
    chunk = T if not prefill_chunk else int(prefill_chunk)
    for start in range(0, T, chunk):
        logits, cache = prefill(
            graphdef, state, jnp.asarray(tokens[:, start:start + chunk]),
            jnp.asarray(positions[:, start:start + chunk]), cache, attn_state, attn_fn=attn_fn,
        )
    first = _sample_jit(
        logits, jax.random.fold_in(key, 0), temp, topp, greedy=greedy, use_top_p=use_top_p
    )
    nxt = np.asarray(first)
    t1 = time.perf_counter()

    out: list[list[int]] = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    stop_dev = jnp.asarray(stop, jnp.int32)
    pad_dev = jnp.int32(pad_id)
    # carried on the device from step to step (donated, so their addresses never change)
    cur_dev, done_dev = _mask_stopped(first, jnp.zeros((B,), bool), stop_dev, pad_dev)
    pos_dev = jnp.asarray([position_offset + len(p) for p in prompts], jnp.int32)
    step_dev = jnp.ones((1,), jnp.int32)
    nxt_dev = first
    steps = 0
    for step in range(max_new_tokens):
        # pipelined: step+1 is dispatched before token `step` reaches the host, so the host's
        # bookkeeping (and its kernel enqueueing) overlaps the device's work; the stop mask is
        # applied on the device. A halt decided on the host rewinds that one extra token.
        ahead = step + 1 < max_new_tokens
        if ahead:
            cur_dev, done_dev, pos_dev, step_dev, cache, nxt_ahead = _decode_step_carried(
                graphdef, state, cur_dev, done_dev, pos_dev, step_dev, cache, key, temp, topp,
                stop_dev, pad_dev, attn_state, attn_fn=attn_fn, greedy=greedy, use_top_p=use_top_p,
            )
            steps += 1
        nxt = np.asarray(nxt_dev)
        reported = np.where(done, -1, nxt).astype(np.int32)
        for b in range(B):
            if not done[b]:
                out[b].append(int(nxt[b]))
        done |= np.isin(nxt, stop) & ~done
        halt = bool(on_token(step, reported)) if on_token is not None else False
        if halt or done.all():
            if ahead:  # the step dispatched ahead fed a token nobody asked for
                cache = cache.rewind(1)
                steps -= 1
            break
        if ahead:
            nxt_dev = nxt_ahead
    t2 = time.perf_counter()

    texts = None
    if tokenizer is not None:
        texts = [tokenizer.decode(ids) for ids in out]
    return Generation(
        token_ids=out,
        texts=texts,
        cache=cache,
        prompt_lengths=[len(p) for p in prompts],
        stopped=[bool(d) for d in done],
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        decode_steps=steps,
    )
