"""Questions one by one (`FixedContext.ask`) against one batch (`FixedContext.ask_many`).

    python -m benchmarks.batch_ask [--model smollm2-135m] [--batch 4] [--tokens 32] [--out FILE]

Indexes the demo document (the pydoc page of `json`) once with Squeezed + sink at 90% sparsity and
with full attention, then for each: the questions asked one at a time, and the same questions as
one batch, every answer `--tokens` tokens long (no stop token, so both do the same number of
steps). Greedy answers must be equal; it reports wall time (median of `--reps` after a warm-up
round), decode tokens/s over all answers, and the ratio, as JSON with the run's metadata.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._meta import metadata, report

QUESTIONS = (
    "What does json.dumps return?",
    "Which exception does json.loads raise for invalid JSON?",
    "Summarize what the json module is for.",
    "How do I pretty-print JSON with indentation?",
    "What does the object_hook argument do?",
    "Which Python types does json encode as arrays?",
    "How are NaN and Infinity handled?",
    "What is JSONDecodeError a subclass of?",
)


def run(model_name: str, batch: int, tokens: int, reps: int, log=print) -> dict:
    import sqjax
    from sqjax.cli import demo_document
    from sqjax.fixed_context import FixedContext

    if not 1 <= batch <= len(QUESTIONS):
        raise ValueError(f"--batch must be in 1..{len(QUESTIONS)}")
    qs = list(QUESTIONS[:batch])
    model = sqjax.load_model(model_name)
    t0 = time.perf_counter()
    ctx = FixedContext.build(model, demo_document(), sqjax.methods.Squeezed(sparsity=0.9, n_sink=1), truncate=True)
    log(f"indexed {ctx.n_tokens} tokens in {time.perf_counter() - t0:.1f}s")
    rows = []
    for label, c in (("squeezed+sink1 s0.9", ctx), ("full", ctx.with_method(sqjax.methods.Full()))):
        one = lambda: [c.ask(q, max_new_tokens=tokens, stop_ids=()) for q in qs]  # noqa: E731
        many = lambda: c.ask_many(qs, max_new_tokens=tokens, stop_ids=())  # noqa: E731
        ref, got = one(), many()  # warm-up (compilation), and the answers to compare
        same = [a.token_ids == b.token_ids for a, b in zip(ref, got)]
        t_one, t_many = [], []
        for _ in range(reps):
            t = time.perf_counter()
            one()
            t_one.append(time.perf_counter() - t)
            t = time.perf_counter()
            many()
            t_many.append(time.perf_counter() - t)
        s_one, s_many = statistics.median(t_one), statistics.median(t_many)
        row = {"method": label, "questions": batch, "tokens_per_answer": tokens,
               "one_by_one_s": s_one, "batch_s": s_many, "speedup": s_one / s_many,
               "tokens_per_s_one_by_one": batch * tokens / s_one, "tokens_per_s_batch": batch * tokens / s_many,
               "time_per_step_one_by_one_ms": 1e3 * statistics.median(a.stats.time_per_output_token_s for a in ref),
               "time_per_step_batch_ms": 1e3 * got[0].stats.time_per_output_token_s,
               "greedy_answers_equal": same, "kv_budget_batch": [a.stats.kv_budget for a in got],
               "kv_budget_one_by_one": [a.stats.kv_budget for a in ref], "samples_one_by_one_s": t_one,
               "samples_batch_s": t_many}
        rows.append(row)
        log(f"{label}: {batch} questions x {tokens} tokens: one by one {s_one:.2f}s, batch {s_many:.2f}s "
            f"({s_one / s_many:.2f}x); answers equal: {same}")
    return {"meta": metadata(), "model": model_name, "document_tokens": ctx.n_tokens, "rows": rows}


def to_markdown(res: dict) -> str:
    lines = [f"`FixedContext.ask` one by one vs `ask_many` ({res['meta']['device']}, jax {res['meta']['jax']}, "
             f"{res['meta']['git_commit'][:12]}; {res['model']}, {res['document_tokens']}-token document)", "",
             "| method | questions × tokens | one by one | batch | speed-up | ms/step one / batch | greedy answers equal |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['questions']} × {r['tokens_per_answer']} | {r['one_by_one_s']:.2f} s "
                     f"({r['tokens_per_s_one_by_one']:.1f} tok/s) | {r['batch_s']:.2f} s ({r['tokens_per_s_batch']:.1f} tok/s) "
                     f"| {r['speedup']:.2f}× | {r['time_per_step_one_by_one_ms']:.1f} / {r['time_per_step_batch_ms']:.1f} "
                     f"| {sum(r['greedy_answers_equal'])}/{len(r['greedy_answers_equal'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file (a .md beside it); default: print only")
    args = ap.parse_args(argv)
    res = run(args.model, args.batch, args.tokens, args.reps)
    report(res, to_markdown(res), args.out)
    return 0 if all(all(r["greedy_answers_equal"]) for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
