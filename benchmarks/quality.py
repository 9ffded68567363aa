"""Quality harness: every method at matched KV budgets against full attention (DESIGN §7).

    sqjax eval [--model M] [--docs FILES] [--methods ...] [--budgets ...] [--classifier DIR] [-o DIR]
    python -m benchmarks.quality [same options] [--context-tokens N] [--continuation N] [--no-passkey] ...

For each document (long real text: the fixed context is its first `context_tokens` tokens;
the user input is its continuation and, separately, a question), each method and each
budget level, the real model is run teacher-forced against full attention on the same
prefilled document (see `quality_engine`): next-token KL (mean, p95) in prefill-block and
decode mode, Δ perplexity, top-1 agreement, the question's answer, attention-mass recall and
attention-output error per layer and head, and the measured KV budget / bytes moved.
Then pass-key retrieval at the lengths where full attention succeeds.

Budget levels: Squeezed runs at sparsity s ∈ {0.7, 0.8, 0.9} (`--budgets` gives kept
fractions 1 − s). As in Squeezed Attention App. F, QUEST's token budget is set per document
to the fraction of the fixed context that Squeezed(s) (the paper's algorithm, no sink)
actually read in decode mode, rounded up to whole pages; SnapKV, StreamingLLM and the
oracle get the same fraction. QUEST's page bounds and first two dense layers, and
Squeezed's centroids, are counted in the measured KV budget reported in every row.

Resumable: finished (document, method, level) cells are appended to `cells.jsonl` in the
output directory and skipped on a rerun with the same settings. Outputs: config.json,
cells.jsonl, metrics.json, table.md, kl_vs_budget.png, dppl_vs_budget.png,
per_layer.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.quality_data import (
    PASSKEY_QUESTION, Document, default_documents, file_document, passkey_prompts,
)

DEFAULT_OUT = "benchmarks/results/quality"
METHOD_NAMES = ("full", "squeezed", "hsqueezed", "quest", "snapkv", "saap", "streaming", "oracle")

# family -> CLI method name
FAMILIES = {
    "full": "full",
    "squeezed": "squeezed", "squeezed+sink1": "squeezed", "squeezed+token": "squeezed",
    "squeezed+sink1+token": "squeezed",
    "hsqueezed": "hsqueezed", "hsqueezed+sink1": "hsqueezed",
    "quest": "quest", "snapkv": "snapkv", "streaming": "streaming", "oracle": "oracle",
    "saap-nc": "saap", "saap-clf": "saap",
}
MATCHED = ("quest", "snapkv", "streaming", "oracle")
#: the Squeezed family whose measured fraction sets the matched budgets (the paper's algorithm)
MATCH_SOURCE = "squeezed"


@dataclasses.dataclass(frozen=True)
class Settings:
    context_tokens: int = 6000
    continuation: int = 128        # scored continuation tokens (one block / token by token)
    answer_tokens: int = 16        # full attention's greedy answer to the question, teacher-forced
    levels: tuple = (0.7, 0.8, 0.9)          # Squeezed sparsities
    hier_levels: tuple = (0.9,)
    hier_sinks: tuple = (1,)       # n_sink of the hierarchical rows (0 = the paper's exact algorithm)
    hier_level1_prune: float = 0.5  # keys level 1 rules out on calibration (paper: 0.5; its kernel Table 9: 0.9)
    lookup_int8: bool = False      # Squeezed rows: block lookups from int8 q and centroids (`Squeezed.lookup_int8`)
    streaming_levels: tuple | None = (0.7, 0.9)  # None = every level
    saap_probes: tuple = (8, 16)
    classifier: str | None = None
    methods: tuple | None = None   # CLI names or family names; None = all
    capacity_fraction: float = 1.0  # Squeezed's static capacity: 1.0 = never overflows (quality of the algorithm)
    attention: bool = True
    attention_stride: int = 4      # attention-level metrics on every 4th continuation token
    passkey: bool = True
    passkey_lengths: tuple = (512, 1024, 2048, 4096)
    passkey_trials: int = 10
    passkey_eval_lengths: int = 2  # the longest N lengths where full attention succeeds >= passkey_success
    passkey_success: float = 0.5
    passkey_answer_tokens: int = 12
    passkey_levels: tuple | None = (0.9,)

    def setup_key(self) -> str:
        """Hash of what makes a finished cell valid (resumability)."""
        d = {k: getattr(self, k) for k in ("context_tokens", "continuation", "answer_tokens", "capacity_fraction")}
        if self.hier_level1_prune != 0.5:  # (keys of runs at the default stay what they were)
            d["hier_level1_prune"] = self.hier_level1_prune
        if self.lookup_int8:
            d["lookup_int8"] = True
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def passkey_key(self) -> str:
        d = {k: getattr(self, k) for k in ("passkey_trials", "passkey_answer_tokens", "capacity_fraction")}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# The plan: which (family, level) cells, and their method configs
# ---------------------------------------------------------------------------------------------

def wanted(settings: Settings, family: str) -> bool:
    if settings.methods is None:
        return family != "saap-clf" or settings.classifier is not None
    names = set(settings.methods)
    if family == "saap-clf" and settings.classifier is None:
        return False
    return family in names or FAMILIES[family] in names or family == "full"


def level_name(s: float) -> str:
    return f"s{s:g}"


def plan(settings: Settings, levels=None) -> list[tuple[str, str]]:
    """(family, level) cells in run order: full, the Squeezed family (sets matched budgets), the rest."""
    levels = settings.levels if levels is None else levels
    cells = [("full", "-")]
    for fam in ("squeezed", "squeezed+sink1", "squeezed+token", "squeezed+sink1+token"):
        cells += [(fam, level_name(s)) for s in levels]
    for fam, sink in (("hsqueezed", 0), ("hsqueezed+sink1", 1)):
        if sink in settings.hier_sinks:
            cells += [(fam, level_name(s)) for s in settings.hier_levels if s in levels]
    for fam in MATCHED:
        lv = levels if fam != "streaming" or settings.streaming_levels is None else \
            [s for s in levels if s in settings.streaming_levels]
        cells += [(fam, level_name(s)) for s in lv]
    for fam in ("saap-nc", "saap-clf"):
        cells += [(fam, f"p{p}") for p in settings.saap_probes]
    return [c for c in cells if wanted(settings, c[0])]


def _ceil(x: float, step: float) -> float:
    return math.ceil(x / step - 1e-9) * step


def matched_fraction(family: str, frac: float, length: int) -> float:
    """A baseline's budget parameter for a measured Squeezed token fraction (rounded up)."""
    if family == "quest":
        pages = math.ceil(frac * length / 16 - 1e-9)
        return min(1.0, pages * 16 / length)
    return min(1.0, round(_ceil(frac, 1e-4), 4))


