"""A/B: clustered decode attention kernel with and without compaction of the selected clusters."""
import functools, json, os
import jax
from benchmarks import decode_profile as dp
from benchmarks._profile import kernel_time_per_call
from benchmarks._meta import time_ms_looped, metadata
from pallas_kernels import clustered_attention as clat
out = {"meta": metadata()}
for L in (131072, 524288):
    plan = dp.Plan(smoke=False, backend="pallas", n_sets=3, lengths=(L,))
    ctx = dp.make_inputs(plan, L, print)
    sets = ctx["whole"]
    ref = dp.reference(ctx)
    for name, kw in [("none", dict(compact_slots=None)), ("k32", {}), ("k16", dict(compact_slots=16)),
                     ("k64", dict(compact_slots=64)), ("k32_bk32", dict(block_k=32)),
                     ("k32_sub256", dict(sub_clusters=256)), ("none_again", dict(compact_slots=None))]:
        cfg = clat.ClusteredConfig(**kw)
        f = jax.jit(functools.partial(clat.clustered_decode_attention, scale=ctx["scale"], vote="kv",
                                      backend="pallas", config=cfg))
        try:
            o = f(*sets[0]).astype("float32")
            err = float(jax.numpy.linalg.norm(o - ref["o"].astype("float32")) / jax.numpy.linalg.norm(ref["o"].astype("float32")))
            tr = kernel_time_per_call(f, sets, n=6, top=6)
            loop = time_ms_looped(lambda q, *c: f(q, *c), [s[0] for s in sets], fixed=sets[0][1:], n_iter=30, reps=7)
            ks = {k["name"][:24]: round(k["ms_per_call"] * 1e3, 1) for k in tr["kernels"]}
            out[f"{L}/{name}"] = dict(config=kw, rel_err_vs_reference=err, busy_us=round(tr["busy_ms_per_call"] * 1e3, 1),
                                      loop_ms=round(loop, 4), kernels_us=ks)
        except Exception as e:
            out[f"{L}/{name}"] = dict(config=kw, error=str(e)[:300])
        print(L, name, out[f"{L}/{name}"], flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/ab2.json", "w"), indent=1)
