"""The `sqjax` command line on a tiny Hugging Face checkpoint: outputs, --json, and clear errors."""

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np

import pytest
from _tiny_model import save_hf_checkpoint, tiny_model

import sqjax
from sqjax import FixedContext
from sqjax.fixed_context import SqjaxError
from sqjax.cli import dumps, main

DOC = " ".join(f"Record {i}: the {c} valve in room {i % 9} was serviced." for i, c in
               zip(range(40), ["red", "blue", "green", "grey"] * 10))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_hf_checkpoint(tiny_model(), tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(scope="module")
def doc_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("docs") / "doc.txt"
    p.write_text(DOC)
    return p


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "sqjax.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for sub in ("demo", "index", "ask", "chat", "eval", "bench", "train-qclassifier"):
        assert sub in out.stdout


def test_index_then_ask_json(capsys, model_dir, doc_file, tmp_path):
    out_path = tmp_path / "doc.sqx"
    code, out, err = _run(capsys, "index", str(doc_file), "-o", str(out_path), "--model", model_dir,
                          "--sparsity", "0.8", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["index"] == str(out_path) and info["document_tokens"] > 100 and out_path.is_file()
    code, out, err = _run(capsys, "ask", str(out_path), "Which valve was serviced in room 3?", "--model", model_dir,
                          "--max-new-tokens", "5", "--json")
    assert code == 0, err
    ans = json.loads(out)
    assert isinstance(ans["answer"], str) and 1 <= len(ans["token_ids"]) <= 5
    assert 0 < ans["stats"]["kv_budget"] <= 1.0
    # plain-text output streams the answer and prints the stats line
    code, out, err = _run(capsys, "ask", str(out_path), "Which room?", "--model", model_dir, "--max-new-tokens", "3")
    assert code == 0 and "KV budget" in out


@pytest.mark.parametrize("method,extra", [("quest", ()), ("snapkv", ()), ("saap", ("--deterministic",)),
                                          ("hsqueezed", ("--deterministic",))])
def test_index_other_methods(capsys, model_dir, doc_file, tmp_path, method, extra):
    code, out, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "m.sqx"), "--model", model_dir,
                          "--method", method, "--json", *extra)
    assert code == 0, err
    assert json.loads(out)["method"].startswith(method if method != "saap" else "saap")
    if extra:  # the flag reached the method (saved with the index)
        assert FixedContext.load(tmp_path / "m.sqx", sqjax.load_model(model_dir)).method.deterministic_build


def test_sqjax_warnings_print_as_one_line(capsys, model_dir, doc_file, tmp_path):
    """SAAP's 32 default probes cover all 16 buckets of this short document: the build warns, and the
    command line prints sqjax's warnings as one line (other libraries' as Python does)."""
    import warnings

    from sqjax.cli import _format_warning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, out, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "s.sqx"), "--model", model_dir,
                              "--method", "saap", "--json")
    assert code == 0, err
    (w,) = [w for w in seen if "visits all" in str(w.message)]
    line = _format_warning(w.message, w.category, w.filename, w.lineno)
    assert line.startswith("sqjax: warning: Saap(probes=32) visits all 16 buckets") and line.count("\n") == 1
    other = _format_warning(DeprecationWarning("old"), DeprecationWarning, "/x/jax/y.py", 3)
    assert "DeprecationWarning: old" in other