def nominal_fraction(s: float, length: int, n_obs: int = 100) -> float:
    return ((1 - s) * (length - n_obs) + n_obs) / length


def make_method(family: str, level: str, settings: Settings, matched: dict | None = None, length: int = 0):
    """The method config of one cell. matched: level -> measured Squeezed token fraction."""
    from sqjax.methods import Full, HierarchicalSqueezed, Oracle, Quest, Saap, SnapKV, Squeezed, StreamingLLM

    if family == "full":
        return Full()
    if family.startswith("saap"):
        p = int(level[1:])
        return Saap(probes=p, classifier=settings.classifier if family == "saap-clf" else None)
    s = float(level[1:])
    sink = 1 if "+sink1" in family else 0
    if family.startswith("squeezed"):
        # +token: decode steps select with thresholds calibrated on single queries
        return Squeezed(sparsity=s, n_sink=sink, capacity_fraction=settings.capacity_fraction,
                        decode_calibration="token" if family.endswith("+token") else "window",
                        lookup_int8=settings.lookup_int8)
    if family.startswith("hsqueezed"):
        return HierarchicalSqueezed(sparsity=s, n_sink=sink, capacity_fraction=settings.capacity_fraction,
                                    level1_prune=settings.hier_level1_prune, lookup_int8=settings.lookup_int8)
    frac = (matched or {}).get(level)
    if frac is None:
        frac = nominal_fraction(s, length)
    b = matched_fraction(family, frac, length)
    return {"quest": lambda: Quest(budget=b), "snapkv": lambda: SnapKV(budget=b),
            "streaming": lambda: StreamingLLM(budget=b), "oracle": lambda: Oracle(budget=b)}[family]()


# ---------------------------------------------------------------------------------------------
# Resumable store
# ---------------------------------------------------------------------------------------------

class Store:
    """Finished cells, one JSON object per line; a rerun skips what is there."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[tuple, dict] = {}
        if path.exists():
            text = path.read_text()
            if text and not text.endswith("\n"):  # a torn last line: keep later appends on their own lines
                with open(path, "a") as f:
                    f.write("\n")
            for line in text.splitlines():
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a torn last line from an interrupted run
                    continue
                self.records[self.key(r)] = r

    @staticmethod
    def key(r: dict) -> tuple:
        return (r["kind"], r.get("setup"), r.get("doc"), r.get("family"), r.get("level"), r.get("trial"))

    def get(self, **k):
        return self.records.get(self.key(k))

    def add(self, r: dict) -> None:
        self.records[self.key(r)] = r
        with open(self.path, "a") as f:
            f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def of_kind(self, kind: str, setup: str) -> list[dict]:
        return [r for r in self.records.values() if r["kind"] == kind and r.get("setup") == setup]


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def _bar(total, desc, enabled, leave=False):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=leave, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _shapes(settings: Settings, q_len: int):
    from benchmarks.quality_engine import RunShapes

    block = -(-max(settings.continuation, q_len, 16) // 16) * 16
    need = block + max(settings.continuation, settings.answer_tokens)
    return RunShapes(block=block, cache=-(-need // 64) * 64)


def doc_tokens(model, doc: Document) -> np.ndarray:
    return np.asarray(model.tokenizer.encode(doc.text, add_bos=None), np.int32)


def evaluate_documents(model, docs: list[Document], settings: Settings, store: Store, *, progress=True,
                       log=print, counter=None) -> list[dict]:
    """Run every planned cell of every document (skipping finished ones). Returns the docs' facts."""
    from benchmarks.quality_engine import ClusterMemo, compute_reference, evaluate_cell
    from sqjax.fixed_context import FixedContext

    setup = settings.setup_key()
    facts = []
    cells = plan(settings)
    for doc in _iter(docs, "documents", progress):
        ids = doc_tokens(model, doc)
        n_ctx = min(settings.context_tokens, len(ids) - settings.continuation - 1)
        limit = model.config.max_position_embeddings
        if n_ctx < 200:
            log(f"skipping {doc.name}: {len(ids)} tokens is too short for a fixed context + "
                f"{settings.continuation}-token continuation")
            continue
        facts.append({"name": doc.name, "kind": doc.kind, "source": doc.source, "sha256": doc.sha256,
                      "tokens": int(len(ids)), "context_tokens": int(n_ctx)})
        def done(c):
            r = store.get(kind="cell", setup=setup, doc=doc.name, family=c[0], level=c[1])
            return r is not None and r.get("doc_sha256") == doc.sha256

        todo = [c for c in cells if not done(c)]
        if not todo:
            continue
        log(f"{doc.name}: {len(ids)} tokens, fixed context {n_ctx}, {len(todo)} cells to run")
        t0 = time.perf_counter()
        full_ctx = FixedContext.build(model, doc.text, make_method("full", "-", settings), chat=False, truncate=True,
                                      reserve=limit - n_ctx, progress=progress)
        if not np.array_equal(full_ctx.doc_ids, ids[:n_ctx]):
            raise RuntimeError(f"{doc.name}: the fixed context's tokens differ from the document's first tokens")
        prefill_s = time.perf_counter() - t0
        cont = ids[n_ctx:n_ctx + settings.continuation + 1]
        q_ids = model.tokenizer.encode("\n\nQuestion: " + doc.question + "\nAnswer:", add_bos=False)
        shapes = _shapes(settings, len(q_ids))
        bar = _bar(settings.continuation, f"{doc.name} full", progress)
        ref = compute_reference(full_ctx, cont, q_ids, settings.answer_tokens, shapes, progress=bar)
        bar.close()
        _trim_jit_caches(force=True)  # a new document: the previous one's compilations are done with
        facts[-1]["answer_full"] = model.tokenizer.decode(list(ref.answer))
        facts[-1]["prefill_seconds"] = prefill_s
        with ClusterMemo():
            for family, level in _iter(todo, doc.name, progress):
                matched = {r["level"]: r["budget"]["decode"]["token_fraction"]
                           for r in store.of_kind("cell", setup)
                           if r["doc"] == doc.name and r["family"] == MATCH_SOURCE
                           and r.get("doc_sha256") == doc.sha256}
                method = make_method(family, level, settings, matched, n_ctx)
                t1 = time.perf_counter()
                ctx = full_ctx.with_method(method)
                build_s = time.perf_counter() - t1
                bar = _bar(settings.continuation, f"{method.label} decode", progress)
                rec = evaluate_cell(ctx, ref, shapes, attention=settings.attention,
                                    attention_stride=settings.attention_stride, progress=bar)
                bar.close()
                rec.update(kind="cell", setup=setup, doc=doc.name, doc_sha256=doc.sha256, family=family, level=level,
                           label=method.label,
                           params={f.name: getattr(method, f.name) for f in dataclasses.fields(method)},
                           expected_budget=method.expected_budget(n_ctx), build_seconds=build_s,
                           context_tokens=n_ctx, info=_small_info(ctx.info))
                store.add(rec)
                if counter is not None:
                    counter.append((doc.name, family, level))
                _trim_jit_caches()
                log(f"  {method.label:>22}: budget {rec['budget']['decode']['kv_budget']:.3f} "
                    f"(tokens {rec['budget']['decode']['token_fraction']:.3f}) KL dec {rec['decode']['kl_mean']:.4f} "
                    f"pre {rec['prefill']['kl_mean']:.4f} Δppl {rec['decode']['dppl_pct']:+.2f}% "
                    f"top1 {rec['decode']['top1']:.3f} [{rec['seconds']:.0f}s]")
    return facts


