"""The one place that decides how a kernel runs.

Every public op in ``pallas_kernels`` takes ``backend: str = "auto"``:

* ``"auto"``      -- compiled Pallas (Triton lowering) when ``jax.default_backend()``
                     is ``"gpu"``, else the op's plain-jnp reference.
* ``"pallas"``    -- compiled Pallas; needs a GPU.
* ``"interpret"`` -- the same Pallas kernel run by the Pallas interpreter (any
                     device; this is what the CPU tests use).
* ``"reference"`` -- the plain-jnp ``*_reference`` beside the kernel.

``resolve_backend`` turns the user's string into one of the last three, and
``pallas_call`` is the only caller of ``pl.pallas_call`` in the package, so the
compiler parameters (``num_warps``, ``num_stages``) are always passed explicitly.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BACKENDS = ("auto", "pallas", "interpret", "reference")


def _platform() -> str:
  return jax.default_backend()


def resolve_backend(backend: str) -> str:
  """Maps ``backend`` to ``"pallas"``, ``"interpret"`` or ``"reference"``."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  on_gpu = _platform() == "gpu"
  if backend == "auto":
    return "pallas" if on_gpu else "reference"
  if backend == "pallas" and not on_gpu:
    raise ValueError(
        "backend='pallas' compiles Triton kernels and needs a GPU (default "
        f"backend is {_platform()!r}); use backend='interpret' to run "
        "the same kernel in the Pallas interpreter, or 'reference'.")
  return backend


def pallas_call(kernel: Callable[..., Any], *, backend: str, num_warps: int,
                num_stages: int, **kwargs: Any) -> Callable[..., Any]:
  """``pl.pallas_call`` with Triton compiler params; interpreted if asked."""
  if backend not in ("pallas", "interpret"):
    raise ValueError(f"pallas_call needs backend 'pallas' or 'interpret', got {backend!r}")
  return pl.pallas_call(
      kernel,
      interpret=backend == "interpret",
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      **kwargs,
  )
