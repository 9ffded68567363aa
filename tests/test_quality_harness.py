"""The quality harness on the tiny random model: exactness at budget 1, oracle optimality,
monotone KL in budget, resumability, and the `sqjax eval` entry point."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from _tiny_model import save_hf_checkpoint, tiny_model

from benchmarks import quality as Q
from benchmarks.quality_data import Document
from benchmarks.quality_engine import RunShapes, compute_reference, evaluate_cell, kl_per_token
from sqjax.fixed_context import FixedContext
from sqjax.methods import Full, Oracle, Quest, Saap, SnapKV, Squeezed, StreamingLLM

DOC = " ".join(f"Item {i} of the inventory is a {w} stored in aisle {i % 7}, next to the {v}." for i, w, v in
               zip(range(80), ["lamp", "chair", "table", "rug", "book", "vase"] * 14, ["door", "window", "stairs"] * 27))
N_CTX, N_CONT, N_ANSWER = 320, 10, 3
# the shapes and question the harness itself uses for this document (shared compilations)
SETTINGS = Q.Settings(context_tokens=N_CTX, continuation=N_CONT, answer_tokens=N_ANSWER, levels=(0.9,), hier_levels=(),
                      saap_probes=(), passkey=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def setup(model):
    ids = np.asarray(model.tokenizer.encode(DOC, add_bos=None), np.int32)
    assert len(ids) > N_CTX + N_CONT + 1
    full = FixedContext.build(model, DOC, Full(), chat=False, truncate=True,
                              reserve=model.config.max_position_embeddings - N_CTX)
    assert full.n_tokens == N_CTX
    q_ids = model.tokenizer.encode("\n\nQuestion: " + Document("d", DOC).question + "\nAnswer:", add_bos=False)
    global SHAPES
    SHAPES = Q._shapes(SETTINGS, len(q_ids))
    ref = compute_reference(full, ids[N_CTX:N_CTX + N_CONT + 1], q_ids, N_ANSWER, SHAPES)
    return full, ref


SHAPES = None


_cache = {}


def cell(setup, method):
    """evaluate_cell (with attention metrics), memoized over the module (methods are hashable)."""
    if method not in _cache:
        full, ref = setup
        ctx = _squeezed_everything(full) if method == "squeezed-everything" else full.with_method(method)
        _cache[method] = evaluate_cell(ctx, ref, SHAPES, attention=True)
    return _cache[method]


def _squeezed_everything(full):
    ctx = full.with_method(Squeezed(sparsity=0.5, capacity_fraction=1.0))
    ctx.index = dataclasses.replace(ctx.index, threshold=jnp.float32(-1.0))  # every cluster scores above T
    ctx._state = {**ctx._state, "index": ctx.index}
    return ctx


# the oracle without a forced tail is the pure top-k of the true attention ("ideal", App. H)
BUDGET_ONE = [Full(), Oracle(budget=1.0, n_tail=0), Quest(budget=1.0, dense_layers=0), SnapKV(budget=1.0),
              StreamingLLM(budget=1.0), Saap(probes=100_000, dense_layers=0), "squeezed-everything"]


@pytest.mark.parametrize("method", BUDGET_ONE, ids=lambda m: m if isinstance(m, str) else m.name)
def test_budget_one_reproduces_full(setup, method):
    rec = cell(setup, method)
    for regime in ("decode", "prefill", "question"):
        assert rec[regime]["kl_mean"] < 1e-6, regime
        assert abs(rec[regime]["dppl_pct"]) < 1e-3 and rec[regime]["top1"] == 1.0
    assert rec["budget"]["decode"]["token_fraction"] == pytest.approx(1.0)
    assert rec["budget"]["decode"]["kv_budget"] >= 1.0 - 1e-6  # + metadata for QUEST/SAAP/Squeezed
    for mode in ("decode", "prefill"):
        assert rec["attention"][mode]["recall_mean"] == pytest.approx(1.0, abs=1e-5)
        assert rec["attention"][mode]["err_max_layer"] < 1e-4


BUDGETS = (0.15, 0.4)


@pytest.mark.parametrize("budget", BUDGETS)
def test_oracle_kl_lowest_at_matched_budget(setup, budget):
    oracle = cell(setup, Oracle(budget=budget, n_tail=0))
    for other in (StreamingLLM(budget=budget), Quest(budget=budget, dense_layers=0)):
        rec = cell(setup, other)
        # same key count for StreamingLLM; QUEST rounds up to whole pages, so it reads at least as many
        assert rec["budget"]["decode"]["token_fraction"] >= oracle["budget"]["decode"]["token_fraction"] - 1e-6
        for regime in ("decode", "prefill", "question"):
            assert oracle[regime]["kl_mean"] < rec[regime]["kl_mean"], (other.label, regime)


@pytest.mark.parametrize("budget", BUDGETS)
def test_oracle_recall_is_optimal_by_construction(setup, budget):
    """Top-k of the true (group-mean) attention maximises the attention mass for its key count:
    at the same count per token as StreamingLLM / QUEST / Squeezed its recall is at least theirs,
    in every layer."""
    from benchmarks.quality_engine import run_lookups

    full, ref = setup
    n = full.n_tokens
    others = [StreamingLLM(budget=budget), Quest(budget=budget, dense_layers=0)]
    for other in others:
        rec = cell(setup, other)
        k = round(rec["budget"]["decode"]["token_fraction"] * n)  # constant per token for these two
        orc = full.with_method(Oracle(budget=k / n, n_tail=0))
        rep, _ = run_lookups(orc, ref.q, ref.q_pre, per_token=True)
        _, att = run_lookups(orc, ref.q, ref.q_pre, per_token=True, keys=ref.keys)
        assert float(np.mean(rep.rows)) == pytest.approx(k)
        got, base = np.asarray(att["recall_per_layer"]), np.asarray(rec["attention"]["decode"]["recall_per_layer"])
        assert np.all(got >= base - 1e-4), (other.label, got, base)
        assert att["err_mean"] <= rec["attention"]["decode"]["err_mean"] + 1e-6


@pytest.mark.parametrize("make", [
    lambda b: Oracle(budget=b, n_tail=0), lambda b: StreamingLLM(budget=b), lambda b: Quest(budget=b, dense_layers=0),
], ids=["oracle", "streaming", "quest"])
def test_kl_non_increasing_in_budget(setup, make):
    kls = [cell(setup, make(b))["decode"]["kl_mean"] for b in BUDGETS + (1.0,)]
    assert all(a >= b - 1e-6 for a, b in zip(kls, kls[1:])), kls
    assert kls[-1] < 1e-6


def test_squeezed_kl_non_increasing_in_budget(setup):
    recs = [cell(setup, Squeezed(sparsity=s, capacity_fraction=1.0)) for s in (0.9, 0.6)]
    recs.append(cell(setup, "squeezed-everything"))
    fr = [r["budget"]["decode"]["token_fraction"] for r in recs]
    kls = [r["decode"]["kl_mean"] for r in recs]
    assert fr == sorted(fr) and fr[0] < fr[1] < 1.0
    assert all(a >= b - 1e-6 for a, b in zip(kls, kls[1:])), kls


def test_shared_compilation_changes_nothing(setup):
    """The harness runs Squeezed@s through one canonical config (only the traced threshold
    differs); the results equal those of the method's own config."""
    from benchmarks.quality_engine import Runner, canonical

    full, ref = setup
    m = Squeezed(sparsity=0.9, capacity_fraction=1.0)
    assert canonical(m) != m and canonical(Squeezed(sparsity=0.7, capacity_fraction=1.0)) == canonical(m)
    own = Runner(full.with_method(m), SHAPES).block(ref.cont[:-1])[0]  # the method's own hook
    shared = cell(setup, m)
    np.testing.assert_allclose(shared["prefill"]["kl_tokens"], kl_per_token(ref.prefill_logits, np.asarray(own)),
                               atol=2e-6)
    # decode thresholds live in the index: the canonical config decodes with them too
    tok = Squeezed(sparsity=0.9, capacity_fraction=1.0, decode_calibration="token")
    assert canonical(tok) == canonical(m)
    ctx = full.with_method(tok)
    own = Runner(ctx, SHAPES).decode(ref.cont[:4], ctx.n_tokens)[0]
    shared = cell(setup, tok)
    np.testing.assert_allclose(shared["decode"]["kl_tokens"][:4], kl_per_token(ref.decode_logits[:4], np.asarray(own)),
                               atol=2e-6)