def test_index_reads_the_document_from_stdin(capsys, monkeypatch, model_dir, doc_file, tmp_path):
    """`sqjax index - -o X` indexes stdin: the same tokens as the file; empty or non-UTF-8 input is named."""
    import io

    def stdin(data: bytes):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))

    stdin(doc_file.read_bytes())
    code, out, err = _run(capsys, "index", "-", "-o", str(tmp_path / "in.sqx"), "--model", model_dir, "--method",
                          "full", "--json")
    assert code == 0, err
    code, out, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "file.sqx"), "--model", model_dir,
                          "--method", "full", "--json")
    assert code == 0, err
    model = sqjax.load_model(model_dir)
    a, b = (FixedContext.load(tmp_path / f, model) for f in ("in.sqx", "file.sqx"))
    assert a.doc_ids.tolist() == b.doc_ids.tolist() and a.doc_sha256 == b.doc_sha256
    for data, message in [(b" \n", "document is empty: stdin holds no text"),
                          (b"caf\xe9", "stdin is not UTF-8 text")]:
        stdin(data)
        code, out, err = _run(capsys, "index", "-", "-o", str(tmp_path / "x.sqx"), "--model", model_dir)
        assert code != 0 and message in _error_line(err)
    assert not (tmp_path / "x.sqx").exists()


def test_index_with_decode_calibration(capsys, model_dir, doc_file, tmp_path):
    code, out, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "t.sqx"), "--model", model_dir,
                          "--method", "hsqueezed", "--decode-calibration", "token", "--lookup-int8", "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["method"].endswith("/token/int8") and payload["info"]["threshold_decode"] > 0
    ctx = FixedContext.load(tmp_path / "t.sqx", sqjax.load_model(model_dir))
    assert ctx.method.decode_calibration == "token" and ctx.method.lookup_int8   # saved with the index
    assert float(ctx.index.threshold_decode) == pytest.approx(payload["info"]["threshold_decode"])


def _error_line(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one error line, got: {err!r}"
    assert lines[0].startswith("sqjax: error: ")
    return lines[0]


def test_errors_are_one_clear_line(capsys, model_dir, doc_file, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, _, err = _run(capsys, "index", str(empty), "-o", str(tmp_path / "e.sqx"), "--model", model_dir)
    assert code != 0 and "document is empty" in _error_line(err)
    assert not (tmp_path / "e.sqx").exists()

    short = tmp_path / "short.txt"
    short.write_text("Record 1: the red valve was serviced.")
    code, _, err = _run(capsys, "index", str(short), "-o", str(tmp_path / "s.sqx"), "--model", model_dir,
                        "--method", "hsqueezed")
    assert code != 0 and "too few for hsqueezed" in _error_line(err) and "it needs at least 131 tokens" in err
    assert not (tmp_path / "s.sqx").exists()

    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "nodir" / "x.sqx"), "--model", model_dir)
    assert code != 0 and "does not exist" in _error_line(err)

    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "s.sqx"), "--model", model_dir,
                        "--sparsity", "1.5")
    assert code != 0 and "sparsity must lie in (0, 1)" in _error_line(err)

    code, _, err = _run(capsys, "index", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "m.sqx"))
    assert code != 0 and "not found" in _error_line(err)

    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "m.sqx"), "--model", "no-such-model")
    assert code != 0 and "unknown model" in _error_line(err)

    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "q.sqx"), "--model", model_dir,
                        "--method", "quest", "--deterministic")
    assert code != 0 and "--deterministic is for squeezed, hsqueezed and saap" in _error_line(err)

    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "q.sqx"), "--model", model_dir,
                        "--method", "saap", "--decode-calibration", "token")
    assert code != 0 and "--decode-calibration is for squeezed and hsqueezed" in _error_line(err)

    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "q.sqx"), "--model", model_dir,
                        "--method", "quest", "--lookup-int8")
    assert code != 0 and "--lookup-int8 is for squeezed and hsqueezed" in _error_line(err)

    with pytest.raises(SystemExit) as e:  # argparse rejects an unknown method by name
        main(["index", str(doc_file), "-o", str(tmp_path / "m.sqx"), "--method", "magic"])
    assert e.value.code == 2
    assert "invalid choice: 'magic'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # with --json the usage error is a JSON line on stdout too
        main(["index", str(doc_file), "-o", str(tmp_path / "m.sqx"), "--method", "magic", "--json"])
    out, err = capsys.readouterr()
    row = json.loads(out)
    assert e.value.code == 2 and row["exit_code"] == 2 and row["error"].startswith("argument --method: invalid choice")
    assert f"error: {row['error']}" in err

    long_doc = tmp_path / "long.txt"
    long_doc.write_text(DOC * 12)
    code, _, err = _run(capsys, "index", str(long_doc), "-o", str(tmp_path / "l.sqx"), "--model", model_dir)
    assert code != 0 and "tokens too many" in _error_line(err) and "--truncate" in err


