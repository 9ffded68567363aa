"""One layer of Squeezed's CPU decode at the demo's shapes (SmolLM2: 9 query / 3 KV heads, d = 64,
5,862 keys, capacity 2,055 as the demo's index), Gaussian keys: the retrieval's slot search per method,
the gather route over the whole capacity (`sparse_attention_reference`) against the chunked one
(`retrieved_attention`) per chunk, and full attention. Medians (and minima) of 15 rounds × 20 calls,
the arms interleaved. Run from the repository root: .venv/bin/python benchmarks/results/cpu_gather_decode/layer_probe.py"""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention import sparse_attention_reference
from sqjax import squeezed
from sqjax.attention import fixed_context_attention, retrieved_attention

hq, hkv, d, length, cap, n_sink, n_tail = 9, 3, 64, 5862, 2055, 1, 100
rng = np.random.default_rng(0)
k, v = (jnp.asarray(rng.standard_normal((hkv, length, d), np.float32)) for _ in range(2))
q = jnp.asarray(rng.standard_normal((hq, 1, d), np.float32))
kn = vn = jnp.asarray(rng.standard_normal((hkv, 40, d), np.float32))
q_pos, kv_pos = jnp.array([length + 39], jnp.int32), jnp.arange(length, length + 40, dtype=jnp.int32)
scale = d ** -0.5
layer = jax.tree.map(lambda a: a[0], squeezed.cluster_fixed_context(
    k[None, :, n_sink:length - n_tail], squeezed.SqueezedConfig(sparsity=0.9)))
scores = squeezed.layer_scores(layer, q, None, scale, "kv")[0]
thr = float(jnp.quantile(scores, 0.9))
ret = squeezed.lookup(layer, q, thr, None, scale=scale, vote="kv", n_tail=n_tail, capacity=cap, n_sink=n_sink)[0]
print("clusters", layer.centroids.shape[1], "counts", np.asarray(ret.count).tolist(), "capacity", cap)

arms = []


def arm(name, f, *args):
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    arms.append((name, f, args))


selected = (scores > thr) & (layer.counts > 0)
cum = jnp.cumsum(jnp.where(selected, layer.counts, 0), axis=-1)
slots = jnp.arange(cap - n_tail - n_sink, dtype=jnp.int32)
for m in ("scan_unrolled", "scan", "compare_all", "sort"):
    arm(f"slot search {m}", lambda c, m=m: jax.vmap(lambda x: jnp.searchsorted(x, slots, side="right", method=m))(c), cum)
whole = lambda q, i, c: sparse_attention_reference(q, k, v, i, c, kn, vn, q_pos, kv_pos, scale=scale)  # noqa: E731
arm("gather, whole capacity", whole, q, ret.idx, ret.count)
for chunk in (128, 256, 512, 1024):
    f = lambda q, i, c, ch=chunk: retrieved_attention(q, k, v, i, c, kn, vn, q_pos, kv_pos, scale, ch)  # noqa: E731
    err = float(jnp.max(jnp.abs(jax.jit(f)(q, ret.idx, ret.count) - whole(q, ret.idx, ret.count))))
    print(f"chunk {chunk}: max |diff| vs the whole-capacity gather {err:.1e}")
    arm(f"gather, chunks of {chunk}", f, q, ret.idx, ret.count)
arm("full attention", lambda q: fixed_context_attention(q, k, v, None, kn, vn, q_pos, kv_pos, scale), q)
times = {name: [] for name, _, _ in arms}
for _ in range(15):
    for name, f, args in arms:
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t)
        times[name].append(statistics.median(ts))
for name, ts in times.items():
    print(f"{name:28s} median {statistics.median(ts) * 1e6:7.1f} us   min {min(ts) * 1e6:7.1f} us")
