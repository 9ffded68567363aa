"""CPU: compile times of a new question-length bucket's programs in `FixedContext.ask` (embedded
SmolLM2, Squeezed 90% + sink, ~1K-token document), from jax's compile log -> JSON on stdout.

    cd <checkout> && PYTHONPATH=. .venv/bin/python <this file> <label>
"""
import json, logging, re, subprocess, sys, time

import jax
import sqjax

model = sqjax.load_model("smollm2-135m")
doc = open("README.md").read()[:3000]   # run from the checkout root
ctx = sqjax.FixedContext.build(model, doc, sqjax.methods.Squeezed(sparsity=0.9, centroid_fraction=0.05, n_sink=1))
ctx.ask("What is sqjax?", max_new_tokens=8)                          # the 16-token bucket: compiled here
msgs = []
handler = logging.Handler()
handler.emit = lambda r: msgs.append(r.getMessage())
for name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler"):
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).setLevel(logging.DEBUG)
jax.config.update("jax_log_compiles", True)
t = time.perf_counter()
ctx.ask("Which models does it support, and how are they loaded?", max_new_tokens=8)   # the 32-token bucket
total = time.perf_counter() - t
compiles = {m.group(1): float(m.group(2)) for m in
            (re.search(r"Finished XLA compilation of jit\((\w+)\) in ([\d.]+) sec", x) for x in msgs) if m}
print(json.dumps({"label": sys.argv[1], "jax": jax.__version__, "device": str(jax.devices()[0]),
                  "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip(),
                  "new_bucket_ask_s": total, "compile_s": compiles}, indent=1))