def test_run_is_resumable(model, tmp_path, monkeypatch):
    docs = [Document("inventory", DOC)]
    st = dataclasses.replace(SETTINGS, methods=("squeezed", "quest"), attention=False)
    first = Q.run(model, docs, st, tmp_path, progress=False, log=lambda *a: None)
    fams = {(f, lv) for _, f, lv in first["computed"]}
    assert fams == {("full", "-"), ("squeezed", "s0.9"), ("squeezed+sink1", "s0.9"), ("squeezed+token", "s0.9"),
                    ("squeezed+sink1+token", "s0.9"), ("quest", "s0.9")}
    # QUEST got Squeezed's measured decode fraction, rounded up to pages (App. F)
    cells = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    sq = next(c for c in cells if c["family"] == "squeezed")
    qu = next(c for c in cells if c["family"] == "quest")
    assert qu["params"]["budget"] == pytest.approx(Q.matched_fraction("quest", sq["budget"]["decode"]["token_fraction"], N_CTX))
    metrics = (tmp_path / "metrics.json").read_text()
    for f in ("config.json", "table.md", "kl_vs_budget.png", "dppl_vs_budget.png"):
        assert (tmp_path / f).is_file(), f

    import benchmarks.quality_engine as E

    def boom(*a, **k):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(E, "evaluate_cell", boom)
    monkeypatch.setattr(E, "compute_reference", boom)
    monkeypatch.setattr(FixedContext, "build", boom)
    cfg = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(cfg[:len(cfg) // 2])  # torn by an interrupted (older) run
    second = Q.run(model, docs, st, tmp_path, progress=False, log=lambda *a: None)
    assert second["computed"] == []
    assert (tmp_path / "metrics.json").read_text() == metrics
    assert json.loads((tmp_path / "config.json").read_text())["cells_computed_this_invocation"] == 0
    # every output is written atomically: no temporary file is left behind
    assert not [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")]
    json.loads(metrics)
    # a changed document is a different document: its cells are recomputed
    monkeypatch.undo()
    docs = [Document("inventory", DOC.replace("lamp", "lantern"))]
    third = Q.run(model, docs, dataclasses.replace(st, methods=("full",)), tmp_path, progress=False, log=lambda *a: None)
    assert [c[1] for c in third["computed"]] == ["full"]


def test_sqjax_eval_cli(model, tmp_path, capsys, monkeypatch):
    """`sqjax eval` reaches benchmarks.quality.main; pass key on the way (tiny model, one trial)."""
    import sqjax
    from sqjax import cli

    real = Q.settings_from_args

    def small(args):  # the CLI's options, at this module's sizes (shared compilations)
        s = real(args)
        return dataclasses.replace(s, context_tokens=N_CTX, continuation=N_CONT, answer_tokens=N_ANSWER,
                                   passkey_lengths=(200,), passkey_trials=1, passkey_success=0.0, passkey_answer_tokens=3)

    monkeypatch.setattr(Q, "settings_from_args", small)
    monkeypatch.setattr(sqjax, "load_model", lambda name: model)
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    out = tmp_path / "out"
    rc = cli.main(["eval", "--docs", str(doc), "--methods", "oracle", "--budgets", "0.6", "--quick", "-o", str(out),
                   "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["computed"] >= 3
    rows = {(r["family"], r["level"]): r for r in res["summary"]}
    assert rows[("full", "-")]["decode"]["kl_mean"] == 0.0
    assert 0 < rows[("oracle", "s0.4")]["decode"]["kv_budget"] < 1
    pk = {r["family"]: r for r in res["passkey"]}
    assert set(pk) == {"full", "oracle"} and pk["oracle"]["token_fraction"] < 1
    for f in ("table.md", "metrics.json", "config.json", "cells.jsonl", "per_layer.png"):
        assert (out / f).is_file(), f
    # a bad method name is one clear error line
    assert cli.main(["eval", "--methods", "nope", "-o", str(out)]) == 2
    assert "unknown method" in capsys.readouterr().err
    # a directory given as a document, and a classifier directory that is no export, before any model loads
    monkeypatch.setattr(sqjax, "load_model", lambda name: pytest.fail("loaded a model before the check"))
    (tmp_path / "empty").mkdir()
    assert cli.main(["eval", "--docs", str(tmp_path), "-o", str(out)]) == 2
    assert "is a directory: name its text files" in capsys.readouterr().err
    assert cli.main(["eval", "--docs", str(doc), "--classifier", str(tmp_path / "empty"), "-o", str(out)]) == 2
    assert "--classifier: " in (err := capsys.readouterr().err) and "is not a classifier export" in err
