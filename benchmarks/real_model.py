"""The embedded real model end to end on whatever device jax has: the demo's questions with
Squeezed Attention and with full attention, answers and timings, and a comparison with a
reference run (the same script on another device, e.g. the CPU).

    python -m benchmarks.real_model --out DIR [--doc FILE] [--dtypes float32 bfloat16] [--reference CPU.json]

Per dtype: the document (the demo's pydoc page of `json`, or --doc) is prefilled and indexed once
(`FixedContext.build`, Squeezed at --sparsity with n_sink=1, and full attention via `with_method`);
each question is answered twice per method (the first call compiles; the second is timed). The
JSON records the answers' token ids, KV budgets, time to first token and time per output token,
and, with --reference, for each (dtype, method, question) whether the greedy tokens equal the
reference's and up to where. The document's sha256 is recorded: runs compare only on the same text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks._meta import metadata
from benchmarks.quality_engine import kl_per_token
from sqjax.index_io import write_text_atomic


def run_dtype(model_name: str, doc: str, dtype: str, sparsity: float, max_new_tokens: int, n_questions: int = 3) -> dict:
    import sqjax
    from sqjax.cli import DEMO_QUESTIONS

    t0 = time.perf_counter()
    model = sqjax.load_model(model_name, dtype=jnp.dtype(dtype))
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctx = sqjax.FixedContext.build(model, doc, sqjax.Squeezed(sparsity=sparsity, n_sink=1), truncate=True)
    t_build = time.perf_counter() - t0
    contexts = {"squeezed+sink1": ctx, "full": ctx.with_method(sqjax.Full())}
    rows = []
    for q in DEMO_QUESTIONS[:n_questions]:
        for name, c in contexts.items():
            c.ask(q, max_new_tokens=max_new_tokens)            # compiles
            a = c.ask(q, max_new_tokens=max_new_tokens)        # timed
            s = a.stats
            rows.append({"method": name, "question": q, "answer": str(a), "token_ids": [int(t) for t in a.token_ids],
                         "kv_budget": s.kv_budget, "kv_budget_prefill": s.kv_budget_prefill,
                         "ttft_s": s.time_to_first_token_s, "tpot_s": s.time_per_output_token_s})
    return {"dtype": dtype, "document_tokens": ctx.n_tokens, "threshold": ctx.info.get("threshold"),
            "load_s": t_load, "build_s": t_build, "index_s": ctx.info.get("index_seconds"), "answers": rows}


def fidelity(model_name: str, text: str, dtype: str, sparsity: float, n_ctx: int, n_cont: int, seed: int = 0,
             prefill_precision: str | None = None, index_precision: str | None = None) -> dict:
    """The compiled routes against the reference routes on one index (same selections, so only the
    kernels' arithmetic differs), and Squeezed against full attention under each.

    The document's first `n_ctx` tokens are the fixed context (no chat template); its next `n_cont`
    tokens are scored token by token ("decode": one lookup per token) and as one block ("prefill")."""
    import copy
    import dataclasses

    import numpy as np

    import sqjax

    model = sqjax.load_model(model_name, dtype=jnp.dtype(dtype))
    tok = model.tokenizer
    ids = tok.encode(text, add_bos=False)
    if len(ids) < n_ctx + n_cont:
        raise ValueError(f"the fidelity document has {len(ids)} tokens; it needs {n_ctx} + {n_cont}")
    # the document's prefill and the index build each under their own matmul precision (None: JAX's setting)
    with jax.default_matmul_precision(prefill_precision):
        full = sqjax.FixedContext.build(model, tok.decode(ids[:n_ctx]), sqjax.Full(), chat=False)
    with jax.default_matmul_precision(index_precision):
        sq = full.with_method(sqjax.Squeezed(sparsity=sparsity, n_sink=1, seed=seed))
    cont = np.asarray(ids[n_ctx:n_ctx + n_cont], np.int32)
    logits = {}
    for name, ctx in (("full", sq.with_method(sqjax.Full())), ("squeezed+sink1", sq)):
        for backend in ("auto", "reference"):
            c = copy.copy(ctx)
            c._hook = dataclasses.replace(ctx._hook, backend=backend)
            for mode in ("decode", "prefill"):
                logits[name, backend, mode] = c.score_ids(cont, mode=mode, return_logits=True)[1]
    rows = []
    for mode in ("decode", "prefill"):
        for name in ("full", "squeezed+sink1"):
            kl = kl_per_token(logits[name, "reference", mode], logits[name, "auto", mode])
            rows.append({"what": "compiled vs reference", "method": name, "mode": mode,
                         "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                         "max_abs_logit_diff": float(np.max(np.abs(logits[name, "reference", mode]
                                                                   - logits[name, "auto", mode])))})
        for backend in ("auto", "reference"):
            kl = kl_per_token(logits["full", backend, mode], logits["squeezed+sink1", backend, mode])
            rows.append({"what": f"squeezed vs full ({'compiled' if backend == 'auto' else 'reference'})",
                         "method": "squeezed+sink1", "mode": mode, "kl_mean": float(kl.mean()),
                         "kl_median": float(np.median(kl)), "kl_max": float(kl.max())})
    return {"dtype": dtype, "n_ctx": sq.n_tokens, "n_cont": int(len(cont)), "seed": seed,
            "prefill_precision": prefill_precision, "index_precision": index_precision,
            "matmul_precision": str(jax.config.jax_default_matmul_precision), "rows": rows}


def compare(runs: list[dict], reference: dict) -> list[dict]:
    """Per (dtype, method, question): greedy tokens equal to the reference's, and the first differing step."""
    ref = {(r["dtype"], a["method"], a["question"]): a["token_ids"] for r in reference["runs"] for a in r["answers"]}
    out = []
    for r in runs:
        for a in r["answers"]:
            want = ref.get((r["dtype"], a["method"], a["question"]))
            if want is None:
                continue
            got = a["token_ids"]
            first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            out.append({"dtype": r["dtype"], "method": a["method"], "question": a["question"],
                        "identical": got == want, "first_difference": None if got == want else first,
                        "tokens": len(got), "reference_tokens": len(want)})
    return out


def main(argv: list[str] | None = None) -> int:
    from sqjax.cli import demo_document

    p = argparse.ArgumentParser(prog="python -m benchmarks.real_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--doc", default=None, help="document text file (default: the demo's pydoc page of json)")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--questions", type=int, default=3, help="how many of the demo's questions (0: none)")
    p.add_argument("--fidelity-doc", default=None, metavar="FILE",
                   help="also compare the compiled routes with the reference routes on this document's index")
    p.add_argument("--fidelity-tokens", type=int, nargs=2, default=(6000, 128), metavar=("CONTEXT", "SCORED"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="k-means seeds of the fidelity index (one run each)")
    p.add_argument("--prefill-precision", default=None, help="matmul precision of the fidelity document's prefill "
                   "(e.g. highest; default: JAX's setting, TF32 for float32 on recent GPUs)")
    p.add_argument("--index-precision", default=None, help="matmul precision of the fidelity index's build")
    p.add_argument("--reference", default=None, help="a real_model.json from another device to compare answers with")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="run nothing: write the report of this real_model.json (with --reference: the comparison)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    reference = json.loads(Path(args.reference).read_text()) if args.reference else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        res = json.loads(Path(args.report).read_text())
    else:
        doc = Path(args.doc).read_text(encoding="utf-8") if args.doc else demo_document()
        res = {**metadata(), "model": args.model, "sparsity": args.sparsity, "max_new_tokens": args.max_new_tokens,
               "document_sha256": hashlib.sha256(doc.encode()).hexdigest(), "runs": [], "errors": {}}
        res["fidelity"] = []
        fid_text = Path(args.fidelity_doc).read_text(encoding="utf-8") if args.fidelity_doc else None
        for dt in args.dtypes:
            jobs = ([("demo", lambda: res["runs"].append(
                        run_dtype(args.model, doc, dt, args.sparsity, args.max_new_tokens, args.questions)))]
                    if args.questions else [])
            for seed in (args.seeds if fid_text is not None else []):
                jobs.append((f"fidelity seed {seed}", lambda seed=seed: res["fidelity"].append(
                    fidelity(args.model, fid_text, dt, args.sparsity, *args.fidelity_tokens, seed=seed,
                             prefill_precision=args.prefill_precision, index_precision=args.index_precision))))
            for what, job in jobs:
                try:
                    job()
                except Exception as e:  # recorded: the other parts still run
                    res["errors"][f"{dt} {what}"] = f"{type(e).__name__}: {e}"
                    print(f"{dt} {what}: {type(e).__name__}: {e}", file=sys.stderr)
                write_text_atomic(out / "real_model.json", json.dumps(res, indent=1))   # a partial run keeps its rows
    if reference is not None:
        same_doc = reference.get("document_sha256") == res["document_sha256"]
        res["reference"] = {"device": reference.get("device"), "git_commit": reference.get("git_commit"),
                            "same_document": same_doc, "answers": compare(res["runs"], reference) if same_doc else []}
    write_text_atomic(out / "real_model.json", json.dumps(res, indent=1))
    lines = [f"# {res['model']} on {res['device']} (jax {res['jax']}, commit {res['git_commit']})", "",
             f"Squeezed at sparsity {res['sparsity']} with n_sink=1 against full attention; the demo's questions, "
             f"{res['max_new_tokens']} new tokens, greedy; timings from the second call of each.", "",
             "| dtype | method | question | KV budget | TTFT ms | ms/token | answer |", "|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        for a in r["answers"]:
            tpot = "-" if a["tpot_s"] is None or a["tpot_s"] != a["tpot_s"] else f"{1e3 * a['tpot_s']:.2f}"
            lines.append(f"| {r['dtype']} | {a['method']} | {a['question']} | {a['kv_budget']:.3f} | "
                         f"{1e3 * a['ttft_s']:.1f} | {tpot} | {a['answer'].strip()[:60]!r} |")
    for dt, err in res.get("errors", {}).items():
        lines.append(f"| {dt} | failed: {err[:200]} | | | | | |")
    for f in res.get("fidelity", []):
        lines += ["", f"Fidelity, {f['dtype']}, seed {f.get('seed', 0)} (matmul precision {f['matmul_precision']}; prefill "
                      f"{f.get('prefill_precision')}, index {f.get('index_precision')}): a {f['n_ctx']}-token fixed "
                      f"context, {f['n_cont']} scored tokens; KL in nats per token.", "",
                  "| comparison | method | mode | KL mean | KL median | KL max | max abs logit diff |", "|---|---|---|---|---|---|---|"]
        for r in f["rows"]:
            lines.append(f"| {r['what']} | {r['method']} | {r['mode']} | {r['kl_mean']:.2e} | "
                         f"{r.get('kl_median', float('nan')):.2e} | {r['kl_max']:.2e} | "
                         f"{r.get('max_abs_logit_diff', float('nan')):.2e} |")
    if reference is not None:
        ref = res["reference"]
        lines += ["", f"Against {ref['device']} ({ref['git_commit']}): same document: {ref['same_document']}."]
        for c in ref["answers"]:
            lines.append(f"- {c['dtype']} {c['method']} — {c['question']}: "
                         + ("identical greedy tokens" if c["identical"] else f"first difference at token {c['first_difference']}"))
    write_text_atomic(out / "real_model.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
