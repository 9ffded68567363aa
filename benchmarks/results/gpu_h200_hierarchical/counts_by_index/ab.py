"""A/B in one process: the hierarchical decode's level-2 kernel with its counts loaded after the
live rows are known (shipped) or by index (`CentroidLookupConfig(level2_counts_by_index=True)`),
on the speed suite's inputs (captured keys tiled to 512K, Llama-3-8B shape, the suite's
`HierarchicalSqueezed(sparsity=0.9, n_sink=1)` index, 1024 new keys). Kernel time per call from a
profiler trace of 10 calls, each variant timed twice in alternation; the 1-level lookup
(`centroid_lookup_decode`) in the same run for the ratio. Outputs of the two variants must be equal.

Run from the repository root: python benchmarks/results/gpu_h200_hierarchical/counts_by_index/ab.py OUT_DIR"""
import json
import math
import os
import sys

sys.path.insert(0, ".")
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks._meta import metadata
from benchmarks._profile import kernel_time_per_call
from benchmarks.speed import KeySource, Plan
from sqjax.methods import ContextData, HierarchicalSqueezed

SMOKE = os.environ.get("AB_SMOKE") == "1"   # CPU plumbing check: 4K context, interpret mode, no timing
L, HQ, HKV, D, S = (4096 if SMOKE else 524288), 32, 8, 128, (64 if SMOKE else 1024)
BACKEND = "interpret" if SMOKE else "pallas"
out_dir = sys.argv[1]
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
scale = 1.0 / math.sqrt(D)
k, v = src.kv(L, seed=L, n_heads=HKV)
q_obs = src.queries(100, seed=L, n_heads=HQ)[None]
index, _ = HierarchicalSqueezed(sparsity=0.9, n_sink=1).build(
    ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale))
li = index.layer(0)
ks, vs, off = pk.cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                     num_clusters=index.layers.counts.shape[-1])[:3]
kn, vn = src.kv(S, seed=7, n_heads=HKV)
kp = (L + jnp.arange(S)).astype(jnp.int32)
qp = jnp.asarray([L + S - 1], jnp.int32)
qs = [src.queries(1, seed=100 + j, n_heads=HQ)[:, 0] for j in range(3)]
t1, t2 = jnp.float32(index.threshold1), jnp.float32(index.threshold)
c1, n1, c2, n2, par = li.centroids1, li.counts1, li.centroids, li.counts, li.parent
cfgs = {"shipped": pk.CentroidLookupConfig(), "by_index": pk.CentroidLookupConfig(level2_counts_by_index=True)}


def lookup(cfg):
    return jax.jit(lambda q: pk.hierarchical_lookup_decode(q, c1, n1, c2, n2, par, t1, t2, scale=scale,
                                                           backend=BACKEND, config=cfg))


def decode(cfg):
    return jax.jit(lambda q: pk.clustered_decode_hierarchical(q, ks, vs, c1, n1, c2, off, par, t1, t2, kn, vn, qp, kp,
                                                              scale=scale, backend=BACKEND, lookup_config=cfg))


one_level = jax.jit(lambda q: pk.centroid_lookup_decode(q, c2, n2, t2, scale=scale, backend=BACKEND))
fns = {(kind, name): (lookup if kind == "lookup" else decode)(cfg) for kind in ("lookup", "decode")
       for name, cfg in cfgs.items()}
res = {"meta": metadata(), "L": L, "Hq": HQ, "Hkv": HKV, "d": D, "dtype": "bfloat16",
       "C1": int(c1.shape[1]), "C2": int(c2.shape[1]), "rows": [], "equal": {}}
for kind in ("lookup", "decode"):
    a = [np.asarray(x) for x in jax.tree.leaves(fns[(kind, "shipped")](qs[0]))]
    b = [np.asarray(x) for x in jax.tree.leaves(fns[(kind, "by_index")](qs[0]))]
    res["equal"][kind] = all(np.array_equal(x, y) for x, y in zip(a, b))
jax.block_until_ready(one_level(qs[0]))
sets = [(q,) for q in qs]
for rep in range(0 if SMOKE else 2):
    for name in ("shipped", "by_index") if rep == 0 else ("by_index", "shipped"):
        for kind in ("lookup", "decode"):
            tr = kernel_time_per_call(fns[(kind, name)], sets, top=6)
            res["rows"].append({"rep": rep, "variant": name, "what": kind, "busy_ms": tr["busy_ms_per_call"],
                                "kernels": tr["kernels"]})
            print(rep, name, kind, f"{1e3 * tr['busy_ms_per_call']:.1f} us",
                  "; ".join(f"{x['name']} {1e3 * x['ms_per_call']:.1f}" for x in tr["kernels"][:4]), flush=True)
    tr = kernel_time_per_call(one_level, sets, top=4)
    res["rows"].append({"rep": rep, "variant": "one_level", "what": "lookup", "busy_ms": tr["busy_ms_per_call"],
                        "kernels": tr["kernels"]})
    print(rep, "one_level lookup", f"{1e3 * tr['busy_ms_per_call']:.1f} us", flush=True)
print("equal outputs:", res["equal"])
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, "ab.json"), "w") as f:
    json.dump(res, f, indent=1, default=float)
