import time, sys, os
t0=time.perf_counter()
import sqjax, jax
m = sqjax.load_model("smollm2-135m")
doc = open("README.md").read()[:9000]
t=time.perf_counter()
ctx = sqjax.FixedContext.build(m, doc, sqjax.methods.Squeezed(sparsity=0.9, n_sink=1))
print("tokens", ctx.n_tokens, "build", round(time.perf_counter()-t,1), flush=True)
for q in ["What is sqjax?", "Which command runs the tests, and how long does the whole suite take to run?", "What is sqjax for?"]:
    t=time.perf_counter(); a=ctx.ask(q, max_new_tokens=16); dt=time.perf_counter()-t
    print(len(ctx._question_ids(q)), round(dt,2), "ttft", round(a.stats.time_to_first_token_s,3), "tpot", round(a.stats.time_per_output_token_s,4), repr(str(a)[:40]), flush=True)
print("total", round(time.perf_counter()-t0,1))
