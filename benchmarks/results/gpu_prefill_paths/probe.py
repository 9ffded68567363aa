"""A/B of GPU routes for one layer's Squeezed prefill of a block (90% sparsity, 1 level and hierarchical).

    PYTHONPATH=. python benchmarks/results/gpu_prefill_paths/probe.py OUT_DIR [--cpu-smoke]

A. the library route (`Method.select`: lookup kernels -> `squeezed.retrieve`, a score sort for the
   capacity's overflow policy, cumsums, a search over the capacity's slots -> `dispatch.attention`:
   `gather_live_rows` + cuDNN + the new part + merge): what `FixedContext.ask` ran for a question's
   prefill before this change;
C. `sqjax.dispatch.clustered_prefill` over the cluster-contiguous copy the GPU context holds for
   decode: the same lookup kernels, the selected clusters' row ranges expanded by cumsums (no sort),
   every selected row (no capacity, no branch), the gathered rows dealt round-robin into cuDNN's key
   splits; what `FixedContext` runs now.
(The first run of this probe, `h100_3b4c9f6/`, had a B route: `clustered_prefill_attention` before the
round-robin gather, with capacity None and with the index's capacity.)

Shapes: Llama-3-8B attention (32/8 heads, d = 128, bf16), captured SmolLM2 keys tiled
(`.scratch/captured`), the block's own keys as its new part (a question's prefill). Each case:
outputs compared (C vs A), wall time per call (`time_ms`), kernel busy time per call and the
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
from benchmarks.speed import KeySource, Plan, _kernel_path, _library_path, cpu_plan
from pallas_kernels import cluster_sort_layout
from sqjax import dispatch
from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed

CASES = ((131072, 128, ("squeezed", "hsqueezed")), (131072, 1024, ("squeezed",)),
         (524288, 4096, ("hsqueezed", "squeezed")))


def main(out: str, smoke: bool = False) -> int:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = cpu_plan() if smoke else Plan()
    be = "interpret" if smoke else "pallas"
    cases = ((1024, 32, ("squeezed", "hsqueezed")),) if smoke else CASES
    src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
    scale = 1.0 / math.sqrt(plan.d)
    res = {"meta": metadata(), "keys": src.kind, "rows": []}
    lib = jax.jit(lambda m, index, *a: _library_path(m, index, *a, backend=be)[0], static_argnums=0)
    kern = functools.partial(_kernel_path, backend=be)
    for length, t, names in cases:
        k, v = src.kv(length, seed=length)
        q_obs = src.queries(100, seed=length)[None]
        data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
        kn, vn = src.kv(t, seed=7 + t)
        pos = (length + jnp.arange(t)).astype(jnp.int32)
        qs = [src.queries(t, seed=100 * t + j) for j in range(3)]
        for name in names:
            t0 = time.perf_counter()
            m = (HierarchicalSqueezed if name == "hsqueezed" else Squeezed)(sparsity=0.9, n_sink=1)
            with dispatch.using(be):
                index = m.build(data)[0]
            layout = cluster_sort_layout(k, v, index.layers.labels[0], index.n_sink, index.n_tail,
                                         num_clusters=index.layers.counts.shape[-1])[:3]
            print(f"[build] {name} L={length} T={t}: {time.perf_counter() - t0:.1f}s, capacity {index.capacity}",
                  flush=True)
            routes = {"A_library": (lambda q: lib(m, index, q, k, v, kn, vn, pos, pos)),
                      "C_clustered": (lambda q: kern(m, index, layout, q, k, v, kn, vn, pos, pos))}
            ref = np.asarray(routes["A_library"](qs[0]), np.float32)
            for route, fn in routes.items():
                row = {"L": length, "T": t, "method": name, "route": route}
                try:
                    o = np.asarray(fn(qs[0]), np.float32)
                    row["max_abs_diff_vs_A"] = float(np.max(np.abs(o - ref)))
                    row["rel_diff_vs_A"] = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
                    row["finite"] = bool(np.isfinite(o).all())
                    row["wall_ms"] = time_ms(fn, [(q,) for q in qs], reps=10, inner=3)
                    tr = kernel_time_per_call(fn, [(q,) for q in qs], n=6, top=14)
                    if tr:
                        row.update(busy_ms=tr["busy_ms_per_call"], span_ms=tr.get("span_ms_per_call"),
                                   kernels_per_call=tr.get("kernels_per_call"), kernels=tr["kernels"])
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                res["rows"].append(row)
                print(f"[{route}] {name} L={length} T={t}: "
                      + json.dumps({kk: vv for kk, vv in row.items() if kk != "kernels"}), flush=True)
                for kk in row.get("kernels", [])[:10]:
                    print(f"    {kk['ms_per_call']:.4f} ms x{kk.get('per_call', 1):g} {kk['name'][:70]}", flush=True)
            write_json(out_dir / "probe.json", res)
            del index, layout
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/prefill_paths", smoke="--cpu-smoke" in sys.argv))