def test_ask_many_questions_in_one_process(capsys, monkeypatch, model_dir, doc_file, tmp_path):
    """Several questions (arguments and '-' = stdin lines, blank lines skipped) against one loaded
    index: one JSON line each, in order, each answer the one the question gets on its own."""
    import io

    idx = tmp_path / "many.sqx"
    assert main(["index", str(doc_file), "-o", str(idx), "--model", model_dir, "--sparsity", "0.8", "--json"]) == 0
    capsys.readouterr()
    qs = ["Which valve was serviced in room 3?", "Which room?", "What colour was record 5?"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{qs[1]}\n\n  {qs[2]}  \n"))
    code, out, err = _run(capsys, "ask", str(idx), qs[0], "-", "--model", model_dir, "--max-new-tokens", "4", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["question"] for r in rows] == qs
    assert all(1 <= len(r["token_ids"]) <= 4 and 0 < r["stats"]["kv_budget"] <= 1 for r in rows)
    code, out, err = _run(capsys, "ask", str(idx), qs[2], "--model", model_dir, "--max-new-tokens", "4", "--json")
    assert code == 0 and json.loads(out)["token_ids"] == rows[2]["token_ids"]
    # text output: a header per question, the streamed answer, a stats line each
    code, out, _ = _run(capsys, "ask", str(idx), qs[0], qs[1], "--model", model_dir, "--max-new-tokens", "2")
    assert code == 0 and out.count("Q: ") == 2 and out.count("KV budget") == 2
    # --batch 2: the same answers (two batches: 2 + 1 questions), in order
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{qs[1]}\n{qs[2]}\n"))
    code, out, err = _run(capsys, "ask", str(idx), qs[0], "-", "--model", model_dir, "--max-new-tokens", "4",
                          "--json", "--batch", "2")
    assert code == 0, err
    key = lambda r: (r["question"], r["answer"], r["token_ids"], r["stats"]["kv_budget"])  # noqa: E731  (not the timings)
    assert [key(json.loads(line)) for line in out.strip().splitlines()] == [key(r) for r in rows]
    code, out, _ = _run(capsys, "ask", str(idx), *qs, "--model", model_dir, "--max-new-tokens", "2", "--batch", "3")
    assert code == 0 and out.count("Q: ") == 3 and out.count("for 3 answers") == 3
    code, out, err = _run(capsys, "ask", str(idx), qs[0], "--model", model_dir, "--batch", "0")
    assert code != 0 and "--batch must be >= 1" in _error_line(err)
    # checked before anything loads: a blank question among several, nothing on stdin
    code, out, err = _run(capsys, "ask", str(idx), qs[0], " ", "--model", model_dir)
    assert code != 0 and not out and "question 2 on the command line is empty" in _error_line(err)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    code, out, err = _run(capsys, "ask", str(idx), "-", "--model", model_dir)
    assert code != 0 and not out and "no questions on stdin" in _error_line(err)


def test_chat_is_one_conversation_per_stdin(capsys, monkeypatch, model_dir, doc_file, tmp_path):
    """`sqjax chat`: each stdin line a question asked after the earlier turns (the API's
    `Conversation`, which keeps the turns' K/V), "/undo" forgets the last turn, "/reset" starts over,
    a failing question (or an undo with nothing to undo) prints its error and the rest go on."""
    import io

    idx = tmp_path / "chat.sqx"
    assert main(["index", str(doc_file), "-o", str(idx), "--model", model_dir, "--sparsity", "0.8", "--json"]) == 0
    capsys.readouterr()
    qs = ["Which valve was serviced in room 3?", "And in room 4?", "Which colour?", "And room 5?"]
    too_long = "Tell me more. " * 600
    lines = [qs[0], "", qs[1], too_long, "/undo", qs[3], "/reset", "/undo", qs[2]]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    code, out, err = _run(capsys, "chat", str(idx), "--model", model_dir, "--max-new-tokens", "4", "--json")
    assert code == 2 and err.count("sqjax: error: ") == 2 and "exceed the model's context" in err
    assert "start a new conversation (/reset)" in err and "no turn to undo" in err
    # --json: one line per non-empty input line, in order (its answer, what a command did, or its error)
    lines_out = [json.loads(line) for line in out.strip().splitlines()]
    assert len(lines_out) == 8
    too_long_error = next(l for l in err.splitlines() if "exceed" in l).removeprefix("sqjax: error: ")
    assert lines_out[2] == {"question": too_long.strip(), "turn": 2, "error": too_long_error}
    assert "start a new conversation (/reset)" in lines_out[2]["error"]
    assert lines_out[3] == {"command": "/undo", "undone": qs[1], "turn": 1}
    assert lines_out[5] == {"command": "/reset", "turn": 0}
    assert lines_out[6]["command"] == "/undo" and "no turn to undo" in lines_out[6]["error"]
    rows = [r for r in lines_out if "answer" in r]
    assert [(r["question"], r["turn"]) for r in rows] == [(qs[0], 1), (qs[1], 2), (qs[3], 2), (qs[2], 1)]
    ctx = FixedContext.load(idx, sqjax.load_model(model_dir))
    conv = ctx.conversation()
    assert rows[0]["token_ids"] == conv.ask(qs[0], max_new_tokens=4).token_ids
    assert rows[1]["token_ids"] == conv.ask(qs[1], max_new_tokens=4).token_ids
    conv.undo()
    assert rows[2]["token_ids"] == conv.ask(qs[3], max_new_tokens=4).token_ids
    assert rows[0]["stats"]["n_reused_tokens"] == 0 < rows[1]["stats"]["n_reused_tokens"]
    assert rows[2]["stats"]["n_reused_tokens"] >= rows[0]["stats"]["n_prompt_tokens"]
    assert rows[3]["token_ids"] == ctx.ask(qs[2], max_new_tokens=4).token_ids
    # text output: streamed answers with a stats line each; sampling options reach the answers
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{qs[0]}\n{qs[1]}\n/undo\n/reset\n"))
    code, out, err = _run(capsys, "chat", str(idx), "--model", model_dir, "--max-new-tokens", "3",
                          "--temperature", "0.9", "--top-p", "0.8", "--seed", "7")
    assert code == 0, err
    assert out.count("KV budget") == 2 and "[new conversation]" in out and f"[undone: {qs[1]}]" in out
    assert out.count("prompt tokens kept") == 1
    sampled = ctx.ask(qs[0], max_new_tokens=3, temperature=0.9, top_p=0.8, seed=7)
    assert out.startswith(str(sampled))
    # an index built without the chat template cannot hold a conversation
    # (its build shows progress bars on a terminal only: not into a file or pipe, not with --json)
    raw = tmp_path / "raw.sqx"
    code, out, err = _run(capsys, "index", str(doc_file), "-o", str(raw), "--model", model_dir, "--raw")
    assert code == 0 and "indexed" in out and "prefill" not in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = _run(capsys, "index", str(doc_file), "-o", str(raw), "--model", model_dir, "--raw")
    assert code == 0 and "prefill" in err and "clustering" in err
    monkeypatch.undo()
    code, out, err = _run(capsys, "chat", str(raw), "--model", model_dir)
    assert code != 0 and not out and "needs the chat template" in _error_line(err)
    # with --json the error is also a JSON line on stdout
    code, out, err = _run(capsys, "chat", str(raw), "--model", model_dir, "--json")
    assert json.loads(out) == {"exit_code": code, "error": _error_line(err)[len("sqjax: error: "):]} and code == 2


def test_chat_session_file_keeps_the_conversation(capsys, monkeypatch, model_dir, doc_file, tmp_path):
    """`chat --session FILE`: the turns are written to FILE after every answer, /undo and /reset, and a
    later chat goes on from them (its first question prefills them: `ask(history=...)`'s answer). A
    FILE that is not a conversation about the index's document is an error before the model loads,
    and is left as it was."""
    import io

    from sqjax.conversation_file import write_conversation

    idx = tmp_path / "s.sqx"
    assert main(["index", str(doc_file), "-o", str(idx), "--model", model_dir, "--sparsity", "0.8", "--json"]) == 0
    capsys.readouterr()
    session = tmp_path / "s.json"
    qs = ["Which valve was serviced in room 3?", "And in room 4?"]

    def chat(stdin, *extra):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        return _run(capsys, "chat", str(idx), "--model", model_dir, "--max-new-tokens", "3", "--session",
                    str(session), *extra)

    code, out, err = chat(qs[0] + "\n", "--json")
    assert code == 0, err
    first = json.loads(out)
    assert json.loads(session.read_text())["turns"] == [[qs[0], first["answer"]]]
    code, out, err = chat(qs[1] + "\n", "--json")
    assert code == 0, err
    second = json.loads(out)
    assert second["turn"] == 2 and second["stats"]["n_reused_tokens"] == 0   # the saved turn prefilled again
    ctx = FixedContext.load(idx, sqjax.load_model(model_dir))
    assert second["token_ids"] == ctx.ask(qs[1], max_new_tokens=3, history=[(qs[0], first["answer"])]).token_ids
    assert [t[0] for t in json.loads(session.read_text())["turns"]] == qs
    code, out, err = chat("/undo\n")
    assert code == 0 and out.startswith("[resumed: 2 turns from ") and f"[undone: {qs[1]}]" in out
    assert [t[0] for t in json.loads(session.read_text())["turns"]] == qs[:1]
    code, out, err = chat("/reset\n")
    assert code == 0 and json.loads(session.read_text())["turns"] == []
    # files it must not use: named, untouched, nothing answered
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    other = tmp_path / "other.json"
    write_conversation(other, "0" * 64, [("q", "a")])
    for path, message in [(notes, "is not a sqjax conversation file"), (other, "about another document"),
                          (tmp_path / "no" / "s.json", "does not exist; create it first"), (idx, "not JSON")]:
        before = path.read_bytes() if path.exists() else None
        monkeypatch.setattr(sys, "stdin", io.StringIO(qs[0] + "\n"))
        code, out, err = _run(capsys, "chat", str(idx), "--model", "nowhere", "--session", str(path))
        assert code == 2 and not out and message in _error_line(err) and "--session" in err, (path, err)
        assert (path.read_bytes() if path.exists() else None) == before


@pytest.mark.parametrize("argv,message", [
    (("--temperature", "-1"), "--temperature must be a finite number >= 0"),
    (("--top-p", "0"), "--top-p must lie in (0, 1]"),
    (("--seed", "-3"), "--seed must be an integer in [0, 2**32)"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
])
@pytest.mark.parametrize("cmd", ["ask", "chat"])
def test_generation_options_are_checked_before_anything_loads(capsys, tmp_path, cmd, argv, message):
    """The index does not exist and the model is not a model: the option's error comes first."""
    args = [cmd, str(tmp_path / "none.sqx")] + (["hi"] if cmd == "ask" else []) + ["--model", "nowhere", *argv]
    code, out, err = _run(capsys, *args)
    assert code != 0 and not out and message in _error_line(err)


def test_ask_errors(capsys, model_dir, doc_file, tmp_path):
    idx = tmp_path / "ok.sqx"
    assert main(["index", str(doc_file), "-o", str(idx), "--model", model_dir, "--json"]) == 0
    capsys.readouterr()
    code, _, err = _run(capsys, "ask", str(idx), "   ", "--model", model_dir)
    assert code != 0 and "question is empty" in _error_line(err)
    bad = tmp_path / "bad.sqx"
    bad.write_bytes(idx.read_bytes()[:1000])
    code, _, err = _run(capsys, "ask", str(bad), "hi", "--model", model_dir)
    assert code != 0 and "corrupted or truncated" in _error_line(err)
    code, _, err = _run(capsys, "ask", str(tmp_path / "none.sqx"), "hi", "--model", model_dir)
    assert code != 0 and "not found" in _error_line(err)
    # the document given where its index belongs: the message says how to index it
    code, _, err = _run(capsys, "ask", str(doc_file), "hi", "--model", model_dir)
    assert code != 0 and f"{doc_file} is a text file, not a sqjax index; index it first: `sqjax index {doc_file} " \
        f"-o {doc_file.with_suffix('.sqx')}`" in _error_line(err)


def test_index_options_a_method_does_not_take_are_errors(capsys, doc_file, tmp_path):
    """Checked before the model loads (the model named here does not exist): nothing is built."""
    cases = [(("--budget", "0.2"), "--budget is for quest, snapkv, streaming and oracle; --method squeezed"),
             (("--method", "full", "--sparsity", "0.5"), "--sparsity is for squeezed, hsqueezed, quest"),
             (("--probes", "4"), "--probes is for saap; --method squeezed does not take it"),
             (("--method", "quest", "--n-sink", "2"), "--n-sink is for squeezed, hsqueezed, streaming and saap"),
             (("--method", "quest", "--sparsity", "0.5", "--budget", "0.2"), "--sparsity and --budget both set"),
             (("--raw", "--system", "Be brief."), "--system needs the chat template: drop --raw or --system")]
    for extra, message in cases:
        code, out, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "x.sqx"), "--model",
                              str(tmp_path / "none.gguf"), *extra)
        assert code == 2 and not out and message in _error_line(err), (extra, err)
    assert not (tmp_path / "x.sqx").exists()


