"""The measuring engine of the quality harness: run a method on a prefilled document, score it.

Everything is teacher-forced against full attention on the same prefilled document
(`FixedContext.with_method`, no new prefill), in three regimes:

- continuation, "prefill": the continuation's tokens as ONE sparse block (the method's block
  lookup: Squeezed averages Eq. 1 over the block — the paper's prefill of the user input);
- continuation, "decode": token by token, one lookup per token (the generation regime);
- question: the question as one sparse block, then the full-attention answer decoded token
  by token (what `FixedContext.ask` does), scored on the answer tokens.

Metrics (numpy, float64): next-token KL(full || method) per token, Δ perplexity (%), top-1
agreement with full attention. The KV budget is measured, not assumed: every lookup the run
made is re-run on the queries the run captured and summed with `sqjax.budget.account`.
Attention level (reference queries of full attention, so errors do not compound over
layers): true softmax mass on the retrieved keys (recall) and the relative error of the
attention output (fixed context ∪ the input's own causal keys), per layer and query head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from sqjax import squeezed as sq
from sqjax.attention import expand_heads, fixed_context_attention
from sqjax.baselines import true_attention
from sqjax.budget import account

# ---------------------------------------------------------------------------------------------
# Token-level metrics (numpy)
# ---------------------------------------------------------------------------------------------


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_per_token(ref_logits, logits) -> np.ndarray:
    """KL(p_ref || p) in nats for each row: Σ p_ref (log p_ref − log p)."""
    lr, lq = log_softmax(ref_logits), log_softmax(logits)
    return np.maximum(np.sum(np.exp(lr) * (lr - lq), axis=-1), 0.0)


def nll(logits, targets) -> np.ndarray:
    lp = log_softmax(logits)
    return -lp[np.arange(lp.shape[0]), np.asarray(targets)]


def delta_ppl_percent(ref_logits, logits, targets) -> float:
    """100 · (ppl(method) / ppl(full) − 1) over the targets."""
    return float(100.0 * np.expm1(np.mean(nll(logits, targets)) - np.mean(nll(ref_logits, targets))))


def top1_agreement(ref_logits, logits) -> float:
    return float(np.mean(np.argmax(np.asarray(ref_logits), -1) == np.argmax(np.asarray(logits), -1)))


def token_metrics(ref_logits, logits, targets) -> dict:
    kl = kl_per_token(ref_logits, logits)
    return {
        "kl_mean": float(kl.mean()), "kl_p95": float(np.percentile(kl, 95)),
        "dppl_pct": delta_ppl_percent(ref_logits, logits, targets),
        "top1": top1_agreement(ref_logits, logits),
        "nll": float(np.mean(nll(logits, targets))), "n": int(len(kl)),
        "kl_tokens": [round(float(x), 6) for x in kl],
    }


# ---------------------------------------------------------------------------------------------
# Running a context (teacher forcing, captures)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunShapes:
    """Static sizes shared by every method (one compilation of each forward per method)."""

    block: int = 128   # user-input blocks are left-padded to this many tokens
    cache: int = 256   # cache slots for the user input (block + decoded tokens)


class Runner:
    """Forward passes of one FixedContext with captured roped/de-roped queries."""

    def __init__(self, ctx, shapes: RunShapes):
        self.ctx = ctx
        self.shapes = shapes

    def new_cache(self):
        return self.ctx._new_cache(self.shapes.cache)

    def block(self, ids, cache=None):
        """One sparse block over `ids` (≤ shapes.block).  -> (logits [n, V], cache, q, q_pre [Lyr, Hq, n, d])."""
        ids = np.asarray(ids, np.int32)
        n = len(ids)
        if not 0 < n <= self.shapes.block:
            raise ValueError(f"block of {n} tokens; the harness pads blocks to {self.shapes.block}")
        padded = np.concatenate([np.full(self.shapes.block - n, -1, np.int32), ids])
        cache = self.new_cache() if cache is None else cache
        logits, cache, caps = self.ctx._run(padded, self.ctx.n_tokens, cache, capture=None)
        q = jnp.stack([jnp.swapaxes(c["q"][0, -n:], 0, 1) for c in caps])
        q_pre = jnp.stack([jnp.swapaxes(c["q_pre"][0, -n:], 0, 1) for c in caps])
        return logits[0, -n:], cache, q, q_pre

    def decode(self, ids, start_pos: int, cache=None, progress=None):
        """Token-by-token forward of `ids` from position `start_pos`.
        -> (logits [n, V], cache, q, q_pre [Lyr, Hq, n, d])."""
        cache = self.new_cache() if cache is None else cache
        rows, qs, qps = [], [], []
        for i, t in enumerate(np.asarray(ids, np.int32)):
            lg, cache, caps = self.ctx._run(np.asarray([t], np.int32), start_pos + i, cache, capture=1)
            rows.append(lg[0, -1])
            qs.append(jnp.stack([c["q"][0, 0] for c in caps]))        # [Lyr, Hq, d]
            qps.append(jnp.stack([c["q_pre"][0, 0] for c in caps]))
            if progress is not None:
                progress.update(1)
        return jnp.stack(rows), cache, jnp.stack(qs, axis=2), jnp.stack(qps, axis=2)

    def greedy(self, q_ids, n_new: int, stop_ids=()):
        """Greedy answer after a question block (full attention: the reference answer)."""
        logits, cache, _, _ = self.block(q_ids)
        out = [int(jnp.argmax(logits[-1]))]
        pos = self.ctx.n_tokens + len(q_ids)
        while len(out) < n_new and out[-1] not in stop_ids:
            lg, cache, _, _ = self.decode([out[-1]], pos, cache)
            out.append(int(jnp.argmax(lg[-1])))
            pos += 1
        return out


# ---------------------------------------------------------------------------------------------
# Lookups re-run outside the model: budget accounting and attention-level metrics
# ---------------------------------------------------------------------------------------------


def layer_index(index, i: int):
    """Layer i of a method's index, keeping a leading layer axis of size 1 (select with layer=0)."""
    if index is None:
        return None
    if isinstance(index, sq.SqueezedIndex):
        return dataclasses.replace(index, layers=jax.tree.map(lambda a: a[i:i + 1], index.layers))
    return jax.tree.map(lambda a: a[i:i + 1], index)


