"""The quality harness's token metrics equal plain numpy; planning and budget matching (no model)."""

import math

import jax
import numpy as np
import pytest

from benchmarks import quality as Q
from benchmarks.quality_engine import (
    delta_ppl_percent, kl_per_token, log_softmax, nll, token_metrics, top1_agreement,
)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_kl_equals_numpy(rng):
    a = rng.normal(size=(7, 50)) * 3
    b = a + rng.normal(size=(7, 50))
    p, q = _softmax(a), _softmax(b)
    ref = np.array([sum(pi * math.log(pi / qi) for pi, qi in zip(pr, qr)) for pr, qr in zip(p, q)])
    np.testing.assert_allclose(kl_per_token(a, b), ref, rtol=1e-10, atol=1e-12)
    # invariances: KL(x, x) = 0, shifting logits changes nothing, KL >= 0
    np.testing.assert_allclose(kl_per_token(a, a), 0.0, atol=1e-12)
    np.testing.assert_allclose(kl_per_token(a + 5.0, b - 2.0), ref, rtol=1e-9, atol=1e-12)
    assert np.all(kl_per_token(b, a) >= 0)
    np.testing.assert_allclose(log_softmax(a), np.asarray(jax.nn.log_softmax(a.astype(np.float32), -1)), atol=1e-5)


def test_ppl_and_top1_equal_numpy(rng):
    a = rng.normal(size=(9, 40)) * 2
    b = a + rng.normal(size=(9, 40))
    t = rng.integers(0, 40, size=9)
    nll_a = -np.log(_softmax(a)[np.arange(9), t])
    nll_b = -np.log(_softmax(b)[np.arange(9), t])
    np.testing.assert_allclose(nll(b, t), nll_b, rtol=1e-10)
    ppl_a, ppl_b = np.exp(nll_a.mean()), np.exp(nll_b.mean())
    assert delta_ppl_percent(a, b, t) == pytest.approx(100 * (ppl_b / ppl_a - 1), rel=1e-9)
    assert top1_agreement(a, b) == pytest.approx(np.mean(a.argmax(-1) == b.argmax(-1)))
    m = token_metrics(a, b, t)
    assert m["kl_mean"] == pytest.approx(kl_per_token(a, b).mean())
    assert m["kl_p95"] == pytest.approx(np.percentile(kl_per_token(a, b), 95))
    assert m["n"] == 9 and len(m["kl_tokens"]) == 9
    same = token_metrics(a, a, t)
    assert same["kl_mean"] == 0 and same["dppl_pct"] == 0 and same["top1"] == 1


def test_quest_budget_matching_rounds_up_to_pages():
    # App. F: QUEST gets Squeezed's measured fraction of the fixed context, rounded up to 16-token pages
    b = Q.matched_fraction("quest", 0.1234, 6000)
    assert b * 6000 % 16 == pytest.approx(0) and b * 6000 >= 0.1234 * 6000 and b * 6000 - 0.1234 * 6000 < 16
    assert Q.matched_fraction("oracle", 0.12341, 6000) == pytest.approx(0.1235)
    assert Q.matched_fraction("quest", 1.0, 6000) == 1.0
    m = Q.make_method("quest", "s0.9", Q.Settings(), {"s0.9": 0.1234}, 6000)
    assert m.n_pages(6000) * 16 == round(b * 6000)
    # without a Squeezed measurement: the nominal fraction (clustered keys kept + exact tail)
    m = Q.make_method("oracle", "s0.9", Q.Settings(), {}, 6000)
    assert m.budget == pytest.approx(Q.nominal_fraction(0.9, 6000), abs=1e-4)


def test_plan_and_settings_from_args():
    import argparse

    cells = Q.plan(Q.Settings())
    fams = {f for f, _ in cells}
    assert cells[0] == ("full", "-") and "saap-clf" not in fams
    assert {"squeezed", "squeezed+sink1", "hsqueezed+sink1", "quest", "snapkv", "oracle", "streaming", "saap-nc"} <= fams
    # the Squeezed rows (which set the matched budgets) run before the matched baselines
    first_matched = min(i for i, (f, _) in enumerate(cells) if f in Q.MATCHED)
    assert all(i < first_matched for i, (f, _) in enumerate(cells) if f == Q.MATCH_SOURCE)
    ns = argparse.Namespace(model="m", docs=None, methods=["squeezed", "quest"], budgets=[0.1, 0.3],
                            classifier=None, quick=False, out="x", json=False)
    s = Q.settings_from_args(ns)
    assert s.levels == (0.9, 0.7)
    assert {f for f, _ in Q.plan(s)} == {"full", "squeezed", "squeezed+sink1", "squeezed+token", "squeezed+sink1+token",
                                         "quest"}
    # the +token families are Squeezed with decode thresholds; +sink1 keeps the first token exact
    m = Q.make_method("squeezed+sink1+token", "s0.9", s)
    assert m.n_sink == 1 and m.decode_calibration == "token"
    assert Q.make_method("squeezed+token", "s0.9", s).n_sink == 0
    with pytest.raises(ValueError, match="unknown method"):
        Q.settings_from_args(argparse.Namespace(methods=["nope"]))
    with pytest.raises(ValueError, match="--classifier: classifier path /nonexistent/clf does not exist"):
        Q.settings_from_args(argparse.Namespace(classifier="/nonexistent/clf"))
    parsed = Q.build_parser().parse_args(["--budgets", "0.2", "--no-passkey", "--context-tokens", "500"])
    s = Q.settings_from_args(parsed)
    assert s.levels == (0.8,) and not s.passkey and s.context_tokens == 500


