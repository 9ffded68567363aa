"""CPU (2 cores): SmolLM2-135M decode with the side-by-side products forced on vs off, to check
the choice `models.llama._linears_side_by_side` makes on CPU (off). 512-token prompt, 16 greedy
steps, median of 3, two rounds alternating.

    PYTHONPATH=. python benchmarks/results/gpu_h200_e2e_gemv/cpu_ab.py OUT_DIR   (writes cpu_ab.json)
"""
import functools
import json
import sys
from pathlib import Path
import statistics
import time

import jax
import numpy as np

from benchmarks._meta import metadata
from models import bench_cpu as b
from models import llama
from models.registry import load_model

helper = llama._linears_side_by_side
model = load_model("smollm2-135m")
ids = (np.arange(512, dtype=np.int32)[None] % 1000) + 13
res = {"meta": metadata(), "model": "smollm2-135m", "prompt_tokens": 512, "decode_steps": 16, "rows": []}
for rnd in range(2):
    for fused in (False, True):
        llama._linears_side_by_side = functools.partial(helper, fused=fused)
        jax.clear_caches()
        _, cache = b._prefill_all(model, ids, 512, 1024)
        b._decode(model, cache, 512, 5, 2)  # compile
        t0 = time.perf_counter()
        _, cache = b._prefill_all(model, ids, 512, 1024)
        tp = time.perf_counter() - t0
        ts = []
        for _ in range(3):
            _, cache = b._prefill_all(model, ids, 512, 1024)
            ts.append(b._decode(model, cache, 512, 5, 16)[0] / 16 * 1e3)
        res["rows"].append({"round": rnd, "side_by_side": fused, "prefill_ms": tp * 1e3,
                            "decode_ms_per_token_median_of_3": statistics.median(ts), "decode_ms_per_token": ts})
        print(f"round {rnd}, side by side {'on ' if fused else 'off'}: prefill of 512 tokens {tp * 1e3:.0f} ms, "
              f"decode {statistics.median(ts):.1f} ms/token", flush=True)
(Path(sys.argv[1]) / "cpu_ab.json").write_text(json.dumps(res, indent=1))
