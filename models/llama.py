"""Flax NNX Llama-family decoder (Llama-2/3/3.1, SmolLM2, Qwen2-style QKV bias).

Module tree and parameter names mirror Hugging Face's ``LlamaForCausalLM`` so that loaders map
names one to one (Linear kernels are stored ``[in, out]``, i.e. HF weights transposed):

    Llama
      embed_tokens          nnx.Embed           embedding [V, D]
      layers[i]             DecoderLayer
        input_layernorm     RMSNorm             weight [D]
        self_attn           Attention           q_proj [D, Hq*d] (+bias), k_proj/v_proj [D, Hkv*d] (+bias), o_proj [Hq*d, D]
        post_attention_layernorm RMSNorm        weight [D]
        mlp                 MLP (SwiGLU)        gate_proj/up_proj [D, F], down_proj [F, D]
      norm                  RMSNorm             weight [D]
      lm_head               nnx.Linear | None   kernel [D, V] (None when tied to embed_tokens)

``Llama.__call__(input_ids [B, T]) -> float32 logits [B, T, V]`` runs full causal attention.
Cached/sparse inference goes through `models.forward` on ``nnx.split`` state; it reuses
`DecoderLayer.__call__` with an ``attend`` callback, so both paths share every op.
Computation dtype is ``dtype`` (float32 default, bfloat16 option); norms and softmax run in
float32, logits are returned in float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import dense_attention
from .config import LlamaConfig
from .rope import apply_rope, config_frequencies

# attend(q [B,T,Hq,d] roped, k [B,T,Hkv,d] roped, v [B,T,Hkv,d]) -> [B,T,Hq,d]
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# capture(q_pre [B,T,Hq,d], q [B,T,Hq,d], k_pre [B,T,Hkv,d]) -> None
CaptureFn = Callable[[jax.Array, jax.Array, jax.Array], None]


class RMSNorm(nnx.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in float32 (HF LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):  # [..., D] -> [..., D]
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        y = (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return (self.weight[...].astype(self.dtype) * y.astype(self.dtype)).astype(self.dtype)


def _linears_side_by_side(x, lins, fused: bool | None = None):
    """What each `nnx.Linear` in `lins` (same input, same dtypes) gives for x [..., D] -> a tuple of
    [..., N_i]. `fused`: from one product over their kernels concatenated along the output axis.
    None = on GPU only: there XLA fuses the concatenation into one GEMM; on CPU it copies the
    kernels on every call (SmolLM2-135M decode on 2 cores: ~120 instead of ~28 ms per token, cpu_ab.json)."""
    if fused is None:
        fused = jax.default_backend() == "gpu"
    if not fused:
        return tuple(lin(x) for lin in lins)
    first = lins[0]
    kernel = jnp.concatenate([lin.kernel[...] for lin in lins], axis=1)
    bias = jnp.concatenate([lin.bias[...] for lin in lins]) if first.bias is not None else None
    x, kernel, bias = first.promote_dtype((x, kernel, bias), dtype=first.dtype)
    y = first.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=first.precision)
    if bias is not None:
        y = y + bias
    cuts = list(itertools.accumulate(lin.kernel[...].shape[1] for lin in lins[:-1]))
    return tuple(jnp.split(y, cuts, axis=-1))


class Attention(nnx.Module):
    """Q/K/V/O projections with grouped-query heads; attention itself is supplied by the caller."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        c = config
        lin = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(c.hidden_size, c.num_heads * c.head_dim, use_bias=c.attention_bias, **lin)
        self.k_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, use_bias=c.attention_bias, **lin)
        self.v_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, use_bias=c.attention_bias, **lin)
        self.o_proj = nnx.Linear(c.num_heads * c.head_dim, c.hidden_size, use_bias=False, **lin)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim

    def project(self, x):
        """x [B, T, D] -> q_pre [B, T, Hq, d], k_pre [B, T, Hkv, d], v [B, T, Hkv, d] (pre-RoPE).

        On GPU one product over the three kernels side by side (what the three `nnx.Linear` calls
        compute, same dtype promotion): for a single token XLA on GPU lowers a product as narrow as
        K's or V's to a reduction at ~0.5 TB/s, and fuses the concatenation into one GEMM instead
        (Llama-3-8B size on an H200: 13.0 vs 43.2 us per layer, benchmarks/results/gpu_h200_e2e_gemv/probe2.json).
        """
        B, T, _ = x.shape
        q, k, v = _linears_side_by_side(x, (self.q_proj, self.k_proj, self.v_proj))
        return (q.reshape(B, T, self.num_heads, self.head_dim), k.reshape(B, T, self.num_kv_heads, self.head_dim),
                v.reshape(B, T, self.num_kv_heads, self.head_dim))

    def output(self, o):  # [B, T, Hq, d] -> [B, T, D]
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **lin)
        self.up_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **lin)
        self.down_proj = nnx.Linear(config.intermediate_size, config.hidden_size, **lin)

    def __call__(self, x):  # [B, T, D] -> [B, T, D]
        """On GPU gate and up as one product over their kernels side by side (as `nnx.Linear` computes
        each; one token on an H200 at Llama-3-8B size: 54.7 vs 58.8 us, benchmarks/results/gpu_h200_e2e_gemv/probe3.json)."""
        gate, up = _linears_side_by_side(x, (self.gate_proj, self.up_proj))
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype
        )
        self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, inv_freq, attend: AttendFn, capture: CaptureFn | None = None):
        """x [B, T, D], positions int32 [B, T], inv_freq [d/2] -> [B, T, D]."""
        q_pre, k_pre, v = self.self_attn.project(self.input_layernorm(x))
        q = apply_rope(q_pre, positions, inv_freq)  # [B, T, Hq, d]
        k = apply_rope(k_pre, positions, inv_freq)  # [B, T, Hkv, d]
        if capture is not None:
            capture(q_pre, q, k_pre)
        x = x + self.self_attn.output(attend(q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
    """Llama-family causal LM. ``dtype``: computation dtype; ``param_dtype``: storage dtype."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [DecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(
                config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )

    def embed(self, tokens):  # int32 [B, T] -> [B, T, D]
        return self.embed_tokens(tokens).astype(self.dtype)

    def logits(self, h):  # [..., D] -> float32 [..., V]
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...].astype(self.dtype)  # [V, D]
            out = jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
        else:
            out = self.lm_head(h)
        return out.astype(jnp.float32)

    def __call__(self, input_ids):
        """int32 [B, T] -> float32 logits [B, T, V]; full causal attention, positions 0..T-1."""
        B, T = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        inv_freq = config_frequencies(self.config)

        def attend(q, k, v):  # fresh keys only, no cache
            kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, Hkv, T, d]
            return dense_attention(q, kt, vt, positions, positions)

        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, inv_freq, attend)
        return self.logits(self.norm(x))
