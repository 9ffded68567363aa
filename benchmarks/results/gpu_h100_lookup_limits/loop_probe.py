"""Where the device loop's time above the kernel span goes: the hierarchical int8 prefill lookup (4K tokens over 512K,
the A/B inputs) timed per call, back to back (steady), and 16 calls in one jitted ``fori_loop`` (what the #8 "loop"
column does), each with a profiler trace of the same calls: busy time, span and the largest idle gaps per call.
Run it with and without XLA's command buffers (``run.sh loop``).

    python benchmarks/results/gpu_h100_lookup_limits/loop_probe.py OUT_JSON [--interpret]
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks._meta import looped_program, metadata, time_ms, time_ms_looped, time_ms_steady, write_json
from benchmarks._profile import device_activity, trace_calls
from benchmarks.lookup_engines import ab_inputs, prefill_ab_calls
from pallas_kernels import centroid_lookup as cl

N_ITER = 16
x = ab_inputs("--interpret" in sys.argv)
calls, _, _ = prefill_ab_calls(x)
fn, args = calls["hierarchical"](cl.INT8_PREFILL)
qs = [args[0], args[0] * jnp.bfloat16(0.5)]           # two query sets, cycled
fixed = args[1:]
res = {"meta": metadata(), "xla_flags": __import__("os").environ.get("XLA_FLAGS", ""), "n_iter": N_ITER}
sets = [(q, *fixed) for q in qs]
res["per_call_ms"] = time_ms(fn, sets)
res["steady_ms"] = time_ms_steady(fn, sets)
res["loop_ms"] = time_ms_looped(fn, qs, fixed=fixed, n_iter=N_ITER, reps=5)
planes = trace_calls(fn, sets, n=6)
if not planes:   # no device (the interpreter): nothing to trace
  write_json(Path(sys.argv[1]), res)
  sys.exit(print(res))
tr = next(iter(planes.values()))
res["trace_back_to_back"] = {k: tr[k] for k in ("busy_ms_per_call", "span_ms_per_call", "kernels_per_call", "gaps")}
loop = looped_program(fn, len(qs), n_iter=N_ITER)
stacked = jnp.stack(qs)
jax.block_until_ready(loop(stacked, fixed))
act = next(iter(device_activity(lambda: jax.block_until_ready(loop(stacked, fixed)), top=12).values()))
res["trace_loop"] = {"busy_ms_per_call": act["busy_ms"] / N_ITER, "span_ms_per_call": act["span_ms"] / N_ITER,
                     "kernels_per_call": act["n_kernels"] / N_ITER, "gaps": act["gaps"],
                     "largest": act["by_name"][:8]}
write_json(Path(sys.argv[1]), res)
print(f"per call {res['per_call_ms']:.3f}, steady {res['steady_ms']:.3f}, loop {res['loop_ms']:.3f} ms; "
      f"back-to-back trace busy {tr['busy_ms_per_call']:.3f} span {tr['span_ms_per_call']:.3f} "
      f"({tr['kernels_per_call']:.0f} kernels); loop trace busy {res['trace_loop']['busy_ms_per_call']:.3f} span "
      f"{res['trace_loop']['span_ms_per_call']:.3f} ({res['trace_loop']['kernels_per_call']:.0f} kernels)")
print("loop gaps:", [(round(g["ms"], 4), g["after"][:30], g["before"][:30]) for g in act["gaps"][:6]])
print("back-to-back gaps:", [(round(g["ms"], 4), g["after"][:30], g["before"][:30]) for g in tr["gaps"][:6]])
