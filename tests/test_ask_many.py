"""FixedContext.ask_many: a batch of questions answered together equals asking them one by one."""

import numpy as np
import pytest
from _tiny_model import tiny_model

from sqjax import fixed_context as fc
from sqjax.fixed_context import FixedContext, SqjaxError
from sqjax.methods import Full, HierarchicalSqueezed, Quest, Saap, Squeezed

DOC = " ".join(f"Shelf {i} holds a {w} next to box {i % 5}." for i, w in
               zip(range(50), ["kettle", "drill", "lamp", "ladder", "globe"] * 10))
# lengths in different padding buckets (the longest pads the others by > 16 tokens)
QUESTIONS = ["Which shelf?",
             "What does shelf 12 hold, and which box stands next to it on the left side of the aisle "
             "when you walk in from the north door past the drills?",
             "Where is the globe kept?"]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def ctx(model):
    return FixedContext.build(model, DOC, Squeezed(sparsity=0.8, n_sink=1), chat=False)


def _same_answer(got, ref):
    assert got.token_ids == ref.token_ids and str(got) == str(ref)
    assert got.stats.n_prompt_tokens == ref.stats.n_prompt_tokens
    assert got.stats.n_new_tokens == ref.stats.n_new_tokens == len(ref.token_ids)
    # each answer's budget counts its own lookups (its question block, then its own decode steps)
    np.testing.assert_allclose(got.stats.kv_budget_prefill, ref.stats.kv_budget_prefill, rtol=1e-6)
    np.testing.assert_allclose(got.stats.kv_budget, ref.stats.kv_budget, rtol=1e-6)
    np.testing.assert_allclose(got.stats.kv_budget_per_layer, ref.stats.kv_budget_per_layer, rtol=1e-6)


@pytest.mark.parametrize("method", [None, HierarchicalSqueezed(sparsity=0.8, n_sink=1), Quest(budget=0.3),
                                    Saap(probes=4), Full(), Squeezed(sparsity=0.8, n_sink=1, dense_layers=1)],
                         ids=lambda m: "squeezed" if m is None else m.name + ("_dense1" if m.dense_layers else ""))
def test_batch_equals_one_by_one(ctx, method):
    c = ctx if method is None else ctx.with_method(method)
    assert len({len(c._question_ids(q)) for q in QUESTIONS}) == 3
    got = c.ask_many(QUESTIONS, max_new_tokens=6, stop_ids=())
    assert len(got) == len(QUESTIONS)
    for q, a in zip(QUESTIONS, got):
        _same_answer(a, c.ask(q, max_new_tokens=6, stop_ids=()))
        assert a.stats.time_to_first_token_s > 0 and a.stats.time_per_output_token_s > 0


def test_rows_stop_on_their_own(ctx):
    """A row that emits a stop id ends there (the stop id is its last token) while the others go on;
    streamed pieces add up to each answer."""
    free = ctx.ask_many(QUESTIONS, max_new_tokens=5, stop_ids=())
    stop = free[0].token_ids[1]                      # row 0's second token
    assert stop not in free[1].token_ids[:4] or stop not in free[2].token_ids[:4]
    pieces = {i: "" for i in range(3)}
    got = ctx.ask_many(QUESTIONS, max_new_tokens=5, stop_ids=(stop,),
                       on_token=lambda i, t: pieces.__setitem__(i, pieces[i] + t))
    for q, a, f in zip(QUESTIONS, got, free):
        ref = ctx.ask(q, max_new_tokens=5, stop_ids=(stop,))
        _same_answer(a, ref)
        k = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
        assert a.token_ids == f.token_ids[:k]
    assert got[0].token_ids == free[0].token_ids[:2]
    assert [pieces[i] for i in range(3)] == [str(a) for a in got]


