"""A/B of the speed suite's end-to-end section (Llama-3-8B-shaped random bf16 model, 128K fixed
context, Squeezed vs full attention) with the KV cache of the new tokens stored as one stacked
[layers, B, Hkv, S, d] array per K and V (before) and as one array per layer (`models.KVCache`
now), in one process, before first.

    PYTHONPATH=. python benchmarks/results/gpu_h200_e2e_kvcache/ab_kvcache.py OUT_DIR

`models.forward` only calls the cache's methods, so the "before" run passes `StackedKVCache`
(the previous class, kept here) through the same code.
"""
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import models
from benchmarks import speed
from benchmarks._meta import metadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedKVCache(models.KVCache):
    """The cache before: k, v [L, B, Hkv, S, d]; a layer is sliced out of it inside the step."""

    @classmethod
    def init(cls, config, batch, capacity, dtype=jnp.float32):
        shape = (config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   pos=jnp.full((batch, capacity), -1, jnp.int32), length=jnp.zeros((batch,), jnp.int32))

    @property
    def num_layers(self):
        return self.k.shape[0]

    def write(self, layer, k_new, v_new):
        B, T = k_new.shape[:2]
        slots = self.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        k = self.k.at[layer, rows, :, slots].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[layer, rows, :, slots].set(v_new.astype(self.v.dtype), mode="drop")
        return self.replace(k=k, v=v)


def main():
    out = Path(sys.argv[1])
    plan = speed.Plan()
    src = speed.KeySource(".scratch/captured/smollm2_qkv.npz", plan)
    res = {"meta": metadata(), "runs": {}}
    per_layer = models.KVCache
    for label, cls in (("stacked_cache", StackedKVCache), ("per_layer_cache", per_layer)):
        models.KVCache = cls          # speed.end_to_end imports it from `models` when it runs
        jax.clear_caches()
        e = speed.end_to_end(plan, src, lambda m: print(m, flush=True), None)
        res["runs"][label] = e
        keys = ("decode_speedup", "decode_speedup_pipelined", "decode_speedup_pipelined_stable", "ttft_speedup")
        print(label, {k: round(e[k], 3) for k in keys if k in e}, flush=True)
        for n in ("squeezed", "full", "no-attention"):
            r = e.get(n, {})
            prof = r.get("profile", {})
            copies = [x for x in prof.get("by_name", []) if x.get("name") == "MemcpyD2D"]
            print(f"  {n}: {r.get('ms_per_token_pipelined_stable', float('nan')):.3f} ms/token stable pipelined, "
                  f"{r.get('tokens_per_s_pipelined_stable', float('nan')):.1f} tokens/s, "
                  f"busy {prof.get('busy_ms_per_token', float('nan')):.3f} ms/token, "
                  f"kernels/token {prof.get('kernels_per_token', float('nan'))}, "
                  f"D2D copies {copies[0]['count'] / prof['steps'] if copies else 0:.0f}/token, "
                  f"ttft {r.get('ttft_s', float('nan')) * 1e3:.1f} ms", flush=True)
        (out / "ab_kvcache.json").write_text(json.dumps(res, indent=1, default=str))
    models.KVCache = per_layer


if __name__ == "__main__":
    main()
