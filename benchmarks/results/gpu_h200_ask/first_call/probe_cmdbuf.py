"""Where `ask`'s one-time cost on its first timed call comes from: a jitted program of many small
kernels, executed 8 times on the same buffers and then 4 times on fresh input buffers, each call
synced and timed on the host; once with XLA's command buffers as shipped and once with them off
(`--xla_gpu_enable_command_buffer=`), each in its own process (XLA flags are per process).

Hypothesis: XLA runs a program's first execution through its plain thunks, records and
instantiates the CUDA graph on the second, and updates the graph when buffer addresses change,
each a host cost that grows with the number of kernels.

Run from the repository root: python benchmarks/results/gpu_h200_ask/first_call/probe_cmdbuf.py OUT_DIR"""
import json
import os
import subprocess
import sys
import time

N_LAYERS = (100, 400)   # kernels grow with the layers: two sizes show how the cost scales


def child(n_layers: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (512, 512), jnp.bfloat16) * 0.04 for i in range(n_layers)]
    bs = [jax.random.normal(jax.random.fold_in(key, 10_000 + i), (512,), jnp.float32) for i in range(n_layers)]

    @jax.jit
    def prog(x, ws, bs):
        for w, b in zip(ws, bs):   # a matmul + a reduction-fed normalisation per layer: kernels XLA cannot merge
            h = (x @ w).astype(jnp.float32) + b
            x = (h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
        return x

    x = jax.random.normal(key, (16, 512), jnp.bfloat16)

    def timed(inp):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(inp, ws, bs))
        return 1e3 * (time.perf_counter() - t0)

    same = [timed(x) for _ in range(8)]                          # call 1 compiles
    fresh = [timed(x + jnp.bfloat16(i + 1)) for i in range(4)]   # a new input buffer each call (the add is its own program)
    stable = [timed(x) for _ in range(4)]
    return {"n_layers": n_layers, "same_buffers_ms": same, "fresh_input_ms": fresh, "same_again_ms": stable,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__}


def main(out_dir: str) -> None:
    sys.path.insert(0, ".")
    from benchmarks._meta import metadata

    res = {"meta": metadata(), "runs": []}
    for label, flags in (("command_buffers_default", ""), ("command_buffers_off", "--xla_gpu_enable_command_buffer=")):
        for n in N_LAYERS:
            env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
            p = subprocess.run([sys.executable, __file__, "--child", str(n)], env=env, capture_output=True, text=True,
                               timeout=300)
            row = {"label": label, "rc": p.returncode, "stderr_tail": p.stderr[-2000:]}
            if p.returncode == 0:
                row.update(json.loads(p.stdout.strip().splitlines()[-1]))
            res["runs"].append(row)
            print(label, n, {k: [round(v, 2) for v in row.get(k, [])]
                             for k in ("same_buffers_ms", "fresh_input_ms", "same_again_ms")}, flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "probe_cmdbuf.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]))))
    else:
        main(sys.argv[1])
