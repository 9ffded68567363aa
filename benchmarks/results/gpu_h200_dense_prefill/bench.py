"""Full attention's prefill of a question block over a 128K fixed context, one layer (Llama-3-8B
attention: 32/8 heads, d = 128, bf16), the routes the library can take, in one process:
  split_kv       = pallas_kernels.dense_decode_attention (the route before this change),
  flash_auto     = dense_prefill_attention, cuDNN over the fixed K/V in place, kv_splits automatic,
  flash_1        = the same with the fixed context in one piece,
  cudnn_concat   = jax.nn.dot_product_attention(implementation="cudnn") over [fixed ; new] with the
                   causal mask (what the speed suite times as cuDNN dense),
for T = 128 (one question) and 512 (four questions folded), S = T new keys. Median of 20 calls
(block_until_ready each), 2 input sets rotated. Every output is compared with
dense_attention_reference (f32). Writes dense_prefill.json to $OUT."""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks._meta import metadata
from pallas_kernels import dense_attention_reference, dense_decode_attention, dense_prefill_attention
from pallas_kernels.sparse_attention import flash_kv_splits

OUT = os.environ.get("OUT", "/tmp")
BF = jnp.bfloat16
hq, hkv, d, L = 32, 8, 128, 131072
scale = d ** -0.5
key = jax.random.key(0)
k = jax.random.normal(key, (hkv, L, d), BF)
v = jax.random.normal(jax.random.fold_in(key, 1), (hkv, L, d), BF)
res = {"meta": {**metadata(), "shape": dict(hq=hq, hkv=hkv, d=d, L=L), "dtype": "bfloat16",
                "timing": "median of 20 calls, block_until_ready each, 2 input sets rotated"}, "rows": []}


def timed(f, sets, n=20):
  for s in sets:
    jax.block_until_ready(f(*s))
  ts = []
  for i in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*sets[i % len(sets)]))
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts))


for T in (128, 512):
  sets = []
  for j in range(2):
    kk = jax.random.fold_in(key, 10 + j)
    q = jax.random.normal(kk, (hq, T, d), BF)
    kn = jax.random.normal(jax.random.fold_in(kk, 1), (hkv, T, d), BF)
    vn = jax.random.normal(jax.random.fold_in(kk, 2), (hkv, T, d), BF)
    qp = (L + jnp.arange(T)).astype(jnp.int32)
    sets.append((q, k, v, kn, vn, qp, qp))
  ref = np.asarray(dense_attention_reference(*sets[0], scale=scale), np.float32)
  routes = {
      "split_kv": jax.jit(lambda *a: dense_decode_attention(*a, scale=scale)),
      "flash_auto": jax.jit(lambda *a: dense_prefill_attention(*a, scale=scale)),
      "flash_1": jax.jit(lambda *a: dense_prefill_attention(*a, scale=scale, kv_splits=1)),
  }

  def concat(q, k, v, kn, vn, qp, kp):
    kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
    vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
    mask = jnp.concatenate([jnp.ones((T, L), bool), kp[None, :] <= qp[:, None]], 1)[None, None]
    return jax.nn.dot_product_attention(q.swapaxes(0, 1)[None], kk, vv, mask=mask, scale=scale,
                                        implementation="cudnn")[0].swapaxes(0, 1)
  routes["cudnn_concat"] = jax.jit(concat)
  for name, f in routes.items():
    row = {"T": T, "route": name}
    try:
      out = np.asarray(f(*sets[0]), np.float32)
      row["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
      row["ms"] = timed(f, sets)
      if name == "flash_auto":
        row["kv_splits"] = flash_kv_splits(hkv, (hq // hkv) * T, L)
    except Exception as e:  # noqa: BLE001
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    res["rows"].append(row)
    print(row, flush=True)
    json.dump(res, open(f"{OUT}/dense_prefill.json", "w"), indent=1)
print("done", flush=True)
