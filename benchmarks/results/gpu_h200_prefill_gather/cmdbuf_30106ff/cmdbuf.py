"""Prefill 4K over 512K (hierarchical, library path) and cuDNN dense: wall per call, device loop, span.
Run under different XLA_FLAGS to see what the wall time above the kernels' span is."""
import math, sys, json, os
import jax, jax.numpy as jnp
from benchmarks.speed import Plan, KeySource, _library_path, _dense_fns_nocat
from benchmarks._profile import trace_calls
from benchmarks._meta import time_ms, time_ms_looped
from sqjax.methods import ContextData, HierarchicalSqueezed
from sqjax import dispatch

L, T = 524288, 4096
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
k, v = src.kv(L, seed=L, n_heads=8)
data = ContextData(k[None], v[None], src.queries(100, seed=L, n_heads=32)[None], k_pre=k[None], scale=1 / math.sqrt(128))
kn, vn = src.kv(1024, seed=7, n_heads=8)
kp = (L + jnp.arange(1024)).astype(jnp.int32)
qp = (L + 1024 - T + jnp.arange(T)).astype(jnp.int32)
qs = [src.queries(T, seed=400 + j, n_heads=32) for j in range(3)]
m = HierarchicalSqueezed(sparsity=0.9, n_sink=1)
with dispatch.using("pallas"):
    index = m.build(data)[0]
lib = lambda q: _library_path(m, index, q, k, v, kn, vn, qp, kp, backend="pallas")
sets = [(q,) for q in qs]
r = {"flags": os.environ.get("XLA_FLAGS", "")}
r["sparse_ms"] = time_ms(lib, sets, reps=10)
r["sparse_ms_inner20"] = time_ms(lib, sets, reps=5, inner=20)
r["sparse_loop_ms"] = time_ms_looped(lambda q, ix, *c: _library_path(m, ix, q, *c, backend="pallas"), qs,
                                     fixed=(index, k, v, kn, vn, qp, kp), n_iter=4, reps=5)
tr = next(iter(trace_calls(lib, sets, n=3).values()))
r["sparse_busy_ms"], r["sparse_span_ms"] = tr["busy_ms_per_call"], tr["span_ms_per_call"]
kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
fn = _dense_fns_nocat(plan)["cudnn"]
dq = [q.swapaxes(0, 1)[None] for q in qs]
r["dense_ms"] = time_ms(fn, [(q, kk, vv) for q in dq], reps=5)
tr = next(iter(trace_calls(fn, [(q, kk, vv) for q in dq], n=3).values()))
r["dense_busy_ms"], r["dense_span_ms"] = tr["busy_ms_per_call"], tr["span_ms_per_call"]
print(json.dumps(r))
