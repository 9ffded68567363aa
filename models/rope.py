"""Rotary position embeddings (RoPE), Hugging Face "rotate_half" convention.

For a head vector x of size d split in halves (x1, x2) and frequencies f_i (i < d/2), the
rotation at position p is

    rope(x, p) = x * cos(p f) + rotate_half(x) * sin(p f),   rotate_half(x) = (-x2, x1)

with cos/sin of the d/2 angles repeated to size d. `remove_rope` applies the inverse rotation
(angle -p f), so ``remove_rope(apply_rope(x, p), p) == x`` up to rounding: that is how keys and
queries are "de-roped" for indexing (SAAP).

Frequencies: ``f_i = theta ** (-2i/d)``, optionally rescaled by Llama-3.1's ``llama3`` rule or
divided by explicit per-frequency factors (GGUF ``rope_freqs``).

Positions: ``x`` is ``[..., T, H, d]`` with ``positions`` ``[..., T]`` (one position per token,
broadcast over heads), or ``positions`` has ``x.ndim - 1`` dims and broadcasts against
``x.shape[:-1]`` directly (e.g. a cache ``[B, H, S, d]`` with ``pos[:, None, :]``).
Angles are computed in float32; the result has ``x``'s dtype.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .config import Llama3RopeScaling, LlamaConfig


def rope_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    scaling: Llama3RopeScaling | None = None,
    freq_factors=None,
) -> np.ndarray:
    """Inverse frequencies ``f`` as float32 ``[head_dim // 2]`` (computed in float64)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if freq_factors is not None:
        factors = np.asarray(freq_factors, np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"freq_factors must have shape {inv_freq.shape}, got {factors.shape}")
        inv_freq = inv_freq / factors
    elif scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: Llama3RopeScaling) -> np.ndarray:
    """Llama-3.1 frequency rescaling (transformers' ``_compute_llama3_parameters``)."""
    old_ctx = s.original_max_position_embeddings
    low_freq_wavelen = old_ctx / s.low_freq_factor
    high_freq_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are divided by `factor`; short ones kept
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def config_frequencies(config: LlamaConfig) -> np.ndarray:
    """The model's RoPE inverse frequencies, float32 ``[head_dim // 2]``."""
    return rope_frequencies(
        config.head_dim, config.rope_theta, config.rope_scaling, config.rope_freq_factors
    )


def _inv_freq(freqs) -> jnp.ndarray:
    if isinstance(freqs, LlamaConfig):
        freqs = config_frequencies(freqs)
    return jnp.asarray(freqs, jnp.float32)


def _cos_sin(x, positions, freqs):
    inv_freq = _inv_freq(freqs)  # [d/2]
    pos = jnp.asarray(positions)
    if pos.ndim == x.ndim - 2:  # [..., T] for x [..., T, H, d]: broadcast over heads
        pos = pos[..., None]
    elif pos.ndim != x.ndim - 1:
        raise ValueError(
            f"positions of shape {pos.shape} do not fit x of shape {x.shape}: expected "
            f"{x.ndim - 2} dims ([..., T] for [..., T, H, d]) or {x.ndim - 1} dims"
        )
    angles = pos.astype(jnp.float32)[..., None] * inv_freq  # [..., d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., d]
    return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, positions, freqs) -> jnp.ndarray:
    """Rotate ``x`` [..., T, H, d] by ``positions`` [..., T]; ``freqs`` = LlamaConfig or [d/2]."""
    cos, sin = _cos_sin(x, positions, freqs)
    xf = x.astype(jnp.float32)
    return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)


def remove_rope(x, positions, freqs) -> jnp.ndarray:
    """Inverse of `apply_rope` (rotation by ``-positions``): de-ropes keys or queries."""
    cos, sin = _cos_sin(x, positions, freqs)
    xf = x.astype(jnp.float32)
    return (xf * cos - _rotate_half(xf) * sin).astype(x.dtype)
