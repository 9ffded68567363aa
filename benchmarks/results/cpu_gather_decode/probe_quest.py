"""QUEST on the CPU: a decode step's selected pages gathered as positions (`quest.page_rows`, through
`retrieved_attention`) against the mask over the whole fixed context (`dispatch.CPU_GATHER = False`),
beside full attention. The demo's document, QUEST at the KV budget Squeezed reads there (0.125),
one `ask` to compile, then the 3 demo questions, in 2 rounds. `--snapkv`: SnapKV at that budget
instead (its kept positions gathered, for blocks too).
Run from the repository root: .venv/bin/python benchmarks/results/cpu_gather_decode/probe_quest.py [index.sqx] [--snapkv]"""
import os
import statistics
import sys
import time

import jax

import sqjax
from sqjax import dispatch
from sqjax.cli import DEMO_QUESTIONS, demo_document
from sqjax.fixed_context import FixedContext
from sqjax.methods import DEFAULT_SINK

model = sqjax.load_model("smollm2-135m")
args = [a for a in sys.argv[1:] if a != "--snapkv"]
method, mname = (sqjax.SnapKV(budget=0.125), "snapkv") if "--snapkv" in sys.argv else (sqjax.Quest(budget=0.125), "quest")
path = args[0] if args else None
if path and os.path.exists(path):
    ctx = FixedContext.load(path, model)
else:
    ctx = FixedContext.build(model, demo_document(), sqjax.Squeezed(sparsity=0.9, n_sink=DEFAULT_SINK), truncate=True)
sparse = ctx.with_method(method)
full = ctx.with_method(sqjax.Full())
arms = ((f"{mname}, mask", sparse, False), (f"{mname}, gathered", sparse, True), ("full", full, True))
answers, rows = {}, {}
for rnd in range(2):
    for name, c, gather in arms:
        dispatch.CPU_GATHER = gather
        jax.clear_caches()
        t = time.perf_counter()
        c.ask(DEMO_QUESTIONS[0], max_new_tokens=32)
        first = time.perf_counter() - t
        r = rows.setdefault(name, {"tpot": [], "ttft": [], "ask": []})
        for q in DEMO_QUESTIONS:
            t = time.perf_counter()
            a = c.ask(q, max_new_tokens=32)
            r["ask"].append(time.perf_counter() - t)
            r["tpot"].append(a.stats.time_per_output_token_s * 1e3)
            r["ttft"].append(a.stats.time_to_first_token_s * 1e3)
            answers.setdefault(name, []).append(list(a.token_ids))
        print(f"round {rnd} {name:16s} first ask {first:5.1f} s | per output token {[round(x, 1) for x in r['tpot'][-3:]]}"
              f" | kv budget {a.stats.kv_budget:.3f}", flush=True)
print("medians over both rounds (6 asks each):")
for name, r in rows.items():
    print(f"{name:16s} per output token {statistics.median(r['tpot']):6.1f} ms | TTFT {statistics.median(r['ttft']):6.1f} ms"
          f" | ask {statistics.median(r['ask']):5.2f} s")
print("gathered gives the mask's tokens:", [x == y for x, y in zip(answers[f"{mname}, gathered"], answers[f"{mname}, mask"])])
