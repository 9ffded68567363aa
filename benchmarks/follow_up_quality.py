"""How close a follow-up's answer stays to full attention's when the conversation keeps its turns'
K/V (`Conversation`, the default) and when it prefills them again (`ask(history=...)`), on the
embedded SmolLM2 model (CPU is enough).

For each document: a Squeezed conversation with kept K/V answers the questions in turn. At each
turn, with that conversation's earlier turns as the history, three greedy answers are compared:
  kept   -- the conversation's own answer (earlier turns' K/V as made when they were answered),
  again  -- `ask(question, history=...)` with the same method (the whole conversation prefilled),
  full   -- `ask(question, history=...)` with full attention (the reference).
The numbers per turn: tokens until the first that differs from full attention's answer (of
`--max-new-tokens`), whether the answer is identical, and the tokens the kept answer reused.
Turn 1 has nothing to reuse (kept = again). Writes follow_up_quality.json and .md under --out.

    python -m benchmarks.follow_up_quality [--docs 3] [--doc-tokens 4096] [--sparsity 0.9] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

QUESTIONS = (
    "What is this document about? Answer in one sentence.",
    "Name one thing it describes and say what it does.",
    "Give one more example from it, with a short explanation.",
    "Which of your two examples is more useful, and why?",
)


def _agree(a: list[int], ref: list[int]) -> int:
    """Tokens of `a` before the first that differs from `ref` (all of the shorter when none does)."""
    n = min(len(a), len(ref))
    d = np.flatnonzero(np.asarray(a[:n]) != np.asarray(ref[:n]))
    return int(d[0]) if d.size else n


def run(args) -> dict:
    import jax

    import sqjax
    from benchmarks._meta import metadata
    from benchmarks.quality_data import default_documents
    from sqjax import FixedContext
    from sqjax.methods import DEFAULT_SINK, Full, Squeezed

    model = sqjax.load_model(args.model)
    tok = model.tokenizer
    method = Squeezed(sparsity=args.sparsity, n_sink=DEFAULT_SINK)
    res = {"meta": metadata(), "model": args.model, "method": method.label, "max_new_tokens": args.max_new_tokens,
           "doc_tokens": args.doc_tokens, "questions": list(QUESTIONS[:args.turns]), "documents": []}
    for doc in default_documents(args.docs):
        t0 = time.perf_counter()
        text = tok.decode(tok.encode(doc.text, add_bos=False)[:args.doc_tokens])
        sparse = FixedContext.build(model, text, method)
        full = sparse.with_method(Full())
        conv = sparse.conversation()
        turns = []
        for q in QUESTIONS[:args.turns]:
            history = list(conv.history)
            kept = conv.ask(q, args.max_new_tokens)
            again = sparse.ask(q, args.max_new_tokens, history=history)
            ref = full.ask(q, args.max_new_tokens, history=history)
            turns.append({
                "n_prompt_tokens": kept.stats.n_prompt_tokens, "n_reused_tokens": kept.stats.n_reused_tokens,
                "agree_kept": _agree(kept.token_ids, ref.token_ids), "agree_again": _agree(again.token_ids, ref.token_ids),
                "same_kept": kept.token_ids == ref.token_ids, "same_again": again.token_ids == ref.token_ids,
                "kept_equals_again": kept.token_ids == again.token_ids, "n_ref_tokens": len(ref.token_ids),
                "kv_budget_kept": kept.stats.kv_budget, "kv_budget_again": again.stats.kv_budget,
                "answers": {"kept": str(kept), "again": str(again), "full": str(ref)}})
        res["documents"].append({"name": doc.name, "n_tokens": sparse.n_tokens, "turns": turns,
                                 "seconds": time.perf_counter() - t0})
        print(f"{doc.name}: " + "; ".join(f"turn {i + 1}: kept {t['agree_kept']} / again {t['agree_again']} of "
                                          f"{t['n_ref_tokens']}" for i, t in enumerate(turns)), flush=True)
        del sparse, full, conv
        jax.clear_caches()
    follow = [t for d in res["documents"] for t in d["turns"][1:]]
    if follow:
        res["follow_ups"] = {
            "n": len(follow),
            "mean_agree_kept": float(np.mean([t["agree_kept"] for t in follow])),
            "mean_agree_again": float(np.mean([t["agree_again"] for t in follow])),
            "same_kept": sum(t["same_kept"] for t in follow), "same_again": sum(t["same_again"] for t in follow),
            "kept_equals_again": sum(t["kept_equals_again"] for t in follow)}
    return res


def markdown(res: dict) -> str:
    m = res["meta"]
    md = [f"# Follow-ups: the turns' K/V kept or prefilled again, against full attention ({m['device']}, "
          f"jax {m['jax']}, commit {m['git_commit']})", "",
          f"{res['model']}, {res['method']}, documents cut to {res['doc_tokens']} tokens, greedy answers of up to "
          f"{res['max_new_tokens']} tokens. Per turn, with the kept conversation's earlier turns as the history: "
          "tokens before the first that differs from full attention's answer (kept / prefilled again), and the "
          "prompt tokens the kept answer reused.", "",
          "| document | turn | prompt tokens | reused | kept: agree | again: agree | full's tokens | kept = again |",
          "|---|---|---|---|---|---|---|---|"]
    for d in res["documents"]:
        for i, t in enumerate(d["turns"]):
            md.append(f"| {d['name']} | {i + 1} | {t['n_prompt_tokens']} | {t['n_reused_tokens']} | {t['agree_kept']} | "
                      f"{t['agree_again']} | {t['n_ref_tokens']} | {'yes' if t['kept_equals_again'] else 'no'} |")
    f = res.get("follow_ups")
    if f:
        md += ["", f"Follow-ups (turns 2 on, {f['n']}): mean agreement with full attention **{f['mean_agree_kept']:.1f} "
               f"tokens kept, {f['mean_agree_again']:.1f} prefilled again**; identical to full attention's answer "
               f"{f['same_kept']} / {f['same_again']} times; kept = prefilled again {f['kept_equals_again']} times."]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=3, help="how many of the quality harness's default documents")
    ap.add_argument("--doc-tokens", type=int, default=4096, help="each document's first N tokens")
    ap.add_argument("--turns", type=int, default=len(QUESTIONS), choices=range(2, len(QUESTIONS) + 1))
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="benchmarks/results/cpu_follow_up_quality")
    args = ap.parse_args(argv)
    if args.docs < 1 or args.doc_tokens < 256 or args.max_new_tokens < 1:
        ap.error("--docs >= 1, --doc-tokens >= 256 and --max-new-tokens >= 1")
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from sqjax.index_io import write_text_atomic

    write_text_atomic(out / "follow_up_quality.json", json.dumps(res, indent=1))
    write_text_atomic(out / "follow_up_quality.md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