def test_index_options_reach_the_method(capsys, model_dir, doc_file, tmp_path):
    cases = [(("--method", "saap", "--probes", "3", "--n-sink", "2"), {"probes": 3, "n_sink": 2}),
             (("--method", "streaming", "--sparsity", "0.75"), {"budget": 0.25, "n_sink": 4}),
             (("--method", "quest", "--budget", "0.3"), {"budget": 0.3}),
             # Squeezed keeps the first token exact unless told (the paper's n_sink=0 on request)
             (("--method", "squeezed",), {"n_sink": 1, "sparsity": 0.9}),
             (("--method", "hsqueezed", "--n-sink", "0"), {"n_sink": 0})]
    model = sqjax.load_model(model_dir)
    for extra, want in cases:
        code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "m.sqx"), "--model", model_dir,
                            "--json", *extra)
        assert code == 0, err
        method = FixedContext.load(tmp_path / "m.sqx", model).method
        assert {k: getattr(method, k) for k in want} == pytest.approx(want), extra
    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "m.sqx"), "--model", model_dir,
                        "--method", "full", "--system", "Be brief.", "--json")
    assert code == 0, err
    assert FixedContext.load(tmp_path / "m.sqx", model).system == "Be brief."
    code, _, err = _run(capsys, "index", str(doc_file), "-o", str(tmp_path / "m.sqx"), "--model", model_dir,
                        "--method", "saap", "--probes", "0")   # 0 is a value, not "not given"
    assert code == 2 and "probes must be >= 1" in _error_line(err)