def _sparse(method):
    """The method with no dense layers: the harness handles dense layers itself, so that one
    compiled lookup serves every layer (layer-sliced index, layer=0)."""
    return dataclasses.replace(method, dense_layers=0) if method.dense_layers else method


@functools.partial(jax.jit, static_argnames=("method", "per_token", "metrics", "stride"))
def _layer_lookup(method, index_l, q, q_pre, k, v, k_new, v_new, q_pos, kv_pos, *, per_token: bool, metrics: bool,
                  stride: int = 1):
    """One layer's lookups for queries q [Hq, T, d] (per token, or one block lookup).

    Without `metrics`: rows, meta [Hs, T|1] of every lookup (no mask is materialised).
    With `metrics`: recall and relative output error [Hq], averaged over the query tokens
    q[:, ::stride] (a block lookup still selects with all T queries, as the run did).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])

    def per_token_select(qs, qps, with_mask):
        def one(qt, qpt):
            s = method.select(index_l, 0, qt[:, None], None if qpt is None else qpt[:, None], k)
            m = None if (s.mask is None or not with_mask) else s.mask[:, 0]
            return m, s.kv_rows[:, 0], s.meta_rows[:, 0]
        mask, rows, meta = jax.vmap(one, in_axes=(1, 1 if qps is not None else None))(qs, qps)
        return (None if mask is None else jnp.swapaxes(mask, 0, 1)), rows.T, meta.T  # [Hs, T, L], [Hs, T]

    if not metrics:
        if per_token:
            _, rows, meta = per_token_select(q, q_pre, False)
        else:
            s = method.select(index_l, 0, q, q_pre, k)
            rows, meta = s.kv_rows, s.meta_rows
        return {"rows": rows.astype(jnp.float32), "meta": meta.astype(jnp.float32)}

    qe = q[:, ::stride]
    qpe = None if q_pre is None else q_pre[:, ::stride]
    hq = q.shape[0]
    if per_token:
        mask, _, _ = per_token_select(qe, qpe, True)
    else:
        mask = method.select(index_l, 0, q, q_pre, k).mask  # [Hs, 1, L]; [Hs, T, L] for per-token methods
        if mask is not None and mask.shape[1] != 1:
            mask = mask[:, ::stride]
    if mask is None:
        return {"recall": jnp.ones((hq,), jnp.float32), "err": jnp.zeros((hq,), jnp.float32)}
    pos = q_pos[::stride]
    p = true_attention(qe, k, scale, "q")  # [Hq, T', L]
    m = jnp.broadcast_to(expand_heads(mask, hq), p.shape)
    recall = jnp.mean(jnp.sum(jnp.where(m, p, 0.0), axis=-1), axis=-1)
    o_ref = fixed_context_attention(qe, k, v, None, k_new, v_new, pos, kv_pos, scale)
    o = fixed_context_attention(qe, k, v, mask, k_new, v_new, pos, kv_pos, scale)
    err = jnp.linalg.norm(o - o_ref, axis=-1) / jnp.maximum(jnp.linalg.norm(o_ref, axis=-1), 1e-30)
    return {"recall": recall, "err": jnp.mean(err, axis=-1)}


@dataclasses.dataclass
class InputKeys:
    """The user input's own (roped) keys from the full-attention run, for attention outputs."""

    k: jax.Array     # [Lyr, Hkv, S, d]
    v: jax.Array
    kv_pos: jax.Array  # [S]
    q_pos: jax.Array   # [T]