def _trim_jit_caches(limit: int = 30000, force: bool = False) -> None:
    """Drop JAX's in-memory compilation caches when the process holds many memory maps.

    Every compiled XLA:CPU executable maps memory; a long run compiles hundreds (one model
    forward per method config and shape) and reaches the kernel's vm.max_map_count (65530
    by default), where LLVM fails with "Cannot allocate memory" and the process dies.
    Recompiling afterwards mostly reads the persistent compilation cache.
    """
    try:
        with open("/proc/self/maps") as f:
            n = sum(1 for _ in f)
    except OSError:
        n = 0
    if force or n > limit:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def _small_info(info: dict) -> dict:
    return {k: v for k, v in info.items() if not isinstance(v, list) or len(v) < 64}


def _iter(items, desc, progress):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, leave=False, disable=not progress, file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# Pass key
# ---------------------------------------------------------------------------------------------

def _passkey_answer(ctx, q_ids, n_new: int, shapes):
    """Greedy answer (block + decode) and the decode lookups' measured budget."""
    import jax.numpy as jnp

    from benchmarks.quality_engine import Runner, budget_summary, run_lookups, share_compilation

    run = Runner(share_compilation(ctx), shapes)
    logits, cache, _, _ = run.block(q_ids)
    out = [int(jnp.argmax(logits[-1]))]
    stop = set(ctx.model.tokenizer.eos_ids)
    lg, cache, q, q_pre = run.decode([out[-1]], ctx.n_tokens + len(q_ids), cache)
    qs, qps = [q], [q_pre]
    pos = ctx.n_tokens + len(q_ids) + 1
    while len(out) < n_new and out[-1] not in stop:
        out.append(int(jnp.argmax(lg[-1])))
        if len(out) == n_new or out[-1] in stop:
            break
        lg, cache, q, q_pre = run.decode([out[-1]], pos, cache)
        qs.append(q)
        qps.append(q_pre)
        pos += 1
    rep, _ = run_lookups(ctx, jnp.concatenate(qs, axis=2), jnp.concatenate(qps, axis=2), per_token=True)
    return out, budget_summary(rep, ctx.n_tokens)


