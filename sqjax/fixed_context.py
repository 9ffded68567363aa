"""The fixed-context workflow: index a document once, answer many questions against it.

    ctx = FixedContext.build(model, document, Squeezed(sparsity=0.9))   # prefill + cluster + calibrate
    answer = ctx.ask("question")          # sparse prefill of the question, sparse decode
    answer.stats                          # KV budget, bytes moved, time to first token, time/token
    ctx.save("doc.sqx"); ctx = FixedContext.load("doc.sqx", model)

The document's KV cache lives in the hook's state, once, one array per layer (`LayerKV`; with
Squeezed on a GPU also a cluster-sorted copy); every question runs `models.forward` with
`SparseAttentionHook` as the attention of each layer: the method selects fixed-context keys
from the roped queries, attention is exact over those keys (exact tail included) plus the
question's own causal keys, merged by log-sum-exp (`attention.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sqjax import dispatch, index_io
from sqjax._checks import check_seed
from sqjax.budget import account
from sqjax.methods import DEFAULT_SINK, ContextData, Full, Method, Saap, Squeezed, method_from_name
from sqjax.selection import Selection

_SENTINEL = "\u2063SQJAX-QUESTION\u2063"
_DOC_SENTINEL = "\u2063SQJAX-DOCUMENT\u2063"
_TURN = "\u2063SQJAX-TURN-{}\u2063"  # the i-th question or answer of a conversation
_BUCKET = 16  # question blocks are left-padded to a multiple of this (fewer compilations); see _block_length


class SqjaxError(ValueError):
    """A user-facing error: the message says what went wrong and what to do."""


def _check_text(what: str, text) -> None:
    """A document, question or text to score: a str with something in it."""
    if not isinstance(text, str):
        hint = " (decode it first)" if isinstance(text, (bytes, bytearray)) else ""
        raise SqjaxError(f"{what} must be a str; got {type(text).__name__}{hint}")
    if not text.strip():
        raise SqjaxError(f"{what} is empty: " + {"the document": "pass a text file with content",
                                                  "the text to score": "pass some text"}.get(what, "ask something"))


def _encode_user_text(tok, template: list[str], user: list[str], add_bos) -> list[int]:
    """Token ids of template text around user text (a document, questions, answers), interleaved
    template[0] user[0] template[1] ... user[-1] template[-1]: special tokens written in the
    template map to their ids, those written in user text stay text, so it cannot open or close a
    chat turn. (Text without them is encoded whole, as one string.)"""
    ids = tok.encode(template[0], add_bos=add_bos)
    for text, after in zip(user, template[1:], strict=True):
        ids += tok.encode(text, add_bos=False, special=False) + tok.encode(after, add_bos=False)
    return ids


def check_sampling(temperature, top_p, names: tuple[str, str] = ("temperature", "top_p")) -> None:
    """temperature a finite number >= 0 (0 = greedy), top_p in (0, 1]; errors call them `names`."""
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
        raise SqjaxError(f"{names[0]} must be a finite number >= 0 (0 = greedy); got {temperature!r}")
    if not (isinstance(top_p, numbers.Real) and 0 < top_p <= 1):
        raise SqjaxError(f"{names[1]} must lie in (0, 1]; got {top_p!r}")


def _check_history(history, what: str = "history") -> tuple[tuple[str, str], ...]:
    """A conversation's earlier turns: (question, answer) pairs of str, oldest first (an `Answer`
    is a str). Questions must say something; an answer may be empty (the model may stop at once)."""
    if history is None:
        return ()
    if isinstance(history, (str, bytes)) or not isinstance(history, (list, tuple)):
        raise SqjaxError(f"{what} must be a list of (question, answer) pairs; got {type(history).__name__}")
    turns = []
    for i, turn in enumerate(history, 1):
        if isinstance(turn, (str, bytes)) or not isinstance(turn, (list, tuple)) or len(turn) != 2:
            raise SqjaxError(f"{what}: turn {i} must be a (question, answer) pair; got {turn!r:.80}")
        q, a = turn
        _check_text(f"{what}: the question of turn {i}", q)
        if not isinstance(a, str):
            raise SqjaxError(f"{what}: the answer of turn {i} must be a str; got {type(a).__name__}")
        turns.append((str(q), str(a)))
    return tuple(turns)


def _check_system(model, system, chat: bool) -> None:
    """A system message is a str for a chat template that takes one, written without special tokens."""
    if system is None:
        return
    if not isinstance(system, str):
        raise SqjaxError(f"system must be a str (the system message) or None; got {type(system).__name__}")
    if not chat:
        raise SqjaxError("a system message needs the chat template: drop system, or keep chat=True (no --raw)")
    if model.tokenizer.has_special_text(system):
        raise SqjaxError(f"the system message writes out special tokens (such as {model.tokenizer.special_texts[:2]}); "
                         "remove them: the chat template writes the turn markers itself")
    try:
        model.chat_prompt("x", system)
    except Exception as e:  # a template that takes no system turn raises from jinja
        raise SqjaxError(f"{model.name}'s chat template does not take a system message ({e}); drop system") from None


def _check_method(method) -> None:
    if not isinstance(method, Method):
        raise SqjaxError(f"method must be a sqjax.methods.Method such as sqjax.Squeezed(sparsity=0.9); got {method!r} "
                         f"({type(method).__name__})")


# ---------------------------------------------------------------------------------------------
# The attention hook
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SparseAttentionHook:
    """`attn_fn` for `models.forward`: a method's selection of the fixed context + causal input.

    attn_state = attention_state(k, v, index): per-layer K/V as tuples of [Hkv, L, d] arrays
    (slicing a stacked [layers, ...] array inside the jitted forward made XLA copy it every
    layer: 5x slower decode on CPU) and the method's index.
    """

    method: Method
    inv_freq: tuple[float, ...]  # RoPE frequencies (for de-roped queries, SAAP)
    needs_q_pre: bool = False
    backend: str = "auto"        # kernels: see sqjax.dispatch
    # how a block attends its own keys (`pallas_kernels.sparse_attention._new_part`): question blocks are
    # left-padded (to `_block_length`); a follow-up's comes after its conversation's kept turns
    new_part: str = "causal_left_padded"

    def __call__(self, layer, q, cache_k, cache_v, q_pos, kv_pos, state):
        from models.rope import remove_rope

        k_fix, v_fix = state["k"][layer], state["v"][layer]  # [Hkv, L, d]
        scale = 1.0 / math.sqrt(q.shape[-1])
        q_pre = remove_rope(q, q_pos, jnp.asarray(self.inv_freq, jnp.float32)) if self.needs_q_pre else None

        def one(qb, qpre_b, ckb, cvb, qpb, kpb):
            qh = jnp.swapaxes(qb, 0, 1)  # [Hq, T, d]
            qpre_h = None if qpre_b is None else jnp.swapaxes(qpre_b, 0, 1)
            q_valid = None if qh.shape[1] == 1 else qpb >= 0  # padding only exists in blocks
            if "clustered" in state and layer >= self.method.dense_layers:
                # the cluster-contiguous copy (GPU): a decode step through the fused kernels, a block (a
                # question) through the lookup kernels and every selected cluster's contiguous rows
                ks, vs, off, cent = state["clustered"][layer]
                level1 = state["level1"][layer] if "level1" in state else None  # hierarchical index
                t, t1 = state["index"].thresholds(qh.shape[1])
                if qh.shape[1] == 1:
                    o = dispatch.clustered_decode(qh, ks, vs, cent, off, t, ckb, cvb, qpb, kpb, scale,
                                                  self.method.vote, level1=level1, threshold1=t1)
                else:
                    o = dispatch.clustered_prefill(qh, ks, vs, cent, off, t, ckb, cvb, qpb, kpb, scale,
                                                   self.method.vote, level1=level1, threshold1=t1, q_valid=q_valid,
                                                   int8=self.method.lookup_int8, new_part=self.new_part)
                if o is not None:
                    return jnp.swapaxes(o, 0, 1)
            sel = self.method.select(state["index"], layer, qh, qpre_h, k_fix, q_valid=q_valid)
            o = dispatch.attention(qh, k_fix, v_fix, sel, ckb, cvb, qpb, kpb, scale, new_part=self.new_part)
            return jnp.swapaxes(o, 0, 1)

        with dispatch.using(self.backend):
            if q.shape[0] > 1 and self.method.dense_at(layer) and (q.shape[1] == 1 or dispatch.resolved() != "reference"):
                # several rows (questions, decode steps) over the whole fixed context: read it once, not per row
                # (the reference's prefill stays per row: it holds a [Hq, T, L] score array per row)
                return jnp.swapaxes(dispatch.dense_attention_batched(jnp.swapaxes(q, 1, 2), k_fix, v_fix, cache_k,
                                                                     cache_v, q_pos, kv_pos, scale), 1, 2)
            if ("clustered" in state and q.shape[0] > 1 and q.shape[1] == 1
                    and layer >= self.method.dense_layers):
                # several rows' decode steps over the one fixed context: one set of launches that
                # scores the centroids once and streams the union of the rows' clusters once
                ks, vs, off, cent = state["clustered"][layer]
                level1 = state["level1"][layer] if "level1" in state else None  # hierarchical index
                t, t1 = state["index"].thresholds(1)
                o = dispatch.clustered_decode_batched(jnp.swapaxes(q, 1, 2), ks, vs, cent, off, t, cache_k, cache_v,
                                                      q_pos, kv_pos, scale, self.method.vote, level1=level1,
                                                      threshold1=t1)
                if o is not None:
                    return jnp.swapaxes(o, 1, 2)                             # [B, 1, Hq, d]
            # rows one after another, not vmap: cuDNN attention's batching rule rejects the masks of the
            # gathered prefill path (seen on H200); lax.map traces one row's attention once, where a
            # Python loop wrote it out per row (a batch of 4 questions took 93 s to compile on an H200)
            if q.shape[0] == 1:
                return one(q[0], None if q_pre is None else q_pre[0], cache_k[0], cache_v[0], q_pos[0], kv_pos[0])[None]
            return jax.lax.map(lambda a: one(*a), (q, q_pre, cache_k, cache_v, q_pos, kv_pos))


@jax.jit
def _log_softmax_rows(logits, targets):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """A prefilled fixed context held as one K and one V array per layer: the only copy of the
    document's K/V a `FixedContext` keeps (the stacked [layers, ...] arrays of `ContextData`, which
    index builds read, exist only while an index is built or saved).

    k, v: per layer [Hkv, L, d]; q_obs [layers, Hq, n, d]; scale: the softmax scale.
    """

    k: tuple
    v: tuple
    q_obs: jax.Array
    scale: float

    @classmethod
    def of(cls, data: ContextData) -> "LayerKV":
        """Each layer copied out of `data`'s stacked arrays (drop `data` afterwards to free them)."""
        return cls(_split_layers(data.k), _split_layers(data.v), data.q_obs, data.scale)

    def stacked(self, k_pre: jax.Array | None = None) -> ContextData:
        """A stacked copy [layers, Hkv, L, d] (for index builds and saving); freed when dropped."""
        return ContextData(_stack_layers(self.k), _stack_layers(self.v), self.q_obs, k_pre=k_pre, scale=self.scale)

    @property
    def dtype(self):
        return self.k[0].dtype


