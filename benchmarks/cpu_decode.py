"""Decode and time to first token without a GPU: each method's gathered rows against its mask.

    python -m benchmarks.cpu_decode [--model smollm2-135m] [--methods squeezed,hsqueezed,quest,snapkv,saap]
                                    [--budget 0.125] [--tokens 32] [--rounds 2] [--out FILE]

Without a GPU, `dispatch.attention` gathers the rows a method selects (`dispatch.CPU_GATHER`,
`sqjax.attention.retrieved_attention`) instead of attending the whole fixed context under the
selection's mask. This benchmark measures both routes of every method on one prefilled document
(the demo's, indexed with Squeezed + sink at 90% sparsity), beside full attention in the same run:
each route asks the demo questions `--rounds` times after one ask that compiles, `--tokens` tokens
per answer, no stop token. QUEST and SnapKV run at `--budget` (the KV fraction they read), SAAP
visits `round(budget * buckets)` buckets. Reported per route: median time per output token, time
to first token and whole ask, the first ask (compilation), the KV budget, whether the greedy tokens
equal the mask route's, and full attention's time per output token over the route's (the ratio).
The routes are read at trace time, so the jit caches are cleared between routes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._meta import metadata, report

ALL_METHODS = ("squeezed", "hsqueezed", "quest", "snapkv", "saap")


def _method(name: str, budget: float, ctx):
    import sqjax
    from sqjax.methods import DEFAULT_SINK, saap_defaults

    if name == "squeezed":
        return ctx.method                                            # the index the document was built with
    if name == "hsqueezed":
        return sqjax.HierarchicalSqueezed(sparsity=0.9, n_sink=DEFAULT_SINK)
    if name == "quest":
        return sqjax.Quest(budget=budget)
    if name == "snapkv":
        return sqjax.SnapKV(budget=budget)
    if name == "saap":
        return sqjax.Saap(probes=max(1, round(budget * saap_defaults(ctx.n_tokens)[0])))
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}")


def _time_route(c, questions, tokens: int, rounds: int, gather: bool) -> dict:
    """One route of one context: a compiling ask, then `rounds` × the questions."""
    import jax

    from sqjax import dispatch

    dispatch.CPU_GATHER = gather
    jax.clear_caches()                      # the route is read at trace time
    t = time.perf_counter()
    c.ask(questions[0], max_new_tokens=tokens, stop_ids=())
    first = time.perf_counter() - t
    tpot, ttft, ask, ids, budget = [], [], [], [], []
    for _ in range(rounds):
        for q in questions:
            t = time.perf_counter()
            a = c.ask(q, max_new_tokens=tokens, stop_ids=())
            ask.append(time.perf_counter() - t)
            tpot.append(a.stats.time_per_output_token_s * 1e3)
            ttft.append(a.stats.time_to_first_token_s * 1e3)
            ids.append(list(a.token_ids))
            budget.append(a.stats.kv_budget)
    return {"route": "gathered" if gather else "mask", "first_ask_s": first,
            "ms_per_output_token": statistics.median(tpot), "ttft_ms": statistics.median(ttft),
            "ask_s": statistics.median(ask), "kv_budget": statistics.median(budget),
            "samples_ms_per_output_token": tpot, "samples_ttft_ms": ttft, "token_ids": ids}


def run(model_name: str, methods: list[str], budget: float, tokens: int, rounds: int, log=print) -> dict:
    import sqjax
    from sqjax import dispatch
    from sqjax.cli import DEMO_QUESTIONS, demo_document
    from sqjax.fixed_context import FixedContext
    from sqjax.methods import DEFAULT_SINK

    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(ALL_METHODS)}")
    if rounds < 1 or tokens < 1 or not 0 < budget <= 1:
        raise ValueError("need --rounds >= 1, --tokens >= 1 and 0 < --budget <= 1")
    if not dispatch.cpu_gathers():
        raise SystemExit("cpu_decode measures the route without a GPU: run it with JAX_PLATFORMS=cpu")
    model = sqjax.load_model(model_name)
    t0 = time.perf_counter()
    ctx = FixedContext.build(model, demo_document(), sqjax.Squeezed(sparsity=0.9, n_sink=DEFAULT_SINK), truncate=True)
    log(f"indexed {ctx.n_tokens} tokens in {time.perf_counter() - t0:.1f} s")
    qs = list(DEMO_QUESTIONS)
    try:
        full = _time_route(ctx.with_method(sqjax.Full()), qs, tokens, rounds, True)
        full.update(method="full", label="full", route="dense")   # no selection: the routes are the same
        log(f"full: {full['ms_per_output_token']:.1f} ms/token, TTFT {full['ttft_ms']:.0f} ms")
        rows = [full]
        for name in methods:
            m = _method(name, budget, ctx)
            c = ctx if name == "squeezed" else ctx.with_method(m)
            mask = _time_route(c, qs, tokens, rounds, False)
            for r in (_time_route(c, qs, tokens, rounds, True), mask):
                r.update(method=name, label=m.label, same_tokens_as_mask=r["token_ids"] == mask["token_ids"],
                         full_over_route=full["ms_per_output_token"] / r["ms_per_output_token"])
                rows.append(r)
                log(f"{m.label} {r['route']}: {r['ms_per_output_token']:.1f} ms/token "
                    f"({r['full_over_route']:.2f}x full), TTFT {r['ttft_ms']:.0f} ms, first ask {r['first_ask_s']:.1f} s,"
                    f" KV budget {r['kv_budget']:.3f}, same tokens as the mask: {r['same_tokens_as_mask']}")
    finally:
        dispatch.CPU_GATHER = True
    return {"meta": metadata(), "model": model_name, "document_tokens": ctx.n_tokens, "questions": qs,
            "tokens_per_answer": tokens, "rounds": rounds, "budget": budget, "rows": rows}


def to_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"Decode without a GPU, gathered rows vs the mask ({m['device']}, jax {m['jax']}, {m['git_commit'][:12]}; "
             f"{res['model']}, {res['document_tokens']}-token document, medians of {res['rounds']} × "
             f"{len(res['questions'])} asks of {res['tokens_per_answer']} tokens)", "",
             "| method | route | ms / output token | full ÷ route | TTFT ms | ask s | first ask s | KV budget "
             "| tokens = mask's |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        same = "—" if r["method"] == "full" else ("yes" if r["same_tokens_as_mask"] else "no")
        ratio = "1.00 (baseline)" if r["method"] == "full" else f"{r['full_over_route']:.2f}×"
        lines.append(f"| {r['label']} | {r['route']} | {r['ms_per_output_token']:.1f} | {ratio} | {r['ttft_ms']:.0f} "
                     f"| {r['ask_s']:.2f} | {r['first_ask_s']:.1f} | {r['kv_budget']:.3f} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated: " + ", ".join(ALL_METHODS))
    ap.add_argument("--budget", type=float, default=0.125, help="QUEST's / SnapKV's KV fraction, SAAP's buckets")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file (a .md beside it); default: print only")
    args = ap.parse_args(argv)
    try:
        res = run(args.model, [m for m in args.methods.split(",") if m], args.budget, args.tokens, args.rounds)
    except ValueError as e:
        print(f"cpu_decode: error: {e}", file=sys.stderr)
        return 2
    report(res, to_markdown(res), args.out)
    return 0 if all(r.get("same_tokens_as_mask", True) for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
