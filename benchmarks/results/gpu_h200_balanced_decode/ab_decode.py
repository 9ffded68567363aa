"""A/B: balanced (HEAD) vs cluster-range (6ad78a3) clustered decode, kernel times from traces."""
import dataclasses, functools, json, sys, os
import jax, jax.numpy as jnp
sys.path.insert(0, ".scratch")
import clat_old
from benchmarks import decode_profile as dp
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped
from pallas_kernels import clustered_attention as clat
out = {}
for L in (131072, 524288):
    plan = dp.Plan(smoke=False, backend="pallas", n_sets=3, lengths=(L,))
    ctx = dp.make_inputs(plan, L, print)
    sets = ctx["whole"]
    variants = {"old": (clat_old.clustered_decode_attention, clat_old.ClusteredConfig())}
    for name, kw in [("new", {}), ("new_s1", dict(num_stages=1)), ("new_bk32", dict(block_k=32)),
                     ("new_sub64", dict(sub_clusters=64)), ("new_sub64_bk32", dict(sub_clusters=64, block_k=32)),
                     ("new_sub32", dict(sub_clusters=32)), ("new_t768", dict(target_programs=768))]:
        variants[name] = (clat.clustered_decode_attention, clat.ClusteredConfig(**kw))
    for name, (fn, cfg) in variants.items():
        f = jax.jit(functools.partial(fn, scale=ctx["scale"], vote="kv", backend="pallas", config=cfg))
        try:
            tr = kernel_time_per_call(f, sets, n=6, top=6)
            loop = time_ms_looped(lambda q, *c: f(q, *c), [s[0] for s in sets], fixed=sets[0][1:], n_iter=30, reps=5)
            ks = {k["name"][:24]: round(k["ms_per_call"] * 1e3, 1) for k in tr["kernels"]}
            out[f"{L}/{name}"] = dict(busy_us=round(tr["busy_ms_per_call"] * 1e3, 1), loop_ms=round(loop, 4), kernels=ks)
        except Exception as e:
            out[f"{L}/{name}"] = dict(error=str(e)[:300])
        print(L, name, out[f"{L}/{name}"], flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/ab.json", "w"), indent=1)
