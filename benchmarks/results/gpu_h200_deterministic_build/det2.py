"""Reproducible SAAP and sharded index builds on the GPU (commit c74e7af: `Saap(deterministic_build=...)`,
`SqueezedConfig(deterministic_build=...)` reaching `sharding.cluster_sharded`).  Builds SAAP's k-means buckets
and the sharded clustering (a 1 x 1 mesh on the one GPU; 1 and 2 levels) on the speed suite's captured keys
tiled (8 KV heads, d = 128, bf16) and writes a SHA-256 of every array; run twice in separate processes
per mode and compare (`compare` mode), as det.py does for the single-device Squeezed builds.

    DET=1|0 OUT=... TAG=name python det2.py        # one build per length and method
    OUT=... python det2.py compare A B
"""
import hashlib, json, math, os, sys, time
sys.path.insert(0, os.getcwd())

OUT = os.environ["OUT"]
if sys.argv[1:2] == ["compare"]:
  a, b = (json.load(open(f"{OUT}/det2_{t}.json")) for t in sys.argv[2:4])
  res = {L: {m: {f: a["hashes"][L][m][f] == b["hashes"][L][m][f] for f in a["hashes"][L][m]} for m in a["hashes"][L]}
         for L in a["hashes"]}
  print(sys.argv[2], "vs", sys.argv[3], json.dumps(res))
  json.dump(res, open(f"{OUT}/compare_{sys.argv[2]}_{sys.argv[3]}.json", "w"), indent=1)
  sys.exit(0)

import jax, jax.numpy as jnp, numpy as np
from benchmarks.speed import Plan, KeySource
from benchmarks._meta import metadata
from sqjax.methods import ContextData, Saap
from sqjax import dispatch, sharding, squeezed

det = os.environ.get("DET", "1") == "1"
src = KeySource(".scratch/captured/smollm2_qkv.npz", Plan())
scale = 1.0 / math.sqrt(128)
out = {"meta": {**metadata(), "tag": os.environ["TAG"], "deterministic_build": det}, "hashes": {}, "seconds": {}}
h = lambda a: hashlib.sha256(np.asarray(a).tobytes()).hexdigest()[:16]   # noqa: E731
mesh = sharding.make_mesh(1, 1)
for L in [int(x) for x in os.environ.get("DET_L", "131072,524288").split(",")]:
  k, v = src.kv(L, seed=L, n_heads=8)
  q_obs = src.queries(100, seed=L, n_heads=32)[None]
  data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=scale)
  out["hashes"][str(L)] = {}
  t = time.time()
  with dispatch.using("auto"):
    idx = Saap(deterministic_build=det).build(data)[0]
  jax.block_until_ready(idx["unit"])
  out["seconds"][f"{L}/saap"] = round(time.time() - t, 2)
  out["hashes"][str(L)]["saap"] = {f: h(idx[f]) for f in ("unit", "labels", "off", "lst")}
  for name, hier in (("sharded", False), ("sharded_hier", True)):
    cfg = squeezed.SqueezedConfig(sparsity=0.9, n_sink=1, hierarchical=hier, deterministic_build=det)
    t = time.time()
    lay = sharding.cluster_sharded(k[None], cfg, mesh)
    jax.block_until_ready(lay)
    out["seconds"][f"{L}/{name}"] = round(time.time() - t, 2)
    out["hashes"][str(L)][name] = {f.name: h(getattr(lay, f.name)) for f in __import__("dataclasses").fields(lay)} \
        if hasattr(lay, "__dataclass_fields__") else {str(i): h(a) for i, a in enumerate(jax.tree.leaves(lay))}
  print(L, out["seconds"], flush=True)
  del k, v, data
json.dump(out, open(f"{OUT}/det2_{os.environ['TAG']}.json", "w"), indent=1)
