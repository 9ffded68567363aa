"""Where the GPU time of `probe.py`'s first minutes went (it printed no row in 8 minutes): each
phase's lowering, compilation and first call timed apart, T = 128, QUEST block route at 128K.

    python benchmarks/results/gpu_h200_mask_chunks/phases.py
"""

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sqjax import dispatch, quest  # noqa: E402
from sqjax.methods import ContextData, Quest  # noqa: E402

L, HQ, HKV, D, T = 131072, 32, 8, 128, 128
T0 = time.perf_counter()


def say(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def timed(name, fn, *args):
    t = time.perf_counter()
    lo = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    c = lo.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(c(*args))
    t3 = time.perf_counter()
    jax.block_until_ready(c(*args))
    say(f"{name}: lower {t1 - t:.2f} s, compile {t2 - t1:.2f} s, first call {t3 - t2:.3f} s, "
        f"second {1e3 * (time.perf_counter() - t3):.2f} ms")


key = jax.random.split(jax.random.key(0), 4)
k = jax.random.normal(key[0], (1, HKV, L, D), jnp.float32).astype(jnp.bfloat16)
v = jax.random.normal(key[1], (1, HKV, L, D), jnp.float32).astype(jnp.bfloat16)
q = jax.random.normal(key[2], (HQ, T, D), jnp.float32).astype(jnp.bfloat16)
kn = jax.random.normal(key[3], (HKV, T, D), jnp.float32).astype(jnp.bfloat16)
jax.block_until_ready((k, v, q, kn))
say("inputs", jax.devices()[0].device_kind)
m = Quest(budget=0.15, dense_layers=0)
idx, _ = m.build(ContextData(k, v, q[None, :, :4], scale=1 / math.sqrt(D)))
jax.block_until_ready(idx)
say("Quest.build")
pos = L + jnp.arange(T, dtype=jnp.int32)
timed("page_scores [Hs, T, P]", lambda q, a, b: quest.page_scores(q, a, b, "kv"), q, idx["kmin"][0], idx["kmax"][0])
timed("select (mask)", lambda q, kc, ix: m.select(ix, 0, q, None, kc).mask, q, k[0], idx)


def block(q, kn, kc, vc, ix):
    with dispatch.using("pallas"):
        sel = m.select(ix, 0, q, None, kc)
        return dispatch.attention(q, kc, vc, sel, kn, kn, pos, pos, 1 / math.sqrt(D))


timed("select + attention (key chunks)", block, q, kn, k[0], v[0], idx)
