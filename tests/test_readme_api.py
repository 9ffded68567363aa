"""The README's "Python API" block, run as written (on the tiny model, in a scratch directory): every
name and argument it shows exists and does what its comments say."""

import re
from pathlib import Path

import numpy as np
from _tiny_model import tiny_model

import sqjax

README = Path(__file__).resolve().parents[1] / "README.md"
DOC = " ".join(f"Item {i} of the inventory is a {w} stored in aisle {i % 7}." for i, w in
               zip(range(40), ["lamp", "chair", "table", "rug", "book", "vase"] * 10))


def test_python_api_block_runs_as_written(monkeypatch, tmp_path, capsys):
    block = re.search(r"## Python API\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "the README has no python block under '## Python API'"
    (tmp_path / "manual.txt").write_text(DOC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sqjax, "load_model", lambda *a, **k: tiny_model())   # the block loads SmolLM2 by name
    ns: dict = {}
    exec(compile(block.group(1), str(README), "exec"), ns)

    ctx, answer, answers, quest = ns["ctx"], ns["answer"], ns["answers"], ns["quest"]
    assert isinstance(ns["method"], sqjax.methods.Squeezed) and ns["method"].sparsity == 0.9
    printed = capsys.readouterr().out.split()
    assert printed[-2:] == [str(answer.stats.kv_budget), str(answer.stats.time_per_output_token_s)]
    assert 0 < answer.stats.kv_budget < 1 and answer.token_ids and len(answer.token_ids) <= 64
    assert len(answers) == 2 and all(a.token_ids for a in answers)
    logprobs = np.asarray(ns["logprobs"])
    assert logprobs.ndim == 1 and len(logprobs) > 1 and np.all(np.isfinite(logprobs)) and np.all(logprobs <= 0)
    assert (tmp_path / "manual.sqx").is_file() and ctx.method == ns["method"]   # loaded back from the file
    assert isinstance(quest.method, sqjax.methods.Quest) and quest.doc_ids.tolist() == ctx.doc_ids.tolist()