def evaluate_passkey(model, settings: Settings, store: Store, *, progress=True, log=print, counter=None) -> dict:
    """Full attention over the lengths (stop at the first with no success), then every method at
    the longest lengths where full attention succeeds."""
    from benchmarks.quality_engine import ClusterMemo, RunShapes
    from sqjax.fixed_context import FixedContext

    setup = settings.passkey_key()
    tok = model.tokenizer
    count = lambda t: len(tok.encode(FixedContext._split_template(model, t, True)[0], add_bos=False))  # noqa: E731
    shapes = RunShapes(block=32, cache=64)
    rates = {}
    prompts_at = {}
    for length in settings.passkey_lengths:
        prompts = passkey_prompts(length, settings.passkey_trials, count)
        prompts_at[length] = prompts
        for i, p in enumerate(_iter(prompts, f"pass key full @{length}", progress)):
            if store.get(kind="passkey", setup=setup, doc=f"passkey@{length}", family="full", level="-", trial=i):
                continue
            ctx = FixedContext.build(model, p.text, make_method("full", "-", settings), chat=True)
            q_ids = ctx._question_ids(PASSKEY_QUESTION)
            out, budget = _passkey_answer(ctx, q_ids, settings.passkey_answer_tokens, shapes)
            text = tok.decode(out)
            store.add({"kind": "passkey", "setup": setup, "doc": f"passkey@{length}", "family": "full", "level": "-",
                       "trial": i, "length": ctx.n_tokens, "target": length, "key": p.key, "depth": p.depth,
                       "answer": text, "success": p.key in text, "budget": budget, "label": "full"})
            if counter is not None:
                counter.append((f"passkey@{length}", "full", i))
        recs = [store.get(kind="passkey", setup=setup, doc=f"passkey@{length}", family="full", level="-", trial=i)
                for i in range(len(prompts))]
        rates[length] = float(np.mean([r["success"] for r in recs]))
        log(f"pass key, full attention, ~{length} tokens: {rates[length]:.0%} ({recs[0]['length']} tokens)")
        if rates[length] == 0.0 and settings.passkey_success > 0:
            break  # longer prompts will not do better
    ok = [length for length, r in rates.items() if r >= settings.passkey_success]
    eval_lengths = ok[-settings.passkey_eval_lengths:] if settings.passkey_eval_lengths > 0 else []
    levels = settings.passkey_levels or settings.levels
    cells = [c for c in plan(settings, levels) if c[0] != "full"]
    for length in eval_lengths:
        doc = f"passkey@{length}"
        prompts = prompts_at[length]
        # phase A: the Squeezed family (sets the matched budget: mean over the trials of this length),
        # phase B: everything else
        phases = [[c for c in cells if c[0].startswith(("squeezed", "hsqueezed"))],
                  [c for c in cells if not c[0].startswith(("squeezed", "hsqueezed"))]]
        for phase in phases:
            matched = _passkey_matched(store, setup, doc)
            for i, p in enumerate(_iter(prompts, f"pass key methods @{length}", progress)):
                todo = [c for c in phase if store.get(kind="passkey", setup=setup, doc=doc, family=c[0],
                                                      level=c[1], trial=i) is None]
                if not todo:
                    continue
                full_ctx = FixedContext.build(model, p.text, make_method("full", "-", settings), chat=True)
                q_ids = full_ctx._question_ids(PASSKEY_QUESTION)
                with ClusterMemo():
                    for family, level in todo:
                        method = make_method(family, level, settings, matched, full_ctx.n_tokens)
                        ctx = full_ctx.with_method(method)
                        out, budget = _passkey_answer(ctx, q_ids, settings.passkey_answer_tokens, shapes)
                        text = tok.decode(out)
                        store.add({"kind": "passkey", "setup": setup, "doc": doc, "family": family, "level": level,
                                   "trial": i, "length": full_ctx.n_tokens, "target": length, "key": p.key,
                                   "depth": p.depth, "answer": text, "success": p.key in text, "budget": budget,
                                   "label": method.label})
                        if counter is not None:
                            counter.append((doc, family, level, i))
                        _trim_jit_caches()
    return {"full_success": rates, "eval_lengths": eval_lengths}


def _passkey_matched(store: Store, setup: str, doc: str) -> dict:
    by = defaultdict(list)
    for r in store.of_kind("passkey", setup):
        if r["doc"] == doc and r["family"] == MATCH_SOURCE:
            by[r["level"]].append(r["budget"]["token_fraction"])
    return {lv: float(np.mean(v)) for lv, v in by.items()}


# ---------------------------------------------------------------------------------------------
# Aggregation and report
# ---------------------------------------------------------------------------------------------

FAMILY_ORDER = ["full", "squeezed", "squeezed+sink1", "squeezed+token", "squeezed+sink1+token", "hsqueezed", "hsqueezed+sink1", "quest", "snapkv", "oracle",
                "streaming", "saap-nc", "saap-clf"]


def _level_key(level: str):
    if level == "-":
        return (0, 0.0)
    return (1 if level.startswith("s") else 2, -float(level[1:]) if level.startswith("s") else float(level[1:]))


def aggregate(records: list[dict]) -> list[dict]:
    """Mean over documents of every (family, level)."""
    groups = defaultdict(list)
    for r in records:
        groups[(r["family"], r["level"])].append(r)
    rows = []
    for (fam, level), rs in groups.items():
        def m(path):
            vals = []
            for r in rs:
                x = r
                for p in path:
                    x = x.get(p) if isinstance(x, dict) else None
                    if x is None:
                        break
                if x is not None:
                    vals.append(x)
            return float(np.mean(vals)) if vals else float("nan")

        def pooled_p95(mode):
            toks = [t for r in rs for t in r.get(mode, {}).get("kl_tokens", [])]
            return float(np.percentile(toks, 95)) if toks else float("nan")

        def per_layer(mode, key):
            arrs = [r["attention"][mode][key] for r in rs if r.get("attention", {}).get(mode)]
            return np.mean(arrs, axis=0).tolist() if arrs else []

        row = {"family": fam, "level": level, "n_docs": len(rs), "labels": sorted({r["label"] for r in rs})}
        for mode in ("decode", "prefill"):
            row[mode] = {
                "kv_budget": m(("budget", mode, "kv_budget")), "token_fraction": m(("budget", mode, "token_fraction")),
                "bytes_moved": m(("budget", mode, "bytes_moved")), "kl_mean": m((mode, "kl_mean")),
                "kl_p95": pooled_p95(mode), "dppl_pct": m((mode, "dppl_pct")), "top1": m((mode, "top1")),
            }
            rl, el = per_layer(mode, "recall_per_layer"), per_layer(mode, "err_per_layer")
            row[mode]["attention"] = {
                "recall_mean": m(("attention", mode, "recall_mean")), "err_mean": m(("attention", mode, "err_mean")),
                "recall_min_layer": float(min(rl)) if rl else float("nan"),
                "recall_min_layer_id": int(np.argmin(rl)) if rl else -1,
                "err_max_layer": float(max(el)) if el else float("nan"),
                "err_max_layer_id": int(np.argmax(el)) if el else -1,
                "recall_per_layer": rl, "err_per_layer": el,
            }
        row["question"] = {"kl_mean": m(("question", "kl_mean")), "top1": m(("question", "top1")),
                           "kl_p95": pooled_p95("question")}
        row["expected_budget"] = m(("expected_budget",))
        rows.append(row)
    rows.sort(key=lambda r: (FAMILY_ORDER.index(r["family"]) if r["family"] in FAMILY_ORDER else 99,
                             _level_key(r["level"])))
    return rows


