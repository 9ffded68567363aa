"""Where the host spends a prefill call of the library path (hierarchical Squeezed, 4K over 512K)."""
import math, sys, time, json, statistics, os
import jax, jax.numpy as jnp
from benchmarks.speed import Plan, KeySource, _library_path
from benchmarks._profile import device_activity
from benchmarks._meta import dispatch_ms, time_ms
from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed
from sqjax import dispatch

L = int(sys.argv[1]) if len(sys.argv) > 1 else 524288
T = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
BE = "pallas" if jax.default_backend() == "gpu" else "reference"
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
k, v = src.kv(L, seed=L, n_heads=8)
data = ContextData(k[None], v[None], src.queries(100, seed=L, n_heads=32)[None], k_pre=k[None], scale=1 / math.sqrt(128))
kn, vn = src.kv(1024, seed=7, n_heads=8)
kp = (L + jnp.arange(1024)).astype(jnp.int32)
qp = (L + 1024 - T + jnp.arange(T)).astype(jnp.int32)
qs = [src.queries(T, seed=400 + j, n_heads=32) for j in range(3)]
out = {}
for m in (HierarchicalSqueezed(sparsity=0.9, n_sink=1),):
    with dispatch.using(BE):
        index = m.build(data)[0]
    f = lambda q: _library_path(m, index, q, k, v, kn, vn, qp, kp, backend=BE)
    sets = [(q,) for q in qs]
    r = {"time_ms_inner5": time_ms(f, sets, reps=10), "time_ms_inner20": time_ms(f, sets, reps=5, inner=20),
         "dispatch_ms": dispatch_ms(f, sets)}
    # host planes of a trace of 3 calls
    def run():
        o = None
        for q in qs:
            o = f(q)
        jax.block_until_ready(o)
    planes = device_activity(run, top=25, plane_prefix="/host")
    r["host"] = {p: {"busy_ms": a["busy_ms"], "span_ms": a["span_ms"], "n": a["n_kernels"],
                     "top": a["by_name"][:25]} for p, a in planes.items()}
    dev = device_activity(run, top=5)
    r["device"] = {p: {"busy_ms": a["busy_ms"], "span_ms": a["span_ms"], "n": a["n_kernels"]} for p, a in dev.items()}
    out[m.name] = r
    print(json.dumps(r, indent=1)[:6000])
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "host_prof.json"), "w"), indent=1)