def test_stats_of_an_early_stop_look_up_only_the_steps_fed(ctx, monkeypatch):
    """An answer that stops long before max_new_tokens: its accounting re-runs the lookups of the steps
    that were fed (rounded up to a bucket of 16), not of every slot up to max_new_tokens, and its stats
    are those of the same answer asked with room for just its tokens."""
    free = ctx.ask(QUESTIONS[0], max_new_tokens=5, stop_ids=())
    stop = free.token_ids[2]
    seen = []
    real = fc._step_counts_jit

    def spy(method, index, k, qbuf, n_steps):
        seen.append((qbuf.shape[2], n_steps))                 # qbuf's step slots, the steps looked up
        return real(method, index, k, qbuf, n_steps)

    monkeypatch.setattr(fc, "_step_counts_jit", spy)
    long = ctx.ask(QUESTIONS[0], max_new_tokens=64, stop_ids=(stop,))
    assert long.token_ids == free.token_ids[:3] and seen == [(64, 16)]
    _same_answer(long, ctx.ask(QUESTIONS[0], max_new_tokens=4, stop_ids=(stop,)))
    assert seen[1] == (16, 16)


def test_ask_streams_like_before(ctx):
    pieces = []
    a = ctx.ask(QUESTIONS[2], max_new_tokens=4, stop_ids=(), on_token=pieces.append)
    assert "".join(pieces) == str(a) and len(a.token_ids) == 4


def test_decode_step_compiles_once_per_batch_size(ctx):
    ctx.ask_many(QUESTIONS[:2], max_new_tokens=3, stop_ids=())
    before = fc._ask_step._cache_size()
    ctx.ask_many(QUESTIONS[1:], max_new_tokens=3, stop_ids=())   # same batch size, same buckets
    assert fc._ask_step._cache_size() == before


def test_bad_batches(ctx):
    with pytest.raises(SqjaxError, match="question 2 of 3 .*empty"):
        ctx.ask_many(["a?", "  ", "b?"], max_new_tokens=2)
    with pytest.raises(SqjaxError, match="list of questions"):
        ctx.ask_many("one string", max_new_tokens=2)
    with pytest.raises(SqjaxError, match="list of questions"):
        ctx.ask_many([], max_new_tokens=2)
    with pytest.raises(SqjaxError, match="max_new_tokens"):
        ctx.ask_many(["a?"], max_new_tokens=0)
    n = ctx.model.config.max_position_embeddings
    with pytest.raises(SqjaxError, match="exceed the model's context"):
        ctx.ask_many(["a?", "b?"], max_new_tokens=n)
    for bad in (["x"], "</s>", [1.0], [True], 7):   # stop ids are token ids: named before any work
        with pytest.raises(SqjaxError, match="stop_ids must be"):
            ctx.ask_many(["a?"], max_new_tokens=2, stop_ids=bad)
    assert ctx.ask("a?", max_new_tokens=2, stop_ids=np.asarray([10 ** 6])).stats.n_new_tokens == 2


@pytest.mark.bench_smoke
def test_batch_benchmark_plumbing(tmp_path):
    """`benchmarks.batch_ask` on a tiny checkpoint: both methods, answers compared, JSON + markdown."""
    from _tiny_model import save_hf_checkpoint

    from benchmarks import batch_ask

    ckpt = save_hf_checkpoint(tiny_model(), tmp_path / "ckpt")
    out = tmp_path / "res" / "b.json"
    assert batch_ask.main(["--model", str(ckpt), "--batch", "2", "--tokens", "3", "--reps", "1", "--out", str(out)]) == 0
    import json

    res = json.loads(out.read_text())
    assert [r["method"] for r in res["rows"]] == ["squeezed+sink1 s0.9", "full"]
    for r in res["rows"]:
        assert r["greedy_answers_equal"] == [True, True] and r["batch_s"] > 0 and r["one_by_one_s"] > 0
        np.testing.assert_allclose(r["kv_budget_batch"], r["kv_budget_one_by_one"], rtol=1e-6)
    assert "| full | 2 × 3 |" in out.with_suffix(".md").read_text()


