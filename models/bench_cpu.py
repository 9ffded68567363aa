"""CPU speed of the model port: prefill of a long prompt and decode tokens/s.

    .venv/bin/python -m models.bench_cpu [--model smollm2-135m] [--context 8192] [--chunk 0]
                                         [--repeats 3] [--decode-steps 32] [-o benchmarks/results/cpu_model_speed.json]

Prefill runs `models.prefill` (jitted, cache donated) over ``--context`` tokens of real text
(pydoc renderings of stdlib modules), at once or in chunks of ``--chunk`` tokens, against a
fixed-capacity cache (default dense attention: blocked, invisible key blocks skipped). Decode runs `models.decode_step` (greedy)
after that prefill (context = ``--context``) and after a short prompt. Compilation happens in
a warm-up and is reported separately; the table shows medians over ``--repeats``. Results are
written as JSON (atomically) with the jax version, commit and shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pydoc
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .generate import decode_step, prefill
from .kv_cache import KVCache
from .registry import load_model

REPO = Path(__file__).resolve().parents[1]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "uncommitted"
    except (OSError, subprocess.SubprocessError):
        return "uncommitted"


def _real_text_ids(tokenizer, n: int) -> np.ndarray:
    modules = ("textwrap", "shlex", "heapq", "bisect", "fractions", "statistics", "difflib", "json", "string",
               "functools", "collections", "argparse", "pathlib", "typing", "dataclasses", "enum")
    ids: list[int] = []
    for m in modules:
        ids += tokenizer.encode(pydoc.render_doc(m, renderer=pydoc.plaintext), add_bos=False)
        if len(ids) >= n:
            return np.asarray(ids[:n], np.int32)
    reps = -(-n // len(ids))
    return np.asarray((ids * reps)[:n], np.int32)


def _block(x):
    jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)
    return x


def _prefill_all(model, ids, chunk, capacity):
    cache = KVCache.init(model.config, 1, capacity, model.dtype)
    T = ids.shape[1]
    pos = np.arange(T, dtype=np.int32)[None]
    for s in range(0, T, chunk):
        logits, cache = prefill(model.graphdef, model.state, jnp.asarray(ids[:, s:s + chunk]),
                                jnp.asarray(pos[:, s:s + chunk]), cache)
    _block((logits, cache))
    return logits, cache


def _decode(model, cache, start_pos: int, first_token: int, steps: int):
    key = jax.random.key(0)
    tok = jnp.asarray([first_token], jnp.int32)
    t0 = time.perf_counter()
    for i in range(steps):
        tok, _, cache = decode_step(model.graphdef, model.state, tok, jnp.asarray([start_pos + i], jnp.int32),
                                    cache, key, jnp.int32(i), jnp.float32(1.0), jnp.float32(1.0))
    tok.block_until_ready()
    return time.perf_counter() - t0, cache


def _atomic_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="CPU prefill / decode speed of a model")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk (0 = the whole context at once)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--short-context", type=int, default=128)
    ap.add_argument("-o", "--out", default=str(REPO / "benchmarks/results/cpu_model_speed.json"))
    args = ap.parse_args(argv)
    args.chunk = args.chunk or args.context
    if args.context % args.chunk:
        ap.error("--context must be a multiple of --chunk (one compiled chunk shape)")

    t0 = time.perf_counter()
    model = load_model(args.model)
    load_s = time.perf_counter() - t0
    ids = _real_text_ids(model.tokenizer, args.context)[None]  # [1, T]
    capacity = args.context + args.decode_steps + 64

    # warm-up: compile prefill (one chunk shape) and decode at this capacity
    t0 = time.perf_counter()
    logits, cache = _prefill_all(model, ids[:, : args.chunk], args.chunk, capacity)
    first = int(jnp.argmax(logits[0]))
    _decode(model, cache, args.chunk, first, 1)
    compile_s = time.perf_counter() - t0

    prefill_s, decode_long, decode_short = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        logits, cache = _prefill_all(model, ids, args.chunk, capacity)
        prefill_s.append(time.perf_counter() - t0)
        dt, cache = _decode(model, cache, args.context, int(jnp.argmax(logits[0])), args.decode_steps)
        decode_long.append(dt)
        del cache
    # short context: same capacity class as a chat turn
    short_cap = args.short_context + args.decode_steps + 64
    for r in range(args.repeats + 1):
        _, cache = _prefill_all(model, ids[:, : args.short_context], args.short_context, short_cap)
        dt, cache = _decode(model, cache, args.short_context, first, args.decode_steps)
        if r:  # first round compiles
            decode_short.append(dt)
        del cache

    med = statistics.median
    result = {
        "benchmark": "cpu_model_speed",
        "model": model.name,
        "fingerprint": model.fingerprint,
        "dtype": jnp.dtype(model.dtype).name,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "commit": _commit(),
        "shapes": {
            "batch": 1, "prefill_tokens": args.context, "prefill_chunk": args.chunk, "cache_capacity": capacity,
            "decode_steps": args.decode_steps, "short_context": args.short_context, "short_capacity": short_cap,
            "layers": model.config.num_layers, "hidden": model.config.hidden_size,
            "heads": [model.config.num_heads, model.config.num_kv_heads], "head_dim": model.config.head_dim,
            "vocab": model.config.vocab_size,
        },
        "repeats": args.repeats,
        "load_seconds": load_s,
        "compile_seconds_warmup": compile_s,
        "prefill_seconds_median": med(prefill_s),
        "prefill_tokens_per_second": args.context / med(prefill_s),
        "decode_tokens_per_second_at_context": args.decode_steps / med(decode_long),
        "decode_ms_per_token_at_context": 1e3 * med(decode_long) / args.decode_steps,
        "decode_tokens_per_second_short": args.decode_steps / med(decode_short),
        "decode_ms_per_token_short": 1e3 * med(decode_short) / args.decode_steps,
        "raw": {"prefill_seconds": prefill_s, "decode_seconds_at_context": decode_long,
                "decode_seconds_short": decode_short},
    }
    rows = [
        ("load (GGUF + dequantize)", f"{load_s:.2f} s"),
        ("warm-up compile", f"{compile_s:.1f} s"),
        (f"prefill {args.context} tok (chunks of {args.chunk})",
         f"{med(prefill_s):.2f} s  ({result['prefill_tokens_per_second']:.0f} tok/s)"),
        (f"decode @ {args.context} ctx", f"{result['decode_ms_per_token_at_context']:.1f} ms/tok  "
         f"({result['decode_tokens_per_second_at_context']:.1f} tok/s)"),
        (f"decode @ {args.short_context} ctx", f"{result['decode_ms_per_token_short']:.1f} ms/tok  "
         f"({result['decode_tokens_per_second_short']:.1f} tok/s)"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{model.name}  jax {jax.__version__}  {jax.default_backend()}  {os.cpu_count()} cpus  "
          f"dtype {result['dtype']}  median of {args.repeats}")
    for name, val in rows:
        print(f"  {name:<{width}}  {val}")
    _atomic_json(Path(args.out), result)
    print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
