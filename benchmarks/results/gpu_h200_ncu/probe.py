"""Hardware counters of the decode kernels at 512K (ncu), on the speed suite's inputs.

    ncu --profile-from-start off --clock-control none --set full -o OUT/probe \
        python benchmarks/results/gpu_h200_ncu/probe.py [--cpu]

Builds the speed suite's 512K case (captured SmolLM2 keys tiled, 32/8 heads, d=128, bf16, 90%
sparsity, 5% centroids; 1-level and hierarchical), warms every path up, then opens the profiler
range (cuProfilerStart) around one call of each: the 1-level fused decode at the App. C threshold and
at the single-query threshold, the hierarchical fused decode, and the two lookups alone.
"""
import ctypes
import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import speed
from sqjax import dispatch
from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed


def main():
    cpu = "--cpu" in sys.argv
    plan = speed.cpu_plan() if cpu else speed.Plan()
    length = 1024 if cpu else 524288
    hq, hkv = plan.shapes[0]
    be = plan.backend
    src = speed.KeySource(".scratch/captured/smollm2_qkv.npz", plan)
    print("keys:", src.kind, flush=True)
    scale = 1.0 / math.sqrt(plan.d)
    k, v = src.kv(length, seed=length, n_heads=hkv)
    q_obs = src.queries(100, seed=length, n_heads=hq)[None]
    data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
    from pallas_kernels import cluster_sort_layout
    built = {}
    for m in (Squeezed(sparsity=0.9, n_sink=1), HierarchicalSqueezed(sparsity=0.9, n_sink=1)):
        t0 = time.perf_counter()
        with dispatch.using(be):
            idx = m.build(data)[0]
        jax.block_until_ready(idx)
        lay = cluster_sort_layout(k, v, idx.layers.labels[0], idx.n_sink, idx.n_tail,
                                  num_clusters=idx.layers.counts.shape[-1])[:3]
        built[m.name] = (m, idx, lay)
        print(f"built {m.name} in {time.perf_counter() - t0:.1f}s", flush=True)
    m, idx, lay = built["squeezed"]
    t_single = speed.decode_threshold(idx, q_obs, scale, m.vote, 0.9, be)
    built["squeezed_single"] = (m, dataclasses.replace(idx, threshold=jnp.float32(t_single)), lay)
    n_new = 16 if cpu else 1024
    kn, vn = src.kv(n_new, seed=7, n_heads=hkv)
    kp = (length + jnp.arange(n_new)).astype(jnp.int32)
    q = src.queries(1, seed=100, n_heads=hq)
    qp = jnp.asarray([length + n_new - 1], jnp.int32)
    calls = []
    for name in ("squeezed", "squeezed_single", "hsqueezed"):
        m, idx, lay = built[name]
        calls.append((f"{name} decode", lambda m=m, idx=idx, lay=lay: speed._kernel_path(
            m, idx, lay, q, k, v, kn, vn, qp, kp, backend=be)))
    for name in ("squeezed", "hsqueezed"):
        m, idx, lay = built[name]
        calls.append((f"{name} lookup", lambda m=m, idx=idx, lay=lay: speed._kernel_path(
            m, idx, lay, q, k, v, kn, vn, qp, kp, backend=be, lookup_only=True)))
    for _, f in calls:  # compile and warm up outside the profiled range
        for _ in range(3):
            jax.block_until_ready(f())
    cuda = None if cpu else ctypes.CDLL("libcuda.so.1")
    for label, f in calls:
        print(f"profiled: {label}", flush=True)
        if cuda is not None:
            cuda.cuProfilerStart()
        jax.block_until_ready(f())
        if cuda is not None:
            cuda.cuProfilerStop()
    print("done", flush=True)


if __name__ == "__main__":
    main()
