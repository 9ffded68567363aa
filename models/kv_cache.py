"""Fixed-capacity KV cache as a plain JAX pytree.

    k, v    tuple over layers of [B, Hkv, S, d]  roped keys / values, S = capacity (slots)
    pos     int32 [B, S]                absolute position held in each slot; -1 = empty/padding
    length  int32 [B]                   slots used per row (next write starts at `length`)

One array per layer, not one stacked [layers, ...] array: a layer's cache is then a whole
buffer, which a kernel (or a dot) reads in place. Slicing a layer out of a stacked array inside
the jitted forward made XLA copy it for every layer and every step (two copies per layer per
token in an H200 profile of the end-to-end decode; the same happened to the fixed context's
K/V on the CPU, see `sqjax.fixed_context.SparseAttentionHook`). `stacked()` gives the
[layers, B, Hkv, S, d] view where one is wanted.

New tokens of a forward step are written at slots ``length .. length + T`` of each row. Left
padding (pad tokens at position -1) writes slots that stay invisible (``pos = -1``), so with the
library's padding convention every row has the same ``length``. The capacity is static: the
caller checks ``length + T <= capacity`` (`models.generate` does, on the host); writes past the
end are dropped by the scatter, never wrapped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .config import LlamaConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, Hkv, S, d]
    v: tuple[jax.Array, ...]  # per layer [B, Hkv, S, d]
    pos: jax.Array  # int32 [B, S], -1 = empty
    length: jax.Array  # int32 [B]

    @classmethod
    def init(cls, config: LlamaConfig, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
        """An empty cache (all slots at position -1)."""
        if batch <= 0 or capacity <= 0:
            raise ValueError(f"batch and capacity must be positive, got {batch}, {capacity}")
        k, v, pos, length = _empty(config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim,
                                   jnp.dtype(dtype))
        return cls(k=k, v=v, pos=pos, length=length)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def batch(self) -> int:
        return self.pos.shape[0]

    @property
    def capacity(self) -> int:
        return self.pos.shape[1]

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """(k, v) as [layers, B, Hkv, S, d] arrays (a copy)."""
        return jnp.stack(self.k), jnp.stack(self.v)

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)

    def write(self, layer: int, k_new, v_new) -> "KVCache":
        """Store k_new, v_new [B, T, Hkv, d] of ``layer`` at slots ``length .. length+T`` (pos untouched)."""
        B, T = k_new.shape[:2]
        slots = self.length[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]  # [B, 1]

        def put(cache, new):
            # advanced indices (rows, slots) around a slice -> update shape [B, T, Hkv, d]
            return cache.at[rows, :, slots].set(new.astype(cache.dtype), mode="drop")

        k, v = list(self.k), list(self.v)
        # The barrier keeps XLA from fusing the in-place update into each of its readers: on
        # the CPU it did, and every such copy of the update needed its own copy of the layer's
        # cache (4 per layer and array per step; decode at 4K context 5x slower).
        k[layer], v[layer] = jax.lax.optimization_barrier((put(k[layer], k_new), put(v[layer], v_new)))
        return self.replace(k=tuple(k), v=tuple(v))

    def advance(self, positions) -> "KVCache":
        """Record ``positions`` int32 [B, T] at slots ``length .. length+T`` and bump ``length``."""
        B, T = positions.shape
        slots = self.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        pos = self.pos.at[rows, slots].set(positions.astype(jnp.int32), mode="drop")
        return self.replace(pos=pos, length=self.length + T)

    def rewind(self, n: int = 1) -> "KVCache":
        """Forget the last ``n`` tokens of every row: their slots become empty (pos -1) and
        ``length`` drops by n, so the next write reuses them (the stale K/V stay invisible)."""
        if n < 0:
            raise ValueError(f"rewind needs n >= 0, got {n}")
        if n == 0:
            return self
        S = self.capacity
        slots = jnp.arange(S, dtype=jnp.int32)[None]  # [1, S]
        drop = (slots >= self.length[:, None] - n) & (slots < self.length[:, None])  # [B, S]
        return self.replace(pos=jnp.where(drop, -1, self.pos), length=jnp.maximum(self.length - n, 0))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _empty(num_layers, batch, num_kv_heads, capacity, head_dim, dtype):
    """An empty cache's arrays in one dispatch (2 * num_layers + 2 eager ones took ~ms on a GPU)."""
    shape = (batch, num_kv_heads, capacity, head_dim)
    return (tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            jnp.full((batch, capacity), -1, jnp.int32), jnp.zeros((batch,), jnp.int32))