def _split_layers(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else tuple(x[i] for i in range(x.shape[0]))


@jax.jit
def _stack_layers(layers):
    return jnp.stack(layers)


def attention_state(k, v, index, *, clustered_layout: bool = False) -> dict:
    """The hook's attn_state: per-layer fixed K/V [Hkv, L, d] tuples and the method index.

    k, v: stacked [layers, Hkv, L, d] arrays (each layer is copied out) or per-layer sequences
    (used as they are, no copy).

    clustered_layout (Squeezed, 1- or 2-level, GPU decode): also the cluster-contiguous copy of
    each layer's K/V, its offsets and its centroids, read by the fused clustered decode kernel
    (`sqjax.dispatch`); for a hierarchical index also each layer's level-1 centroids and counts
    and the level-2 clusters' parents, read by the hierarchical lookup kernels (level-2 counts come
    from the offsets).
    """
    k, v = _split_layers(k), _split_layers(v)
    state = {"k": k, "v": v, "index": index}
    if clustered_layout:
        from pallas_kernels import cluster_sort_layout

        sorted_kv = [cluster_sort_layout(k[i], v[i], index.layers.labels[i], index.n_sink, index.n_tail,
                                         num_clusters=index.layers.counts.shape[-1]) for i in range(len(k))]
        # per-layer centroids in the K/V dtype: slicing the stacked index inside the step copied
        # each layer's centroids (13 MB at 128K) on every token (seen in an H200 profile)
        state["clustered"] = tuple((ks, vs, off, index.layer(i).centroids.astype(ks.dtype))
                                   for i, (ks, vs, off, _) in enumerate(sorted_kv))
        if index.layers.centroids1.shape[-2]:  # hierarchical
            state["level1"] = tuple((li.centroids1.astype(k[0].dtype), li.counts1, li.parent)
                                    for li in (index.layer(i) for i in range(len(k))))
    return state


# ---------------------------------------------------------------------------------------------
# Answers and their stats
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class AnswerStats:
    method: str
    n_prompt_tokens: int       # the tokens after the document: the question (with a conversation's earlier turns)
    n_new_tokens: int
    kv_budget: float           # mean over decode steps (prefill if no decode step)
    kv_budget_prefill: float   # the question's prefill lookup
    kv_budget_per_layer: list  # decode mean, per layer
    bytes_moved_per_token: float
    bytes_dense_per_token: float
    overflow: bool             # a squeezed capacity overflowed (clusters dropped, see squeezed.py; never on a GPU:
                               # the cluster-contiguous routes read every selected row, and count them so)
    time_to_first_token_s: float
    time_per_output_token_s: float
    n_reused_tokens: int = 0   # of n_prompt_tokens, those whose K/V a `Conversation` kept from its earlier turns

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Answer(str):
    """The generated text (a str) with `.token_ids` and `.stats`."""

    token_ids: list
    stats: AnswerStats

    def __new__(cls, text: str, token_ids: list, stats: AnswerStats):
        obj = super().__new__(cls, text)
        obj.token_ids = token_ids
        obj.stats = stats
        return obj


# ---------------------------------------------------------------------------------------------
# FixedContext
# ---------------------------------------------------------------------------------------------

def _method_params(method: Method) -> dict:
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method)}


