"""benchmarks.real_model on the CPU with the tiny model: the demo rows, the fidelity rows (on a CPU the
"compiled" route is jnp too: full attention's is the reference's code, so it agrees exactly; Squeezed's
gathers its retrieved rows where the reference masks the fixed context, so it agrees to rounding) and
the report against a reference run."""
import json

import pytest

from _tiny_model import tiny_model

import sqjax
from benchmarks import real_model

DOC = " ".join(f"Record {i} lists a {c} valve serviced in room {i % 9}." for i, c in
               zip(range(80), ["red", "blue", "green", "grey"] * 20))


def test_real_model_demo_fidelity_and_report(tmp_path, monkeypatch, capsys):
    model = tiny_model()
    monkeypatch.setattr(sqjax, "load_model", lambda name, dtype=None: model)
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    out = tmp_path / "run"
    assert real_model.main(["--doc", str(doc), "--questions", "1", "--max-new-tokens", "3", "--fidelity-doc", str(doc),
                            "--fidelity-tokens", "200", "8", "--seeds", "0", "1", "--out", str(out)]) == 0
    res = json.loads((out / "real_model.json").read_text())
    assert res["errors"] == {} and len(res["runs"]) == 1 and len(res["fidelity"]) == 2
    answers = res["runs"][0]["answers"]
    assert [a["method"] for a in answers] == ["squeezed+sink1", "full"]
    assert all(1 <= len(a["token_ids"]) <= 3 for a in answers) and answers[1]["kv_budget"] == 1.0
    for f in res["fidelity"]:
        rows = {(r["what"], r["mode"], r["method"]): r for r in f["rows"]}
        assert f["n_cont"] == 8 and len(rows) == 8
        for mode in ("decode", "prefill"):
            assert rows["compiled vs reference", mode, "full"]["kl_mean"] == 0.0
            same = rows["compiled vs reference", mode, "squeezed+sink1"]
            assert 0.0 <= same["kl_mean"] < 1e-9 and same["max_abs_logit_diff"] < 1e-3
            sel = rows["squeezed vs full (compiled)", mode, "squeezed+sink1"]
            ref = rows["squeezed vs full (reference)", mode, "squeezed+sink1"]["kl_mean"]
            assert sel["kl_mean"] == pytest.approx(ref, rel=1e-5) and ref > 0.0
    capsys.readouterr()
    assert real_model.main(["--report", str(out / "real_model.json"), "--reference", str(out / "real_model.json"),
                            "--out", str(tmp_path / "rep")]) == 0
    rep = json.loads((tmp_path / "rep" / "real_model.json").read_text())["reference"]
    assert rep["same_document"] and all(c["identical"] for c in rep["answers"]) and len(rep["answers"]) == 2
    assert "identical greedy tokens" in (tmp_path / "rep" / "real_model.md").read_text()
