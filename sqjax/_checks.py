"""Input validation shared by the core algorithms: clear ValueErrors that name shapes."""

from __future__ import annotations

import numbers
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


def check_same(what: str, pairs: Sequence[tuple[str, int]]) -> None:
    """All (name, value) pairs must agree on `what`, e.g. the head dimension."""
    vals = {v for _, v in pairs}
    if len(vals) > 1:
        desc = ", ".join(f"{n}={v}" for n, v in pairs)
        raise ValueError(f"inconsistent {what}: {desc}")


def _is_real(value) -> bool:
    """A real number: Python/NumPy ints and floats, or a 0-d numeric array (bools are not numbers here)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    dt = getattr(value, "dtype", None)
    return dt is not None and np.ndim(value) == 0 and (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer))


def check_fraction(name: str, value: float, *, inclusive_high: bool = False) -> None:
    hi = "1]" if inclusive_high else "1)"
    if not _is_real(value):
        raise ValueError(f"{name} must be a number in (0, {hi}; got {value!r} ({type(value).__name__})")
    ok = 0.0 < value < 1.0 or (inclusive_high and value == 1.0)
    if not ok:
        raise ValueError(f"{name} must lie in (0, {hi}; got {value}")


def check_count(name: str, value: int | None, lo: int = 0, *, optional: bool = False) -> None:
    """A Python/NumPy integer >= `lo` (a setting such as a token count; bools are not counts).
    `optional`: None is allowed too (the setting's default is computed elsewhere)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an integer >= {lo}{none}; got {value!r} ({type(value).__name__})")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}; got {value}")


SEED_LIMIT = 2 ** 32   # PRNG seeds become uint32


def check_seed(name: str, value) -> None:
    """A PRNG seed: a Python/NumPy integer in [0, 2**32)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2**32); got {value!r}")


def derived_seed(seed: int, offset: int) -> int:
    """`seed + offset` wrapped into [0, 2**32): the seed of one part of a job (a layer group, a level)."""
    return (int(seed) + int(offset)) % SEED_LIMIT


def check_choice(name: str, value, choices: Sequence[str]) -> None:
    """A string setting that must be one of `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}; got {value!r}")


def check_gqa(n_q_heads: int, n_kv_heads: int, what: str = "query heads") -> int:
    """Return the group size g = Hq / Hkv, or raise when Hq is not a multiple of Hkv.
    `what` names the first count when it is not the query heads (e.g. the selection heads Hs)."""
    if n_kv_heads <= 0 or n_q_heads % n_kv_heads:
        raise ValueError(
            f"{what} ({n_q_heads}) must be a positive multiple of KV heads ({n_kv_heads})"
        )
    return n_q_heads // n_kv_heads