def head_to_head(records: list[dict], a: str, b: str, mode: str = "decode") -> list[dict]:
    """Per level: on how many documents family `a` has a lower KL than `b` (same document, matched budget)."""
    by = {(r["doc"], r["family"], r["level"]): r for r in records}
    out = []
    levels = sorted({r["level"] for r in records if r["family"] == a}, key=_level_key)
    for lv in levels:
        pairs = [(by[(d, a, lv)], by[(d, b, lv)]) for (d, f, l) in by if f == a and l == lv and (d, b, lv) in by]
        if not pairs:
            continue
        wins = sum(x[mode]["kl_mean"] < y[mode]["kl_mean"] for x, y in pairs)
        ratio = float(np.exp(np.mean([np.log(max(x[mode]["kl_mean"], 1e-12) / max(y[mode]["kl_mean"], 1e-12))
                                      for x, y in pairs])))
        out.append({"a": a, "b": b, "level": lv, "mode": mode, "docs": len(pairs), "a_wins": wins,
                    "kl_ratio_geomean": ratio})
    return out


def passkey_summary(records: list[dict]) -> list[dict]:
    """Success rate per (prompt length, method), overall and on the trials full attention gets right."""
    groups = defaultdict(list)
    full_ok = {}
    for r in records:
        groups[(r["doc"], r["family"], r["level"])].append(r)
        if r["family"] == "full":
            full_ok[(r["doc"], r["trial"])] = r["success"]
    rows = []
    for (doc, fam, lv), rs in groups.items():
        cond = [r["success"] for r in rs if full_ok.get((doc, r["trial"]))]
        rows.append({"doc": doc, "length": rs[0]["length"], "family": fam, "level": lv, "trials": len(rs),
                     "success": float(np.mean([r["success"] for r in rs])),
                     "success_where_full_succeeds": float(np.mean(cond)) if cond else float("nan"),
                     "n_full_succeeds": len(cond),
                     "kv_budget": float(np.mean([r["budget"]["kv_budget"] for r in rs])),
                     "token_fraction": float(np.mean([r["budget"]["token_fraction"] for r in rs])),
                     "labels": sorted({r["label"] for r in rs}),
                     "answers": [r["answer"] for r in rs][:3]})
    rows.sort(key=lambda r: (r["length"], FAMILY_ORDER.index(r["family"]) if r["family"] in FAMILY_ORDER else 99,
                             _level_key(r["level"])))
    return rows


def _fmt(x, nd=4):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def per_document_lines(records: list[dict]) -> list[str]:
    """Decode KL / measured KV budget of every family on every document, one table per level."""
    docs = sorted({r["doc"] for r in records})
    by = {(r["doc"], r["family"], r["level"]): r for r in records}
    levels = sorted({r["level"] for r in records if r["level"].startswith("s")}, key=_level_key)
    fams = [f for f in FAMILY_ORDER if any(r["family"] == f for r in records)]
    lines = ["", "## Per document (decode KL, nats/token / measured KV budget)", ""]
    for lv in levels:
        lines += [f"**{lv}**", "", "| method | " + " | ".join(docs) + " |", "|---" * (len(docs) + 1) + "|"]
        for f in fams:
            cells = [by.get((d, f, lv)) for d in docs]
            if not any(cells):
                continue
            lines.append(f"| {f} | " + " | ".join(
                f"{c['decode']['kl_mean']:.4f} / {c['budget']['decode']['kv_budget']:.3f}" if c else "–" for c in cells) + " |")
        lines.append("")
    return lines