@pytest.mark.bench_smoke
@pytest.mark.parametrize("method", ["squeezed", "hierarchical"])
def test_batch_decode_benchmark_plumbing(tmp_path, method):
    """`benchmarks.batch_decode --cpu-smoke` (one- and two-level index): its checks pass (folded
    dense = row-by-row dense, Squeezed rows = the clustered decode's jnp reference, the batched call
    = the rows one by one) and it writes JSON + markdown; the two-level run also times (and checks)
    the batched call with one level-2 program per (KV head, row) beside the default layout."""
    import json

    from benchmarks import batch_decode

    ab = ["--ab-level2-rows", "1"] if method == "hierarchical" else []
    assert batch_decode.main(["--cpu-smoke", "--method", method, "--out", str(tmp_path), *ab]) == 0
    res = json.loads((tmp_path / "batch_decode.json").read_text())
    assert res["method"] == method and res["ab_level2_rows"] == (1 if ab else None)
    assert [(r["L"], r["B"]) for r in res["rows"]] == [(1024, 1), (1024, 2)]
    for r in res["rows"]:
        assert r["ok"] and r["squeezed_loop_ms"] > 0 and r["dense_shared_loop_ms"] > 0 and 0 < r["kept"] < 1
        assert (r.get("squeezed_batched_ab_loop_ms", 0) > 0) == bool(ab)
    md = (tmp_path / "batch_decode.md").read_text()
    assert "| 1024 | 2 |" in md and ("level2_rows = 1 |" in md) == bool(ab)


def _two_row_step_logits(model, c, states, patch=None):
    """Each backend's logits for one decode step of two rows (the first two questions, prefilled
    through the context's own hook) through `c`'s hook on that backend and attention state.
    patch = (monkeypatch, name): record `dispatch.resolved()` whenever `sqjax.dispatch.<name>` is
    traced; -> (logits by backend, the records)."""
    import dataclasses

    import jax.numpy as jnp

    from models.forward import forward_jit
    from sqjax import dispatch

    calls = []
    if patch is not None:
        monkeypatch, name = patch
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, **k: calls.append(dispatch.resolved()) or real(*a, **k))
    padded = fc._left_pad([c._question_ids(q) for q in QUESTIONS[:2]])
    pos = jnp.asarray([[c.n_tokens + len(c._question_ids(q))] for q in QUESTIONS[:2]], jnp.int32)
    logits = {}
    for backend, state in states.items():
        hook = dataclasses.replace(c._hook, backend=backend)
        cache = c._new_cache(padded.shape[1] + 4, 2)
        _, cache, _ = c._forward(*fc._tokens_positions(padded, c.n_tokens), cache, False)   # the questions (prefill)
        lg, _, _ = forward_jit(model.graphdef, model.state, jnp.asarray([[321], [77]]), pos, cache,
                               attn_fn=hook, attn_state=state, logits="last")
        logits[backend] = np.asarray(lg)
    return logits, calls


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_batched_gpu_decode_path_equals_reference(model, vote, monkeypatch):
    """On GPU a batch's decode step goes through `clustered_decode_batched` (one set of launches
    for every row; here interpreted): the same logits as the reference path row by row, each row
    with its own question tokens in the cache."""
    from sqjax.fixed_context import attention_state

    c = FixedContext.build(model, DOC, Squeezed(sparsity=0.8, n_sink=1, vote=vote, capacity_fraction=1.0), chat=False)
    states = {"reference": c._state, "interpret": attention_state(c.kv.k, c.kv.v, c.index, clustered_layout=True)}
    logits, calls = _two_row_step_logits(model, c, states, (monkeypatch, "clustered_decode_batched"))
    assert "interpret" in calls
    np.testing.assert_allclose(logits["interpret"], logits["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend,dtype,num_s,t", [("reference", "float32", 9, 1), ("interpret", "float32", 9, 1),
                                                    ("interpret", "bfloat16", 9, 1), ("interpret", "float32", 0, 1),
                                                    ("reference", "float32", 9, 5), ("interpret", "float32", 9, 5),
                                                    ("interpret", "bfloat16", 9, 5)])   # bf16 blocks: flash route
def test_dense_attention_batched_equals_rows(backend, dtype, num_s, t):
    """Full attention for B rows over one shared fixed context (the rows' tokens folded into one pass
    over it) equals each row's own exact attention: GQA 4:1, decode steps (T = 1) and left-padded
    question blocks (T = 5, padding tokens at position -1), ragged visibility of each row's new keys
    (one row sees none at decode, one has empty slots), no new keys at all."""
    import jax.numpy as jnp

    from pallas_kernels import dense_attention_reference
    from sqjax import dispatch

    rng = np.random.default_rng(7)
    n_rows, hq, hkv, num_l, d = 3, 8, 2, 45, 16
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.normal(size=(n_rows, hq, t, d)), dt)
    k, v = (jnp.asarray(rng.normal(size=(hkv, num_l, d)), dt) for _ in range(2))
    kn, vn = (jnp.asarray(rng.normal(size=(n_rows, hkv, num_s, d)), dt) for _ in range(2))
    q_pos = np.asarray([[60], [52], [70]]) + np.arange(t)[None, :] - (t - 1)
    q_pos[1, :2] = -1                                     # row 1: two left-padding tokens
    kvp = np.tile(np.arange(50, 50 + num_s), (n_rows, 1))
    kvp[1] = 53 + np.arange(num_s)                        # row 1: every new key is in its future at decode
    kvp[2, ::3] = -1                                      # row 2: empty slots
    q_pos, kvp = jnp.asarray(q_pos, jnp.int32), jnp.asarray(kvp, jnp.int32)
    with dispatch.using(backend):
        got = np.asarray(dispatch.dense_attention_batched(q, k, v, kn, vn, q_pos, kvp, d ** -0.5), np.float64)
    assert got.shape == (n_rows, hq, t, d) and not np.isnan(got).any()
    for b in range(n_rows):
        want = dense_attention_reference(q[b], k, v, kn[b], vn[b], q_pos[b], kvp[b], scale=d ** -0.5)
        tol = 1e-5 if dtype == "float32" else 2e-2
        np.testing.assert_allclose(got[b], np.asarray(want, np.float64), atol=tol, rtol=tol)


