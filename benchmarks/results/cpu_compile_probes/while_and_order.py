"""Two ideas for Squeezed's CPU compile time, each against the shipped program in one process.

    .venv/bin/python benchmarks/results/cpu_compile_probes/while_and_order.py {shipped|while|no_sort|toy}

One variant per process (a fresh process each: in one process a second compile of the same program
after `jax.clear_caches()` took 16.1 instead of 12.8 s).

`forward_new_cache_jit`'s program for a 16-token question over the first 6,000 characters of
sqjax/cli.py (SmolLM2, Squeezed + sink at 90%), lowered then compiled, at the suite's LLVM level 0
(XLA_FLAGS as tests/conftest.py sets it) and compared logits:

- ``while``: each layer's attention hook run inside a while loop of one trip whose count XLA cannot
  see (an optimization barrier), so that each layer's selection becomes a computation of its own;
- ``no_sort``: the retrieval with its capacity lifted (every selected cluster fits) and the clusters
  enumerated in index order instead of `argsort` by score (the sort gone from the program).

``toy``: 30 "layers" of 20 matmul + sort + cumsum steps, written out or each in a while loop of one.
"""
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402


def once(fn, *args):
    """fn(*args) inside a while loop of one trip (count behind an optimization barrier)."""
    n = lax.optimization_barrier(jnp.int32(1))
    out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
    return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1], fn(*c[1])), (jnp.int32(0), args, out))[2]


def toy():
    def heavy(x, w):
        for _ in range(20):
            x = jnp.tanh(x @ w) + jnp.sort(x, axis=-1) * 0.1
            x = x + jnp.cumsum(x, axis=0) * 1e-3
        return x

    ws = [jnp.ones((64, 64)) * 0.01 * i for i in range(30)]
    x = jnp.ones((32, 64))
    for mode in ("written out", "while"):
        def layers(x, ws, mode=mode):
            for w in ws:
                x = once(heavy, x, w) if mode == "while" else heavy(x, w)
            return x

        f = jax.jit(layers)
        t = time.perf_counter()
        c = f.lower(x, ws).compile()
        print(f"toy {mode}: compile {time.perf_counter() - t:.1f} s, sum {float(c(x, ws).sum()):.3f}", flush=True)


@dataclasses.dataclass(frozen=True)
class WhileHook:
    """The context's hook, each call inside a while loop of one trip."""
    hook: object

    def __call__(self, layer, q, cache_k, cache_v, q_pos, kv_pos, state):
        return once(lambda q, ck, cv: self.hook(layer, q, ck, cv, q_pos, kv_pos, state).astype(q.dtype),
                    q, cache_k, cache_v)


def model_probe(name: str):
    import sqjax
    import sqjax.squeezed as sq
    from models.forward import forward_new_cache_jit
    from sqjax.fixed_context import _capacity, _left_pad, _tokens_positions

    m = sqjax.load_model("smollm2-135m")
    ctx = sqjax.FixedContext.build(m, open("sqjax/cli.py").read()[:6000],
                                   sqjax.methods.Squeezed(sparsity=0.9, n_sink=1), progress=False)
    ids = _left_pad([ctx._question_ids("What does the parser do?")])
    tokens, positions = _tokens_positions(ids, ctx.n_tokens)

    class NoSortJnp:
        """jax.numpy as `sqjax.squeezed` sees it, with `argsort` giving index order (no sort)."""

        def __getattr__(self, name):
            return getattr(jnp, name)

        @staticmethod
        def argsort(x, **_):
            return jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)

    lifted = dataclasses.replace(ctx.index, capacity=ctx.index.n_sink + ctx.index.n_tail + ctx.n_tokens)
    out = {}
    for variant in dict.fromkeys((name, "shipped")):   # the variant's compile first in its process
        hook, state = ctx._hook, ctx._state
        sq.jnp = NoSortJnp() if variant == "no_sort" else jnp
        if variant == "while":
            hook = WhileHook(hook)
        if variant == "no_sort":   # with every selected cluster fitting, index order enumerates the same rows
            state = dict(state, index=lifted)
        kw = dict(config=m.config, batch=1, capacity=_capacity(ids.shape[1]), dtype=jnp.dtype(m.dtype),
                  attn_fn=hook, attn_state=state, capture_last=1, logits="last")
        low = forward_new_cache_jit.lower(m.graphdef, m.state, tokens, positions, **kw)
        t = time.perf_counter()
        c = low.compile()
        out[variant] = (time.perf_counter() - t, c.as_text().count("\n"),
                        np.asarray(c(m.graphdef, m.state, tokens, positions, attn_state=state)[0]))
    tc, lines, logits = out[name]
    print(f"{name}: compile {tc:.1f} s, optimized HLO {lines} lines, "
          f"max |logit - shipped| {float(np.max(np.abs(logits - out['shipped'][2]))):.2e}", flush=True)
    sq.jnp = jnp


if __name__ == "__main__":
    print("XLA_FLAGS", os.environ.get("XLA_FLAGS"), "jax", jax.__version__, flush=True)
    toy() if sys.argv[1] == "toy" else model_probe(sys.argv[1])