def run_lookups(ctx, q, q_pre, *, per_token: bool, keys: InputKeys | None = None, stride: int = 1):
    """Re-run `ctx.method`'s lookup on captured queries q [Lyr, Hq, T, d], layer by layer.

    Without `keys`: the BudgetReport of every lookup (`sqjax.budget.account`).
    With `keys`: the attention-level metrics per layer and head, on every `stride`-th query
    (give the full-attention queries: recall and error then measure the selection alone).
    """
    method = ctx.method
    n_layers = q.shape[0]
    length = ctx.n_tokens
    sparse = _sparse(canonical(method))
    hq = q.shape[1]
    hs = method.selection_heads(hq, ctx.kv.k[0].shape[0])
    sels, recall, err = [], [], []
    zero = jnp.zeros((1, 1, 1))
    for layer in range(n_layers):
        dense = layer < method.dense_layers or method.name == "full"
        if keys is None:
            if dense:
                t = q.shape[2] if per_token else 1
                sels.append(_Sel(np.full((hs, t), length, np.float32), np.zeros((hs, t), np.float32)))
                continue
            out = _layer_lookup(sparse, layer_index(ctx.index, layer), q[layer],
                                None if q_pre is None else q_pre[layer], ctx.kv.k[layer], zero, zero, zero,
                                jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), per_token=per_token,
                                metrics=False)
            sels.append(_Sel(np.asarray(out["rows"]), np.asarray(out["meta"])))
            continue
        if dense:
            recall.append(np.ones(hq))
            err.append(np.zeros(hq))
            continue
        out = _layer_lookup(sparse, layer_index(ctx.index, layer), q[layer], None if q_pre is None else q_pre[layer],
                            ctx.kv.k[layer], ctx.kv.v[layer], keys.k[layer], keys.v[layer], keys.q_pos,
                            keys.kv_pos, per_token=per_token, metrics=True, stride=stride)
        recall.append(np.asarray(out["recall"], np.float64))
        err.append(np.asarray(out["err"], np.float64))
    if keys is not None:
        return None, attention_summary(np.stack(recall), np.stack(err))
    cfg = ctx.model.config
    rep = account(sels, length, cfg.head_dim, cfg.num_kv_heads, jnp.dtype(ctx.kv.dtype).itemsize)
    return rep, None


@dataclasses.dataclass
class _Sel:
    kv_rows: np.ndarray
    meta_rows: np.ndarray


