"""Input validation shared by the core algorithms: clear ValueErrors that name shapes."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


def shape_of(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def check_rank(name: str, x, rank: int, layout: str) -> None:
    """Raise if `x` is not rank `rank`; `layout` documents the expected axes, e.g. '[H, L, d]'."""
    if np.ndim(x) != rank:
        raise ValueError(f"{name} must have shape {layout} (rank {rank}); got shape {shape_of(x)}")


def check_float(name: str, x) -> None:
    dt = jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (float32/bfloat16/float16); got {dt}")


def check_int(name: str, x) -> None:
    dt = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if not jnp.issubdtype(dt, jnp.integer):
        raise ValueError(f"{name} must be an integer dtype; got {dt}")


def check_same(what: str, pairs: Sequence[tuple[str, int]]) -> None:
    """All (name, value) pairs must agree on `what`, e.g. the head dimension."""
    vals = {v for _, v in pairs}
    if len(vals) > 1:
        desc = ", ".join(f"{n}={v}" for n, v in pairs)
        raise ValueError(f"inconsistent {what}: {desc}")


def check_fraction(name: str, value: float, *, inclusive_high: bool = False) -> None:
    ok = 0.0 < value < 1.0 or (inclusive_high and value == 1.0)
    if not ok:
        hi = "1]" if inclusive_high else "1)"
        raise ValueError(f"{name} must lie in (0, {hi}; got {value}")


def check_gqa(n_q_heads: int, n_kv_heads: int) -> int:
    """Return the group size g = Hq / Hkv, or raise when Hq is not a multiple of Hkv."""
    if n_kv_heads <= 0 or n_q_heads % n_kv_heads:
        raise ValueError(
            f"query heads ({n_q_heads}) must be a positive multiple of KV heads ({n_kv_heads})"
        )
    return n_q_heads // n_kv_heads
