"""A/B of the prefill's block lengths on the 2-core CPU: `FixedContext.score` of 12 texts of random
lengths (300-600 tokens, seed 0) after a 2.9K-token document, SmolLM2-135M + Squeezed (90%, sink).

    python benchmarks/results/cpu_block_lengths/probe.py {ladder|multiple16} OUT.json

`multiple16` puts back the earlier rule (every block padded to a multiple of 16). Each arm runs in
its own process (no compiled program shared); jax's persistent cache is off."""
import json
import subprocess
import sys
import time

import jax
import numpy as np

import sqjax
from sqjax import fixed_context as fc

arm, out = sys.argv[1], sys.argv[2]
if arm == "multiple16":
    fc._block_length = lambda n: -(-max(n, 1) // 16) * 16
model = sqjax.load_model("smollm2-135m")
doc = open("README.md").read()[:9000]
ctx = fc.FixedContext.build(model, doc, sqjax.methods.Squeezed(sparsity=0.9, n_sink=1))
lengths = [int(n) for n in np.random.default_rng(0).integers(300, 601, size=12)]
rows = []
t_all = time.perf_counter()
for n in lengths:
    ids = np.random.default_rng(n).integers(100, 40000, size=n + 1).astype(np.int32)
    t = time.perf_counter()
    lp = ctx.score_ids(ids)
    rows.append({"tokens": n, "padded": fc._block_length(n), "s": time.perf_counter() - t, "mean_logprob": float(np.mean(lp))})
    print(rows[-1], flush=True)
res = {"arm": arm, "jax": jax.__version__, "device": str(jax.devices()[0]), "doc_tokens": ctx.n_tokens,
       "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "programs": len({r["padded"] for r in rows}), "total_s": time.perf_counter() - t_all, "rows": rows}
json.dump(res, open(out, "w"), indent=1)
print(arm, "programs", res["programs"], "total", round(res["total_s"], 1))
