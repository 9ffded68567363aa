"""`sqjax` command line: demo, index, ask, chat, eval, bench, train-qclassifier.

Errors print one line on stderr and exit non-zero (a traceback only with --debug).
Every subcommand takes --json for machine-readable output on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

DEMO_MODULE = "json"
DEMO_QUESTIONS = (
    "What does json.dumps return?",
    "Which exception does json.loads raise for invalid JSON?",
    "Summarize what the json module is for.",
)
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
METHOD_CHOICES = ("squeezed", "hsqueezed", "quest", "snapkv", "saap", "streaming", "oracle", "full")


def _enable_compilation_cache() -> None:
    """Persist XLA compilations across runs (the model's forward takes tens of seconds to compile on CPU)."""
    import jax

    cache = os.environ.get("SQJAX_CACHE_DIR", os.path.join(Path.home(), ".cache", "sqjax", "xla"))
    try:
        os.makedirs(cache, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except Exception:  # a read-only home must not stop the CLI
        pass


def demo_document() -> str:
    """The demo's real document: the plain-text pydoc rendering of the stdlib `json` module, with
    object addresses (``0x7f...``, different in every process) written as ``0x0`` so that every
    run indexes the same text and gives the same answers."""
    import pydoc
    import re

    return re.sub(r"0x[0-9a-fA-F]+", "0x0", pydoc.render_doc(DEMO_MODULE, renderer=pydoc.plaintext))


SQUEEZED = ("squeezed", "hsqueezed")
BUDGETED = ("quest", "snapkv", "streaming", "oracle")
# `sqjax index` options -> the methods that take them (a method that has no use for a given option is an error)
INDEX_OPTIONS = {
    "sparsity": SQUEEZED + BUDGETED,   # budget methods keep 1 - sparsity
    "budget": BUDGETED,
    "probes": ("saap",),
    "n_sink": SQUEEZED + ("streaming", "saap"),
    "decode_calibration": SQUEEZED,
    "lookup_int8": SQUEEZED,
    "deterministic": SQUEEZED + ("saap",),
}


def _given_index_options(args) -> list[str]:
    return [k for k in INDEX_OPTIONS if getattr(args, k) is not None and getattr(args, k) is not False]  # 0 is given


def check_index_options(args) -> None:
    """Every given option applies to --method, and the kept fraction is set once."""
    from sqjax.fixed_context import SqjaxError

    for k in _given_index_options(args):
        if args.method not in INDEX_OPTIONS[k]:
            names = INDEX_OPTIONS[k]
            takers = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
            raise SqjaxError(f"--{k.replace('_', '-')} is for {takers}; --method {args.method} does not take it")
    if args.sparsity is not None and args.budget is not None:
        raise SqjaxError(f"--sparsity and --budget both set the fraction of keys {args.method} keeps; give one")
    if args.system is not None and args.raw:
        raise SqjaxError("--system needs the chat template: drop --raw or --system")


def make_method(args):
    """The method `sqjax index` builds from its (checked) options."""
    from sqjax.methods import DEFAULT_SINK, method_from_name

    param = {"deterministic": "deterministic_build"}
    kwargs = {param.get(k, k): getattr(args, k) for k in _given_index_options(args) if k not in ("sparsity", "budget")}
    if args.method in SQUEEZED and args.sparsity is not None:
        kwargs["sparsity"] = args.sparsity
    if args.method in SQUEEZED:
        kwargs.setdefault("n_sink", DEFAULT_SINK)   # unless --n-sink says otherwise (0: the paper exactly)
    if args.method in BUDGETED and (args.budget is not None or args.sparsity is not None):
        kwargs["budget"] = args.budget if args.budget is not None else 1.0 - args.sparsity
    return method_from_name(args.method, **kwargs)


_plain_format_warning = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """sqjax's own warnings as one line, like its errors; others as Python prints them."""
    if category is UserWarning and f"{os.sep}sqjax{os.sep}" in filename:
        return f"sqjax: warning: {message}\n"
    return _plain_format_warning(message, category, filename, lineno, line)


def _show_progress(args) -> bool:
    """Progress bars on stderr for a person watching: not with --json, not into a file or pipe."""
    return not args.json and sys.stderr.isatty()


def _json_safe(x):
    """`x` with every non-finite float as None (JSON has no NaN or infinity)."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def dumps(payload, **kwargs) -> str:
    """Strict JSON of a payload (numpy scalars as floats, NaN and infinities as null)."""
    return json.dumps(_json_safe(json.loads(json.dumps(payload, default=float))), allow_nan=False, **kwargs)


def _out(args, payload: dict, text: str) -> None:
    if args.json:
        print(dumps(payload, indent=1))
    else:
        print(text)


def _agreement(a: list, b: list) -> float:
    """Fraction of the reference answer's token positions where both answers hold the same token."""
    if not b:
        return float(a == b)
    return sum(x == y for x, y in zip(a, b)) / len(b)


def cmd_demo(args) -> int:
    import sqjax
    from sqjax.fixed_context import FixedContext

    from sqjax.fixed_context import SqjaxError
    from sqjax.methods import DEFAULT_SINK

    if not 1 <= args.questions <= len(DEMO_QUESTIONS):
        raise SqjaxError(f"--questions must lie in [1, {len(DEMO_QUESTIONS)}] (the demo has {len(DEMO_QUESTIONS)}); "
                         f"got {args.questions}")
    if args.max_new_tokens < 1:
        raise SqjaxError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    t_start = time.perf_counter()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    say(f"loading {args.model} ...")
    model = sqjax.load_model(args.model, dtype=args.dtype)
    doc = demo_document()
    method = sqjax.Squeezed(sparsity=args.sparsity, n_sink=DEFAULT_SINK if args.n_sink is None else args.n_sink)
    say(f"indexing the pydoc page of `{DEMO_MODULE}` with {method.label} ...")
    ctx = FixedContext.build(model, doc, method, truncate=True, progress=_show_progress(args))
    full = ctx.with_method(sqjax.Full())
    say(f"document: {ctx.n_tokens} tokens; threshold T={ctx.info['threshold']:.3g}; "
        f"index built in {ctx.info['index_seconds']:.1f}s\n")
    rows = []
    for q in DEMO_QUESTIONS[: args.questions]:
        a = ctx.ask(q, max_new_tokens=args.max_new_tokens)
        b = full.ask(q, max_new_tokens=args.max_new_tokens)
        agree = _agreement(a.token_ids, b.token_ids)
        rows.append({"question": q, "squeezed": str(a), "full": str(b), "token_agreement": agree,
                     "squeezed_stats": a.stats.to_dict(), "full_stats": b.stats.to_dict()})
        say(f"Q: {q}")
        say(f"  {method.label:>14}: {a.strip()!r}")
        say(f"  {'full':>14}: {b.strip()!r}")
        say(f"  KV budget {a.stats.kv_budget:.3f} (prefill {a.stats.kv_budget_prefill:.3f}) | "
            f"time/token {_per_token(a.stats)} vs full {_per_token(b.stats)} | token agreement {agree:.0%}\n")
    total = time.perf_counter() - t_start
    say(f"done in {total:.0f}s (CPU timings include no GPU kernels; see README for GPU numbers)")
    if args.json:
        _out(args, {"model": model.name, "document_tokens": ctx.n_tokens, "method": method.label,
                    "info": ctx.info, "answers": rows, "seconds": total}, "")
    return 0


def _check_index_paths(doc_path: Path, out: Path) -> None:
    """The document is a readable file and -o names a file that may be written, before any work."""
    from sqjax.fixed_context import SqjaxError
    from sqjax.index_io import check_index_target

    if str(doc_path) == "-":   # stdin
        check_index_target(out)
        return
    if doc_path.is_dir():
        raise SqjaxError(f"document {str(doc_path)!r} is a directory; give a text file")
    if not doc_path.is_file():
        raise SqjaxError(f"document {str(doc_path)!r} not found")
    if out.exists() and out.resolve() == doc_path.resolve():
        raise SqjaxError(f"-o {str(out)!r} is the document itself; give the index another name, such as "
                         f"{str(out.with_suffix('.sqx'))!r}")
    check_index_target(out)


def cmd_index(args) -> int:
    import sqjax
    from sqjax.fixed_context import FixedContext, SqjaxError

    doc_path, out = Path(args.document), Path(args.output)
    check_index_options(args)
    _check_index_paths(doc_path, out)
    name = "stdin" if str(doc_path) == "-" else str(doc_path)
    try:
        text = sys.stdin.buffer.read().decode("utf-8") if name == "stdin" else doc_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SqjaxError(f"{name} is not UTF-8 text; convert it (e.g. `iconv -t UTF-8`) or give a plain-text "
                         "file") from None
    if not text.strip():
        raise SqjaxError(f"document is empty: {name} holds no text")
    method = make_method(args)
    model = sqjax.load_model(args.model, dtype=args.dtype)
    t0 = time.perf_counter()
    ctx = FixedContext.build(model, text, method, truncate=args.truncate, progress=_show_progress(args), chat=not args.raw,
                             system=args.system)
    ctx.save(out)
    payload = {"index": str(out), "document_tokens": ctx.n_tokens, "method": method.label,
               "model": model.name, "seconds": time.perf_counter() - t0, "info": ctx.info}
    _out(args, payload, f"indexed {ctx.n_tokens} tokens with {method.label} -> {out} ({payload['seconds']:.1f}s)")
    return 0


def _questions(args) -> list[str]:
    """The questions of `sqjax ask`, in order: each argument, and for ``-`` every non-blank line of
    stdin. All are checked before the model loads, so a bad one costs nothing."""
    from sqjax.fixed_context import SqjaxError

    qs = []
    for i, q in enumerate(args.questions, 1):
        if q == "-":
            lines = [line for line in map(str.strip, sys.stdin) if line]
            if not lines:
                raise SqjaxError("no questions on stdin: give one question per line")
            qs += lines
        elif not q.strip():
            where = f" {i} on the command line" if len(args.questions) > 1 else ""
            raise SqjaxError(f"question{where} is empty: ask something")
        else:
            qs.append(q)
    return qs


def _index_model(path: Path, header: dict, given: str | None):
    """The model an index is answered with: --model, else the one its header names, in the dtype it
    was built in (checked: a header damaged in those fields reads as the corruption it is)."""
    import sqjax
    from sqjax.fixed_context import SqjaxError
    from sqjax.index_io import IndexFileError, load_index

    def damaged_or(message: str):
        try:
            load_index(path)
        except IndexFileError as bad:
            return SqjaxError(str(bad))
        return SqjaxError(message)

    dtype = header.get("model_dtype") or "float32"   # indexes from before the field: float32
    if dtype not in DTYPE_CHOICES:
        raise damaged_or(f"{path} was built with the model in {dtype!r}, which sqjax does not load; rebuild it")
    if given:
        return sqjax.load_model(given, dtype=dtype)
    source = header.get("model_source") or "smollm2-135m"
    try:
        return sqjax.load_model(source, dtype=dtype)
    except (OSError, ValueError) as e:
        raise damaged_or(f"{path} was built with the model {source!r}, which does not load here ({e}); "
                         "pass --model with that model's path") from None


def _check_generation_options(args) -> None:
    """--max-new-tokens, --temperature, --top-p, --seed (and --batch where it exists), before the model loads."""
    from sqjax._checks import check_seed
    from sqjax.fixed_context import SqjaxError, check_sampling

    for flag, value in (("--batch", getattr(args, "batch", 1)), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise SqjaxError(f"{flag} must be >= 1; got {value}")
    check_sampling(args.temperature, args.top_p, names=("--temperature", "--top-p"))
    try:
        check_seed("--seed", args.seed)
    except ValueError as e:
        raise SqjaxError(str(e)) from None


def _index_header(args) -> dict:
    """The header of `ask` / `chat`'s index (read without its arrays)."""
    from sqjax.fixed_context import SqjaxError
    from sqjax.index_io import IndexFileError, read_header

    try:
        return read_header(Path(args.index))
    except IndexFileError as e:
        raise SqjaxError(str(e)) from None


def _load_context(args):
    """The index of `ask` / `chat` with its model, loaded (and compiled) once for every question."""
    from sqjax.fixed_context import FixedContext

    path = Path(args.index)
    return FixedContext.load(path, _index_model(path, _index_header(args), args.model))


def _session_turns(args) -> list | None:
    """`chat --session FILE`'s saved turns ([] for a new file; None without --session), checked
    before the model loads: a file there must be a conversation about the index's document."""
    from sqjax.conversation_file import ConversationFileError, read_conversation
    from sqjax.fixed_context import SqjaxError

    if args.session is None:
        return None
    path = Path(args.session)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SqjaxError(f"--session: directory {str(parent)!r} does not exist; create it first")
    if not path.exists():
        return []
    try:
        return read_conversation(path, _index_header(args)["document"]["sha256"])
    except ConversationFileError as e:
        raise SqjaxError(f"--session: {e}") from None


def _sampling(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "seed": args.seed}


def _answer_json(question: str, ans, **extra) -> str:
    return dumps({"question": question, **extra, "answer": str(ans), "token_ids": ans.token_ids,
                  "stats": ans.stats.to_dict()})


def _error(args, message: str, **fields) -> None:
    """An error: one line on stderr ("sqjax: error: ..."); with --json also a JSON line on stdout
    ({..fields, "error": message}), so that a program reading stdout sees it in its place."""
    print(f"sqjax: error: {message}", file=sys.stderr, flush=True)
    if getattr(args, "json", False):
        print(dumps({**fields, "error": message}), flush=True)


def _per_token(stats, unit: str = "ms") -> str:
    """An answer's time per output token, or what stands for it when the answer had no decode step."""
    t = stats.time_per_output_token_s
    return f"{1e3 * t:.1f} {unit}" if math.isfinite(t) else "no decode step"


def _stats_line(ans, n_answers: int = 1) -> str:
    s = ans.stats
    reused = f" ({s.n_reused_tokens} of {s.n_prompt_tokens} prompt tokens kept)" if s.n_reused_tokens else ""
    return (f"[{s.method}: KV budget {s.kv_budget:.3f}, TTFT {s.time_to_first_token_s:.2f}s{reused}, "
            f"{_per_token(s, 'ms/token')}" + (f" for {n_answers} answers" if n_answers > 1 else "")
            + f"{', OVERFLOW' if s.overflow else ''}]")


def cmd_ask(args) -> int:
    questions = _questions(args)
    _check_generation_options(args)
    ctx = _load_context(args)
    ctx.check_questions(questions, args.max_new_tokens)   # every question fits before the first is answered
    batch = args.batch
    # batch 1: each answer streams as it is generated; larger batches print each answer when its batch ends
    stream = None if args.json or batch > 1 else (lambda _i, s: print(s, end="", flush=True))
    for start in range(0, len(questions), batch):
        group = questions[start:start + batch]
        if batch == 1 and len(questions) > 1 and not args.json:
            print(f"Q: {group[0]}")
        answers = ctx.ask_many(group, on_token=stream, **_sampling(args))
        for q, ans in zip(group, answers):
            if args.json:   # JSON Lines: one object per question, printed as soon as its batch is answered
                print(_answer_json(q, ans), flush=True)
                continue
            if batch > 1:
                print(f"Q: {q}\n{ans}", end="")
            print("\n" + _stats_line(ans, len(group)) + ("\n" if len(questions) > 1 else ""))
    return 0


def cmd_chat(args) -> int:
    """A conversation about an indexed document: one question per line of stdin, each asked after
    the earlier questions and answers; "/undo" forgets the last turn, "/reset" starts a new
    conversation. A follow-up prefills only its new tokens (`Conversation`'s kept K/V). A question
    that fails (too long for what is left of the context, ...) prints its error and the conversation
    goes on. With --session FILE the turns are read from FILE when it exists and written back to it
    (atomically, as text) after every answer, /undo and /reset."""
    from sqjax.fixed_context import SqjaxError

    _check_generation_options(args)
    saved = _session_turns(args)
    conv = _load_context(args).conversation(history=saved)
    if saved and not args.json:
        print(f"[resumed: {len(saved)} turn{'s' if len(saved) > 1 else ''} from {args.session}]", flush=True)
    tty = sys.stdin.isatty()
    failed = 0

    def save() -> int:   # -> errors (0 / 1); the conversation goes on either way
        if args.session is None:
            return 0
        try:
            conv.save(args.session)
        except (SqjaxError, OSError) as e:
            _error(args, f"--session: {e}", command="save", turn=len(conv.history))
            return 1
        return 0

    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 2 if failed else 0
        question = line.strip()
        if not question:
            continue
        # with --json every command and question gets one line on stdout, in order: its answer,
        # what it did, or its error (a save's error comes after)
        if question == "/reset":
            conv.reset()
            print(dumps({"command": "/reset", "turn": 0}) if args.json else "[new conversation]", flush=True)
            failed += save()
            continue
        if question == "/undo":
            try:
                undone, _ = conv.undo()
            except SqjaxError as e:
                failed += 1
                _error(args, str(e), command="/undo", turn=len(conv.history))
                continue
            print(dumps({"command": "/undo", "undone": undone, "turn": len(conv.history)}) if args.json
                  else f"[undone: {undone}]", flush=True)
            failed += save()
            continue
        stream = None if args.json else (lambda s: print(s, end="", flush=True))
        try:
            ans = conv.ask(question, on_token=stream, **_sampling(args))
        except SqjaxError as e:
            failed += 1
            _error(args, str(e).replace("start a new conversation", "start a new conversation (/reset)"),
                   question=question, turn=len(conv.history))
            continue
        if args.json:
            print(_answer_json(question, ans, turn=len(conv.history)), flush=True)
        else:
            print("\n" + _stats_line(ans), flush=True)
        failed += save()


def cmd_eval(args) -> int:
    from benchmarks.quality import main as quality_main

    return quality_main(args)


def cmd_bench(args) -> int:
    from benchmarks.speed import main as speed_main

    return speed_main(args)


def cmd_train(args) -> int:
    from train_qclassifier.__main__ import main as train_main

    return train_main(args.rest)


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' parsers are of this class too) whose usage errors carry
    their message on the SystemExit, for `main` to print as JSON under --json."""

    def error(self, message: str):
        try:
            super().error(message)
        except SystemExit as e:
            e.usage_error = message
            raise


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sqjax", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")

    def generation(sp):
        sp.add_argument("--max-new-tokens", type=int, default=64)
        sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
        sp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
        sp.add_argument("--seed", type=int, default=0, help="the sampling's PRNG seed")

    d = sub.add_parser("demo", help="index a real document with the embedded model and answer 3 questions")
    common(d)
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="the model's compute dtype")
    d.add_argument("--sparsity", type=float, default=0.9)
    d.add_argument("--n-sink", type=int, default=None,
                   help="attention-sink tokens kept exactly (default: the first token; 0 = the paper exactly)")
    d.add_argument("--questions", type=int, default=3)
    d.add_argument("--max-new-tokens", type=int, default=32)
    d.set_defaults(fn=cmd_demo)

    i = sub.add_parser("index", help="prefill a document once and build an index (.sqx)")
    common(i)
    i.add_argument("document", help="a UTF-8 text file; '-' reads it from stdin")
    i.add_argument("-o", "--output", required=True)
    i.add_argument("--model", default="smollm2-135m")
    i.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="the model's compute dtype (saved with the index: ask and chat load the model in it)")
    i.add_argument("--method", default="squeezed", choices=METHOD_CHOICES)
    i.add_argument("--sparsity", type=float, default=None, help="squeezed: fraction pruned (default 0.9)")
    i.add_argument("--budget", type=float, default=None, help="quest/snapkv/streaming/oracle: fraction kept")
    i.add_argument("--probes", type=int, default=None, help="saap: buckets visited per query")
    i.add_argument("--n-sink", type=int, default=None,
                   help="squeezed, hsqueezed, streaming, saap: attention-sink tokens kept exactly "
                        "(default 1, 1, 4 and 1; 0 for squeezed = the paper exactly)")
    i.add_argument("--deterministic", action="store_true",
                   help="squeezed, hsqueezed, saap: bit-identical index on GPU from the same document (k-means 1.2-2.2x slower, measured 128K-512K)")
    i.add_argument("--decode-calibration", choices=("window", "token"), default=None,
                   help="squeezed, hsqueezed: 'window' (default, the paper's App. C: one threshold for prefill "
                        "and decode) or 'token' (decode steps get thresholds calibrated on single queries, "
                        "so a decode step keeps about 1 - sparsity of the keys)")
    i.add_argument("--lookup-int8", action="store_true",
                   help="squeezed, hsqueezed: block (prefill) lookups and calibration from int8 queries and "
                        "centroids: ~20%% faster lookup kernels on an H100, prefill KL ~4%% higher on SmolLM2")
    i.add_argument("--truncate", action="store_true", help="keep the start of a document longer than the context")
    i.add_argument("--raw", action="store_true", help="no chat template around document and questions")
    i.add_argument("--system", metavar="TEXT", default=None,
                   help="the chat's system message before the document (default: the model template's own)")
    i.set_defaults(fn=cmd_index)

    a = sub.add_parser("ask", help="answer questions against an index (model and index loaded once)")
    common(a)
    a.add_argument("index")
    a.add_argument("questions", nargs="+", metavar="question",
                   help="one or more questions; '-' reads one question per line from stdin. "
                        "With --json, one JSON object per question and line")
    a.add_argument("--model", default=None, help="the model the index was built with (default smollm2-135m)")
    a.add_argument("--batch", type=int, default=1,
                   help="answer this many questions at a time in one batch (one model step makes a token for "
                        "each; answers print when their batch ends). Default 1: each answer streams")
    generation(a)
    a.set_defaults(fn=cmd_ask)

    c = sub.add_parser("chat", help="a conversation about an indexed document: one question per line of stdin, "
                                    "each asked after the earlier questions and answers (/undo forgets the last "
                                    "turn, /reset starts over)")
    common(c)
    c.add_argument("index")
    c.add_argument("--model", default=None, help="the model the index was built with (default smollm2-135m)")
    c.add_argument("--session", default=None, metavar="FILE",
                   help="keep the conversation in FILE (JSON text): go on from its turns when it exists, write it "
                        "again after every answer, /undo and /reset")
    generation(c)
    c.set_defaults(fn=cmd_chat)

    e = sub.add_parser("eval", help="quality of every method at matched KV budgets vs full attention")
    common(e)
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--docs", nargs="*", default=None, help="text files (default: built-in pydoc pages + papers)")
    e.add_argument("--methods", nargs="*", default=None)
    e.add_argument("--budgets", nargs="*", type=float, default=None)
    e.add_argument("--classifier", default=None, help="trained SAAP classifier directory")
    e.add_argument("--quick", action="store_true", help="a small smoke run")
    e.add_argument("-o", "--out", default="benchmarks/results/quality")
    e.set_defaults(fn=cmd_eval)

    b = sub.add_parser("bench", help="GPU speed benchmarks vs the best dense attention")
    common(b)
    b.add_argument("--contexts", nargs="*", type=int, default=None)
    b.add_argument("--sparsities", nargs="*", type=float, default=None)
    b.add_argument("--quick", action="store_true")
    b.add_argument("-o", "--out", default="benchmarks/results")
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("train-qclassifier", add_help=False,
                       help="train the SAAP query classifier (options: sqjax train-qclassifier --help)")
    t.set_defaults(fn=cmd_train, json=False, rest=[])
    return p


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "train-qclassifier" in argv:  # everything after it belongs to train_qclassifier's own parser
            i = argv.index("train-qclassifier")
            args = parser.parse_args(argv[: i + 1])
            args.rest = argv[i + 1:]
        else:
            args = parser.parse_args(argv)
    except SystemExit as e:   # argparse's usage error (on stderr with the usage): as JSON too under --json
        if getattr(e, "usage_error", None) and "--json" in argv:
            print(dumps({"error": e.usage_error, "exit_code": e.code}), flush=True)
        raise
    _enable_compilation_cache()
    warnings.formatwarning = _format_warning
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        print("sqjax: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`sqjax ask ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # one clear line unless --debug
        if getattr(args, "debug", False):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        code = 2 if isinstance(e, (ValueError, FileNotFoundError, ImportError, OSError)) else 1
        _error(args, msg, exit_code=code)
        return code


if __name__ == "__main__":
    sys.exit(main())