def write_table(path: Path, rows: list[dict], h2h: list[dict], pk: list[dict], meta: dict,
                per_doc: list[str] | None = None) -> str:
    from sqjax.index_io import write_text_atomic

    lines = [f"# Quality at matched KV budgets — {meta['model']}", "",
             f"{meta['n_docs']} documents ({', '.join(meta['docs'])}); fixed context {meta['context_tokens']} tokens; "
             f"scored continuation {meta['continuation']} tokens; question answer {meta['answer_tokens']} tokens. "
             "KL = KL(full ‖ method) in nats/token (mean over documents; p95 pooled over tokens); Δppl in %; "
             "top-1 = agreement of the argmax with full attention. **KV budget** = measured (K/V rows + metadata rows "
             "read) / (whole fixed context's K and V), dense layers count 1. Matched baselines (QUEST, SnapKV, "
             "StreamingLLM, oracle) at level sX get the fraction of fixed-context tokens that Squeezed@X (no sink) "
             "read in decode mode on the same document (QUEST rounded up to 16-token pages; its page bounds and two "
             "dense layers add to its budget, as in the paper's Table 2).", "",
             "## Decode (generation regime: one lookup per token)", "",
             "| method | level | KV budget | tokens read | KL mean | KL p95 | Δppl % | top-1 | question KL | question top-1 | bytes/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["decode"]
        lines.append(f"| {r['family']} | {r['level']} | {_fmt(d['kv_budget'], 3)} | {_fmt(d['token_fraction'], 3)} | "
                     f"{_fmt(d['kl_mean'])} | {_fmt(d['kl_p95'])} | {_fmt(d['dppl_pct'], 2)} | {_fmt(d['top1'], 3)} | "
                     f"{_fmt(r['question']['kl_mean'])} | {_fmt(r['question']['top1'], 3)} | "
                     f"{d['bytes_moved'] / 1e6:.2f} MB |")
    lines += ["", "## Prefill (the continuation as one block: one lookup for the block)", "",
              "Squeezed variants look up once for the whole block; the other methods select per token in "
              "both modes (QUEST per sample, as in the Squeezed Attention paper's App. F), so their rows "
              "repeat the decode rows.", "",
              "| method | level | KV budget | tokens read | KL mean | KL p95 | Δppl % | top-1 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["prefill"]
        lines.append(f"| {r['family']} | {r['level']} | {_fmt(d['kv_budget'], 3)} | {_fmt(d['token_fraction'], 3)} | "
                     f"{_fmt(d['kl_mean'])} | {_fmt(d['kl_p95'])} | {_fmt(d['dppl_pct'], 2)} | {_fmt(d['top1'], 3)} |")
    lines += ["", "## Attention level (full attention's queries; per layer and query head, summarised)", "",
              "Recall = true softmax mass (over the fixed context) on the keys read; error = ‖o − o_full‖/‖o_full‖ of "
              "the attention output over fixed context ∪ the input's own keys. Worst layer in parentheses.", "",
              "| method | level | decode recall | decode recall, min layer | decode err | decode err, max layer | "
              "prefill recall | prefill recall, min layer | prefill err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["decode"]["attention"], r["prefill"]["attention"]
        lines.append(f"| {r['family']} | {r['level']} | {_fmt(a['recall_mean'], 3)} | {_fmt(a['recall_min_layer'], 3)} "
                     f"(L{a['recall_min_layer_id']}) | {_fmt(a['err_mean'], 3)} | {_fmt(a['err_max_layer'], 3)} "
                     f"(L{a['err_max_layer_id']}) | {_fmt(b['recall_mean'], 3)} | {_fmt(b['recall_min_layer'], 3)} "
                     f"(L{b['recall_min_layer_id']}) | {_fmt(b['err_mean'], 3)} |")
    if h2h:
        lines += ["", "## Head to head at matched budgets (per document)", "",
                  "| A | B | level | mode | docs where A's KL < B's | geomean KL(A)/KL(B) |", "|---|---|---|---|---|---|"]
        for h in h2h:
            lines.append(f"| {h['a']} | {h['b']} | {h['level']} | {h['mode']} | {h['a_wins']}/{h['docs']} | "
                         f"{h['kl_ratio_geomean']:.2f} |")
    lines += per_doc or []
    if pk:
        lines += ["", "## Pass-key retrieval (greedy answer contains the key)", "",
                  "| prompt | tokens | method | level | success (trials) | success where full attention succeeds | "
                  "KV budget | tokens read |", "|---|---|---|---|---|---|---|---|"]
        for r in pk:
            cond = "–" if math.isnan(r["success_where_full_succeeds"]) else \
                f"{r['success_where_full_succeeds']:.0%} ({r['n_full_succeeds']})"
            lines.append(f"| {r['doc']} | {r['length']} | {r['family']} | {r['level']} | "
                         f"{r['success']:.0%} ({r['trials']}) | {cond} | {_fmt(r['kv_budget'], 3)} | "
                         f"{_fmt(r['token_fraction'], 3)} |")
    text = "\n".join(lines) + "\n"
    write_text_atomic(path, text)
    return text


def plot(out: Path, rows: list[dict], records: list[dict]) -> list[str]:
    import matplotlib

    from sqjax.index_io import write_figure_atomic

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fams = [f for f in FAMILY_ORDER if f != "full" and any(r["family"] == f for r in rows)]
    style = {f: dict(marker="osDv^<>ph*x"[i % 11]) for i, f in enumerate(fams)}
    for metric, fname, ylabel, logy in (("kl_mean", "kl_vs_budget.png", "next-token KL vs full (nats/token)", True),
                                        ("dppl_pct", "dppl_vs_budget.png", "Δ perplexity (%)", False)):
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, mode in zip(axes, ("decode", "prefill")):
            for f in fams:
                pts = sorted((r[mode]["kv_budget"], r[mode][metric]) for r in rows if r["family"] == f)
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ys = [max(y, 1e-6) for y in ys] if logy else ys
                ax.plot(xs, ys, label=f, **style[f])
            ax.set_xlabel(f"measured KV budget ({mode}; incl. metadata)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{mode} mode" + (" (generation: one lookup per token)" if mode == "decode" else
                                            " (continuation as one block)"))
            if logy:
                ax.set_yscale("log")
            else:
                ax.axhline(0, color="gray", lw=0.5)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{ylabel.split(' (')[0]} vs measured KV budget (mean over {len({r['doc'] for r in records})} documents)")
        fig.tight_layout()
        write_figure_atomic(fig, out / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    # per-layer breakdown at the most aggressive level
    levels = sorted({r["level"] for r in rows if r["level"].startswith("s")}, key=_level_key)
    if levels and any(r["decode"]["attention"]["recall_per_layer"] for r in rows):
        lv = levels[0]  # the most aggressive (levels sort from the highest sparsity)
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for f in ("squeezed", "squeezed+sink1", "hsqueezed+sink1", "quest", "oracle", "snapkv"):
            r = next((r for r in rows if r["family"] == f and r["level"] == lv), None)
            if r is None or not r["decode"]["attention"]["recall_per_layer"]:
                continue
            a = r["decode"]["attention"]
            axes[0].plot(a["recall_per_layer"], label=f"{f} ({r['decode']['kv_budget']:.3f})", **style.get(f, {}))
            axes[1].plot([e if e > 0 else np.nan for e in a["err_per_layer"]], label=f, **style.get(f, {}))
        axes[0].set_ylabel("attention-mass recall (decode)")
        axes[1].set_ylabel("relative attention-output error (decode)")
        if any(min(r["decode"]["attention"]["err_per_layer"] or [0]) > 0 for r in rows):
            axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xlabel("layer")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"per-layer breakdown at level {lv} (mean over documents and heads; legend: measured KV budget)")
        fig.tight_layout()
        write_figure_atomic(fig, out / "per_layer.png", dpi=110)
        plt.close(fig)
        files.append("per_layer.png")
    return files


def report(out: Path, store: Store, settings: Settings, meta: dict) -> dict:
    from sqjax.index_io import write_text_atomic

    records = store.of_kind("cell", settings.setup_key())
    docs = [d["name"] for d in meta.get("documents", [])]
    if docs:
        records = [r for r in records if r["doc"] in docs]
    rows = aggregate(records)
    h2h = []
    for a in ("squeezed", "squeezed+sink1", "squeezed+token", "squeezed+sink1+token", "hsqueezed", "hsqueezed+sink1"):
        for mode in ("decode", "prefill"):
            h2h += head_to_head(records, a, "quest", mode)
    pk_records = store.of_kind("passkey", settings.passkey_key())
    pk = passkey_summary(pk_records) if settings.passkey else []
    tmeta = {"model": meta.get("model"), "n_docs": len({r["doc"] for r in records}),
             "docs": sorted({r["doc"] for r in records}), "context_tokens": settings.context_tokens,
             "continuation": settings.continuation, "answer_tokens": settings.answer_tokens}
    table = write_table(out / "table.md", rows, h2h, pk, tmeta, per_document_lines(records))
    plots = plot(out, rows, records) if rows else []
    metrics = {"summary": rows, "head_to_head": h2h, "passkey": pk,
               "per_document": [{k: r.get(k) for k in ("doc", "family", "level", "label", "budget", "decode", "prefill",
                                                       "question", "expected_budget", "seconds")}
                                | {"attention": {m: {k: v for k, v in a.items() if not k.endswith("per_head")}
                                                 for m, a in r.get("attention", {}).items()}}
                                for r in sorted(records, key=lambda r: (r["doc"], r["family"], r["level"]))]}
    for r in metrics["per_document"]:
        for mode in ("decode", "prefill", "question"):
            if r.get(mode):
                r[mode] = {k: v for k, v in r[mode].items() if k != "kl_tokens"}
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=1, default=float))
    return {"table": table, "plots": plots, "rows": rows, "head_to_head": h2h, "passkey": pk}


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def read_old_config(path: Path) -> dict:
    """The previous invocation's config.json, or {} if there is none.

    An unreadable or unparsable one (e.g. torn by an interrupted run from before config.json was
    written atomically) is treated as missing: it only carries the running wall-time total, which
    then restarts from this invocation, and it is rewritten below.
    """
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):  # missing, unreadable or torn
        return {}
    if not isinstance(old, dict):
        return {}
    if not isinstance(old.get("wall_seconds_total", 0.0), (int, float)):
        old.pop("wall_seconds_total")
    return old


