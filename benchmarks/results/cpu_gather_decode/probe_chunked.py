"""Squeezed on the CPU, its gather route as stop 55 left it (every slot of the static capacity gathered;
the retrieval's slot search unrolled) against the rows gathered in chunks up to the largest count
(`retrieved_attention`) and the search as a loop (`squeezed.search_method`), beside full attention.
The demo's document and method; one `ask` to compile, then the 3 demo questions, in 2 rounds.
Run from the repository root: .venv/bin/python benchmarks/results/cpu_gather_decode/probe_chunked.py [index.sqx]"""
import os
import statistics
import sys
import time

import jax

import sqjax
from pallas_kernels.sparse_attention import sparse_attention_reference
from sqjax import dispatch, squeezed
from sqjax.cli import DEMO_QUESTIONS, demo_document
from sqjax.fixed_context import FixedContext
from sqjax.methods import DEFAULT_SINK

model = sqjax.load_model("smollm2-135m")
path = sys.argv[1] if len(sys.argv) > 1 else None
t = time.perf_counter()
if path and os.path.exists(path):
    ctx = FixedContext.load(path, model)
else:
    ctx = FixedContext.build(model, demo_document(), sqjax.Squeezed(sparsity=0.9, n_sink=DEFAULT_SINK), truncate=True)
    if path:
        ctx.save(path)
print(f"document {ctx.n_tokens} tokens, capacity {ctx.index.capacity}, ready in {time.perf_counter() - t:.1f} s",
      flush=True)
full = ctx.with_method(sqjax.Full())


def whole_capacity(q, k, v, idx, count, k_new, v_new, q_pos, kv_pos, scale, chunk):
    return sparse_attention_reference(q, k, v, idx, count, k_new, v_new, q_pos, kv_pos, scale=scale)


new_attention, new_search = dispatch.retrieved_attention, squeezed.search_method
arms = (("gather, stop 55", ctx, whole_capacity, lambda: "scan_unrolled"),
        ("chunked", ctx, new_attention, lambda: "scan_unrolled"),
        ("chunked + loop", ctx, new_attention, new_search),
        ("full", full, new_attention, new_search))
answers, rows = {}, {}
for rnd in range(2):
    for name, c, attend, search in arms:
        dispatch.retrieved_attention, squeezed.search_method = attend, search
        jax.clear_caches()
        t = time.perf_counter()
        c.ask(DEMO_QUESTIONS[0], max_new_tokens=32)
        first = time.perf_counter() - t
        for q in DEMO_QUESTIONS:
            t = time.perf_counter()
            a = c.ask(q, max_new_tokens=32)
            wall = time.perf_counter() - t
            r = rows.setdefault(name, {"tpot": [], "ttft": [], "ask": []})
            r["tpot"].append(a.stats.time_per_output_token_s * 1e3)
            r["ttft"].append(a.stats.time_to_first_token_s * 1e3)
            r["ask"].append(wall)
            answers.setdefault(name, []).append(list(a.token_ids))
        print(f"round {rnd} {name:16s} first ask {first:5.1f} s | per output token {r['tpot'][-3:]}", flush=True)
print("medians over both rounds (6 asks each):")
for name, r in rows.items():
    print(f"{name:16s} per output token {statistics.median(r['tpot']):6.1f} ms | TTFT {statistics.median(r['ttft']):6.1f} ms"
          f" | ask {statistics.median(r['ask']):5.2f} s")
base = answers["gather, stop 55"]
for name in ("chunked", "chunked + loop"):
    print(f"{name} gives stop 55's tokens:", [x == y for x, y in zip(answers[name], base)])
