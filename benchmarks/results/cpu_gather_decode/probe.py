"""Squeezed on the CPU: its retrieved rows gathered (`dispatch.CPU_GATHER`) or the whole fixed context
under a mask, beside full attention. The demo's document and method; one `ask` to compile, then 3 timed.
Run from the repository root: .venv/bin/python benchmarks/results/cpu_gather_decode/probe.py"""
import statistics
import time

import jax

import sqjax
from sqjax import dispatch
from sqjax.cli import DEMO_QUESTIONS, demo_document
from sqjax.fixed_context import FixedContext
from sqjax.methods import DEFAULT_SINK

model = sqjax.load_model("smollm2-135m")
t = time.perf_counter()
ctx = FixedContext.build(model, demo_document(), sqjax.Squeezed(sparsity=0.9, n_sink=DEFAULT_SINK), truncate=True)
print(f"document {ctx.n_tokens} tokens, built in {time.perf_counter() - t:.1f} s", flush=True)
full = ctx.with_method(sqjax.Full())
answers = {}
for name, c, gather in (("squeezed mask", ctx, False), ("squeezed gather", ctx, True), ("full", full, True)):
    dispatch.CPU_GATHER = gather
    jax.clear_caches()
    t = time.perf_counter()
    c.ask(DEMO_QUESTIONS[0], max_new_tokens=32)
    first = time.perf_counter() - t
    tpot, ttft, wall = [], [], []
    for q in DEMO_QUESTIONS:
        t = time.perf_counter()
        a = c.ask(q, max_new_tokens=32)
        wall.append(time.perf_counter() - t)
        tpot.append(a.stats.time_per_output_token_s * 1e3)
        ttft.append(a.stats.time_to_first_token_s * 1e3)
        answers.setdefault(name, []).append(a.token_ids)
    print(f"{name:16s} first ask {first:6.1f} s | per output token {statistics.median(tpot):6.1f} ms "
          f"(of {[round(x, 1) for x in tpot]}) | TTFT {statistics.median(ttft):6.1f} ms | ask {statistics.median(wall):5.2f} s "
          f"| kv budget {a.stats.kv_budget:.3f}", flush=True)
same = [list(x) == list(y) for x, y in zip(answers["squeezed mask"], answers["squeezed gather"])]
print("gather gives the mask route's tokens:", same)
