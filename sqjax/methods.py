"""The attention methods as frozen configs with two operations.

    index, info = method.build(data)                       # offline, once per document
    selection   = method.select(index, layer, q, q_pre)    # traced, per query block / token

`data` is a `ContextData` (the document's roped K/V, the last fixed-context queries, de-roped
keys). `select` returns which fixed-context keys each head attends (`selection.Selection`);
attention itself is exact over those keys plus the user input (`attention.py`).

Budgets: `Squeezed` is set by its sparsity (fraction of clustered keys pruned on the
calibration queries; with `decode_calibration="token"` also on each calibration query alone,
for decode steps); QUEST, SnapKV, StreamingLLM and the oracle by `budget`, the fraction of
the fixed context's tokens attended (rounded up to whole pages for QUEST); SAAP by its number
of probes ℓ (selectivity follows from the bucket sizes). `expected_budget(L)` gives each
method's nominal KV budget at context length L; `budget.account` measures the real one.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp

from sqjax import baselines, precision, quest, saap, snapkv, squeezed
from sqjax._checks import check_choice, check_count, check_fraction, check_rank, check_seed, derived_seed
from sqjax.selection import Buckets, Pages, Selection, dense_selection, from_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContextData:
    """A prefilled fixed context: what every method's index is built from."""

    k: jax.Array          # [layers, Hkv, L, d] roped keys
    v: jax.Array          # [layers, Hkv, L, d]
    q_obs: jax.Array      # [layers, Hq, n, d] roped queries of the last n fixed-context tokens
    k_pre: jax.Array | None = None  # [layers, Hkv, L, d] de-roped keys (SAAP)
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

    def __post_init__(self):
        check_rank("k", self.k, 4, "[layers, Hkv, L, d]")
        check_rank("q_obs", self.q_obs, 4, "[layers, Hq, n, d]")
        if tuple(self.v.shape) != tuple(self.k.shape):
            raise ValueError(f"v shape {tuple(self.v.shape)} must equal k shape {tuple(self.k.shape)}")
        if self.k_pre is not None and tuple(self.k_pre.shape) != tuple(self.k.shape):
            raise ValueError(f"k_pre shape {tuple(self.k_pre.shape)} must equal k shape {tuple(self.k.shape)}")

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def length(self) -> int:
        return self.k.shape[2]


@dataclasses.dataclass(frozen=True)
class Method:
    """Base: subclasses set `name`, implement `build` and `_select`."""

    name: ClassVar[str] = "method"
    dense_layers: int = 0

    def __post_init__(self):
        check_count("dense_layers", self.dense_layers, 0)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "build" in cls.__dict__:   # every index build at full float32 matmul precision (sqjax.precision)
            cls.build = precision.index_build(cls.__dict__["build"])

    def build(self, data: ContextData):
        return None, {}

    def select(self, index, layer: int, q: jax.Array, q_pre: jax.Array | None, k_fixed: jax.Array,
               q_valid: jax.Array | None = None) -> Selection:
        """Keys to attend for queries q [Hq, T, d] at `layer` over k_fixed [Hkv, L, d].

        The first `dense_layers` layers are dense. q_pre: de-roped queries (SAAP only).
        q_valid [T] bool: padding queries (False) take no part in block-level selection.
        """
        if layer < self.dense_layers:
            return dense_selection(self.selection_heads(q.shape[0], k_fixed.shape[0]), k_fixed.shape[1])
        return self.select_sparse(index, layer, q, q_pre, k_fixed, q_valid)

    def select_sparse(self, index, layer, q, q_pre, k_fixed, q_valid=None) -> Selection:
        """`select` at a layer past the dense ones; `layer` may be traced (an index into the stacked
        index) unless the method `reads_keys`."""
        if q_valid is not None and self.block_level:
            return self._select(index, layer, q, q_pre, k_fixed, q_valid=q_valid)
        return self._select(index, layer, q, q_pre, k_fixed)

    #: True when one key set serves the whole query block (padding queries must not vote)
    block_level: ClassVar[bool] = False
    #: True when every layer attends the whole fixed context (full attention)
    always_dense: ClassVar[bool] = False
    #: True when a selection reads the fixed context's keys (not only its shape and the index): the
    #: oracle. The others select with a traced `layer` (an index into the stacked index) too.
    reads_keys: ClassVar[bool] = False

    def dense_at(self, layer: int) -> bool:
        """Whether `layer` attends the whole fixed context (its selection is `dense_selection`)."""
        return self.always_dense or layer < self.dense_layers

    def selection_heads(self, n_q_heads: int, n_kv_heads: int) -> int:
        """Hs: one key set per KV head unless the method selects per query head (vote="q")."""
        return n_q_heads if getattr(self, "vote", "kv") == "q" else n_kv_heads

    def _select(self, index, layer, q, q_pre, k_fixed) -> Selection:
        return dense_selection(self.selection_heads(q.shape[0], k_fixed.shape[0]), k_fixed.shape[1])

    def expected_budget(self, length: int) -> float:
        return 1.0

    def check_length(self, length: int) -> None:
        """Raise ValueError if the method cannot run over a `length`-token fixed context (checked
        by `FixedContext.build` before the prefill and by `with_method`, not at the first question)."""

    @property
    def label(self) -> str:
        return self.name


