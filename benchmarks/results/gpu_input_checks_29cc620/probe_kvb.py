"""Which code gives which e2e `ask` KV budget: builds the speed suite's e2e index, asks once (squeezed)."""
import sys

import numpy as np

import benchmarks.speed as S


def probe_rows(model, methods, data, length, n_prompt, n_new, log, batches=()):
    import sqjax
    from sqjax.fixed_context import FixedContext
    print("PROBE code", sqjax.__file__, flush=True)
    question = ("Which of the measurements in the document above was taken on the largest input, and by how "
                "much did it beat the baseline?")[: max(1, n_prompt - 2)]
    for name, method, idx in methods:
        if name != "squeezed":
            continue
        ctx = FixedContext(model, method, np.zeros(length, np.int32), data, idx, {}, last_logits=None, chat=False,
                           suffix_template="\n\n{question}", doc_sha256="random")
        for _ in range(2):
            ans = ctx.ask(question, max_new_tokens=n_new)
            print("PROBE", name, method, ans.token_ids, ans.stats.kv_budget, ans.stats.kv_budget_prefill,
                  float(idx.threshold), idx.capacity, flush=True)
    raise SystemExit(0)


S._ask_rows = probe_rows
sys.exit(S.main(["--skip", "offline,kernels", "--e2e-ask-only", "--e2e-batches", "0", "--out", sys.argv[1]] + sys.argv[2:]))
