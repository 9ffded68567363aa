"""Diagnostic (GPU): where the host time of a question's prefill goes, and what XLA's command
buffers do to it (the measurements that moved `FixedContext`'s prefills onto command buffers:
benchmarks/results/gpu_ttft/).

Runs the speed suite's end-to-end set-up (8B-shaped random model, fixed context, Squeezed index;
`python -m benchmarks.speed --skip offline,kernels --e2e-ask-only`) and, in place of its `ask`
rows, for Squeezed and for full attention:
  * the question's prefill through `FixedContext._run`, fresh cache, synced, median of 5, compiled
    without command buffers (`no_command_buffers`: how `ask` ran it until the change);
  * the same through `forward_jit` (command buffers) (a) on a fresh cache each call, (b) on a
    donated cache chain with the same token / position arrays (stable addresses), (c) on a donated
    cache chain with new token / position arrays each call;
  * a profiler trace of one prefill of each kind: device busy / span / kernels by name, and the
    host planes' events by name (what the host spends its time on);
  * `ask`'s time to first token (3 calls after a compiling one).
With --ab instead: `ask` itself, prefill without / with command buffers alternating (`ab_rows`).
(`--ab-cache`, at f1fe363 only: `ask` with its empty cache made by its own dispatch or inside the
prefill's program; the second is what `ask` does since.)
The two modes ran at commits before the change, where `ask` itself ran its prefill without them.
Writes probe.json under --out.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

from benchmarks import speed
from benchmarks._meta import metadata
from benchmarks._profile import activity_lines, host_and_device_activity

RESULTS: dict = {}
_NO_CMDBUF = {"xla_gpu_enable_command_buffer": ""}   # jax.jit compiler_options, per executable


class no_command_buffers:
    """Within the block, forwards of more than one token (prefills) run compiled without XLA's
    command buffers (`models.forward.forward_jit` patched), one-token steps as usual."""

    def __enter__(self):
        import importlib

        self.mf = importlib.import_module("models.forward")   # `models.forward` the attribute is the function
        self.real = real = self.mf.forward_jit
        if not hasattr(self, "plain"):   # one jitted function: its compilations are kept
            self.plain = jax.jit(self.mf.forward, static_argnames=("attn_fn", "capture_last", "logits"),
                                 donate_argnames=("cache",), compiler_options=_NO_CMDBUF)
        plain = self.plain
        self.mf.forward_jit = lambda *a, **k: (plain if a[2].shape[1] > 1 else real)(*a, **k)
        return self

    def __exit__(self, *exc):
        self.mf.forward_jit = self.real


NO_CMDBUF_PREFILL = no_command_buffers()


def _median_ms(f, n: int = 5, warm: int = 2) -> tuple[float, list]:
    for _ in range(warm):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(ts)), ts


def probe_rows(model, methods, data, length, n_prompt, n_new, log, batches=()) -> dict:
    from models.forward import forward_jit
    from sqjax.fixed_context import FixedContext, _left_pad, _tokens_positions

    question = ("Which of the measurements in the document above was taken on the largest input, and by how "
                "much did it beat the baseline?")[: max(1, n_prompt - 2)]
    rows = {}
    for name, method, idx in methods:
        r = rows[name] = {}
        ctx = FixedContext(model, method, np.zeros(length, np.int32), data, idx, {}, last_logits=None, chat=False,
                           suffix_template="\n\n{question}", doc_sha256="random")
        t0 = time.perf_counter()
        ctx.ask(question, max_new_tokens=2)
        r["first_ask_s"] = time.perf_counter() - t0
        padded = _left_pad([ctx._question_ids(question)])[0]
        tok, pos = _tokens_positions(padded, ctx.n_tokens)
        n_cache = len(padded) + n_new

        def plain():
            with NO_CMDBUF_PREFILL:
                return jax.block_until_ready(ctx._run(padded, ctx.n_tokens, ctx._new_cache(n_cache), capture=False,
                                                      logits="last")[0])

        def fwd(t, p, cache):
            return forward_jit(model.graphdef, model.state, t, p, cache, attn_fn=ctx._hook, attn_state=ctx._state,
                               capture_last=False, logits="last")

        r["plain_ms"], r["plain_calls"] = _median_ms(plain)
        log(f"[probe] {name}: without command buffers, fresh cache {r['plain_ms']:.2f} ms {np.round(r['plain_calls'], 2)}")

        def plain_captures():
            with NO_CMDBUF_PREFILL:
                return jax.block_until_ready(ctx._run(padded, ctx.n_tokens, ctx._new_cache(n_cache), capture=None,
                                                      logits="last")[0])

        r["plain_captures_ms"], r["plain_captures_calls"] = _median_ms(plain_captures)
        log(f"[probe] {name}: without command buffers, with captures (as ask), fresh cache {r['plain_captures_ms']:.2f} ms "
            f"{np.round(r['plain_captures_calls'], 2)}")

        def ask_path(capture):
            # `ask_many`'s path to its first token, with a host timestamp after each call returns
            from sqjax.fixed_context import _first_token
            import jax.numpy as jnp
            t = [time.perf_counter()]
            cache = ctx._new_cache(n_cache)
            t.append(time.perf_counter())
            with NO_CMDBUF_PREFILL:
                lg, cache, caps = ctx._run(padded[None], ctx.n_tokens, cache, capture=capture, logits="last")
            t.append(time.perf_counter())
            first = _first_token(lg, jax.random.key(0), jnp.float32(0.0), jnp.float32(1.0), greedy=True,
                                 use_top_p=False)
            t.append(time.perf_counter())
            np.asarray(first)
            t.append(time.perf_counter())
            return np.diff(1e3 * np.asarray(t))

        for capture, label in ((None, "ask_path"), (False, "ask_path_no_captures")):
            stages = np.asarray([ask_path(capture) for _ in range(6)])[2:]
            r[label] = {"stages_ms": np.median(stages, axis=0).tolist(), "total_ms": float(np.median(stages.sum(1)))}
            log(f"[probe] {name}: {label}: new_cache / run / first_token dispatch / wait, host ms "
                f"{np.round(r[label]['stages_ms'], 2)}, total {r[label]['total_ms']:.2f}")

        def cmdbuf_fresh():
            return jax.block_until_ready(fwd(tok, pos, ctx._new_cache(n_cache))[0])

        t0 = time.perf_counter()
        cmdbuf_fresh()
        r["cmdbuf_compile_s"] = time.perf_counter() - t0
        r["cmdbuf_fresh_ms"], r["cmdbuf_fresh_calls"] = _median_ms(cmdbuf_fresh)
        log(f"[probe] {name}: forward_jit, fresh cache {r['cmdbuf_fresh_ms']:.2f} ms {np.round(r['cmdbuf_fresh_calls'], 2)}")

        box = {"cache": ctx._new_cache(n_cache)}

        def cmdbuf_stable():
            lg, box["cache"], _ = fwd(tok, pos, box["cache"])
            return jax.block_until_ready(lg)

        r["cmdbuf_stable_ms"], r["cmdbuf_stable_calls"] = _median_ms(cmdbuf_stable, n=7, warm=3)
        log(f"[probe] {name}: forward_jit, donated cache chain, same tokens {r['cmdbuf_stable_ms']:.2f} ms "
            f"{np.round(r['cmdbuf_stable_calls'], 2)}")

        def cmdbuf_new_tokens():
            t, p = _tokens_positions(padded, ctx.n_tokens)
            lg, box["cache"], _ = fwd(t, p, box["cache"])
            return jax.block_until_ready(lg)

        r["cmdbuf_new_tokens_ms"], r["cmdbuf_new_tokens_calls"] = _median_ms(cmdbuf_new_tokens, n=7, warm=3)
        log(f"[probe] {name}: forward_jit, donated cache chain, new token arrays {r['cmdbuf_new_tokens_ms']:.2f} ms "
            f"{np.round(r['cmdbuf_new_tokens_calls'], 2)}")
        _save(log)
        for label, f in (("plain", plain), ("plain_captures", plain_captures), ("ask_path", lambda: ask_path(None))):
            try:
                tr = host_and_device_activity(f, top=60)
                r[f"trace_{label}"] = tr
                for line in activity_lines(tr, f"[probe] {name}: trace {label}"):
                    log(line)
            except Exception as e:  # noqa: BLE001
                r[f"trace_{label}"] = {"error": repr(e)[:500]}
                log(f"[probe] {name}: trace {label} failed: {e!r}"[:400])
            _save(log)
        ttft = []
        for _ in range(3):
            a = ctx.ask(question, max_new_tokens=2)
            ttft.append(1e3 * a.stats.time_to_first_token_s)
        r["ask_ttft_ms"] = ttft
        log(f"[probe] {name}: ask TTFT {np.round(ttft, 2)} ms")
        _save(log)
        del ctx, box
    return rows


def ab_rows(model, methods, data, length, n_prompt, n_new, log, batches=()) -> dict:
    """`ask` itself, alternating the question's prefill without command buffers (`no_command_buffers`)
    and with them (`forward_jit`), 8 calls each after a compiling one; each call's stages
    from host timestamps taken by thin wrappers (`_new_cache`, `_run`, `_first_token` returning)."""
    import contextlib

    import sqjax.fixed_context as fc
    from sqjax.fixed_context import FixedContext

    question = ("Which of the measurements in the document above was taken on the largest input, and by how "
                "much did it beat the baseline?")[: max(1, n_prompt - 2)]
    marks = []
    orig_new, orig_run, orig_first = FixedContext._new_cache, FixedContext._run, fc._first_token

    def new_cache(self, *a, **k):
        out = orig_new(self, *a, **k)
        marks.append(("new_cache", time.perf_counter()))
        return out

    def run(self, *a, **k):
        out = orig_run(self, *a, **k)
        marks.append(("run", time.perf_counter()))
        return out

    def first(*a, **k):
        out = orig_first(*a, **k)
        marks.append(("first_token", time.perf_counter()))
        return out

    FixedContext._new_cache, FixedContext._run, fc._first_token = new_cache, run, first
    rows = {}
    try:
        for name, method, idx in methods:
            r = rows[name] = {"plain": [], "cmdbuf": []}
            ctx = FixedContext(model, method, np.zeros(length, np.int32), data, idx, {}, last_logits=None,
                               chat=False, suffix_template="\n\n{question}", doc_sha256="random")
            variants = {"plain": NO_CMDBUF_PREFILL, "cmdbuf": contextlib.nullcontext()}
            for variant in ("plain", "cmdbuf"):    # compile both
                with variants[variant]:
                    ctx.ask(question, max_new_tokens=n_new)
            for i in range(16):
                variant = ("plain", "cmdbuf")[i % 2]
                marks.clear()
                t0 = time.perf_counter()
                with variants[variant]:
                    a = ctx.ask(question, max_new_tokens=n_new)
                st = a.stats
                m = {k: 1e3 * (t - t0) for k, t in marks[:3]}
                r[variant].append({"ttft_ms": 1e3 * st.time_to_first_token_s,
                                   "ms_per_token": 1e3 * st.time_per_output_token_s, **m})
            for variant in ("plain", "cmdbuf"):
                med = {k: float(np.median([c[k] for c in r[variant]])) for k in r[variant][0]}
                r[f"{variant}_median"] = med
                log(f"[ab] {name}, {variant}: median TTFT {med['ttft_ms']:.2f} ms (host marks: new_cache "
                    f"{med.get('new_cache', 0):.2f}, prefill returned {med.get('run', 0):.2f}, first token dispatched "
                    f"{med.get('first_token', 0):.2f} ms), {med['ms_per_token']:.2f} ms/token; TTFT calls "
                    + ", ".join(f"{c['ttft_ms']:.1f}" for c in r[variant]))
            RESULTS["rows"] = rows
            _save(log)
            del ctx
    finally:
        FixedContext._new_cache, FixedContext._run, fc._first_token = orig_new, orig_run, orig_first
    for v in ("plain", "cmdbuf"):
        if all(f"{v}_median" in rows.get(n, {}) for n in ("squeezed", "full")):
            rows[f"ttft_speedup_{v}"] = rows["full"][f"{v}_median"]["ttft_ms"] / rows["squeezed"][f"{v}_median"]["ttft_ms"]
            log(f"[ab] TTFT full / Squeezed, {v}: {rows[f'ttft_speedup_{v}']:.3f}")
    return rows


def _save(log):
    out = RESULTS.get("_out")
    if out:
        from sqjax.index_io import write_text_atomic

        write_text_atomic(os.path.join(out, "probe.json"),
                          json.dumps({k: v for k, v in RESULTS.items() if k != "_out"}, indent=1, default=str))


def main() -> int:
    out = sys.argv[sys.argv.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    RESULTS["_out"] = out
    RESULTS["meta"] = metadata()

    mode = probe_rows
    for flag, fn in (("--ab", ab_rows),):
        if flag in sys.argv:
            sys.argv.remove(flag)
            mode = fn

    def rows(*a, **k):
        RESULTS["rows"] = mode(*a, **k)
        return RESULTS["rows"]

    speed._ask_rows = rows
    try:
        rc = speed.main(sys.argv[1:])
    except KeyError as e:  # the suite's markdown expects its own `ask` rows; probe.json holds ours
        print(f"[probe] speed's report skipped ({e!r})")
        rc = 0
    _save(print)
    return rc


if __name__ == "__main__":
    sys.exit(main())
