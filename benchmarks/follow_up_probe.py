"""Diagnostic (GPU): why a follow-up with the turns' K/V kept (`Conversation.ask`) reached its first
token ~12 ms later than a lone question of about its length (benchmarks/results/gpu_h200_follow_up/).

Runs the speed suite's end-to-end set-up (8B-shaped random model, fixed context, Squeezed index;
`python -m benchmarks.speed --skip offline,kernels --e2e-ask-only`) and, in place of its `ask` rows,
for Squeezed and for full attention on the chat-template context of `_ttft_follow_up`, after a first
turn of --probe-turn tokens (question and a 16-token answer):
  * "lone": `ask` of a numbered question with no history, back to back;
  * "kept": `Conversation.ask` of the same questions, each undone, back to back;
  * "kept_interleaved" / "lone_interleaved": the same, each followed by `ask(history=...)` (the speed
    suite's follow-up rows interleave like this);
  * "kept_no_cmdbuf": "kept" with the prefill compiled without XLA's command buffers;
  * "kept_16_tokens" / "lone_16_tokens": back to back with 16-token answers (decode steps between);
  * the stages of the kept and the lone path, host time after each returns (async) and synced
    (`block_until_ready` after each stage);
  * profiler traces of one kept and one lone call: device busy / span / kernels / gaps, host events.
With --ab-routes instead of those series: the follow-up block's new part by the prefix route (the default,
`new_part="prefix_causal_left_padded"`) against the position mask over the cache (the route before it),
alternating, and whether both give the same tokens; on a GPU first a model-shaped compiled check of both.
Times are each call's `time_to_first_token_s`; medians of 7 calls after 2. Writes probe.json under --out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import speed
from benchmarks._meta import metadata
from benchmarks._profile import activity_lines, host_and_device_activity
from benchmarks.ttft_probe import NO_CMDBUF_PREFILL

RESULTS: dict = {}
_N_WARM, _N_TIMED = 2, 7


class _Stages:
    """Host timestamps after `_TurnCache.kept`, `FixedContext._run` / `_run_new_cache` and
    `_first_token` return (their outputs synced first with ``sync``)."""

    def __init__(self, sync: bool):
        import sqjax.fixed_context as fc

        self.fc, self.sync, self.marks = fc, sync, []
        self.saved = (fc._TurnCache.kept, fc.FixedContext._run, fc.FixedContext._run_new_cache, fc._first_token)

    def _wrap(self, name, f):
        def g(*a, **k):
            out = f(*a, **k)
            if self.sync:
                jax.block_until_ready(out)
            self.marks.append((name, time.perf_counter()))
            return out
        return g

    def __enter__(self):
        fc = self.fc
        kept, run, run_new, first = self.saved
        fc._TurnCache.kept = self._wrap("kept", kept)
        fc.FixedContext._run = self._wrap("prefill", run)
        fc.FixedContext._run_new_cache = self._wrap("prefill", run_new)
        fc._first_token = self._wrap("first_token", first)
        return self

    def __exit__(self, *exc):
        fc = self.fc
        fc._TurnCache.kept, fc.FixedContext._run, fc.FixedContext._run_new_cache, fc._first_token = self.saved


def _series(call) -> dict:
    """call(i) -> seconds, _N_WARM + _N_TIMED times: {median_ms of the timed calls, calls_ms: all}."""
    ts = [1e3 * call(i) for i in range(_N_WARM + _N_TIMED)]
    return {"median_ms": float(np.median(ts[_N_WARM:])), "calls_ms": ts}


def probe_rows(model, methods, data, length, n_prompt, n_new, log, batches=(), question_tokens=(),
               follow_up_tokens=()) -> dict:
    from sqjax.fixed_context import FixedContext

    question = ("Which of the measurements in the document above was taken on the largest input, and by how "
                "much did it beat the baseline?")[: max(1, n_prompt - 2)]
    n_turn = int(RESULTS["turn_tokens"])
    rows = {}
    for name, method, idx in methods:
        r = rows[name] = {}
        ctx = FixedContext(model, method, np.zeros(length, np.int32), data, idx, {}, last_logits=None, chat=True,
                           suffix_template=speed._CHAT_SUFFIX, doc_sha256="random")
        conv = ctx.conversation()
        t0 = time.perf_counter()
        conv.ask(speed._repeated(question, n_turn - 16 - 30), max_new_tokens=16)
        r["first_turn_s"] = time.perf_counter() - t0
        counter = iter(range(10 ** 6))

        def q():
            return f"({next(counter)}) {question}"

        def kept(_i, cm=contextlib.nullcontext, n_new=2):
            with cm():
                a = conv.ask(q(), max_new_tokens=n_new)
            conv.undo()
            r.setdefault("n_reused", []).append(a.stats.n_reused_tokens)
            r.setdefault("n_prompt_kept", a.stats.n_prompt_tokens)
            return a.stats.time_to_first_token_s

        def lone(_i, n_new=2):
            a = ctx.ask(q(), max_new_tokens=n_new)
            r.setdefault("n_prompt_lone", a.stats.n_prompt_tokens)
            return a.stats.time_to_first_token_s

        def again():
            return ctx.ask(q(), max_new_tokens=2, history=conv.history).stats.time_to_first_token_s

        def interleaved(f):
            def g(i):
                t = f(i)
                again()
                return t
            return g

        routes = {"prefix": ctx._follow_up_hook, "masked": ctx._hook}   # the follow-up block's new part

        def kept_by(route):
            def call(i):
                ctx._follow_up_hook = routes[route]
                try:
                    return kept(i)
                finally:
                    ctx._follow_up_hook = routes["prefix"]
            return call

        series = (("lone", lone), ("kept", kept), ("kept_interleaved", interleaved(kept)),
                  ("lone_interleaved", interleaved(lone)), ("kept_again", kept),
                  ("kept_no_cmdbuf", lambda i: kept(i, lambda: NO_CMDBUF_PREFILL)),
                  ("kept_after_no_cmdbuf", kept), ("lone_again", lone),
                  ("kept_16_tokens", lambda i: kept(i, n_new=16)), ("lone_16_tokens", lambda i: lone(i, 16)))
        if RESULTS.get("ab_routes"):   # the follow-up's new part by route, alternating, in one process
            series = (("lone", lone), ("kept_masked", kept_by("masked")), ("kept_prefix", kept_by("prefix")),
                      ("kept_masked_2", kept_by("masked")), ("kept_prefix_2", kept_by("prefix")), ("lone_2", lone))
            agree = []
            for i in range(4):   # the same follow-up by both routes: the same greedy tokens (bf16 aside)
                q_i = q()
                toks = []
                turn = conv._turn    # each route from a copy of the same kept turns (an answer donates them)
                for route in ("masked", "prefix"):
                    ctx._follow_up_hook = routes[route]
                    conv._turn = dataclasses.replace(turn, cache=jax.tree.map(jnp.copy, turn.cache))
                    toks.append(conv.ask(q_i, max_new_tokens=8).token_ids)
                    conv.undo()
                ctx._follow_up_hook = routes["prefix"]
                agree.append(toks[0] == toks[1])
            r["routes_agree"] = agree
            log(f"[follow-up probe] {name}: the masked and the prefix routes gave the same 8 tokens in "
                f"{sum(agree)} of {len(agree)} follow-ups")
        for label, call in series:
            try:
                r[label] = _series(call)
                log(f"[follow-up probe] {name}: {label}: TTFT median {r[label]['median_ms']:.2f} ms; calls "
                    + ", ".join(f"{x:.1f}" for x in r[label]["calls_ms"]))
            except Exception as e:  # noqa: BLE001
                r[label] = {"error": repr(e)[:400]}
                log(f"[follow-up probe] {name}: {label}: ERROR {e!r}"[:500])
            _save()
        log(f"[follow-up probe] {name}: prompt tokens lone {r.get('n_prompt_lone')}, kept {r.get('n_prompt_kept')} "
            f"(reused: {sorted(set(r.get('n_reused', [])))})")
        for sync in (False, True):
            for label, call in (("lone", lone), ("kept", kept)):
                key = f"stages_{label}_{'synced' if sync else 'async'}"
                per = []
                for i in range(_N_WARM + 5):
                    with _Stages(sync) as st:
                        t0 = time.perf_counter()
                        ttft = call(i)
                    per.append({"ttft_ms": 1e3 * ttft, **{k: 1e3 * (t - t0) for k, t in st.marks[:3]}})
                med = {k: float(np.median([p.get(k, np.nan) for p in per[_N_WARM:]])) for k in per[-1]}
                r[key] = {"median_ms_since_start": med, "calls": per}
                log(f"[follow-up probe] {name}: {key}: ms since the call's start "
                    + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
        _save()
        for label, call in (("lone", lone), ("kept", kept)):
            try:
                call(0)
                tr = host_and_device_activity(lambda: call(0), top=40)
                r[f"trace_{label}"] = tr
                for line in activity_lines(tr, f"[follow-up probe] {name}: trace {label}", gaps=6, kernels=12,
                                           hosts=3):
                    log(line)
            except Exception as e:  # noqa: BLE001
                r[f"trace_{label}"] = {"error": repr(e)[:500]}
                log(f"[follow-up probe] {name}: trace {label} failed: {e!r}"[:500])
            _save()
        del ctx, conv
    return rows


def model_shape_check(log, hq=32, hkv=8, d=128, t=160, n_prefix=2058, capacity=4224) -> dict:
    """The follow-up's new part at the end-to-end model's shapes (bf16, compiled): a left-padded block
    of t tokens after n_prefix kept tokens in a cache of `capacity` slots, by the prefix route and by
    the position mask, against the plain-jnp reference; each call's median time."""
    from benchmarks._meta import time_ms
    from pallas_kernels import dense_prefill_attention
    from pallas_kernels.dense_attention import dense_attention_reference
    from pallas_kernels.sparse_attention import causal_alignment

    rng = np.random.default_rng(0)
    pad, num_l = 7, 64
    q_pos = np.where(np.arange(t) < pad, -1, 1000 + n_prefix + np.arange(t) - pad).astype(np.int32)
    kv_pos = np.full(capacity, -1, np.int32)
    kv_pos[:n_prefix] = 1000 + np.arange(n_prefix)
    kv_pos[n_prefix:n_prefix + t] = q_pos
    bf = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)   # noqa: E731
    args = (bf(hq, t, d), bf(hkv, num_l, d), bf(hkv, num_l, d), bf(hkv, capacity, d), bf(hkv, capacity, d),
            jnp.asarray(q_pos), jnp.asarray(kv_pos))
    ref = np.asarray(dense_attention_reference(*args, scale=d ** -0.5), np.float32)[:, pad:]
    out = {"aligned": bool(causal_alignment(args[5], args[6], True, True)[2])}
    for mode in ("prefix_causal_left_padded", "causal_left_padded", "mask"):
        f = jax.jit(lambda *a, mode=mode: dense_prefill_attention(*a, scale=d ** -0.5, backend="auto", new_part=mode))
        o = np.asarray(f(*args), np.float32)[:, pad:]
        err = float(np.abs(o - ref).max() / np.abs(ref).max())
        out[mode] = {"max_rel_err": err, "ms": time_ms(f, [args])}
        log(f"[follow-up probe] model-shaped new part, {mode}: max rel err {err:.2e}, {out[mode]['ms']:.3f} ms per call")
    return out


