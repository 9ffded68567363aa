import time, math, numpy as np, jax, jax.numpy as jnp
import sqjax
from sqjax import squeezed, methods
from sqjax.selection import Selection
from models.forward import forward_new_cache_jit
from sqjax.fixed_context import _tokens_positions, _capacity
def _select(self, index, layer, q, q_pre, k_fixed, q_valid=None):
    L = k_fixed.shape[1]; li = index.layer(layer)
    s, touched = squeezed.layer_scores(li, q, index.thresholds(q.shape[1])[1], 1 / math.sqrt(q.shape[-1]), self.vote, q_valid)
    hs = s.shape[0]
    selected = (s > index.thresholds(q.shape[1])[0]) & squeezed.per_selection_head(li.counts > 0, hs)
    lab = squeezed.per_selection_head(li.labels, hs)
    mid = jnp.take_along_axis(selected, lab, axis=1)
    mask = jnp.concatenate([jnp.ones((hs, index.n_sink), bool), mid, jnp.ones((hs, index.n_tail), bool)], 1)
    cnt = mask.sum(1).astype(jnp.int32)
    return Selection(mask[:, None, :], cnt[:, None], touched[:, None].astype(jnp.float32), jnp.zeros((hs,), bool), None)
m = sqjax.load_model("smollm2-135m")
doc = open("README.md").read()[:9000]
base = sqjax.FixedContext.build(m, doc, sqjax.methods.Full())
ctx = base.with_method(sqjax.methods.Squeezed(sparsity=0.9, n_sink=1))
ids = np.arange(16, dtype=np.int32)[None]+100
tokens, positions = _tokens_positions(ids, ctx.n_tokens)
for hack in [False, True]:
    if hack: methods.Squeezed._select = _select
    jax.clear_caches()
    kw = dict(config=m.config, batch=1, capacity=_capacity(16+64), dtype=jnp.dtype(m.dtype), attn_fn=ctx._hook, attn_state=ctx._state, capture_last=None, logits="last")
    low = forward_new_cache_jit.lower(m.graphdef, m.state, tokens, positions, **kw)
    t=time.perf_counter(); c = low.compile(); print("hack", hack, "compile", round(time.perf_counter()-t,2), flush=True)
