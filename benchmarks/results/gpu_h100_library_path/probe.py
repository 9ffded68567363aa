"""Where the Squeezed library path's decode time goes at 32/8 x 512K (kernel trace per call).

Run on a GPU from the repository root: `PYTHONPATH=. python <this file>` (keys in .scratch/captured);
writes libpath_probe.json under $OUT."""
import dataclasses, functools, json, math, os, time
import jax, jax.numpy as jnp
from benchmarks.speed import KeySource, Plan, _library_path
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms
from sqjax.methods import ContextData, Squeezed

plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
L, hq, hkv = 524288, 32, 8
k, v = src.kv(L, seed=L, n_heads=hkv)
q_obs = src.queries(100, seed=L, n_heads=hq)[None]
k1 = k[None]
m = Squeezed(sparsity=0.9, n_sink=1)
t0 = time.perf_counter()
idx = m.build(ContextData(k1, v[None], q_obs, k_pre=k1, scale=1 / math.sqrt(128)))[0]
jax.block_until_ready(idx); print("build", time.perf_counter() - t0, "capacity", idx.capacity, flush=True)
kn, vn = src.kv(1024, seed=7, n_heads=hkv)
kv_pos = (L + jnp.arange(1024)).astype(jnp.int32)
qs = [src.queries(1, seed=100 + j, n_heads=hq) for j in range(3)]
sets = [(idx, q, k, v, kn, vn, (L + 1023 + jnp.arange(1)).astype(jnp.int32), kv_pos) for q in qs]
lib = functools.partial(_library_path, m, backend=plan.backend)
out = {"wall_ms": time_ms(lib, sets, reps=5)}
tr = kernel_time_per_call(lib, sets, top=15)
out["trace"] = tr
print(json.dumps(out, indent=1)[:6000], flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "libpath_probe.json"), "w") as f:
    json.dump(out, f, indent=1)
