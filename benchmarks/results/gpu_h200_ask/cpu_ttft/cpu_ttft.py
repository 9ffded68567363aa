"""`ask`'s time to first token on the CPU (SmolLM2-135M, the README's first ~12K characters as the document):
three calls (the first compiles), then the question's forward alone (`speed._question_prefill_s`), to see
whether the GPU's one-time cost on the first timed call shows here. Run from the repository root."""
import json, os, sys
sys.path.insert(0, ".")
import sqjax
from benchmarks._meta import metadata
from benchmarks.speed import _question_prefill_s
from sqjax.fixed_context import FixedContext

ctx = FixedContext.build(sqjax.load_model(), open("README.md").read()[:12000])
q = "What does the README say about the tests?"
ttft = [ctx.ask(q, max_new_tokens=4).stats.time_to_first_token_s for _ in range(3)]
out = {"meta": metadata(), "n_doc_tokens": ctx.n_tokens, "ttft_s_calls": ttft,
       "question_prefill_s": _question_prefill_s(ctx, q, 4)}
print(out)
json.dump(out, open(os.path.join(os.path.dirname(__file__), "cpu_ttft.json"), "w"), indent=1)
