"""A/B of two GPU routes for one layer's Squeezed prefill of a block (1 level, 90% sparsity).

    PYTHONPATH=. python benchmarks/results/gpu_prefill_paths/probe.py OUT_DIR

A. the library route that `FixedContext.ask` takes for a question's prefill today:
   `Squeezed.select` (lookup kernels -> `squeezed.retrieve`: a score sort, cumsums, a search over the
   capacity's slots) -> `dispatch.attention` (`gather_live_rows` + cuDNN + the new part + merge);
B. `pallas_kernels.clustered_prefill_attention` over the cluster-contiguous copy the GPU context
   already holds for decode: the same lookup kernels, the selected clusters' row ranges expanded
   by cumsums (`_expand_positions`, no sort), the same gather + cuDNN; capacity None (every
   selected row: nothing dropped, no branch) and capacity = the index's (a `lax.cond` to the
   full capacity on overflow).

Shapes: Llama-3-8B attention (32/8 heads, d = 128, bf16), captured SmolLM2 keys tiled
(`.scratch/captured`), the block's own keys as its new part (a question's prefill). Each case:
outputs compared (B vs A), wall time per call (`time_ms`), kernel busy time per call and the
largest kernels (profiler trace).
"""
from __future__ import annotations

import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata, time_ms, write_json
from benchmarks._profile import kernel_time_per_call
from benchmarks.speed import KeySource, Plan, _library_path, cpu_plan
from pallas_kernels import cluster_sort_layout, clustered_prefill_attention
from sqjax import dispatch
from sqjax.methods import ContextData, Squeezed

CASES = ((131072, 128), (131072, 1024), (524288, 4096))


def main(out: str, smoke: bool = False) -> int:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = cpu_plan() if smoke else Plan()
    be = "interpret" if smoke else "pallas"
    cases = ((1024, 32),) if smoke else CASES
    src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
    scale = 1.0 / math.sqrt(plan.d)
    res = {"meta": metadata(), "keys": src.kind, "rows": []}
    for length, t in cases:
        t0 = time.perf_counter()
        k, v = src.kv(length, seed=length)
        q_obs = src.queries(100, seed=length)[None]
        data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
        m = Squeezed(sparsity=0.9, n_sink=1)
        with dispatch.using(be):
            index = m.build(data)[0]
        ks, vs, off, _ = cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                             num_clusters=index.layers.counts.shape[-1])
        cent = index.layer(0).centroids.astype(k.dtype)
        thr = jnp.float32(index.thresholds(t)[0])
        kn, vn = src.kv(t, seed=7 + t)
        pos = (length + jnp.arange(t)).astype(jnp.int32)
        qs = [src.queries(t, seed=100 * t + j) for j in range(3)]
        print(f"[build] L={length} T={t}: {time.perf_counter() - t0:.1f}s, capacity {index.capacity}", flush=True)

        lib = jax.jit(lambda q: _library_path(m, index, q, k, v, kn, vn, pos, pos, backend=be)[0])
        routes = {"A_library": lib}
        for name, cap in (("B_clustered_nocap", None), ("B_clustered_cap", int(index.capacity))):
            routes[name] = jax.jit(functools.partial(
                lambda q, cap: clustered_prefill_attention(q, ks, vs, cent, off, thr, kn, vn, pos, pos, scale=scale,
                                                           capacity=cap, backend=be), cap=cap))
        ref = np.asarray(lib(qs[0]), np.float32)
        for name, fn in routes.items():
            row = {"L": length, "T": t, "route": name}
            try:
                o = np.asarray(fn(qs[0]), np.float32)
                row["max_abs_diff_vs_A"] = float(np.max(np.abs(o - ref)))
                row["max_abs_A"] = float(np.max(np.abs(ref)))
                row["wall_ms"] = time_ms(fn, [(q,) for q in qs], reps=10, inner=3)
                tr = kernel_time_per_call(fn, [(q,) for q in qs], n=6, top=14)
                if tr:
                    row["busy_ms"] = tr["busy_ms_per_call"]
                    row["kernels"] = tr["kernels"]
                    row["span_ms"] = tr.get("span_ms_per_call")
                    row["kernels_per_call"] = tr.get("kernels_per_call")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            res["rows"].append(row)
            print(f"[{name}] L={length} T={t}: " + json.dumps({kk: vv for kk, vv in row.items() if kk != "kernels"}),
                  flush=True)
            for kk in row.get("kernels", [])[:14]:
                print(f"    {kk['ms_per_call']:.4f} ms x{kk.get('per_call', 1):g} {kk['name'][:70]}", flush=True)
        write_json(out_dir / "probe.json", res)
        del index, ks, vs, k, v, data
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/prefill_paths", smoke="--cpu-smoke" in sys.argv))