def _save():
    out = RESULTS.get("_out")
    if out:
        from sqjax.index_io import write_text_atomic

        write_text_atomic(os.path.join(out, "probe.json"),
                          json.dumps({k: v for k, v in RESULTS.items() if k != "_out"}, indent=1, default=str))


def _pop_option(argv: list, flag: str, default: str) -> str:
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def main() -> int:
    argv = sys.argv[1:]
    out = _pop_option(argv, "--out", "")
    RESULTS["turn_tokens"] = int(_pop_option(argv, "--probe-turn", "2048"))
    RESULTS["ab_routes"] = "--ab-routes" in argv
    argv = [a for a in argv if a != "--ab-routes"]
    if out:
        os.makedirs(out, exist_ok=True)
        RESULTS["_out"] = out
    RESULTS["meta"] = metadata()

    def rows(*a, **k):
        if jax.default_backend() == "gpu":
            try:
                RESULTS["model_shape_check"] = model_shape_check(a[6] if len(a) > 6 else print)
            except Exception as e:  # noqa: BLE001
                RESULTS["model_shape_check"] = {"error": repr(e)[:500]}
                print(f"[follow-up probe] model-shaped check failed: {e!r}"[:500])
        RESULTS["rows"] = probe_rows(*a, **k)
        return RESULTS["rows"]

    speed._ask_rows = rows
    try:
        rc = speed.main(argv + (["--out", out] if out else []))
    except KeyError as e:  # the suite's markdown expects its own `ask` rows; probe.json holds ours
        print(f"[follow-up probe] speed's report skipped ({e!r})")
        rc = 0
    _save()
    return rc


if __name__ == "__main__":
    sys.exit(main())
