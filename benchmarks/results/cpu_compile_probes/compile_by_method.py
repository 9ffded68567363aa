import time, numpy as np, jax, jax.numpy as jnp
import sqjax
from models.forward import forward_new_cache_jit
from sqjax.fixed_context import _tokens_positions, _capacity
m = sqjax.load_model("smollm2-135m")
doc = open("README.md").read()[:9000]
base = sqjax.FixedContext.build(m, doc, sqjax.methods.Full())
for meth in [sqjax.methods.Full(), sqjax.methods.Squeezed(sparsity=0.9, n_sink=1), sqjax.methods.Quest(budget=0.1)]:
    ctx = base.with_method(meth)
    ids = np.arange(16, dtype=np.int32)[None]+100
    tokens, positions = _tokens_positions(ids, ctx.n_tokens)
    kw = dict(config=m.config, batch=1, capacity=_capacity(16+64), dtype=jnp.dtype(m.dtype), attn_fn=ctx._hook, attn_state=ctx._state, capture_last=None, logits="last")
    t=time.perf_counter(); low = forward_new_cache_jit.lower(m.graphdef, m.state, tokens, positions, **kw); tl=time.perf_counter()-t
    hlo = low.as_text(); 
    t=time.perf_counter(); c = low.compile(); tc=time.perf_counter()-t
    n_ops = c.as_text().count("\n")
    print(type(meth).__name__, "lower", round(tl,2), "compile", round(tc,2), "stablehlo lines", hlo.count("\n"), "opt hlo lines", n_ops, flush=True)
