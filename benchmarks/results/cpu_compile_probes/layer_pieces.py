"""XLA:CPU compile time of one layer's pieces of Squeezed's decode (the tiny test model's shapes: 2 KV
heads, 4 query heads, d = 16, 1,792 fixed tokens, 90% sparsity + sink), each jitted alone after
`jax.clear_caches()`, at XLA's default optimisation level. Medians of 3.
Run from the repository root: .venv/bin/python benchmarks/results/cpu_compile_probes/layer_pieces.py"""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sqjax import squeezed
from sqjax.attention import attend_partial, causal_mask, retrieved_attention

L, HKV, HQ, D = 1792, 2, 4, 16
rng = np.random.default_rng(0)
k = jnp.asarray(rng.normal(size=(1, HKV, L, D)), jnp.float32)
q_obs = jnp.asarray(rng.normal(size=(1, HQ, 100, D)), jnp.float32)
index = squeezed.build_squeezed_index(k, q_obs, squeezed.SqueezedConfig(sparsity=0.9, n_sink=1), 0.25)
index = index[0] if isinstance(index, tuple) else index
layer = index.layer(0)
q = jnp.asarray(rng.normal(size=(HQ, 1, D)), jnp.float32)
k_new = jnp.zeros((HKV, 64, D))
q_pos, kv_pos = jnp.array([L]), jnp.full((64,), -1).at[0].set(L)
t, t1 = index.thresholds(1)


def scores(li, q):
    return squeezed.layer_scores(li, q, t1, 0.25, "kv")[0]


def lookup(li, q):
    return squeezed.lookup(li, q, t, t1, scale=0.25, vote="kv", n_tail=index.n_tail, capacity=index.capacity,
                           n_sink=index.n_sink)[0]


def gather(idx, count, q, k0, kn, qp, kvp):
    return retrieved_attention(q, k0, k0, idx, count, kn, kn, qp, kvp, 0.25, 512)


def lookup_and_gather(li, q, k0, kn, qp, kvp):
    r = lookup(li, q)
    return gather(r.idx, r.count, q, k0, kn, qp, kvp)


def new_part(q, kn, qp, kvp):
    empty = (kvp < 0)[None, :, None]
    return attend_partial(q, jnp.where(empty, 0, kn), jnp.where(empty, 0, kn), causal_mask(qp, kvp), 0.25).o


ret = lookup(layer, q)
cases = [("cluster scores", scores, (layer, q)), ("lookup (scores + retrieval)", lookup, (layer, q)),
         ("gathered attention (retrieved_attention)", gather, (ret.idx, ret.count, q, k[0], k_new, q_pos, kv_pos)),
         ("lookup + gathered attention", lookup_and_gather, (layer, q, k[0], k_new, q_pos, kv_pos)),
         ("the new tokens' attention alone", new_part, (q, k_new, q_pos, kv_pos)), ("x + 1", lambda x: x + 1, (q,))]
print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
for name, fn, args in cases:
    times = []
    for _ in range(3):
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.jit(fn).lower(*args).compile()
        times.append(time.perf_counter() - t0)
    print(f"{name:42s} {statistics.median(times):5.2f} s  ({', '.join(f'{x:.2f}' for x in times)})", flush=True)