def _ids_to_mask(ids: jax.Array, n: int) -> jax.Array:
    """ids [H, K] int (−1 = none) -> bool [H, n] (a scatter: no [H, K, n] intermediate)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], n), bool).at[rows, jnp.where(ids >= 0, ids, n)].set(True, mode="drop")


def _kept_rows(keep: jax.Array) -> squeezed.Retrieval:
    """keep [Hs, L] bool -> the kept positions as a compact retrieval (idx [Hs, L], −1 past each
    head's count), which `dispatch.attention` gathers without a GPU up to the largest count."""
    pos = jax.vmap(lambda m: jnp.nonzero(m, size=m.shape[0], fill_value=-1)[0])(keep).astype(jnp.int32)
    return squeezed.Retrieval(pos, jnp.sum(keep, axis=-1, dtype=jnp.int32), jnp.zeros(pos.shape[:1], bool))


def _kernel_backend(q) -> str | None:
    """The Pallas backend ("pallas" or "interpret") for a one-token lookup, else None
    (blocks of tokens and the reference backend keep the per-token masks)."""
    from sqjax import dispatch

    b = dispatch.resolved()
    return b if (q.shape[1] == 1 and b != "reference") else None


@dataclasses.dataclass(frozen=True)
class Full(Method):
    """Exact attention over the whole fixed context."""

    name: ClassVar[str] = "full"
    always_dense: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class Squeezed(Method):
    """Squeezed Attention, one level of centroids (see `squeezed.py`)."""

    name: ClassVar[str] = "squeezed"
    sparsity: float = 0.9
    centroid_fraction: float = 0.05
    n_centroids: int | None = None
    n_obs: int = 100
    n_sink: int = 0
    vote: str = "kv"
    capacity_fraction: float | None = None
    kmeans_iters: int = 25
    kmeans_init: str = "kmeans++"
    seed: int = 0
    deterministic_build: bool = False   # GPU: bit-identical index from the same document and seed, 1.3-2.2x slower build
    decode_calibration: str = "window"  # "token": decode steps get thresholds calibrated on single queries
    lookup_int8: bool = False            # prefill (block) lookups from int8 q and centroids: ~20% faster kernels

    def __post_init__(self):
        super().__post_init__()
        self.config  # validate

    @property
    def config(self) -> squeezed.SqueezedConfig:
        return squeezed.SqueezedConfig(
            sparsity=self.sparsity, centroid_fraction=self.centroid_fraction, n_centroids=self.n_centroids,
            n_obs=self.n_obs, n_sink=self.n_sink, vote=self.vote, capacity_fraction=self.capacity_fraction,
            kmeans_iters=self.kmeans_iters, kmeans_init=self.kmeans_init, seed=self.seed,
            deterministic_build=self.deterministic_build, decode_calibration=self.decode_calibration,
            lookup_int8=self.lookup_int8, **self._hier_kwargs(),
        )

    def _hier_kwargs(self) -> dict:
        return {}

    def build(self, data: ContextData):
        return squeezed.build_squeezed_index(data.k, data.q_obs, self.config, data.scale)

    block_level: ClassVar[bool] = True

    def _select(self, index: squeezed.SqueezedIndex, layer, q, q_pre, k_fixed, q_valid=None) -> Selection:
        length = k_fixed.shape[1]
        ret, touched = squeezed.lookup(
            index.layer(layer), q, *index.thresholds(q.shape[1]),
            scale=1.0 / math.sqrt(q.shape[-1]), vote=self.vote, n_tail=index.n_tail, capacity=index.capacity,
            q_valid=q_valid, n_sink=index.n_sink, int8=self.lookup_int8,
        )
        mask = squeezed.retrieval_mask(ret, length)[:, None, :]
        return Selection(mask, ret.count[:, None], touched[:, None].astype(jnp.float32), ret.overflow, ret)

    def check_length(self, length: int) -> None:
        self.config.check_length(length, self.label)

    def expected_budget(self, length: int) -> float:
        lc = length - self.n_obs - self.n_sink
        c2 = self.config.n_clusters(lc)[0]
        return ((1 - self.sparsity) * lc + self.n_obs + self.n_sink + c2 / 2) / length

    @property
    def label(self) -> str:
        sink = f"+sink{self.n_sink}" if self.n_sink else ""
        phase = "" if self.decode_calibration == "window" else f"/{self.decode_calibration}"
        return f"{self.name}{sink}@{self.sparsity:g}{phase}{'/int8' if self.lookup_int8 else ''}"


@dataclasses.dataclass(frozen=True)
class HierarchicalSqueezed(Squeezed):
    """Squeezed Attention with a level-1 clustering of the centroids (Eq. 2–3)."""

    name: ClassVar[str] = "hsqueezed"
    level1_fraction: float = 0.01
    level1_prune: float = 0.5

    def _hier_kwargs(self) -> dict:
        return dict(hierarchical=True, level1_fraction=self.level1_fraction, level1_prune=self.level1_prune)

    def expected_budget(self, length: int) -> float:
        lc = length - self.n_obs - self.n_sink
        c2, c1 = self.config.n_clusters(lc)
        return ((1 - self.sparsity) * lc + self.n_obs + self.n_sink + (c1 + (1 - self.level1_prune) * c2) / 2) / length


def _budget_tokens(budget: float, length: int, multiple: int = 1) -> int:
    n = math.ceil(budget * length / multiple) * multiple
    return max(multiple, min(n, -(-length // multiple) * multiple))


@dataclasses.dataclass(frozen=True)
class BudgetMethod(Method):
    """A method set by `budget`: the fraction of the fixed context's tokens it attends."""

    budget: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        check_fraction("budget", self.budget, inclusive_high=True)

    def expected_budget(self, length: int) -> float:
        return min(length, _budget_tokens(self.budget, length)) / length

    @property
    def label(self) -> str:
        return f"{self.name}@{self.budget:g}"


@dataclasses.dataclass(frozen=True)
class Quest(BudgetMethod):
    """QUEST: top-K pages by the min/max upper bound, per token (see `quest.py`)."""

    name: ClassVar[str] = "quest"
    page: int = 16
    vote: str = "kv"
    dense_layers: int = 2

    def __post_init__(self):
        super().__post_init__()
        check_count("page", self.page, 1)
        check_choice("vote", self.vote, squeezed.VOTES)

    def build(self, data: ContextData):
        kmin, kmax = jax.vmap(lambda k: quest.page_bounds(k, self.page))(data.k)
        return {"kmin": kmin, "kmax": kmax}, {}

    def n_pages(self, length: int) -> int:
        return _budget_tokens(self.budget, length, self.page) // self.page

    def _select(self, index, layer, q, q_pre, k_fixed) -> Selection:
        length = k_fixed.shape[1]
        kmin, kmax = index["kmin"][layer], index["kmax"][layer]
        n_p = kmin.shape[1]
        backend = _kernel_backend(q)
        if backend:  # decode on a Pallas backend: page scores + top-K pages for the page-sparse kernel
            from pallas_kernels import quest_page_scores, quest_select

            scores = quest_page_scores(q[:, 0], kmin, kmax, vote=self.vote, backend=backend)  # [Hs, P]
            page_idx = quest_select(scores, self.n_pages(length), force_page=n_p - 1)
            pages = _ids_to_mask(page_idx, n_p)[:, None, :]
        else:
            scores = quest.page_scores(q, kmin, kmax, self.vote)  # [Hs, T, P]
            pages = quest.select_pages(scores, self.n_pages(length), forced_page=n_p - 1)
        mask = quest.pages_to_keys(pages, length, self.page)
        sel = from_mask(mask, meta_rows=2.0 * n_p)
        if backend:
            return sel._replace(retrieval=Pages(page_idx, self.page))
        from sqjax import dispatch

        if q.shape[1] == 1 and dispatch.cpu_gathers():   # decode without a GPU: the pages' rows, gathered
            pos = quest.page_rows(scores[:, 0], self.n_pages(length), n_p - 1, length, self.page)
            n = jnp.full((pos.shape[0],), pos.shape[1], jnp.int32)
            return sel._replace(retrieval=squeezed.Retrieval(pos, n, jnp.zeros(pos.shape[:1], bool)))
        return sel

    def expected_budget(self, length: int) -> float:
        n_pages = -(-length // self.page)
        return (min(self.n_pages(length) * self.page, length) + n_pages) / length


@dataclasses.dataclass(frozen=True)
class SnapKV(BudgetMethod):
    """SnapKV: observation-window voting at indexing time, a compressed static cache."""

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 7
    pool: str = "max"

    def __post_init__(self):
        super().__post_init__()
        check_count("window", self.window, 1)
        snapkv.check_kernel(self.kernel)
        check_choice("pool", self.pool, snapkv.POOLS)

    def capacity(self, length: int) -> int:
        return max(self.window, min(length, round(self.budget * length)))

    def check_length(self, length: int) -> None:
        if length <= self.window:   # the window's queries vote on the keys before it
            raise ValueError(f"the fixed context (the document and any chat template around it) has {length} tokens, "
                             f"not more than SnapKV's observation window of {self.window}: it needs at least "
                             f"{self.window + 1} tokens; give a longer document or a smaller window")

    def build(self, data: ContextData):
        if data.q_obs.shape[2] < self.window:
            raise ValueError(f"SnapKV needs the queries of the last {self.window} tokens; got {data.q_obs.shape[2]} (a "
                             "context prefilled for another method keeps max(100, its window)): build it for this "
                             "method with FixedContext.build(model, document, method)")
        cap = self.capacity(data.length)
        keep = jnp.stack([
            snapkv.snapkv_keep(data.q_obs[i, :, -self.window:], data.k[i], cap, data.scale, self.kernel, self.pool)
            for i in range(data.n_layers)
        ])
        return {"keep": keep}, {"capacity": cap}

    def _select(self, index, layer, q, q_pre, k_fixed) -> Selection:
        from sqjax import dispatch

        keep = index["keep"][layer]                                      # [Hkv, L]
        sel = from_mask(keep[:, None, :])
        if not dispatch.cpu_gathers():
            return sel
        # without a GPU: the kept positions, which `dispatch.attention` gathers up to their count (a block's
        # tokens all see them). Sized by L, not by `capacity`: the budget is build-only (the quality
        # harness runs every SnapKV index through one canonical budget)
        return sel._replace(retrieval=_kept_rows(keep))

    def expected_budget(self, length: int) -> float:
        return self.capacity(length) / length


@dataclasses.dataclass(frozen=True)
class StreamingLLM(BudgetMethod):
    """Attention sink + recent window of the fixed context."""

    name: ClassVar[str] = "streaming"
    n_sink: int = 4

    def __post_init__(self):
        super().__post_init__()
        check_count("n_sink", self.n_sink, 0)

    def n_recent(self, length: int) -> int:
        """The recent window at context length `length`: the budget's tokens after the sink (which
        must fit in them: a sink past the budget would attend more than the label says)."""
        n = _budget_tokens(self.budget, length)
        if self.n_sink > n:
            raise ValueError(f"n_sink ({self.n_sink}) exceeds the budget: budget {self.budget:g} of the {length}-token "
                             f"fixed context is {n} tokens; use a smaller n_sink or a larger budget")
        return n - self.n_sink

    def check_length(self, length: int) -> None:
        self.n_recent(length)

    def _select(self, index, layer, q, q_pre, k_fixed) -> Selection:
        length = k_fixed.shape[1]
        mask = baselines.streaming_mask(length, self.n_sink, self.n_recent(length))
        return from_mask(jnp.broadcast_to(mask, (k_fixed.shape[0], 1, length)))

    def expected_budget(self, length: int) -> float:
        return (self.n_sink + self.n_recent(length)) / length


@dataclasses.dataclass(frozen=True)
class Oracle(BudgetMethod):
    """True top-k keys by attention weight at the same budget, per token (App. H upper bound)."""

    name: ClassVar[str] = "oracle"
    n_tail: int = 100
    vote: str = "kv"

    def __post_init__(self):
        super().__post_init__()
        check_count("n_tail", self.n_tail, 0)
        check_choice("vote", self.vote, squeezed.VOTES)

    reads_keys: ClassVar[bool] = True

    def _select(self, index, layer, q, q_pre, k_fixed) -> Selection:
        length = k_fixed.shape[1]
        n_tail = min(self.n_tail, length)
        n_keep = max(0, _budget_tokens(self.budget, length) - n_tail)
        mask = baselines.oracle_topk_mask(q, k_fixed, 1.0 / math.sqrt(q.shape[-1]), n_keep, n_tail, self.vote)
        return from_mask(mask)


# The attention sink sqjax's own defaults keep exact for Squeezed (`FixedContext.build` without a
# method, `sqjax index`, the demo). The class default, n_sink=0, is the paper exactly; on SmolLM2 it
# drops the sink token and reads 13x the decode KL at 90% (0.305 vs 0.023, README quality table).
DEFAULT_SINK = 1


def saap_defaults(length: int) -> tuple[int, int]:
    """(buckets C, recent tokens) scaled with the context (SAAP App. E.2: 1+63 ≈ 1+2047 quality)."""
    if length >= 65536:
        return 1024, 2047
    if length >= 16384:
        return max(256, length // 64), 511
    return max(16, length // 64), 63


@dataclasses.dataclass(frozen=True)
class Saap(Method):
    """SAAP: de-roped k-means buckets, top-ℓ buckets per query + the dense part.

    `classifier`: None = nearest-centroid assignment (SAAP's k-means ablation); a path to a
    trained query classifier (train_qclassifier) = the full method. `n_buckets`/`n_recent`
    None = scaled with the context length (`saap_defaults`).
    """

    name: ClassVar[str] = "saap"
    probes: int = 32
    n_buckets: int | None = None
    n_sink: int = 1
    n_recent: int | None = None
    dense_layers: int = 1
    classifier: str | None = None
    kmeans_iters: int = 10
    seed: int = 0
    deterministic_build: bool = False   # GPU: bit-identical k-means buckets from the same document and seed

    def __post_init__(self):
        super().__post_init__()
        check_count("probes", self.probes, 1)
        check_count("n_buckets", self.n_buckets, 1, optional=True)
        check_count("n_sink", self.n_sink, 0)
        check_count("n_recent", self.n_recent, 0, optional=True)
        check_count("kmeans_iters", self.kmeans_iters, 0)
        check_seed("seed", self.seed)

    def sizes(self, length: int) -> tuple[int, int]:
        c, r = saap_defaults(length)
        return c if self.n_buckets is None else self.n_buckets, r if self.n_recent is None else self.n_recent

    def build(self, data: ContextData):
        from sqjax.kmeans import KMeansConfig, spherical_kmeans

        if data.k_pre is None:
            raise ValueError("SAAP needs de-roped keys (ContextData.k_pre)")
        c, n_recent = self.sizes(data.length)
        assigner = None
        if self.classifier is not None:
            from train_qclassifier.classifier import load_classifier

            assigner = load_classifier(self.classifier)
            hq = data.q_obs.shape[1]
            assigner.check_compatible(num_layers=data.n_layers, num_heads=hq, num_kv_heads=data.k.shape[1],
                                      head_dim=data.k.shape[-1])  # a classifier of another model: clear error
            unit = assigner.unit_centroids  # [layers, Hkv, C, d] trained offline
            c = unit.shape[2]
        else:
            if c > data.length:
                default = " (the default for this length)" if self.n_buckets is None else ""
                raise ValueError(f"SAAP's k-means needs at least as many fixed-context tokens as buckets: n_buckets={c}"
                                 f"{default} > {data.length} tokens; use a longer document or a smaller n_buckets")
            km = [spherical_kmeans(data.k_pre[i], KMeansConfig(c, self.kmeans_iters, seed=derived_seed(self.seed, i),
                                                               deterministic=self.deterministic_build))
                  for i in range(data.n_layers)]
            unit = jnp.stack([r.unit_centroids for r in km])
        if self.probes >= c:
            warnings.warn(f"Saap(probes={self.probes}) visits all {c} buckets of this {data.length}-token context, so "
                          f"it reads every key (KV budget >= 1); pass probes < {c} for a sparse read", stacklevel=3)
        labels = jnp.stack([saap.assign_keys(data.k_pre[i], unit[i]) for i in range(data.n_layers)])
        off, lst = jax.vmap(lambda lab: saap.inverted_lists(lab, c))(labels)
        index = {"unit": unit, "labels": labels, "off": off, "lst": lst}
        if assigner is not None:
            index["classifier"] = assigner.params
        return index, {"n_buckets": c, "n_recent": n_recent}

    def _select(self, index, layer, q, q_pre, k_fixed) -> Selection:
        length = k_fixed.shape[1]
        if q_pre is None:
            raise ValueError("SAAP needs de-roped queries")
        c, n_recent = self.sizes(length)
        unit = index["unit"][layer]
        if "classifier" in index:
            from train_qclassifier.classifier import bucket_distribution

            scores = bucket_distribution(jax.tree.map(lambda a: a[layer], index["classifier"]), q_pre)
            meta = sum(x.size for x in jax.tree.leaves(index["classifier"])) / index["unit"].shape[0] / q.shape[-1]
        else:
            scores = saap.nearest_centroid_scores(q_pre, unit)
            meta = float(unit.shape[-2])  # C key-sized centroid rows per KV head
        from sqjax import dispatch

        backend = _kernel_backend(q)
        if backend:  # decode on a Pallas backend: the visited buckets' ids for the bucket kernel
            probes = min(self.probes, scores.shape[-1])
            bucket_idx = jax.lax.top_k(scores[:, 0], probes)[1].astype(jnp.int32)  # [Hkv, l]
            visited = _ids_to_mask(bucket_idx, scores.shape[-1])[:, None, :]
        else:
            visited = saap.visited_buckets(scores, self.probes)
        mask = saap.saap_mask(visited, index["labels"][layer], saap.dense_part(length, self.n_sink, n_recent))
        sel = from_mask(mask, meta_rows=meta)
        if backend:
            sel = sel._replace(retrieval=Buckets(index["off"][layer], index["lst"][layer], bucket_idx,
                                                 self.n_sink, n_recent))
        elif q.shape[1] == 1 and dispatch.cpu_gathers():  # decode without a GPU: the visited rows, gathered
            sel = sel._replace(retrieval=_kept_rows(mask[:, 0]))
        return sel

    def expected_budget(self, length: int) -> float:
        c, n_recent = self.sizes(length)
        return min(1.0, (self.n_sink + n_recent + self.probes * length / c) / length)

    @property
    def label(self) -> str:
        kind = "clf" if self.classifier else "nc"
        return f"{self.name}-{kind}@{self.probes}"


METHODS = {m.name: m for m in (Full, Squeezed, HierarchicalSqueezed, Quest, SnapKV, StreamingLLM, Oracle, Saap)}


def method_from_name(name: str, **kwargs) -> Method:
    """Build a method config by its CLI name (`squeezed`, `hsqueezed`, `quest`, ...)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name](**kwargs)
