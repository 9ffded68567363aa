"""Batch-1 Q/K/V projection variants on the GPU (kernel busy time per call, profiler trace):
XLA turns a [1, 4096] x [4096, 1024] dot into a reduce fusion at ~0.5 TB/s while [4096, 4096] runs
as a GEMM at ~4 TB/s (probe.py). Run twice, with and without XLA_FLAGS, by run_probe2.sh; each run
adds its rows to OUT_DIR/probe2.json.

    PYTHONPATH=. python benchmarks/results/gpu_h200_e2e_gemv/probe2.py OUT_DIR
"""
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks._meta import metadata
from benchmarks._profile import kernel_time_per_call

BF16 = jnp.bfloat16
h, nq, nkv = 4096, 4096, 1024
ks = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(ks[0], (1, 1, h), BF16)
wq = jax.random.normal(ks[1], (h, nq), BF16)
wk = jax.random.normal(ks[2], (h, nkv), BF16)
wv = jax.random.normal(ks[3], (h, nkv), BF16)
wqkv = jnp.concatenate([wq, wk, wv], axis=1)
variants = {
    "three dots (as now)": (lambda x, wq, wk, wv: (x @ wq, x @ wk, x @ wv), (x, wq, wk, wv)),
    "k alone": (lambda x, wk: x @ wk, (x, wk)),
    "k alone, f32 out": (lambda x, wk: jax.lax.dot_general(x, wk, (((2,), (0,)), ((), ())),
                                                        preferred_element_type=jnp.float32), (x, wk)),
    "k alone, x as [2, D] (one row of zeros)": (lambda x, wk: (jnp.concatenate([x[0], jnp.zeros_like(x[0])]) @ wk)[:1],
                                                 (x, wk)),
    "one dot over concat(wq, wk, wv) at run time": (
        lambda x, wq, wk, wv: x @ jnp.concatenate([wq, wk, wv], axis=1), (x, wq, wk, wv)),
    "one dot over a stored [D, 6144]": (lambda x, w: x @ w, (x, wqkv)),
}
out = Path(sys.argv[1]) / "probe2.json"
res = json.loads(out.read_text()) if out.exists() else {"meta": metadata(), "rows": []}
for name, (f, args) in variants.items():
    jf = jax.jit(f)
    for _ in range(3):  # compile and autotune outside the trace
        jax.block_until_ready(jf(*args))
    tr = kernel_time_per_call(jf, [args], top=4)
    row = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "variant": name, "busy_us": tr["busy_ms_per_call"] * 1e3,
           "kernels": [(k["name"], k["ms_per_call"] * 1e3) for k in tr["kernels"]],
           "shapes": {"x": list(x.shape), "wq": list(wq.shape), "wk": list(wk.shape)}, "dtype": "bfloat16"}
    res["rows"].append(row)
    print(f"[{row['xla_flags']}] {name}: {row['busy_us']:.1f} us;"
          f" {[(k, round(v, 1)) for k, v in row['kernels']]}", flush=True)
out.write_text(json.dumps(res, indent=1))