def attention_summary(recall: np.ndarray, err: np.ndarray) -> dict:
    """recall/err [layers, Hq] -> mean, worst layer, per layer, per head."""
    rl, el = recall.mean(axis=1), err.mean(axis=1)
    return {
        "recall_mean": float(recall.mean()), "recall_min_layer": float(rl.min()), "recall_min_layer_id": int(rl.argmin()),
        "err_mean": float(err.mean()), "err_max_layer": float(el.max()), "err_max_layer_id": int(el.argmax()),
        "recall_per_layer": [round(float(x), 5) for x in rl], "err_per_layer": [round(float(x), 5) for x in el],
        "recall_per_head": np.round(recall, 4).tolist(), "err_per_head": np.round(err, 4).tolist(),
    }


def budget_summary(rep, length: int) -> dict:
    """KV budget (incl. metadata, dense layers = 1) and the fraction of fixed tokens read."""
    tok_frac = float(np.mean(rep.rows) / length)
    return {"kv_budget": float(rep.overall), "token_fraction": tok_frac, "bytes_moved": float(rep.bytes_moved),
            "bytes_dense": float(rep.bytes_dense), "kv_budget_per_layer": [round(float(x), 5) for x in rep.per_layer]}


# ---------------------------------------------------------------------------------------------
# A document's reference and one method's cell
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Reference:
    """Full attention on one document: logits of every regime, queries and input keys."""

    cont: np.ndarray           # continuation ids [n+1]; ids[1:] are scored
    q_ids: np.ndarray          # question ids
    answer: np.ndarray         # full attention's greedy answer ids
    prefill_logits: np.ndarray  # [n, V] predictions of cont[1:] (one block over cont[:-1])
    decode_logits: np.ndarray
    question_logits: np.ndarray  # [len(answer), V]
    q: jax.Array               # [Lyr, Hq, n, d] reference queries of the block over cont[:-1]
    q_pre: jax.Array
    keys: InputKeys


def compute_reference(full_ctx, cont, q_ids, n_answer: int, shapes: RunShapes, progress=None) -> Reference:
    run = Runner(full_ctx, shapes)
    n0 = full_ctx.n_tokens
    pre, cache, q, q_pre = run.block(cont[:-1])
    keys = InputKeys(*(x[:, 0] for x in cache.stacked()), cache.pos[0],
                     jnp.arange(n0, n0 + len(cont) - 1, dtype=jnp.int32))
    dec, _, _, _ = run.decode(cont[:-1], n0, progress=progress)
    answer = np.asarray(run.greedy(q_ids, n_answer, tuple(full_ctx.model.tokenizer.eos_ids)), np.int32)
    qlog = question_logits(run, q_ids, answer)
    return Reference(np.asarray(cont), np.asarray(q_ids), answer, np.asarray(pre), np.asarray(dec), qlog,
                     q, q_pre, keys)


def question_logits(run: Runner, q_ids, answer) -> np.ndarray:
    """Question as one block, then the answer teacher-forced token by token: logits [len(answer), V]."""
    logits, cache, _, _ = run.block(q_ids)
    rows = [logits[-1]]
    if len(answer) > 1:
        lg, _, _, _ = run.decode(answer[:-1], run.ctx.n_tokens + len(q_ids), cache)
        rows.extend(list(lg))
    return np.asarray(jnp.stack(rows))


