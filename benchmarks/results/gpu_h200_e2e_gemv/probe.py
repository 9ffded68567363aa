"""Which kernels of the end-to-end decode step are not the attention (2-layer Llama-3-8B-shaped
model, random bf16 weights, attention replaced by zeros as in the speed suite's no-attention row),
what each fusion computes (optimized HLO), and how fast the batch-1 projections run alone.

    PYTHONPATH=. python benchmarks/results/gpu_h200_e2e_gemv/probe.py [--cpu]
"""
import re
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import speed
from benchmarks._profile import kernel_time_per_call
from models import KVCache, LlamaConfig
from models.llama import Llama

BF16 = jnp.bfloat16


def main():
    cpu = "--cpu" in sys.argv
    h, inter, vocab, layers = (64, 128, 256, 2) if cpu else (4096, 14336, 128256, 2)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_layers=layers,
                      num_heads=32 if not cpu else 4, num_kv_heads=8 if not cpu else 2, head_dim=128 if not cpu else 16,
                      rope_theta=500000.0, max_position_embeddings=4096, name="probe")
    model = Llama(cfg, dtype=BF16, param_dtype=BF16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    cache = KVCache.init(cfg, 1, 64, BF16)
    tok = jnp.zeros((1, 1), jnp.int32)
    pos = jnp.full((1, 1), 5, jnp.int32)
    hook = speed._NoAttention()
    step = jax.jit(lambda st, t, p, c: speed._stable_step(graphdef, st, t, p, c, None, attn_fn=hook))
    txt = step.lower(state, tok, pos, cache).compile().as_text()
    # every fusion instruction of the entry computation: its name, kind, shape and the computation it calls
    print("== fusions of the step (optimized HLO)")
    comps = {m.group(1): m.group(0) for m in re.finditer(r"(?ms)^%?(\S+) [^\n]*\{\n.*?^\}", txt)}
    for line in txt.splitlines():
        m = re.search(r"%?(\S*fusion\S*) = (\S+) fusion\(.*kind=(\w+), calls=%?([\w.\-]+)", line)
        if m and ("reduce" in m.group(1) or "multiply" in m.group(1) or "gemm" in m.group(1)):
            body = comps.get(m.group(4), "")
            ops = sorted(set(re.findall(r"= \S+ (\w+)\(", body)))
            dots = re.findall(r"= (\S+) dot\(([^)]*)\)", body)
            print(f"{m.group(1)}: {m.group(2)} kind={m.group(3)} ops={ops} dots={dots[:2]}")
    if not cpu:
        tr = kernel_time_per_call(step, [(state, tok, pos, cache)], top=20)
        print("== kernels of one step (busy ms per call)", tr and tr["busy_ms_per_call"])
        for k in (tr or {}).get("kernels", []):
            print(f"  {k['name']}: {k['ms_per_call'] * 1e3:.1f} us per call")
    # the batch-1 projections alone, as nnx.Linear computes them, and fused alternatives
    x = jnp.ones((1, 1, h), BF16)
    print("== batch-1 projections alone")
    for name, n_out in (("k or v", cfg.num_kv_heads * cfg.head_dim), ("k|v fused", 2 * cfg.num_kv_heads * cfg.head_dim),
                        ("q", cfg.num_heads * cfg.head_dim),
                        ("q|k|v fused", (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim), ("gate", inter)):
        w = jax.random.normal(jax.random.key(1), (h, n_out), BF16)
        f = jax.jit(lambda x, w: jnp.dot(x, w))
        hlo = f.lower(x, w).compile().as_text()
        kinds = sorted(set(re.findall(r"(\w*fusion\w*|custom-call\(|cublas\w*|__cublas\w*)", hlo)))[:6]
        if cpu:
            print(f"  {name} [{h}x{n_out}]: {kinds}")
            continue
        tr = kernel_time_per_call(f, [(x, w)], top=3)
        mb = h * n_out * 2 / 1e6
        us = tr["busy_ms_per_call"] * 1e3
        print(f"  {name} [{h}x{n_out}] {mb:.1f} MB: {us:.1f} us busy, {mb / us:.2f} TB/s;"
              f" {[(k['name'], round(k['ms_per_call'] * 1e3, 1)) for k in tr['kernels']]}")


if __name__ == "__main__":
    main()