class FixedContext:
    """A document prefilled once, indexed for one method, ready for many questions."""

    def __init__(self, model, method: Method, doc_ids: np.ndarray, data: ContextData | LayerKV, index, info: dict,
                 *, last_logits: jax.Array, chat: bool, suffix_template: str, doc_sha256: str,
                 system: str | None = None):
        """data: the prefilled document, stacked (`ContextData`: each layer is copied out, so drop
        it afterwards) or already per layer (`LayerKV`: kept as it is, shared with its other holders)."""
        self.model = model
        self.last_logits = last_logits  # [vocab] prediction after the document's last token
        self.method = method
        self.doc_ids = np.asarray(doc_ids, np.int32)
        self.kv = data if isinstance(data, LayerKV) else LayerKV.of(data)
        self.index = index
        self.info = info
        self.chat = chat
        self.suffix_template = suffix_template  # text after the document; "{question}" placeholder
        self.system = system                    # the system message before the document (None: the template's)
        self.doc_sha256 = doc_sha256
        self.n_prefills = 1  # document prefills done for this context (tests: questions reuse it)
        cfg = model.config
        self._hook = SparseAttentionHook(
            method, tuple(float(x) for x in _inv_freq(cfg)), needs_q_pre=isinstance(method, Saap)
        )
        # a follow-up's block after its conversation's kept turns (`_TurnCache.kept` leaves them in slots
        # 0 .. n-1): on GPU the turns by an unmasked split flash call, not the position mask over the cache
        self._follow_up_hook = dataclasses.replace(self._hook, new_part="prefix_causal_left_padded")
        # on GPU, Squeezed (1- or 2-level) decodes through the fused kernel over a cluster-contiguous copy
        fused = isinstance(method, Squeezed) and jax.default_backend() == "gpu"
        self._state = attention_state(self.kv.k, self.kv.v, index, clustered_layout=fused)

    @property
    def data(self) -> ContextData:
        """The prefilled document as stacked `ContextData` -- a copy of `kv`, made on each access
        (index builds and saving use it; `kv` holds the per-layer arrays without copying)."""
        return self.kv.stacked()

    # ----------------------------------------------------------------------------- building
    @classmethod
    def build(cls, model, document: str, method: Method | None = None, *, chat: bool = True,
              system: str | None = None, truncate: bool = False, reserve: int = 256, chunk: int = 1024,
              progress: bool = False):
        """Prefill `document` once and build `method`'s index (clusters, calibration, pages, ...).

        method: None = `Squeezed(sparsity=0.9, n_sink=DEFAULT_SINK)` (the first token kept exact).
        chat: wrap the document (and later questions) in the model's chat template.
        system: the chat's system message, before the document (None: the template's own default,
            e.g. SmolLM2's "You are a helpful AI assistant named SmolLM, ..."; "": an empty one).
        reserve: tokens kept free in the model's context for questions and answers.
        truncate: keep the start of an over-long document instead of failing.
        """
        method = Squeezed(n_sink=DEFAULT_SINK) if method is None else method
        _check_method(method)
        _check_text("the document", document)
        if not (isinstance(reserve, numbers.Integral) and 0 <= reserve < model.config.max_position_embeddings):
            raise SqjaxError(f"reserve must be an int in [0, {model.config.max_position_embeddings}); got {reserve!r}")
        _check_system(model, system, chat)
        prefix, suffix_template = cls._split_template(model, document, chat, system)
        tok = model.tokenizer
        add_bos = False if chat else None
        if tok.has_special_text(document):   # its special tokens' text stays text
            head, text, mid = cls._document_span(model, prefix, chat, system)
            ids = np.asarray(_encode_user_text(tok, [head, mid], [text], add_bos), np.int32)
        else:
            ids = np.asarray(tok.encode(prefix, add_bos=add_bos), np.int32)
        limit = model.config.max_position_embeddings - reserve
        if len(ids) > limit:
            over = len(ids) - limit
            if not truncate:
                raise SqjaxError(
                    f"the document is {len(ids)} tokens but {model.name} holds {model.config.max_position_embeddings} "
                    f"(with {reserve} reserved for the question and answer): {over} tokens too many. "
                    "Shorten it, or pass truncate=True (--truncate) to keep its first part"
                )
            ids = ids[:limit]
        method.check_length(len(ids))
        from sqjax import progress as _progress_mod

        data, last_logits = _prefill_document(model, ids, method, chunk=chunk, progress=progress)
        t0 = time.perf_counter()
        with _progress_mod.enabled(progress):
            index, info = method.build(data)
        jax.block_until_ready(index)
        info = _jsonable(info)
        info["index_seconds"] = time.perf_counter() - t0
        sha = hashlib.sha256(document.encode()).hexdigest()
        kv = LayerKV.of(data)
        del data  # the stacked K/V (and SAAP's de-roped keys) go before the clustered copy is made
        return cls(model, method, ids, kv, index, info, last_logits=last_logits, chat=chat,
                   suffix_template=suffix_template, doc_sha256=sha, system=system)

    @staticmethod
    def _document_span(model, prefix: str, chat: bool, system: str | None = None) -> tuple[str, str, str]:
        """`prefix` as (template text before the document, the document as rendered, template text
        after it)."""
        if not chat:
            return "", prefix, ""
        rendered = model.chat_prompt(_DOC_SENTINEL + "\n\n" + _SENTINEL, system)
        head, _, rest = rendered.partition(_DOC_SENTINEL)
        mid = rest.partition(_SENTINEL)[0]
        if not rest or not prefix.startswith(head) or not prefix.endswith(mid) or len(prefix) < len(head) + len(mid):
            raise SqjaxError("the document writes out special tokens (such as "
                             f"{model.tokenizer.special_texts[:2]}) and the chat template changes the document's text, "
                             "so they cannot be kept as text; use chat=False (--raw)")
        return head, prefix[len(head):len(prefix) - len(mid)], mid

    @staticmethod
    def _split_template(model, document: str, chat: bool, system: str | None = None) -> tuple[str, str]:
        """(fixed prefix text, suffix template with '{question}')."""
        if not chat:
            return document, "\n\n{question}"
        rendered = model.chat_prompt(document + "\n\n" + _SENTINEL, system)
        prefix, _, rest = rendered.partition(_SENTINEL)
        if not rest and not rendered.endswith(_SENTINEL):
            raise SqjaxError("the model's chat template dropped the question placeholder; use chat=False")
        return prefix, "{question}" + rest.replace("{", "{{").replace("}", "}}").replace("{{question}}", "{question}")

    def with_method(self, method: Method) -> "FixedContext":
        """The same prefilled document indexed for another method (no new prefill)."""
        _check_method(method)
        method.check_length(self.n_tokens)
        if type(method).build is Method.build:  # full, StreamingLLM, oracle: nothing built from the K/V
            index, info = method.build(None)
        else:
            data = self.data  # a stacked copy while the index is built
            if isinstance(method, Saap):
                data = dataclasses.replace(data, k_pre=_derope_keys(self.model, data.k))
            index, info = method.build(data)
            del data
        ctx = FixedContext(self.model, method, self.doc_ids, self.kv, index, _jsonable(info),
                           last_logits=self.last_logits, chat=self.chat,
                           suffix_template=self.suffix_template, doc_sha256=self.doc_sha256, system=self.system)
        ctx.n_prefills = 0
        return ctx

    @property
    def n_tokens(self) -> int:
        return int(self.doc_ids.shape[0])

    # ----------------------------------------------------------------------------- running
    def _forward(self, tokens, positions, cache, capture: int | None | bool, logits: str = "all", hook=None):
        """tokens, positions int32 [1, T] (host or device arrays) through the sparse hook (`hook`, else
        `_hook`), one jitted forward (`models.forward.forward_jit`, with XLA's command buffers) for
        prefills and steps."""
        from models.forward import forward_jit

        return forward_jit(self.model.graphdef, self.model.state, tokens, positions, cache,
                           attn_fn=hook or self._hook, attn_state=self._state, capture_last=capture, logits=logits)

    def _run(self, ids: np.ndarray, start_pos: int, cache, capture: int | None | bool, logits: str = "all",
             hook=None):
        """Forward `ids` [n] or [B, n] (−1 = left padding) at positions start_pos.. (per row)
        through the sparse hook."""
        return self._forward(*_tokens_positions(ids, start_pos), cache, capture, logits, hook)

    def _run_new_cache(self, ids: np.ndarray, start_pos: int, n: int, capture: int | None | bool,
                       logits: str = "all"):
        """`_run` on a new cache for n tokens (`_new_cache`'s), made inside the forward's program
        (`models.forward.forward_new_cache_jit`: one dispatch fewer before the first token)."""
        from models.forward import forward_new_cache_jit

        tokens, positions = _tokens_positions(ids, start_pos)
        return forward_new_cache_jit(self.model.graphdef, self.model.state, tokens, positions,
                                     config=self.model.config, batch=int(tokens.shape[0]), capacity=_capacity(n),
                                     dtype=jnp.dtype(self.model.dtype), attn_fn=self._hook, attn_state=self._state,
                                     capture_last=capture, logits=logits)

    def _new_cache(self, n: int, batch: int = 1):
        return self.model.new_cache(batch, _capacity(n))

    def _lookup_counts(self, caps, q_valid: np.ndarray, qbuf, n_steps: int = 0) -> tuple:
        """Re-run the method's lookups on captured queries, for accounting only (outside the timed path):
        every row's question block in one program, every decode step in another, read back together.

        caps: the prefill's captures, per layer {"q", "q_pre": [B, T, Hq, d]}; q_valid [B, T] bool: a
        row's padding tokens (False) take no part; qbuf: None or the steps' queries [K, layers, n, B, Hq,
        1, d] (K = 2: the de-roped ones last), of which the first n_steps were written. -> (blocks,
        steps): each None or host arrays kv_rows [layers, S, Hs, Ts], meta_rows [layers, S, Hs, Ts],
        overflow [layers, S, Hs]; S lookups: the B blocks; the steps as i * B + b (i < n_steps, rounded
        up to a power of two >= _BUCKET: an answer that stops early is not looked up to max_new_tokens,
        and the program compiles once per bucket).
        """
        args = (self.method, self._accounted_index(), self._state["k"])
        blocks = _block_counts_jit(*args, caps, q_valid)
        steps = None
        if qbuf is not None:
            steps = _step_counts_jit(*args, qbuf, min(qbuf.shape[2], max(_BUCKET, 1 << max(n_steps - 1, 0).bit_length())))
        # a few arrays, read together and sliced on the host: sliced on the device and read layer by layer,
        # an answer's accounting took 119 ms in an H200 trace of the 8B shape, 50 of them in 192 device
        # slices (benchmarks/results/gpu_h200_follow_up/probe_c73b37d/; now benchmarks/results/gpu_h200_ask_call/)
        return jax.device_get((blocks, steps))

    def _accounted_index(self):
        """The index `_lookup_counts` re-runs the lookup with: the one the timed path selected with.
        The cluster-contiguous routes (`SparseAttentionHook` with a GPU backend) read every selected
        cluster's rows, with no capacity, so the capacity is lifted there: the rows are counted as
        read and no overflow is reported for clusters the library route would have dropped."""
        with dispatch.using(self._hook.backend):
            routed = "clustered" in self._state and dispatch.resolved() != "reference"
        if not routed:
            return self.index
        return dataclasses.replace(self.index, capacity=self.index.n_sink + self.index.n_tail + self.n_tokens)

    def _question_ids(self, question: str, history: tuple = ()) -> np.ndarray:
        """Token ids after the document for `question` (after the earlier turns of `history`)."""
        _check_text("the question", question)
        if history:
            return self._conversation_ids(question, history)
        tok = self.model.tokenizer
        if tok.has_special_text(question):   # its special tokens' text stays text
            before, after = (part.format() for part in self.suffix_template.split("{question}", 1))
            return np.asarray(_encode_user_text(tok, [before, after], [question], add_bos=False), np.int32)
        text = self.suffix_template.format(question=question)
        return np.asarray(tok.encode(text, add_bos=False), np.int32)

    def _conversation_ids(self, question: str, history: tuple) -> np.ndarray:
        """Token ids after the document for a follow-up: the chat template rendered over the whole
        conversation, whose first user turn opens with the (already prefilled) document:
        [user: document + question 1, assistant: answer 1, ..., user: `question`]. Each question and
        answer is placed as written; special-token text in them stays text."""
        if not self.chat:
            raise SqjaxError("a conversation (history) needs the chat template: this context was built with "
                             "chat=False (--raw); ask without history")
        pieces = [text for turn in history for text in turn] + [question]
        marks = [_TURN.format(i) for i in range(len(pieces))]
        lead = _DOC_SENTINEL + "\n\n"
        turns = [(lead * (i == 0) + marks[2 * i], marks[2 * i + 1]) for i in range(len(history))]
        try:
            rendered = self.model.chat_prompt(marks[-1], self.system, turns)
        except Exception as e:  # a template that takes no assistant turns raises from jinja
            raise SqjaxError(f"{self.model.name}'s chat template does not render a conversation ({e}); "
                             "ask without history") from None
        head, _, rest = rendered.partition(lead)
        if head != self.model.chat_prompt(lead + _SENTINEL, self.system).partition(lead)[0]:
            raise SqjaxError(f"{self.model.name}'s chat template writes the start of a conversation differently "
                             "from a single question's, so the prefilled document cannot be reused; ask without "
                             "history")
        template = []
        for m in marks:
            before, found, rest = rest.partition(m)
            if not found:
                raise SqjaxError(f"{self.model.name}'s chat template drops or reorders a conversation's turns; "
                                 "ask without history")
            template.append(before)
        tok = self.model.tokenizer
        if any(tok.has_special_text(p) for p in pieces):
            return np.asarray(_encode_user_text(tok, template + [rest], pieces, add_bos=False), np.int32)
        text = "".join(t + p for t, p in zip(template, pieces)) + rest
        return np.asarray(tok.encode(text, add_bos=False), np.int32)

    def conversation(self, reuse_cache: bool = True, history=None) -> "Conversation":
        """A conversation about the document: each question sees the earlier questions and answers;
        with reuse_cache a follow-up prefills only its new tokens (see `Conversation`). history:
        earlier turns [(question, answer), ...] to go on from (the first question prefills them)."""
        if not self.chat:
            raise SqjaxError("a conversation needs the chat template: this context was built with chat=False "
                             "(--raw); build it with the template, or ask questions one by one")
        return Conversation(self, reuse_cache, history)

    def load_conversation(self, path, reuse_cache: bool = True) -> "Conversation":
        """The conversation `Conversation.save` wrote to `path`, about this context's document, to go
        on from (its turns are text: the first question prefills them again)."""
        from sqjax.conversation_file import ConversationFileError, read_conversation

        try:
            turns = read_conversation(path, self.doc_sha256)
        except ConversationFileError as e:
            raise SqjaxError(str(e)) from None
        return self.conversation(reuse_cache, _check_history(turns, f"the conversation in {str(path)!r}"))

    def check_questions(self, questions, max_new_tokens: int = 64, temperature: float = 0.0,
                        top_p: float = 1.0, histories=None) -> list[np.ndarray]:
        """Token ids of each question's prompt, once the request is known to be valid: every question a
        non-empty str, document + question (+ its conversation's earlier turns, `histories[i]`) +
        max_new_tokens within the model's context (questions counted from 1), max_new_tokens an int
        >= 1, temperature finite >= 0, 0 < top_p <= 1."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise SqjaxError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
        check_sampling(temperature, top_p)
        if isinstance(questions, str) or not len(questions):
            raise SqjaxError("ask_many takes a non-empty list of questions (ask() takes one string)")
        which = (lambda i: f"question {i + 1} of {len(questions)}") if len(questions) > 1 else (lambda i: "the question")
        for i, q in enumerate(questions):
            _check_text(which(i), q)
        if histories is None:
            histories = [()] * len(questions)
        elif isinstance(histories, (str, bytes)) or not isinstance(histories, (list, tuple)) \
                or len(histories) != len(questions):
            raise SqjaxError(f"histories must be a list with one history (a list of (question, answer) pairs, or "
                             f"None) per question: {len(questions)}; got {histories!r:.80}")
        histories = [_check_history(h, f"the history of {which(i)}") for i, h in enumerate(histories)]
        q_ids = [self._question_ids(q, h) for q, h in zip(questions, histories)]
        limit = self.model.config.max_position_embeddings
        for i, ids in enumerate(q_ids):
            total = self.n_tokens + len(ids) + max_new_tokens
            if total > limit:
                turns = f" with {len(histories[i])} earlier turns" if histories[i] else ""
                raise SqjaxError(
                    f"document ({self.n_tokens}) + {which(i)}{turns} ({len(ids)}) + {max_new_tokens} new tokens = "
                    f"{total} tokens exceed the model's context of {limit}; shorten {which(i)}"
                    + (", start a new conversation" if turns else "") + " or ask for fewer new tokens"
                )
        return q_ids

    def ask(self, question: str, max_new_tokens: int = 64, *, temperature: float = 0.0, top_p: float = 1.0,
            seed: int = 0, on_token: Callable[[str], Any] | None = None, stop_ids=None, history=None) -> Answer:
        """Answer `question` about the document (greedy by default); streams text to `on_token`.

        history: earlier (question, answer) turns of a conversation about the document, oldest
        first; they are prefilled again after the document with this question (`conversation()`
        keeps them, and their K/V, so that a follow-up prefills only its new tokens)."""
        stream = None if on_token is None else (lambda _i, text: on_token(text))
        return self.ask_many([question], max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                             on_token=stream, stop_ids=stop_ids, histories=None if history is None else [history])[0]

    def ask_many(self, questions, max_new_tokens: int = 64, *, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, on_token: Callable[[int, str], Any] | None = None, stop_ids=None,
                 histories=None) -> list[Answer]:
        """Answer several questions in one batch: one prefill of the left-padded questions [B, T]
        and one decode step per token for all rows, so the model's weights are read once per step
        for the batch. Every row attends to the same fixed context (one copy of its K/V) with its
        own selection, and to its own question and answer only. Greedy answers equal `ask`'s.

        on_token(i, text): the new text of answer i as it is generated. A row stops at its own
        stop token; the batch runs until every row has stopped or made `max_new_tokens` tokens.
        Each answer's stats count its own lookups; time to first token and time per output token
        are the batch's (one step produces a token for every row). With sampling (temperature > 0)
        one key per step serves all rows, so a row's draws depend on the batch it is in.
        histories: None, or one history per question (see `ask`): a batch of conversations.
        """
        return self._answer(questions, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            on_token=on_token, stop_ids=stop_ids, histories=histories)[0]

    def _answer(self, questions, max_new_tokens: int, *, temperature: float, top_p: float, seed: int,
                on_token, stop_ids, histories, turn: "_TurnCache | None" = None):
        """`ask_many`; with `turn` (one question: a `Conversation`'s follow-up) the prompt's longest
        prefix whose K/V `turn` holds is not prefilled again. -> (answers, the `_TurnCache` of the
        first row's prompt and answer)."""
        questions = questions if isinstance(questions, str) else list(questions)   # any iterable of str
        q_ids = self.check_questions(questions, max_new_tokens, temperature, top_p, histories)
        from models.generate import stop_id_set

        tok_dec = self.model.tokenizer
        try:
            check_seed("seed", seed)
            stop = stop_id_set(stop_ids, tok_dec.eos_ids)
        except ValueError as e:
            raise SqjaxError(str(e)) from None
        n_reused = turn.reusable(q_ids[0]) if turn is not None and len(q_ids) == 1 else 0
        padded = _left_pad([ids[n_reused:] for ids in q_ids])     # [B, T], -1 = padding
        n_rows, padded_len = padded.shape
        key = jax.random.key(seed)

        t0 = time.perf_counter()
        if n_reused:
            # a follow-up: the earlier turns' K/V in slots 0 .. n_reused - 1, the later slots emptied
            cache = turn.kept(n_reused, padded_len + max_new_tokens,
                              self.model.config.max_position_embeddings - self.n_tokens + _BUCKET)
            logits, cache, caps = self._run(padded, self.n_tokens + n_reused, cache, capture=None, logits="last",
                                            hook=self._follow_up_hook)
        else:
            logits, cache, caps = self._run_new_cache(padded, self.n_tokens, padded_len + max_new_tokens,
                                                      capture=None, logits="last")
        first = _first_token(logits, key, jnp.float32(temperature), jnp.float32(top_p),
                             greedy=temperature == 0.0, use_top_p=top_p < 1.0)    # int32 [B]
        nxt = np.asarray(first)
        ttft = time.perf_counter() - t0
        out: list[list[int]] = [[] for _ in range(n_rows)]
        done = np.zeros(n_rows, bool)
        step_times = []
        emitted = [""] * n_rows
        # carried on the device from step to step (donated: the same buffers every step)
        tok_d = jnp.asarray(first, jnp.int32)[:, None]
        pos_d = jnp.asarray([[self.n_tokens + len(x)] for x in q_ids], jnp.int32)
        step_d = jnp.ones((1,), jnp.int32)
        temp_d, top_p_d = jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p)
        # Each step's queries for the accounting after the loop go into one carried buffer
        # [K, layers, n_pad, B, Hq, 1, d] (a fresh output buffer per step changed the step's
        # addresses and doubled its time on a GPU, gpu_h200_ask/). K = 2 adds the de-roped queries
        # for the method that reads them (SAAP). n_pad: room for max_new_tokens - 1 steps, rounded
        # up to a power of two >= _BUCKET, so the step compiles once per bucket.
        n_pad = max(_BUCKET, 1 << (max_new_tokens - 2).bit_length()) if max_new_tokens > 1 else 0
        cfg = self.model.config
        n_kinds = 2 if self._hook.needs_q_pre else 1
        qbuf = (jnp.zeros((n_kinds, cfg.num_layers, n_pad, n_rows, cfg.num_heads, 1, cfg.head_dim),
                          caps[0]["q"].dtype) if n_pad else None)
        nxt_dev, t_prev = None, time.perf_counter()
        n_fed = 0                                                  # steps dispatched: tokens whose K/V are cached
        for step in range(max_new_tokens):
            # pipelined: the step that feeds token `step` is dispatched (from the tokens still on
            # the device) before the host reads them, so streaming and bookkeeping overlap the
            # device's work; a row that has stopped keeps stepping (its tokens are discarded) and
            # when every row has stopped that one step ahead is discarded.
            nxt_ahead = None
            if step < max_new_tokens - 1:
                tok_d, pos_d, step_d, cache, qbuf, nxt_ahead = _ask_step(
                    self.model.graphdef, self.model.state, tok_d, pos_d, step_d, cache, qbuf, self._state, key,
                    temp_d, top_p_d, attn_fn=self._hook, greedy=temperature == 0.0, use_top_p=top_p < 1.0)
                nxt_ahead.copy_to_host_async()
                n_fed += 1
            if nxt_dev is not None:
                # a host copy, not `nxt_dev[0]`: indexing is a device op queued behind the step
                # dispatched ahead, so reading token n waited for step n + 1 (GPU)
                nxt = np.asarray(nxt_dev)
                now = time.perf_counter()
                step_times.append(now - t_prev)  # between consecutive tokens reaching the host
                t_prev = now
            for b in np.flatnonzero(~done):
                out[b].append(int(nxt[b]))
                if on_token is not None:
                    text = tok_dec.decode(out[b])
                    on_token(int(b), text[len(emitted[b]):])
                    emitted[b] = text
                done[b] = int(nxt[b]) in stop
            if done.all() or nxt_ahead is None:
                break
            nxt_dev = nxt_ahead
        # the accounting's lookups, after the loop (before it, their reads held the decode steps back): every
        # row's block and steps in one program
        block_counts, step_counts = self._lookup_counts(caps, padded >= 0, qbuf, n_fed)
        answers = []
        for b in range(n_rows):
            # the steps that fed this row's tokens 0 .. n - 2 (the last token's step, if any, is not the answer's)
            n_steps = len(out[b]) - 1
            prefill_sel = _selections(block_counts, [b], padded[b] >= 0)
            step_sel = _selections(step_counts, np.arange(n_steps) * n_rows + b) if n_steps else None
            stats = self._stats(prefill_sel, step_sel, len(q_ids[b]), len(out[b]), ttft, step_times)
            stats.n_reused_tokens = n_reused
            answers.append(Answer(tok_dec.decode(out[b]), out[b], stats))
        if n_rows > 1:
            return answers, None
        # the cache holds the prompt and the answer's tokens fed back (all, or all but the last): before
        # them n_reused kept tokens, then the block (its padding at position -1), then the steps' tokens
        ids = np.concatenate([q_ids[0], np.asarray(out[0][:n_fed], np.int32)])
        slot_pos = np.full(cache.capacity, -1, np.int32)
        slot_pos[:n_reused] = self.n_tokens + np.arange(n_reused)
        slot_pos[n_reused:n_reused + padded_len] = _host_tokens_positions(padded, self.n_tokens + n_reused)[1][0]
        slot_pos[n_reused + padded_len:n_reused + padded_len + n_fed] = self.n_tokens + len(q_ids[0]) + np.arange(n_fed)
        return answers, _TurnCache(cache, ids, self.n_tokens, slot_pos)

    def _stats(self, prefill_sel, step_sel, n_prompt, n_new, ttft, step_times) -> AnswerStats:
        cfg = self.model.config
        bpe = jnp.dtype(self.kv.dtype).itemsize
        acc = lambda sels: account(sels, self.n_tokens, cfg.head_dim, cfg.num_kv_heads, bpe)  # noqa: E731
        pre = acc(prefill_sel)
        dec = acc(step_sel) if step_sel else pre  # decode: mean over the generated tokens' lookups
        overflow = any(bool(np.any(np.asarray(s.overflow))) for s in prefill_sel + (step_sel or []))
        per_layer, kv, moved = dec.per_layer, dec.overall, dec.bytes_moved
        return AnswerStats(
            method=self.method.label, n_prompt_tokens=n_prompt, n_new_tokens=n_new, kv_budget=kv,
            kv_budget_prefill=pre.overall, kv_budget_per_layer=[float(x) for x in per_layer],
            bytes_moved_per_token=moved, bytes_dense_per_token=pre.bytes_dense, overflow=overflow,
            time_to_first_token_s=ttft,
            time_per_output_token_s=float(np.median(step_times)) if step_times else float("nan"),
        )

    def score(self, text: str) -> np.ndarray:
        """Log-probs [n] of the tokens of `text` following the document (one sparse prefill block)."""
        _check_text("the text to score", text)
        ids = np.asarray(self.model.tokenizer.encode(text, add_bos=False, special=False), np.int32)
        return self.score_ids(ids)

    def score_ids(self, ids: np.ndarray, *, mode: str = "prefill", return_logits: bool = False):
        """Log-probs of token ids following the document: lp[i] = log p(ids[i] | doc, ids[:i]).

        ids[0] is predicted by the document prefill's last logits. mode="prefill": ids[1:] by
        one sparse prefill block over ids[:-1] (the method's block lookup, e.g. Eq. 1 averaged
        over the block); mode="decode": token by token, one lookup per token (generation).
        """
        ids = np.asarray(ids)
        if ids.ndim != 1 or len(ids) == 0:
            raise SqjaxError(f"ids must be a non-empty 1-D array; got shape {ids.shape}")
        from models.registry import check_token_ids

        try:
            ids = check_token_ids(ids, self.model.config.vocab_size)
        except ValueError as e:
            raise SqjaxError(str(e)) from None
        if mode not in ("prefill", "decode"):
            raise SqjaxError(f"mode must be 'prefill' or 'decode'; got {mode!r}")
        if self.n_tokens + len(ids) > self.model.config.max_position_embeddings:
            raise SqjaxError(f"document ({self.n_tokens}) + {len(ids)} tokens to score = {self.n_tokens + len(ids)} tokens "
                             f"exceed the model's context of {self.model.config.max_position_embeddings}; score a "
                             "shorter text")
        inp = ids[:-1]
        if mode == "prefill":
            padded = _left_pad([inp])[0]
            padded_len = len(padded)
            logits, _, _ = self._run_new_cache(padded, self.n_tokens, padded_len, capture=False)
            logits = logits[0, padded_len - len(inp):]  # predictions for ids[1:]
        else:
            cache = self._new_cache(max(len(inp), 1))
            rows = []
            for i, t in enumerate(inp):
                lg, cache, _ = self._run(np.asarray([t], np.int32), self.n_tokens + i, cache, capture=False)
                rows.append(lg[0, -1])
            logits = jnp.stack(rows) if rows else jnp.zeros((0, self.last_logits.shape[-1]), jnp.float32)
        all_logits = jnp.concatenate([self.last_logits[None], logits], axis=0)
        lp = np.asarray(_log_softmax_rows(all_logits, jnp.asarray(ids)))
        return (lp, np.asarray(all_logits)) if return_logits else lp

    # ----------------------------------------------------------------------------- persistence
    def save(self, path) -> None:
        """Write the index atomically to `path` (`.sqx`, see `index_io`)."""
        tree = {"data": self.data, "index": self.index,
                "doc_ids": self.doc_ids, "last_logits": self.last_logits}
        header = {
            "model_fingerprint": self.model.fingerprint,
            "model_dtype": _model_dtype(self.model),
            "model_name": self.model.name,
            "model_source": getattr(self.model, "source", None),
            "tokenizer": getattr(self.model.tokenizer, "name", None),
            "method": {"name": self.method.name, "params": _method_params(self.method)},
            "document": {"n_tokens": self.n_tokens, "sha256": self.doc_sha256, "chat": self.chat,
                         "suffix_template": self.suffix_template, "system": self.system},
            "info": self.info,
        }
        index_io.save_index(path, tree, header)

    @classmethod
    def load(cls, path, model) -> "FixedContext":
        """Read an index written by `save`; the model must be the one it was built with."""
        try:
            tree, header = index_io.load_index(path, expected_fingerprint=model.fingerprints)
        except index_io.IndexFileError as e:
            raise SqjaxError(str(e)) from None
        built = header.get("model_dtype")
        have = _model_dtype(model)
        if built is not None and built != have:
            raise SqjaxError(f"{path} was built with the model in {built}, this model runs in {have}: its stored "
                             f"keys/values and thresholds belong to {built}; load the model with dtype={built} "
                             f"or rebuild the index")
        m = header["method"]
        method = method_from_name(m["name"], **m["params"])
        doc = header["document"]
        kv = LayerKV.of(tree.pop("data"))  # the stacked copy read from the file goes with `tree`
        ctx = cls(model, method, np.asarray(tree["doc_ids"]), kv, tree["index"], header.get("info", {}),
                  last_logits=tree["last_logits"], chat=doc["chat"], suffix_template=doc["suffix_template"],
                  doc_sha256=doc["sha256"], system=doc.get("system"))
        ctx.n_prefills = 0
        return ctx


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

class Conversation:
    """Follow-up questions about one `FixedContext`: each question is asked after the earlier
    questions and answers, with the prompt `FixedContext.ask(..., history=...)` gives it; the
    document's prefill and index are shared.

    reuse_cache (default): the conversation keeps the K/V of its last prompt and answer, so a
    follow-up prefills only what is new -- the tokens from the first one that differs from them
    (usually the end of the last answer's turn and the new question). The earlier turns' K/V are
    then the ones computed when they were asked and answered; with a sparse method a follow-up's
    answer can differ slightly from `ask(..., history=...)`'s, which prefills the whole conversation
    in one block (selections of the fixed context are made per block). With reuse_cache=False each
    question prefills the whole conversation again (and answers exactly as `ask(history=...)`).
    The kept K/V hold device memory for the conversation's tokens until `reset()`. `history`: turns
    to go on from (their K/V are computed with the first question); `save` / `FixedContext.load_conversation`
    keep the turns in a file (`sqjax.conversation_file`)."""

    def __init__(self, context: FixedContext, reuse_cache: bool = True, history=None):
        self.context = context
        self.reuse_cache = reuse_cache
        self.history: list[tuple[str, str]] = list(_check_history(history))   # (question, answer) turns, oldest first
        self._turn: _TurnCache | None = None      # the last prompt and answer's K/V (reuse_cache)

    def save(self, path) -> None:
        """Write the turns (text, with the document's sha256) atomically to `path` as JSON; a file
        there that is not a conversation file is not overwritten (SqjaxError)."""
        from sqjax.conversation_file import ConversationFileError, write_conversation

        try:
            write_conversation(path, self.context.doc_sha256, self.history)
        except ConversationFileError as e:
            raise SqjaxError(f"{e}; it is not overwritten") from None

    def ask(self, question: str, max_new_tokens: int = 64, *, temperature: float = 0.0, top_p: float = 1.0,
            seed: int = 0, on_token: Callable[[str], Any] | None = None, stop_ids=None) -> Answer:
        """`FixedContext.ask` after this conversation's turns; the turn is kept once answered (a
        question that fails leaves the conversation as it was)."""
        stream = None if on_token is None else (lambda _i, text: on_token(text))
        try:
            answers, turn = self.context._answer(
                [question], max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, on_token=stream,
                stop_ids=stop_ids, histories=[list(self.history)], turn=self._turn if self.reuse_cache else None)
        except BaseException:
            if self._turn is not None and self._turn.cache.k[0].is_deleted():
                self._turn = None   # its K/V went to the failed answer: the next question prefills every turn
            raise
        self.history.append((question, str(answers[0])))
        self._turn = turn if self.reuse_cache else None
        return answers[0]

    def undo(self) -> tuple[str, str]:
        """Forget the last turn and return it (ask again to get another answer). The kept K/V stay:
        the next question reuses them up to where the conversation now differs."""
        if not self.history:
            raise SqjaxError("the conversation has no turn to undo")
        return self.history.pop()

    def reset(self) -> None:
        """Forget the earlier turns and their K/V (the next question starts a new conversation)."""
        self.history.clear()
        self._turn = None


@dataclasses.dataclass(frozen=True)
class _TurnCache:
    """A conversation's K/V after its last answer: `cache` (one row) holds the tokens `ids` [n]
    after the document (the last prompt, then the answer's tokens fed back), at positions
    n_doc + 0 .. n - 1, in slot order; `slot_pos` [capacity] is the host's copy of the cache's
    positions (-1 = empty: the question block's padding slots, the unused ones)."""

    cache: Any           # models.kv_cache.KVCache, batch 1
    ids: np.ndarray      # int32 [n]
    n_doc: int           # the document's tokens (the first position after it)
    slot_pos: np.ndarray  # int32 [capacity]

    def reusable(self, q_ids: np.ndarray) -> int:
        """How many leading tokens of a new prompt q_ids [m] have their K/V here: the common
        prefix, less one when it is all of q_ids (the last token's logits are needed)."""
        n = min(len(self.ids), len(q_ids) - 1)
        differ = np.flatnonzero(self.ids[:n] != q_ids[:n])
        return int(differ[0]) if differ.size else n

    def kept(self, n: int, extra: int, room: int):
        """The cache with the K/V of ids[:n] in slots 0 .. n-1 (the rest empty) and room for `extra`
        more slots.

        In place when it has the room: a question block's padding slots between the kept tokens
        are closed up by moving the tokens after the first of them (`_move_slots`, a window of
        about the last turn's size), and the later slots are emptied (positions -1), so that a
        follow-up's block attends its turns as one prefix (`SparseAttentionHook.new_part`,
        "prefix_causal_left_padded"). The buffers stay those of the whole conversation. They are
        donated on through this, the prefill and the steps, and XLA's command buffers find them at
        the addresses of the last turn (on a new copy each time, a follow-up took 40.5 instead of
        31.0 ms to its first token on an H200, benchmarks/results/gpu_h200_follow_up/).
        Otherwise a new cache, compacted, with twice the capacity (fewer compilations and moves) or
        as much as fits `room` (the most a conversation can use), at least n + extra. Either way
        `cache` is not to be used again. The slots come from `slot_pos`: no read from the device."""
        pos = self.slot_pos
        src = np.flatnonzero((pos >= self.n_doc) & (pos < self.n_doc + n))        # slots in order
        if not np.array_equal(pos[src], self.n_doc + np.arange(n)):
            raise AssertionError(f"a conversation's cache lost track of its tokens: positions {pos[src][:8]}...")
        capacity = self.cache.capacity
        if n + extra > capacity:
            slots = np.zeros(_capacity(max(n + extra, min(2 * capacity, room))), np.int32)
            slots[:n] = src
            return _compact_cache(self.cache, jnp.asarray(slots), jnp.int32(n))
        moved = np.flatnonzero(src != np.arange(n))
        if not moved.size:                                                         # no padding slot between
            return _keep_slots_before(self.cache, jnp.int32(n))
        width = min(capacity, max(64, 1 << int(n - moved[0] - 1).bit_length()))   # a power of two: few compilations
        start = min(int(moved[0]), capacity - width)
        window = start + np.arange(width, dtype=np.int32)                          # slot i <- slot src[i] below n
        window[window < n] = src[window[window < n]]
        return _move_slots(self.cache, jnp.int32(start), jnp.asarray(window), jnp.int32(n))


def _emptied_from(cache, end):
    """cache with its slots from `end` on emptied (position -1) and the next write at slot `end`."""
    slots = jnp.arange(cache.pos.shape[1], dtype=jnp.int32)[None]
    return cache.replace(pos=jnp.where(slots < end, cache.pos, -1), length=jnp.full_like(cache.length, end))


# donated: every buffer comes back at its address, positions and length included
_keep_slots_before = jax.jit(_emptied_from, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def _move_slots(cache, start, window, end):
    """cache (one row, donated: its buffers come back at their addresses) with slot start + i set
    to slot window[i] for each i < len(window) (K, V and position), then its slots from `end` on
    emptied and the next write at slot `end`."""
    # the window's rows read into buffers of their own first (a barrier), so that each update can be
    # written in place: a gather fused into it would read the buffer it writes
    n_layers = len(cache.k)
    arrays = [*cache.k, *cache.v, cache.pos]                                      # [1, Hkv, S, d] ..., [1, S]
    axes = [2] * (2 * n_layers) + [1]                                             # their slot axes
    rows = jax.lax.optimization_barrier([jnp.take(x, window, axis=a) for x, a in zip(arrays, axes)])
    moved = [jax.lax.dynamic_update_slice_in_dim(x, r, start, axis=a) for x, r, a in zip(arrays, rows, axes)]
    cache = cache.replace(k=tuple(moved[:n_layers]), v=tuple(moved[n_layers:-1]), pos=moved[-1])
    return _emptied_from(cache, end)


@jax.jit
def _compact_cache(cache, slots, n):
    """cache (one row) -> a cache of len(slots) slots whose slot i < n is cache's slot slots[i];
    the rest are empty (position -1), and the next write goes to slot n. A new cache: `cache` stays
    valid (the steps donate theirs)."""
    keep = jnp.arange(slots.shape[0]) < n                                         # [S']
    take = lambda x: jnp.take(x, slots, axis=2)                                   # [1, Hkv, S', d]  # noqa: E731
    pos = jnp.where(keep, jnp.take(cache.pos[0], slots), -1)[None]
    return cache.replace(k=tuple(map(take, cache.k)), v=tuple(map(take, cache.v)), pos=pos.astype(jnp.int32),
                         length=jnp.reshape(n, (1,)).astype(jnp.int32))


def _inv_freq(config) -> np.ndarray:
    from models.rope import config_frequencies

    return config_frequencies(config)


def _derope_keys(model, k: jax.Array) -> jax.Array:
    """De-roped keys [layers, Hkv, L, d] from roped ones (inverse rotation at each position)."""
    from models.rope import remove_rope

    pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    inv = jnp.asarray(_inv_freq(model.config))
    return jax.vmap(lambda kl: remove_rope(kl, jnp.broadcast_to(pos, kl.shape[:-1]), inv))(k)


def _prefill_document(model, ids: np.ndarray, method: Method, *, chunk: int, progress: bool):
    """Dense prefill of the document in chunks; returns its KV, the last queries and final logits."""
    from models.forward import forward_jit

    n = len(ids)
    n_obs = max(getattr(method, "n_obs", 100), getattr(method, "window", 0), 100)
    n_obs = min(n_obs, n)
    chunk = max(chunk, n_obs)
    bounds = list(range(0, n, chunk))
    if n - bounds[-1] < n_obs and len(bounds) > 1:  # last chunk must hold the observed queries
        bounds.pop()
    cache = model.new_cache(1, n)
    q_obs = None
    logits = None
    from sqjax.progress import enabled, track

    with enabled(progress):
        bar = track(bounds, "prefill")  # the bar is created now and advances as chunks finish
    for i, start in enumerate(bar):
        end = bounds[i + 1] if i + 1 < len(bounds) else n
        toks = jnp.asarray(ids[None, start:end])
        pos = jnp.arange(start, end, dtype=jnp.int32)[None]
        last = end == n
        logits, cache, caps = forward_jit(model.graphdef, model.state, toks, pos, cache,
                                          capture_last=n_obs if last else False, logits="last")
        if last:
            q_obs = jnp.stack([jnp.swapaxes(c["q"][0], 0, 1) for c in caps])  # [layers, Hq, n_obs, d]
    k, v = _stack_row0(cache.k), _stack_row0(cache.v)  # [layers, Hkv, n, d]
    del cache
    scale = 1.0 / math.sqrt(model.config.head_dim)
    k_pre = _derope_keys(model, k) if isinstance(method, Saap) else None
    return ContextData(k, v, q_obs, k_pre=k_pre, scale=scale), logits[0, -1]


@jax.jit
def _stack_row0(layers):
    """Per-layer cache arrays [1, Hkv, S, d] -> [layers, Hkv, S, d] in one program (eagerly, stacking
    [layers, 1, ...] and then slicing row 0 held three copies of the document's K/V at once)."""
    return jnp.stack([x[0] for x in layers])


def _counts(method, index, k_fixed, q, q_pre, q_valid):
    """The rows each lookup reads at each layer: q, q_pre [layers, S, Hq, T, d], q_valid [S, T] or None ->
    (kv_rows [layers, S, Hs, Ts], meta_rows [layers, S, Hs, Ts], overflow [layers, S, Hs]). The
    selections' masks and positions are not outputs, so they compile away (and with a capacity that
    holds every key, so does Squeezed's sort)."""
    n_layers = q.shape[0]

    def layer_counts(layer, k, q_l, q_pre_l):   # layer: an int, or traced over the sparse layers
        def one(qs, qps, qv):
            pick = method.select if isinstance(layer, int) else method.select_sparse
            sel = pick(index, layer, qs, qps, k, q_valid=qv)
            return sel.kv_rows, sel.meta_rows, sel.overflow
        return jax.vmap(one, in_axes=(0, 0, None if q_valid is None else 0))(q_l, q_pre_l, q_valid)

    # The sparse layers (all after the dense ones) in one loop over the stacked index: compiled once, not
    # once per layer (SmolLM2's 30 layers unrolled took 8.5 s to compile on the 2-core CPU, 1.1 s looped, for
    # every question length: benchmarks/results/gpu_h200_ask_call/accounting_map_18ae739/cpu_compile_*.json). A method that reads the keys themselves (the oracle) keeps the unrolled layers.
    first = next((i for i in range(n_layers) if not method.dense_at(i)), n_layers)
    looped = first < n_layers - 1 and not method.reads_keys
    out = [layer_counts(i, k_fixed[i], q[i], q_pre[i]) for i in range(first if looped else n_layers)]
    if looped:
        rest = jax.lax.map(lambda x: layer_counts(x[0], k_fixed[first], x[1], x[2]),
                           (jnp.arange(first, n_layers), q[first:], q_pre[first:]))
        out += [tuple(x[i] for x in rest) for i in range(n_layers - first)]
    # stacked (a few transfers, where one per layer and array took ~16 ms on an H200); a dense layer's one
    # column (Ts = 1) repeated to a per-token layer's T: the accounting averages a layer's columns
    ts = max(r.shape[-1] for r, _, _ in out)
    wide = lambda x: jnp.broadcast_to(x, x.shape[:-1] + (ts,))   # noqa: E731
    return (jnp.stack([wide(r) for r, _, _ in out]), jnp.stack([wide(m) for _, m, _ in out]),
            jnp.stack([o for _, _, o in out]))


# two programs, each compiled for its own shapes: the blocks' per question length, the steps' per batch
# and step bucket (one program for both compiled again for every pair)
@functools.partial(jax.jit, static_argnames=("method",))
def _block_counts_jit(method, index, k_fixed, caps, q_valid):
    """`_counts` of every row's question block: caps per layer {"q", "q_pre": [B, T, Hq, d]}, q_valid [B, T]."""
    q, q_pre = [jnp.stack([jnp.swapaxes(c[name], 1, 2) for c in caps]) for name in ("q", "q_pre")]
    return _counts(method, index, k_fixed, q, q_pre, q_valid)                 # S = B lookups


@functools.partial(jax.jit, static_argnames=("method", "n_steps"))
def _step_counts_jit(method, index, k_fixed, qbuf, n_steps):
    """`_counts` of the first n_steps decode steps of every row: qbuf [K, layers, n, B, Hq, 1, d]."""
    q, q_pre = [x[:, :n_steps].reshape(x.shape[0], -1, *x.shape[3:]) for x in (qbuf[0], qbuf[-1])]
    return _counts(method, index, k_fixed, q, q_pre, None)                   # S = n_steps * B: step i, row b at i * B + b


def _selections(counts, lookups, keep=None) -> list[Selection]:
    """One Selection per layer of the lookups `lookups` (indices into S) of `_lookup_counts`' host arrays:
    kv_rows and meta_rows [Hs, len(lookups) * Ts'] (a column per lookup token: Ts' = 1 for a block-level
    selection). keep [T] bool: a block's real tokens (a per-token method's padding tokens do not count)."""
    rows, meta, over = (x[:, lookups] for x in counts)                   # [layers, n, Hs, Ts] x2, [layers, n, Hs]
    if keep is not None and rows.shape[-1] == keep.shape[0] > 1:
        rows, meta = rows[..., keep], meta[..., keep]
    cols = lambda x: np.moveaxis(x, 1, 2).reshape(x.shape[0], x.shape[2], -1)   # [layers, Hs, n * Ts]  # noqa: E731
    return [Selection(None, r, m, o) for r, m, o in zip(cols(rows), cols(meta), over.any(1))]


def _model_dtype(model) -> str:
    """The model's compute dtype name (`LoadedModel.dtype`; float32 where a model has none)."""
    return jnp.dtype(getattr(model, "dtype", jnp.float32)).name


@functools.partial(jax.jit, static_argnames=("attn_fn", "greedy", "use_top_p"),
                   donate_argnames=("tok", "pos", "step", "cache", "qbuf"))
def _ask_step(graphdef, state, tok, pos, step, cache, qbuf, attn_state, key, temperature, top_p, *, attn_fn,
              greedy: bool, use_top_p: bool):
    """One decode step of `FixedContext.ask_many` with its inputs carried on the device.

    tok, pos int32 [B, 1], step int32 [1] (1 for the first step), the cache and qbuf [K, layers,
    n_pad, B, Hq, 1, d] (this step's roped queries, and with K = 2 its de-roped ones, are written
    at ``step - 1``, for the accounting after the loop) are donated and come back as the next
    step's, so every step runs on the same buffers, as `models.generate`'s carried step does. The
    sampled ids use the key folded with ``step``.
    -> (tok', pos + 1, step + 1, cache, qbuf, sampled ids int32 [B] for the host).
    """
    from models.forward import forward
    from models.generate import sample_logits

    logits, cache, caps = forward(graphdef, state, tok, pos, cache, attn_fn=attn_fn, attn_state=attn_state,
                                  capture_last=1, logits="last")
    nxt = sample_logits(logits[:, -1], jax.random.fold_in(key, step[0]), temperature, top_p, greedy=greedy,
                        use_top_p=use_top_p)                                      # int32 [B]
    # [K, layers, B, Hq, 1, d]: c[name] is [B, 1, Hq, d]
    q = jnp.stack([jnp.stack([jnp.swapaxes(c[name], 1, 2) for c in caps]) for name in ("q", "q_pre")[:qbuf.shape[0]]])
    qbuf = jax.lax.dynamic_update_slice_in_dim(qbuf, q[:, :, None].astype(qbuf.dtype), step[0] - 1, axis=2)
    return nxt[:, None], pos + 1, step + 1, cache, qbuf, nxt


def _capacity(n: int) -> int:
    """Cache slots for n tokens: a multiple of 64, at least _BUCKET (fewer compilations)."""
    return max(_BUCKET, -(-n // 64) * 64)


@functools.partial(jax.jit, static_argnames=("greedy", "use_top_p"))
def _first_token(logits, key, temperature, top_p, *, greedy: bool, use_top_p: bool):
    """The token after each question: logits [B, T, V] -> int32 [B], key folded with 0 (one
    dispatch, where slicing, folding and sampling eagerly were three)."""
    from models.generate import sample_logits

    return sample_logits(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_p, greedy=greedy,
                         use_top_p=use_top_p)


def _host_tokens_positions(ids: np.ndarray, start_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [n] or [B, n] (−1 = left padding) -> (tokens, positions) int32 [B, n] (B = 1 for [n]) on the
    host: padding is token 0 at position −1, each row's real ids take positions start_pos, start_pos + 1, ..."""
    ids = np.asarray(ids, np.int32)
    ids = ids[None] if ids.ndim == 1 else ids
    pos = np.where(ids >= 0, start_pos + np.cumsum(ids >= 0, axis=1) - 1, -1).astype(np.int32)
    tokens = np.where(ids >= 0, ids, 0).astype(np.int32)
    return tokens, pos


def _tokens_positions(ids: np.ndarray, start_pos: int) -> tuple[jax.Array, jax.Array]:
    """`_host_tokens_positions` as device arrays."""
    tokens, pos = _host_tokens_positions(ids, start_pos)
    return jnp.asarray(tokens), jnp.asarray(pos)


def _block_length(n: int) -> int:
    """The length an n-token block is left-padded to: a multiple of _BUCKET (16) up to 128 tokens, then
    four steps per doubling (160, 192, 224, 256, 320, 384, ...) up to 2048, then multiples of 256.

    A prefill compiles once per length. Multiples of 16 made every 16 tokens of a long question, a
    text to score or a conversation asked again with its history (`ask(history=...)`) a new program:
    20-34 s for SmolLM2 on a 2-core CPU, 15-28 s for an 8B-shaped model on an H200
    (benchmarks/results/*_block_lengths/). Beyond 128 tokens a block gets less than 25% and at most
    255 tokens of padding; 129 to 2048 tokens take 16 programs instead of 120, 2049 to 8192 take 24
    instead of 384."""
    n = max(int(n), 1)
    step = min(256, max(_BUCKET, 1 << max((n - 1).bit_length() - 3, 0)))
    return -(-n // step) * step


def _left_pad(rows) -> np.ndarray:
    """B rows of ids [n_b] -> int32 [B, m], each left-padded with -1 to m = `_block_length` of the
    longest (fewer compilations)."""
    rows = [np.asarray(r, np.int32) for r in rows]
    m = _block_length(max(len(r) for r in rows))
    return np.stack([np.concatenate([np.full(m - len(r), -1, np.int32), r]) for r in rows])


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    return x