def evaluate_cell(ctx, ref: Reference, shapes: RunShapes, *, attention: bool = True, attention_stride: int = 1,
                  progress=None) -> dict:
    """All metrics of `ctx.method` on one document against the reference (attention-level
    metrics on every `attention_stride`-th continuation token)."""
    t0 = time.perf_counter()
    times = {}

    def lap(name):
        nonlocal t0
        t = time.perf_counter()
        times[name] = round(t - t0, 2)
        t0 = t

    ctx = share_compilation(ctx)
    run = Runner(ctx, shapes)
    n0 = ctx.n_tokens
    targets = ref.cont[1:]
    rec: dict = {"budget": {}, "attention": {}}
    # continuation, one block
    pre, _, q_b, qp_b = run.block(ref.cont[:-1])
    rec["prefill"] = token_metrics(ref.prefill_logits, np.asarray(pre), targets)
    lap("block")
    rep, _ = run_lookups(ctx, q_b, qp_b, per_token=False)
    rec["budget"]["prefill"] = budget_summary(rep, n0)
    lap("block_lookups")
    # continuation, token by token
    dec, _, q_d, qp_d = run.decode(ref.cont[:-1], n0, progress=progress)
    rec["decode"] = token_metrics(ref.decode_logits, np.asarray(dec), targets)
    lap("decode")
    rep, _ = run_lookups(ctx, q_d, qp_d, per_token=True)
    rec["budget"]["decode"] = budget_summary(rep, n0)
    lap("decode_lookups")
    # question (block) + answer (decode)
    qlog = question_logits(run, ref.q_ids, ref.answer)
    rec["question"] = token_metrics(ref.question_logits, qlog, ref.answer)
    lap("question")
    # attention level on the reference queries
    if attention:
        for mode, per_token in (("decode", True), ("prefill", False)):
            _, summ = run_lookups(ctx, ref.q, ref.q_pre, per_token=per_token, keys=ref.keys, stride=attention_stride)
            rec["attention"][mode] = summ
        lap("attention")
    rec["times"] = times
    rec["seconds"] = float(sum(times.values()))
    return rec


#: config fields that only `build` reads (the lookup never does): a method that differs from
#: another only in these runs the very same computation at lookup time.
BUILD_ONLY = {
    "squeezed": {"sparsity": 0.5, "kmeans_iters": 25, "seed": 0, "centroid_fraction": 0.05, "n_centroids": None,
                 "decode_calibration": "window"},
    "hsqueezed": {"sparsity": 0.5, "kmeans_iters": 25, "seed": 0, "centroid_fraction": 0.05, "n_centroids": None,
                  "level1_fraction": 0.01, "level1_prune": 0.5, "decode_calibration": "window"},
    "snapkv": {"budget": 0.5, "window": 32, "kernel": 7, "pool": "max"},
}


def canonical(method):
    """`method` with its build-only fields at fixed values: equal lookups, one compilation.

    The model's forward is jitted with the method as a static argument, so Squeezed@0.7 and
    @0.9 would each compile the whole model although their lookups differ only in the
    (traced) threshold of the index. The harness runs every such method through one
    canonical config; `tests/test_quality_harness.py` checks the results are identical.
    """
    fields = BUILD_ONLY.get(method.name)
    return dataclasses.replace(method, **fields) if fields else method


def share_compilation(ctx):
    """The context with its attention hook running `canonical(ctx.method)` (same results)."""
    canon = canonical(ctx.method)
    if canon is not ctx.method and ctx._hook.method != canon:
        ctx._hook = dataclasses.replace(ctx._hook, method=canon)
    return ctx


# ---------------------------------------------------------------------------------------------
# Clustering reuse (a speed-up only: results are identical)
# ---------------------------------------------------------------------------------------------

class ClusterMemo:
    """Reuse one document's k-means across Squeezed configs that differ only in sparsity.

    `build_squeezed_index` clusters (independent of the sparsity) and then calibrates; this
    context manager memoizes `sqjax.squeezed.cluster_fixed_context` for the same key array
    and clustering settings, so Squeezed@0.7/0.8/0.9 cluster once.
    """

    def __init__(self):
        self._memo = {}
        self._orig = None

    def __enter__(self):
        self._orig = sq.cluster_fixed_context

        def memo(k, cfg):
            key = (id(k), tuple(k.shape), cfg.centroid_fraction, cfg.n_centroids, cfg.n_obs, cfg.n_sink,
                   cfg.hierarchical, cfg.level1_fraction, cfg.kmeans_iters, cfg.seed)
            if key not in self._memo:
                self._memo[key] = (k, self._orig(k, cfg))  # keep k alive: its id stays unique
            return self._memo[key][1]

        sq.cluster_fixed_context = memo
        return self

    def __exit__(self, *exc):
        sq.cluster_fixed_context = self._orig
        self._memo.clear()
        return False
