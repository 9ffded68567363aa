"""A/B: models.generate (device-carried step inputs) vs the previous loop, 8B-shaped random model."""
# generate_old.py: `git show 0067b00:models/generate.py` with its two relative imports made absolute
# (from models.forward / models.kv_cache), placed in .scratch/.
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
sys.path.insert(0, ".scratch")
import generate_old as gold
import importlib
gnew = importlib.import_module("models.generate")
from models import LlamaConfig
from models.llama import Llama

SMALL = os.environ.get("GEN_SMALL") == "1"
if SMALL:
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, rope_theta=10000.0, max_position_embeddings=4096, name="tiny")
    dt = jnp.float32
else:
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192, name="8b-shaped")
    dt = jnp.bfloat16
model = Llama(cfg, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(0))
prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, size=128).tolist()
N = int(os.environ.get("GEN_N", "64"))
res = {"device": jax.devices()[0].device_kind, "commit": os.environ.get("SQJAX_GIT_COMMIT", "?"), "new_tokens": N,
       "runs": []}
ids = {}
for name, mod in [("old", gold), ("new", gnew)] * int(os.environ.get("GEN_PAIRS", "3")):
    r = mod.generate(model, prompt, N, stop_ids=(), cache_dtype=dt)
    ids.setdefault(name, r.token_ids[0])
    res["runs"].append({"loop": name, "ms_per_token": 1e3 * r.decode_seconds / r.decode_steps})
    print(name, res["runs"][-1], flush=True)
res["same_tokens"] = ids["old"] == ids["new"]
for name in ("old", "new"):
    v = [x["ms_per_token"] for x in res["runs"][2:] if x["loop"] == name]   # first pair = compile
    res[f"{name}_ms_per_token_median"] = float(np.median(v))
print(json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gen_ab.json"), "w"), indent=1)
