"""Batch-1 MLP variants on the GPU (kernel busy time per call after warm-up): gate and up as two
products vs one over the two kernels side by side; and the whole SwiGLU.  Writes OUT_DIR/probe3.json.

    PYTHONPATH=. python benchmarks/results/gpu_h200_e2e_gemv/probe3.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks._meta import metadata
from benchmarks._profile import kernel_time_per_call

BF16 = jnp.bfloat16
h, f = 4096, 14336
ks = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(ks[0], (1, 1, h), BF16)
wg = jax.random.normal(ks[1], (h, f), BF16) * 0.01
wu = jax.random.normal(ks[2], (h, f), BF16) * 0.01
wd = jax.random.normal(ks[3], (f, h), BF16) * 0.01


def two(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def one(x, wg, wu, wd):
    gu = x @ jnp.concatenate([wg, wu], axis=1)
    return (jax.nn.silu(gu[..., :f]) * gu[..., f:]) @ wd


res = {"meta": metadata(), "shapes": {"x": [1, 1, h], "gate": [h, f], "up": [h, f], "down": [f, h]},
       "dtype": "bfloat16", "rows": []}
for name, fn in (("gate, up as two products", two), ("gate|up as one product", one)):
    jf = jax.jit(fn)
    for _ in range(3):
        jax.block_until_ready(jf(x, wg, wu, wd))
    tr = kernel_time_per_call(jf, [(x, wg, wu, wd)], top=5)
    res["rows"].append({"variant": name, "busy_us": tr["busy_ms_per_call"] * 1e3,
                        "kernels": [(k["name"], k["ms_per_call"] * 1e3) for k in tr["kernels"]]})
    print(f"{name}: {tr['busy_ms_per_call'] * 1e3:.1f} us; "
          f"{[(k['name'], round(k['ms_per_call'] * 1e3, 1)) for k in tr['kernels']]}", flush=True)
res["max_abs_diff"] = float(jnp.max(jnp.abs(jax.jit(two)(x, wg, wu, wd).astype(jnp.float32)
                                          - jax.jit(one)(x, wg, wu, wd).astype(jnp.float32))))
print("max |two - one| =", res["max_abs_diff"])
(Path(sys.argv[1]) / "probe3.json").write_text(json.dumps(res, indent=1))