def test_index_output_is_checked_and_never_clobbers(capsys, model_dir, doc_file, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(doc_file.read_text())
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    (tmp_path / "adir").mkdir()
    missing_model = str(tmp_path / "none.gguf")   # every case fails before the model would load
    for out, message in [(doc, "is the document itself"), (notes, "exists and is not a sqjax index"),
                         (tmp_path / "adir", "is a directory; give a file path such as")]:
        code, _, err = _run(capsys, "index", str(doc), "-o", str(out), "--model", missing_model)
        assert code == 2 and message in _error_line(err), err
    assert doc.read_text() == doc_file.read_text() and notes.read_text() == "mine"
    code, _, err = _run(capsys, "index", str(tmp_path / "adir"), "-o", str(tmp_path / "x.sqx"))
    assert code == 2 and "is a directory; give a text file" in _error_line(err)
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t")
    code, _, err = _run(capsys, "index", str(blank), "-o", str(tmp_path / "x.sqx"), "--model", missing_model)
    assert code == 2 and "document is empty" in _error_line(err)
    # new files get the mode `open` gives (0666 less the umask), overwritten ones keep theirs; a
    # damaged .sqx is rebuilt in place
    old_umask = os.umask(0o027)
    try:
        idx = tmp_path / "doc.sqx"
        assert main(["index", str(doc), "-o", str(idx), "--model", model_dir, "--json"]) == 0
        assert stat.S_IMODE(idx.stat().st_mode) == 0o640
        idx.write_bytes(b"damaged")
        idx.chmod(0o604)
        assert main(["index", str(doc), "-o", str(idx), "--model", model_dir, "--json"]) == 0
        assert stat.S_IMODE(idx.stat().st_mode) == 0o604
        assert FixedContext.load(idx, sqjax.load_model(model_dir)).n_tokens > 100
    finally:
        os.umask(old_umask)
    assert not list(tmp_path.glob(".*.tmp"))


def test_ask_checks_every_question_and_option_first(capsys, model_dir, doc_file, tmp_path):
    # option errors come before the index or the model is read (this index does not exist)
    for flag in ("--max-new-tokens", "--batch"):
        code, out, err = _run(capsys, "ask", str(tmp_path / "none.sqx"), "hi", flag, "0")
        assert code == 2 and not out and f"{flag} must be >= 1; got 0" in _error_line(err)
    idx = tmp_path / "q.sqx"
    assert main(["index", str(doc_file), "-o", str(idx), "--model", model_dir, "--json"]) == 0
    capsys.readouterr()
    context = sqjax.load_model(model_dir).config.max_position_embeddings
    too_long = "valve " * context
    code, out, err = _run(capsys, "ask", str(idx), "Which room?", too_long, "--model", model_dir, "--json")
    assert "shorten question 2 of 2 or ask for fewer new tokens" in _error_line(err)
    # the first question was not answered either: stdout holds the error's JSON line only
    assert code == 2 and json.loads(out) == {"exit_code": 2, "error": _error_line(err).removeprefix("sqjax: error: ")}
    # one token: no decode step, so no time per output token; --json stays strict JSON (null, not NaN)
    code, out, err = _run(capsys, "ask", str(idx), "Which room?", "--model", model_dir, "--json",
                          "--max-new-tokens", "1")
    assert code == 0, err
    row = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    assert row["stats"]["time_per_output_token_s"] is None and len(row["token_ids"]) == 1
    code, out, _ = _run(capsys, "ask", str(idx), "Which room?", "--model", model_dir, "--max-new-tokens", "1")
    assert code == 0 and "no decode step" in out
    assert dumps({"x": float("nan"), "y": [np.float32(np.inf), 1.5]}) == '{"x": null, "y": [null, 1.5]}'


def test_ask_finds_the_model_the_index_names(capsys, model_dir, doc_file, tmp_path):
    """The index records an absolute model path; a moved model gets a message that says what to do, and
    the fingerprint ignores where the weights live and what the files are called."""
    copy = tmp_path / "ckpt"
    shutil.copytree(model_dir, copy)
    idx = tmp_path / "m.sqx"
    os.chdir(tmp_path)   # a relative --model is recorded as an absolute path
    try:
        assert main(["index", str(doc_file), "-o", str(idx), "--model", "ckpt", "--json"]) == 0
    finally:
        os.chdir(Path(__file__).parent)
    capsys.readouterr()
    code, out, err = _run(capsys, "ask", str(idx), "Which room?", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    copy.rename(tmp_path / "moved")
    code, out, err = _run(capsys, "ask", str(idx), "Which room?", "--max-new-tokens", "2")
    line = _error_line(err)
    assert code == 2 and str(copy) in line and "pass --model with that model's path" in line
    code, out, err = _run(capsys, "ask", str(idx), "Which room?", "--max-new-tokens", "2", "--json",
                          "--model", str(tmp_path / "moved"))
    assert code == 0, err


def test_index_dtype_is_the_one_ask_and_chat_load(capsys, monkeypatch, model_dir, doc_file, tmp_path):
    """`index --dtype bfloat16` builds with the model in bf16 and saves that; `ask` and `chat` load the
    model in it (before, they loaded float32 and the index was refused)."""
    import io

    import jax.numpy as jnp

    from sqjax.index_io import read_header

    idx = tmp_path / "bf16.sqx"
    code, out, err = _run(capsys, "index", str(doc_file), "-o", str(idx), "--model", model_dir, "--dtype", "bfloat16",
                          "--sparsity", "0.8", "--json")
    assert code == 0, err
    assert read_header(idx)["model_dtype"] == "bfloat16"
    code, out, err = _run(capsys, "ask", str(idx), "Which room?", "--model", model_dir, "--max-new-tokens", "3",
                          "--json")
    assert code == 0, err
    ctx = FixedContext.load(idx, sqjax.load_model(model_dir, dtype=jnp.bfloat16))
    assert json.loads(out)["token_ids"] == ctx.ask("Which room?", max_new_tokens=3).token_ids
    monkeypatch.setattr(sys, "stdin", io.StringIO("Which room?\n"))
    code, out, err = _run(capsys, "chat", str(idx), "--model", model_dir, "--max-new-tokens", "3", "--json")
    assert code == 0 and json.loads(out)["token_ids"] == ctx.ask("Which room?", max_new_tokens=3).token_ids
    with pytest.raises(SystemExit) as e:  # argparse names the dtypes it takes
        main(["index", str(doc_file), "-o", str(idx), "--model", model_dir, "--dtype", "int8"])
    assert e.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err


def test_fingerprint_ignores_file_names_and_accepts_the_old_one(capsys, model_dir, doc_file, tmp_path):
    model = sqjax.load_model(model_dir)
    (weights,) = model.weight_files
    renamed = tmp_path / "renamed.safetensors"
    shutil.copy(weights, renamed)
    other = dataclasses.replace(model, weight_files=(str(renamed),))
    assert other.fingerprint == model.fingerprint and other.fingerprints[1] != model.fingerprints[1]
    # an index written before the change recorded the v1 fingerprint: it still loads
    ctx = FixedContext.build(model, DOC, sqjax.Squeezed(sparsity=0.8))
    old = dataclasses.replace(model)
    old.__dict__["fingerprint"] = model.fingerprints[1]
    ctx.model = old
    ctx.save(tmp_path / "old.sqx")
    assert FixedContext.load(tmp_path / "old.sqx", model).n_tokens == ctx.n_tokens
    # another model: both fingerprints named
    stranger = dataclasses.replace(model)
    stranger.__dict__["fingerprints"] = ("f" * 64,)
    with pytest.raises(SqjaxError, match=r"fingerprint [0-9a-f]{12}…\) than this one \(fingerprint ffffffffffff…"):
        FixedContext.load(tmp_path / "old.sqx", stranger)


def test_demo_document_is_the_same_text_in_every_process():
    """pydoc writes object addresses (0x7f...) that change from process to process; the demo's
    document writes them as 0x0, so every run indexes the same text."""
    code = "from sqjax.cli import demo_document; import hashlib; print(hashlib.sha1(demo_document().encode()).hexdigest())"
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    assert len(digests) == 1
    from sqjax.cli import demo_document
    import re
    doc = demo_document()
    assert "json" in doc and len(doc) > 10000 and not re.search(r"0x[0-9a-fA-F]*[1-9a-fA-F]", doc)
