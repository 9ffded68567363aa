"""Matmul precision of index builds.

JAX computes float32 matmuls in TF32 (a 10-bit mantissa) on recent NVIDIA GPUs unless told
otherwise (`jax_default_matmul_precision`); PyTorch, where the papers' builds ran, keeps TF32 off
for matmuls by default.  An index build (k-means assignments and seeding, the calibration's Eq. 1
scores, SnapKV's observation scores) is offline and cheap next to its prefill, so it always runs
its float32 matmuls at full precision, closer to a CPU-built index.  Measured on SmolLM2 (float32,
H200, 6000-token context, 3 k-means seeds, the prefill in TF32 both times): decode KL against full
attention 0.0220 with TF32 builds, 0.0143 with full-precision builds, 0.0170 on the CPU
(`benchmarks/results/gpu_real_model/`).  bf16 and f16 operands are unaffected (their products
are exact either way).  The model's own forward passes keep whatever JAX is set to; with
`JAX_DEFAULT_MATMUL_PRECISION=highest` a float32 model on the GPU reproduced the CPU's quality
table (`gpu_real_model/eval5_1f9a8f5/`).
"""

from __future__ import annotations

import functools

import jax

INDEX_BUILD_PRECISION = "highest"


def index_build(fn):
    """Decorator: run `fn` (an index build) with float32 matmuls at full precision."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with jax.default_matmul_precision(INDEX_BUILD_PRECISION):
            return fn(*args, **kwargs)
    return run