def test_full_attention_batch_reads_the_context_once(model, monkeypatch):
    """A batch's decode step with full attention goes through `dense_attention_batched` on every
    backend (the rows folded into one pass over the fixed context; on a Pallas backend the
    questions' prefill too); interpreted on the Pallas dense kernel the step gives the
    reference's logits."""
    c = FixedContext.build(model, DOC, Full(), chat=False)
    logits, calls = _two_row_step_logits(model, c, {"reference": c._state, "interpret": c._state},
                                         (monkeypatch, "dense_attention_batched"))
    # every layer of the step on each backend (the reference prefill stays per row: memory)
    n = model.config.num_layers
    assert calls == ["reference"] * n + ["interpret"] * n
    np.testing.assert_allclose(logits["interpret"], logits["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vote", ["kv", "q"])
def test_hierarchical_batch_rows_through_one_batched_call(model, vote, monkeypatch):
    """On GPU a hierarchical index's batch decode step goes through
    `clustered_decode_hierarchical_batched` (one set of launches for every row, each row its own
    level-1 survivors; here interpreted), once per sparse layer and never row by row, and gives
    the reference's logits."""
    from sqjax.fixed_context import attention_state

    c = FixedContext.build(model, DOC, HierarchicalSqueezed(sparsity=0.8, n_sink=1, vote=vote, capacity_fraction=1.0),
                           chat=False)
    states = {"reference": c._state, "interpret": attention_state(c.kv.k, c.kv.v, c.index, clustered_layout=True)}
    row_calls = []
    real = fc.dispatch.clustered_decode
    monkeypatch.setattr(fc.dispatch, "clustered_decode", lambda *a, **k: row_calls.append(1) or real(*a, **k))
    logits, calls = _two_row_step_logits(model, c, states, (monkeypatch, "clustered_decode_batched"))
    assert calls == ["interpret"] * (model.config.num_layers - HierarchicalSqueezed().dense_layers)
    assert not row_calls
    np.testing.assert_allclose(logits["interpret"], logits["reference"], atol=1e-4, rtol=1e-4)
