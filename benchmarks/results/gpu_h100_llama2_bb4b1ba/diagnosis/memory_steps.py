"""One-off GPU diagnosis: where the 32/32 x 512K Squeezed build asks for 29 GiB (H100 80 GB).

Run on a GPU from the repository root: `PYTHONPATH=. python <this file>` (keys in .scratch/captured,
from `python -m benchmarks.capture_keys`); writes oom_check.json under $OUT. At d706b2e its k-means
step used 4096 keys per assignment step; the chunk is now `assign_chunk(32, c2)`."""
import dataclasses, time, json, os, traceback
import jax, jax.numpy as jnp
from benchmarks.speed import KeySource, Plan
from sqjax import squeezed
from sqjax.methods import Squeezed
from sqjax.kmeans import KMeansConfig, _spherical_kmeans_jit, assign_chunk

dev = jax.devices()[0]
out = {"device": dev.device_kind, "steps": []}
def mem(tag, **kw):
    s = dev.memory_stats() or {}
    row = {"step": tag, "in_use_gib": s.get("bytes_in_use", 0) / 2**30, "peak_gib": s.get("peak_bytes_in_use", 0) / 2**30,
           "limit_gib": s.get("bytes_limit", 0) / 2**30, **kw}
    out["steps"].append(row); print(json.dumps(row), flush=True)
def save():
    with open(os.path.join(os.environ.get("OUT", "."), "oom_check.json"), "w") as f:
        json.dump(out, f, indent=1)
plan = dataclasses.replace(Plan(), hkv=32, hq=32)
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
k, v = src.kv(524288, seed=524288, n_heads=32)
q_obs = src.queries(100, seed=524288, n_heads=32)[None]
jax.block_until_ready((k, v)); mem("kv")
cfg = Squeezed(sparsity=0.9, n_sink=1).config
lc = 524288 - cfg.n_obs - cfg.n_sink
c2, c1 = cfg.n_clusters(lc)
keys = k[None, :, cfg.n_sink:cfg.n_sink + lc]
kc = KMeansConfig(c2, cfg.kmeans_iters, chunk=assign_chunk(32, c2), seed=0, init=cfg.kmeans_init)
try:
    m = _spherical_kmeans_jit.lower(keys, jnp.uint32(0), kc).compile().memory_analysis()
    mem("kmeans_compiled", temp_gib=m.temp_size_in_bytes / 2**30, out_gib=m.output_size_in_bytes / 2**30,
        arg_gib=m.argument_size_in_bytes / 2**30)
except Exception as e:
    mem("kmeans_compile_failed", error=str(e)[:300])
save()
t0 = time.perf_counter()
try:
    layers = jax.block_until_ready(squeezed.cluster_fixed_context(k[None], cfg))
    mem("cluster_fixed_context", s=time.perf_counter() - t0)
except Exception as e:
    mem("cluster_fixed_context_failed", error=str(e)[:300]); save(); raise
save()
li = jax.tree.map(lambda a: a[0], layers)
for name, f in [("layer_scores", lambda: squeezed.layer_scores(li, q_obs[0], 0.0, 128 ** -0.5, cfg.vote)[0])]:
    try:
        r = jax.block_until_ready(f()); mem(name, shape=list(r.shape))
    except Exception as e:
        mem(name + "_failed", error=str(e)[:300])
save()
del layers, li
t0 = time.perf_counter()
try:
    idx, info = Squeezed(sparsity=0.9, n_sink=1).build(__import__("sqjax.methods", fromlist=["ContextData"]).ContextData(
        k[None], v[None], q_obs, k_pre=k[None], scale=128 ** -0.5))
    jax.block_until_ready(idx); mem("build", s=time.perf_counter() - t0, threshold=float(info["threshold"]))
except Exception as e:
    mem("build_failed", error=str(e)[:300], tb=traceback.format_exc()[-1500:])
save()
