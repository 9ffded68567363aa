"""Is the index build reproducible on the GPU?  Builds the speed suite's Squeezed and hierarchical
indexes (captured SmolLM2 keys tiled, 32/8 heads, d = 128, bf16) and writes a SHA-256 of every
index array; run it twice in separate processes and compare (`compare` mode).

    CODE_DIR=<code> OUT=... TAG=name python det.py            # one build
    OUT=... python det.py compare A B                          # A, B: TAGs
"""
import hashlib, json, math, os, sys, time
sys.path.insert(0, os.path.abspath(os.environ.get("CODE_DIR", ".")))

OUT = os.environ["OUT"]
if sys.argv[1:2] == ["compare"]:
  a, b = (json.load(open(f"{OUT}/det_{t}.json")) for t in sys.argv[2:4])
  res = {L: {m: {f: a["hashes"][L][m][f] == b["hashes"][L][m][f] for f in a["hashes"][L][m]} for m in a["hashes"][L]}
         for L in a["hashes"]}
  print(sys.argv[2], "vs", sys.argv[3], json.dumps(res))
  json.dump(res, open(f"{OUT}/compare_{sys.argv[2]}_{sys.argv[3]}.json", "w"), indent=1)
  sys.exit(0)

import jax, jax.numpy as jnp, numpy as np
from benchmarks.speed import Plan, KeySource
from benchmarks._meta import metadata
from sqjax.methods import ContextData, Squeezed, HierarchicalSqueezed
from sqjax import dispatch

T0 = time.time()
src = KeySource(".scratch/captured/smollm2_qkv.npz", Plan())
scale = 1.0 / math.sqrt(128)
out = {"meta": {**metadata(), "tag": os.environ["TAG"]}, "hashes": {}, "seconds": {}}
for L in [int(x) for x in os.environ.get("DET_L", "131072,524288").split(",")]:
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
  out["hashes"][str(L)] = {}
  # DET=1: Squeezed(deterministic_build=True) (the 4fb9b77 run had the deterministic programs as its default)
  kw = {"deterministic_build": True} if os.environ.get("DET", "1") == "1" else {}
  for name, m in (("squeezed", Squeezed(sparsity=0.9, n_sink=1, **kw)),
                  ("hsqueezed", HierarchicalSqueezed(sparsity=0.9, n_sink=1, **kw))):
    t = time.time()
    with dispatch.using("auto"):
      idx = m.build(data)[0]
    jax.block_until_ready(idx.layers.centroids)
    out["seconds"][f"{L}/{name}"] = round(time.time() - t, 2)
    lay = idx.layers
    fields = {f: getattr(lay, f) for f in ("centroids", "counts", "labels", "offsets", "centroids1", "counts1", "parent")}
    fields["threshold"] = jnp.asarray(idx.threshold)
    fields["threshold1"] = jnp.asarray(idx.threshold1)
    out["hashes"][str(L)][name] = {f: hashlib.sha256(np.asarray(a).tobytes()).hexdigest()[:16] for f, a in fields.items()}
    print(L, name, out["seconds"][f"{L}/{name}"], out["hashes"][str(L)][name], flush=True)
json.dump(out, open(f"{OUT}/det_{os.environ['TAG']}.json", "w"), indent=1)
