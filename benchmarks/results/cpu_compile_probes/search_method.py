import sys, time
import jax
import sqjax
import sqjax.squeezed as sq
meth = sys.argv[1]
if meth != "default":
    sq.search_method = lambda: meth
m = sqjax.load_model("smollm2-135m")
import glob
doc = open(sorted(glob.glob("benchmarks/data/*.txt"))[0]).read()
ctx = sqjax.FixedContext.build(m, doc, sqjax.methods.Squeezed(sparsity=0.9, n_sink=1), progress=False)
q = "What does the method keep in the cache?"
t = time.perf_counter(); a = ctx.ask(q, max_new_tokens=24); t1 = time.perf_counter() - t
t = time.perf_counter(); b = ctx.ask(q, max_new_tokens=24); t2 = time.perf_counter() - t
print(meth, "n_tokens", ctx.n_tokens, "first ask", round(t1, 1), "second ask", round(t2, 2),
      "tpot ms", round(1000 * b.stats.time_per_output_token_s, 1), "ttft ms", round(1000 * b.stats.time_to_first_token_s, 1),
      repr(str(a))[:60], flush=True)
