import time, threading, numpy as np, jax, jax.numpy as jnp
import sqjax
from models.forward import forward_new_cache_jit
from sqjax.fixed_context import _tokens_positions, _capacity
m = sqjax.load_model("smollm2-135m")
doc = open("README.md").read()[:9000]
ctx = sqjax.FixedContext.build(m, doc, sqjax.methods.Squeezed(sparsity=0.9, n_sink=1))
def low(T):
    tokens, positions = _tokens_positions(np.arange(T, dtype=np.int32)[None]+100, ctx.n_tokens)
    kw = dict(config=m.config, batch=1, capacity=_capacity(T+64), dtype=jnp.dtype(m.dtype), attn_fn=ctx._hook, attn_state=ctx._state, capture_last=None, logits="last")
    return forward_new_cache_jit.lower(m.graphdef, m.state, tokens, positions, **kw)
ls = [low(T) for T in (32, 48, 64, 80)]
t=time.perf_counter(); ls[0].compile(); ls[1].compile(); print("sequential 2", round(time.perf_counter()-t,1), flush=True)
t=time.perf_counter(); th=[threading.Thread(target=l.compile) for l in ls[2:]]; [x.start() for x in th]; [x.join() for x in th]; print("threads 2", round(time.perf_counter()-t,1), flush=True)