def test_store_skips_torn_lines(tmp_path):
    p = tmp_path / "cells.jsonl"
    st = Q.Store(p)
    st.add({"kind": "cell", "setup": "a", "doc": "d", "family": "full", "level": "-", "x": 1})
    with open(p, "a") as f:
        f.write('{"kind": "cell", "setup": "a", "doc"')  # interrupted write
    st2 = Q.Store(p)
    assert st2.get(kind="cell", setup="a", doc="d", family="full", level="-")["x"] == 1
    assert len(st2.records) == 1
    st2.add({"kind": "cell", "setup": "a", "doc": "e", "family": "full", "level": "-", "x": 2})
    assert len(Q.Store(p).records) == 2


def _no_model(monkeypatch):
    import sqjax

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the bad option was caught")

    monkeypatch.setattr(sqjax, "load_model", boom)


@pytest.mark.parametrize("budget", ["0", "1", "-0.1", "1.5", "nan", "inf", "1e-9"])
def test_bad_budgets_fail_before_the_model_loads(budget, tmp_path, monkeypatch):
    args = Q.build_parser().parse_args(["--budgets", "0.2", budget, "--quick", "--methods", "squeezed",
                                        "-o", str(tmp_path / "ev")])
    with pytest.raises(ValueError, match=r"^--budgets .*strictly between 0 and 1"):
        Q.settings_from_args(args)
    _no_model(monkeypatch)
    with pytest.raises(ValueError, match="--budgets"):
        Q.main(args)
    assert not (tmp_path / "ev").exists()


def test_quick_keeps_the_budgets_for_the_passkey_and_counts_are_checked():
    parse = Q.build_parser().parse_args
    assert Q.settings_from_args(parse(["--quick", "--budgets", "0.4"])).passkey_levels == (0.6,)
    assert Q.settings_from_args(parse(["--quick"])).passkey_levels == (0.9,)
    for argv, message in [(["--context-tokens", "0"], "--context-tokens must be >= 1; got 0"),
                          (["--saap-probes", "4", "0"], "--saap-probes must be >= 1; got 0"),
                          (["--passkey-eval-lengths", "-1"], "--passkey-eval-lengths must be >= 0"),
                          (["--level1-prune", "1.0"], r"--level1-prune must lie in \(0, 1\)")]:
        with pytest.raises(ValueError, match=message):
            Q.settings_from_args(parse(argv))
    assert Q.settings_from_args(parse(["--passkey-eval-lengths", "0"])).passkey_eval_lengths == 0


def test_out_that_is_a_file_fails_before_the_model_loads(tmp_path, monkeypatch):
    doc = tmp_path / "doc.txt"
    doc.write_text("some text " * 50)
    f = tmp_path / "ev"
    f.write_text("not a directory")
    _no_model(monkeypatch)
    args = Q.build_parser().parse_args(["--docs", str(doc), "--quick", "--methods", "squeezed", "-o", str(f)])
    with pytest.raises(ValueError, match=r"-o .*ev is a file; give a directory"):
        Q.main(args)
    with pytest.raises(ValueError, match="is a file; give a directory"):
        Q.check_out_dir(f / "sub" / "dir")  # under a file
    Q.check_out_dir(tmp_path / "new" / "dir")  # a directory to be created is fine
    Q.check_out_dir(tmp_path)
    assert f.read_text() == "not a directory"


def test_torn_config_is_treated_as_missing(tmp_path):
    p = tmp_path / "config.json"
    assert Q.read_old_config(p) == {}
    p.write_text('{\n "settings": {"context_tokens": 6000},\n "wall_seconds_total": 12.5,\n "date": "2024-')
    assert Q.read_old_config(p) == {}  # torn by an interrupted run: only the wall-time total is lost
    p.write_text("null")
    assert Q.read_old_config(p) == {}
    p.write_text('{"wall_seconds_total": "x", "model": "m"}')
    assert Q.read_old_config(p) == {"model": "m"}
    p.write_text('{"wall_seconds_total": 12.5}')
    assert Q.read_old_config(p) == {"wall_seconds_total": 12.5}