def check_out_dir(out: Path) -> None:
    """Fail early (before the model loads) if `out` cannot be the output directory."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"-o {out} is a file; give a directory (it is created if missing)")
    for parent in out.parents:  # the nearest existing ancestor must be a directory
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"-o {out}: {parent} is a file; give a directory path")
            break


def run(model, docs: list[Document], settings: Settings, out: Path, *, progress=True, log=print) -> dict:
    """Evaluate (resumably) and write the report. Returns {"computed": [...], "report": ...}."""
    from sqjax.index_io import write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    store = Store(out / "cells.jsonl")
    computed = []
    t0 = time.perf_counter()
    facts = evaluate_documents(model, docs, settings, store, progress=progress, log=log, counter=computed)
    pk_info = None
    if settings.passkey:
        pk_info = evaluate_passkey(model, settings, store, progress=progress, log=log, counter=computed)
    wall = time.perf_counter() - t0
    cfg_path = out / "config.json"
    old = read_old_config(cfg_path)
    import jax

    config = {
        "settings": dataclasses.asdict(settings), "setup_key": settings.setup_key(),
        "model": getattr(model, "name", "?"), "model_fingerprint": getattr(model, "fingerprint", None),
        "documents": facts, "plan": [list(c) for c in plan(settings)],
        "python": platform.python_version(), "jax": jax.__version__, "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "passkey": pk_info,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds_this_invocation": wall,
        "cells_computed_this_invocation": len(computed),
        "wall_seconds_total": old.get("wall_seconds_total", 0.0) + wall if computed else old.get("wall_seconds_total", wall),
    }
    write_text_atomic(cfg_path, json.dumps(config, indent=1, default=str))
    rep = report(out, store, settings, config | {"model": config["model"]})
    return {"computed": computed, "report": rep, "config": config}


def settings_from_args(args) -> Settings:
    kw = {}
    if getattr(args, "budgets", None):
        for b in args.budgets:
            b = float(b)
            # (the rounded sparsity too: a kept fraction within 1e-6 of 0 or 1 would round to s = 1 or 0)
            if not (math.isfinite(b) and 0.0 < b < 1.0 and 0.0 < round(1.0 - b, 6) < 1.0):
                raise ValueError(f"--budgets {b:g}: each budget is a kept fraction strictly between 0 and 1 "
                                 "(e.g. --budgets 0.3 0.2 0.1)")
        kw["levels"] = tuple(round(1.0 - float(b), 6) for b in args.budgets)
        kw["hier_levels"] = tuple(s for s in (0.9,) if s in kw["levels"]) or kw["levels"][-1:]
        kw["passkey_levels"] = kw["levels"]
    if getattr(args, "methods", None):
        bad = [m for m in args.methods if m not in METHOD_NAMES and m not in FAMILIES]
        if bad:
            raise ValueError(f"unknown method(s) {bad}; choose from {list(METHOD_NAMES)} or {sorted(FAMILIES)}")
        kw["methods"] = tuple(args.methods)
    if getattr(args, "classifier", None):
        from train_qclassifier.classifier import ClassifierFormatError, load_classifier

        try:   # files, format, checksum and shapes, before any model loads (the model's shapes: later)
            load_classifier(args.classifier)
        except ClassifierFormatError as e:
            raise ValueError(f"--classifier: {e}") from None
        kw["classifier"] = str(args.classifier)
    if getattr(args, "quick", False):
        kw.update(context_tokens=1024, continuation=32, answer_tokens=8, saap_probes=(8,),
                  passkey_lengths=(512,), passkey_trials=2)
        kw.setdefault("levels", (0.9,))
        kw.setdefault("hier_levels", (0.9,))
        kw.setdefault("passkey_levels", kw["levels"])   # --budgets' levels, else 0.9

    from sqjax._checks import check_count

    def count(option: str, v, lo: int = 1) -> int:
        check_count(f"--{option.replace('_', '-')}", v, lo)
        return v

    for name in ("context_tokens", "continuation", "answer_tokens", "passkey_trials", "passkey_eval_lengths"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = count(name, v, 0 if name == "passkey_eval_lengths" else 1)
    if getattr(args, "level1_prune", None) is not None:
        if not 0.0 < float(args.level1_prune) < 1.0:
            raise ValueError(f"--level1-prune must lie in (0, 1); got {args.level1_prune}")
        kw["hier_level1_prune"] = float(args.level1_prune)
    if getattr(args, "lookup_int8", False):
        kw["lookup_int8"] = True
    if getattr(args, "saap_probes", None):
        kw["saap_probes"] = tuple(count("saap_probes", p) for p in args.saap_probes)
    if getattr(args, "passkey_lengths", None):
        kw["passkey_lengths"] = tuple(count("passkey_lengths", x) for x in args.passkey_lengths)
    if getattr(args, "no_passkey", False):
        kw["passkey"] = False
    if getattr(args, "no_attention", False):
        kw["attention"] = False
    return Settings(**kw)


def main(args) -> int:
    """`sqjax eval` / `python -m benchmarks.quality`: returns an exit code."""
    import sqjax

    settings = settings_from_args(args)  # bad options fail here, before the model loads
    out = Path(getattr(args, "out", None) or DEFAULT_OUT)
    if getattr(args, "quick", False) and out == Path(DEFAULT_OUT):
        out = out / "quick"  # never mix a smoke run into the committed results
    check_out_dir(out)
    as_json = getattr(args, "json", False)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if as_json else (lambda *a: print(*a, flush=True))
    if getattr(args, "docs", None):
        docs = [file_document(p) for p in args.docs]
    else:
        docs = default_documents(1 if getattr(args, "quick", False) else getattr(args, "n_docs", None) or 5)
    model = sqjax.load_model(getattr(args, "model", None) or "smollm2-135m")
    res = run(model, docs, settings, out, progress=not getattr(args, "no_progress", False), log=log)
    if as_json:
        print(json.dumps({"out": str(out), "computed": len(res["computed"]), "summary": res["report"]["rows"],
                          "head_to_head": res["report"]["head_to_head"], "passkey": res["report"]["passkey"]},
                         default=float))
    else:
        print(res["report"]["table"])
        print(f"results in {out}/ ({len(res['computed'])} cells computed this run)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", nargs="*", default=None, help="text files (default: built-in pydoc pages + papers)")
    p.add_argument("--n-docs", type=int, default=None, help="how many built-in documents (default 5)")
    p.add_argument("--methods", nargs="*", default=None, help=f"subset of {', '.join(METHOD_NAMES)} (or family names)")
    p.add_argument("--budgets", nargs="*", type=float, default=None,
                   help="nominal kept fractions: Squeezed runs at sparsity 1 - b (default 0.3 0.2 0.1)")
    p.add_argument("--classifier", default=None, help="trained SAAP classifier directory (adds saap-clf rows)")
    p.add_argument("--quick", action="store_true", help="a small smoke run (1 document, short context)")
    p.add_argument("-o", "--out", default=DEFAULT_OUT)
    p.add_argument("--json", action="store_true")
    p.add_argument("--context-tokens", type=int, default=None)
    p.add_argument("--continuation", type=int, default=None)
    p.add_argument("--answer-tokens", type=int, default=None)
    p.add_argument("--saap-probes", nargs="*", type=int, default=None)
    p.add_argument("--level1-prune", type=float, default=None,
                   help="hierarchical rows: fraction of keys level 1 rules out on calibration (default 0.5)")
    p.add_argument("--lookup-int8", action="store_true",
                   help="Squeezed rows: block (prefill) lookups from int8 q and centroids (Squeezed.lookup_int8)")
    p.add_argument("--passkey-lengths", nargs="*", type=int, default=None)
    p.add_argument("--passkey-trials", type=int, default=None)
    p.add_argument("--passkey-eval-lengths", type=int, default=None)
    p.add_argument("--no-passkey", action="store_true")
    p.add_argument("--no-attention", action="store_true", help="skip attention-level metrics")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p


if __name__ == "__main__":
    _args = build_parser().parse_args()
    try:
        from sqjax.cli import _enable_compilation_cache

        _enable_compilation_cache()
        sys.exit(main(_args))
    except KeyboardInterrupt:
        print("quality: interrupted (finished cells are kept; rerun to resume)", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if _args.debug:
            raise
        print(f"quality: error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}",
              file=sys.stderr)
        sys.exit(2 if isinstance(e, (ValueError, FileNotFoundError, ImportError, OSError)) else 1)
