"""Squeezed Attention (Hooper et al. 2024, §3 and App. C/D/I): clustered keys, centroid lookup.

Per layer and KV head, the fixed context's keys (all but the exact tail of `n_tail` tokens) are
clustered with spherical k-means; a query retrieves the clusters whose score

    Eq. 1   S_i = exp(s·q·C_i) / Σ_j N_j · exp(s·q·C_j)

exceeds a global threshold T (calibrated once over all layers × heads, see `calibration.py`;
optionally a second pair of thresholds for decode steps, calibrated on single queries).
A block of query tokens (prefill) averages S_i over its tokens and retrieves one set per head;
decode retrieves per token. GQA: by default the g query heads of a group vote (mean of their
S_i), so one key set is read per KV head (vote="kv"); vote="q" selects per query head.

Hierarchical (§3.3, Eq. 2–3): level-1 centroids cluster the level-2 centroids; level-1
clusters with S < T1 are dropped, the survivors' level-2 children are scored with a
denominator that sums over the surviving level-2 clusters only, and S > T2 is retrieved.

Retrieved sets leave as `Retrieval`: int32 key positions with a static capacity plus per-head
counts (the exact tail first), the form the sparse-attention kernels read.

Overflow policy (never silent): when the selected clusters hold more keys than the capacity,
whole clusters are kept in descending score order until the next one would not fit, and
`overflow` is set for that head; `FixedContext` reports it in every answer's stats.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sqjax._checks import (check_choice, check_count, check_fraction, check_gqa, check_rank, check_same, check_seed,
                           derived_seed, shape_of)
from sqjax import precision

VOTES = ("kv", "q")


def _check_vote(vote: str) -> None:
    check_choice("vote", vote, VOTES)


def selection_heads(n_q_heads: int, n_kv_heads: int, vote: str) -> int:
    """Hs: KV heads when the group votes, query heads otherwise."""
    _check_vote(vote)
    return n_kv_heads if vote == "kv" else n_q_heads


def per_selection_head(x: jax.Array, n_sel_heads: int) -> jax.Array:
    """Repeat a per-KV-head array [Hkv, ...] to [Hs, ...] (identity when Hs == Hkv)."""
    return x if x.shape[0] == n_sel_heads else jnp.repeat(x, n_sel_heads // x.shape[0], axis=0)


# ---------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------

def _normalised_scores(logits: jax.Array, weights: jax.Array, live: jax.Array) -> jax.Array:
    """S = exp(x_i − m) / Σ_j N_j exp(x_j − m) over clusters that are `live` (last axis).

    logits/weights/live broadcast to [..., C]; dead clusters score exactly 0; no NaN when
    nothing is live.
    """
    x = jnp.where(live, logits, -jnp.inf)
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(live, jnp.exp(x - m), 0.0)
    den = jnp.sum(weights * e, axis=-1, keepdims=True)
    return jnp.where(den > 0, e / jnp.maximum(den, 1e-30), 0.0)


def _group_logits(q: jax.Array, centroids: jax.Array, scale: float) -> jax.Array:
    """s·q·C for every (query head, token, centroid): [Hkv, g, T, C] f32."""
    hq, t, d = q.shape
    hkv = centroids.shape[0]
    g = hq // hkv
    qg = q.astype(jnp.float32).reshape(hkv, g, t, d)
    return jnp.einsum("kgtd,kcd->kgtc", qg, centroids.astype(jnp.float32)) * scale


def _vote(s_kgc: jax.Array, vote: str) -> jax.Array:
    """[Hkv, g, C] per-query-head scores -> [Hs, C]."""
    if vote == "kv":
        return jnp.mean(s_kgc, axis=1)
    return s_kgc.reshape(-1, s_kgc.shape[-1])


def _check_lookup_inputs(q, centroids, counts, q_valid=None):
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("centroids", centroids, 3, "[Hkv, C, d]")
    check_rank("counts", counts, 2, "[Hkv, C]")
    check_same("head dim", [("q", q.shape[-1]), ("centroids", centroids.shape[-1])])
    check_same("KV heads", [("centroids", centroids.shape[0]), ("counts", counts.shape[0])])
    check_same("clusters", [("centroids", centroids.shape[1]), ("counts", counts.shape[1])])
    check_gqa(q.shape[0], centroids.shape[0])
    if q.shape[1] < 1:
        raise ValueError(f"need at least one query token; got q shape {shape_of(q)}")
    if centroids.shape[1] < 1:
        raise ValueError(f"need at least one cluster; got centroids shape {shape_of(centroids)}")
    if q_valid is not None:
        check_rank("q_valid", q_valid, 1, "[T]")
        check_same("query tokens", [("q", q.shape[1]), ("q_valid", q_valid.shape[0])])


def cluster_scores(
    q: jax.Array,          # [Hq, T, d] roped queries (T = 1 for decode)
    centroids: jax.Array,  # [Hkv, C, d]
    counts: jax.Array,     # [Hkv, C] keys per cluster (0 = empty: never scores)
    scale: float,
    vote: str = "kv",
    q_valid: jax.Array | None = None,  # [T] bool; padding tokens (False) are left out of the mean
    int8: bool = False,
) -> jax.Array:
    """Eq. 1 averaged over the T query tokens (and over the group when vote="kv").  -> [Hs, C] f32.
    ``int8``: a block's logits from int8 q and centroids (`SqueezedConfig.lookup_int8`)."""
    _check_lookup_inputs(q, centroids, counts, q_valid)
    _check_vote(vote)
    from sqjax import dispatch

    int8 = int8 and _is_block(q, q_valid)
    s = dispatch.cluster_scores(q, centroids, counts, scale, vote, q_valid, int8=int8)
    if s is not None:
        return s
    if int8:
        q, centroids = _quantized(q, centroids)
    logits = _group_logits(q, centroids, scale)  # [Hkv, g, T, C]
    w = counts.astype(jnp.float32)[:, None, None, :]
    s = _normalised_scores(logits, w, (counts > 0)[:, None, None, :])
    return _vote(_token_mean(s, q_valid), vote)


def _is_block(q: jax.Array, q_valid: jax.Array | None) -> bool:
    """Whether a lookup is a block's (the prefill kernels; `lookup_int8` applies) rather than one decode query's."""
    return q.shape[1] > 1 or q_valid is not None


def _quantized(q: jax.Array, *centroids: jax.Array) -> tuple[jax.Array, ...]:
    """The int8 lookup's inputs, scaled back in f32 (what the kernels compute with; `_group_logits`
    works in f32, so no rounding back to q's dtype)."""
    from pallas_kernels.centroid_lookup import quantized_inputs

    return quantized_inputs(q, *centroids)


def _token_mean(s: jax.Array, q_valid: jax.Array | None) -> jax.Array:
    """Mean over the token axis (2) of [Hkv, g, T, C], over valid tokens only (the kernels' own rule)."""
    from pallas_kernels._common import token_mean

    return token_mean(s, q_valid, 2)


class HierarchicalScores(NamedTuple):
    scores: jax.Array     # [Hs, C2] Eq. 3 scores (0 for clusters whose parent was dropped)
    level1: jax.Array     # [Hs, C1] Eq. 2 scores
    survivors: jax.Array  # [Hs, C2] bool: level-2 clusters whose parent survived (candidates)
    n_touched: jax.Array  # [Hs] int32 centroids read: C1 + candidates


def hierarchical_scores(
    q: jax.Array,           # [Hq, T, d]
    centroids1: jax.Array,  # [Hkv, C1, d]
    counts1: jax.Array,     # [Hkv, C1] keys under each level-1 cluster
    centroids2: jax.Array,  # [Hkv, C2, d]
    counts2: jax.Array,     # [Hkv, C2]
    parent: jax.Array,      # [Hkv, C2] int32 level-1 parent of each level-2 cluster
    threshold1: jax.Array | float,
    scale: float,
    vote: str = "kv",
    q_valid: jax.Array | None = None,
    int8: bool = False,
) -> HierarchicalScores:
    """Eq. 2 on level 1, drop S1 < T1, then Eq. 3 over the surviving level-2 clusters (``int8``: as
    in `cluster_scores`)."""
    _check_lookup_inputs(q, centroids2, counts2, q_valid)
    _check_vote(vote)
    check_rank("parent", parent, 2, "[Hkv, C2]")
    check_same("level-2 clusters", [("centroids2", centroids2.shape[1]), ("parent", parent.shape[1])])
    from sqjax import dispatch

    int8 = int8 and _is_block(q, q_valid)
    h = dispatch.hierarchical_scores(q, centroids1, counts1, centroids2, counts2, parent, threshold1, scale, vote,
                                     q_valid, int8=int8)
    if h is not None:
        return HierarchicalScores(*h)
    if int8:
        q, centroids1, centroids2 = _quantized(q, centroids1, centroids2)
    hq, hkv = q.shape[0], centroids2.shape[0]
    g = hq // hkv
    s1 = cluster_scores(q, centroids1, counts1, scale, vote, q_valid)  # [Hs, C1]
    hs = s1.shape[0]
    keep1 = (s1 >= threshold1) & per_selection_head(counts1 > 0, hs)
    cand = jnp.take_along_axis(keep1, per_selection_head(parent, hs), axis=-1)  # [Hs, C2]
    cand = cand & per_selection_head(counts2 > 0, hs)
    # Candidates per query head (a voted set is shared by the group's g heads).
    cand_q = cand.reshape(hkv, -1, cand.shape[-1])
    cand_q = jnp.broadcast_to(cand_q, (hkv, g, cand.shape[-1])) if vote == "kv" else cand_q
    logits = _group_logits(q, centroids2, scale)  # [Hkv, g, T, C2]
    w = counts2.astype(jnp.float32)[:, None, None, :]
    s2 = _normalised_scores(logits, w, cand_q[:, :, None, :])
    s2 = _vote(_token_mean(s2, q_valid), vote)
    n_touched = centroids1.shape[1] + jnp.sum(cand, axis=-1).astype(jnp.int32)
    return HierarchicalScores(s2, s1, cand, n_touched)


# ---------------------------------------------------------------------------------------------
# Retrieved key positions with a static capacity
# ---------------------------------------------------------------------------------------------

class Retrieval(NamedTuple):
    idx: jax.Array       # [Hs, cap] int32 fixed-context positions (Squeezed: exact sink + tail first; past count: 0)
    count: jax.Array     # [Hs] int32 valid entries of idx (tail included)
    overflow: jax.Array  # [Hs] bool: selected clusters did not all fit in the capacity


def cluster_layout(labels: jax.Array, n_clusters: int) -> tuple[jax.Array, jax.Array]:
    """Positions grouped by cluster (stable) and CSR offsets.  labels [..., N] -> perm [..., N], offsets [..., C+1]."""
    perm = jnp.argsort(labels, axis=-1, stable=True).astype(jnp.int32)
    counts = jax.vmap(lambda l: jnp.bincount(l, length=n_clusters))(labels.reshape(-1, labels.shape[-1]))
    counts = counts.reshape(labels.shape[:-1] + (n_clusters,))
    offsets = jnp.concatenate(
        [jnp.zeros(counts.shape[:-1] + (1,), jnp.int32), jnp.cumsum(counts, axis=-1).astype(jnp.int32)], axis=-1
    )
    return perm, offsets


def search_method() -> str:
    """`jnp.searchsorted`'s method where the program runs: unrolled on accelerators (a while loop's
    every iteration is a host round trip on a GPU), a loop on a CPU (the unrolled search over a
    retrieval's slots took 2.4× as long there: benchmarks/results/cpu_gather_decode/layer_probe.log)."""
    return "scan" if jax.default_backend() == "cpu" else "scan_unrolled"


def _retrieve_one(selected, scores, counts, perm, offsets, n_tail: int, n_clustered: int, capacity: int, n_sink: int):
    """One selection head.  selected/scores/counts [C], perm [Lc], offsets [C+1]."""
    budget = capacity - n_tail - n_sink
    key = jnp.where(selected, scores, -jnp.inf)
    order = jnp.argsort(-key, stable=True)
    sel_sorted = selected[order]
    n_sorted = jnp.where(sel_sorted, counts[order], 0).astype(jnp.int32)
    cum = jnp.cumsum(n_sorted)
    keep = sel_sorted & (cum <= budget)
    overflow = jnp.any(sel_sorted & ~keep)
    n_keep = jnp.where(keep, n_sorted, 0)
    cum_keep = jnp.cumsum(n_keep)
    total = cum_keep[-1] if n_keep.shape[0] else jnp.int32(0)
    if budget >= n_clustered:
        # (static) every selected cluster fits: the count and the overflow need no order, so a caller
        # that reads only them (`FixedContext`'s accounting) compiles without the sort
        total = jnp.sum(jnp.where(selected, counts, 0)).astype(jnp.int32)
        overflow = jnp.zeros((), bool)
    slots = jnp.arange(budget, dtype=jnp.int32)
    r = jnp.searchsorted(cum_keep, slots, side="right", method=search_method())
    r = jnp.minimum(r, order.shape[0] - 1)
    c = order[r]
    start = cum_keep[r] - n_keep[r]
    src = offsets[c] + (slots - start)
    pos = perm[jnp.clip(src, 0, max(n_clustered - 1, 0))] + n_sink
    pos = jnp.where(slots < total, pos, 0)
    exact = jnp.concatenate([jnp.arange(n_sink, dtype=jnp.int32), jnp.arange(n_tail, dtype=jnp.int32) + n_sink + n_clustered])
    return jnp.concatenate([exact, pos.astype(jnp.int32)]), (n_sink + n_tail + total).astype(jnp.int32), overflow


def retrieve(
    selected: jax.Array,  # [Hs, C] bool
    scores: jax.Array,    # [Hs, C] f32 (orders clusters when the capacity overflows)
    counts: jax.Array,    # [Hkv, C]
    perm: jax.Array,      # [Hkv, Lc] clustered positions grouped by cluster
    offsets: jax.Array,   # [Hkv, C+1]
    n_tail: int,
    capacity: int,
    n_sink: int = 0,
) -> Retrieval:
    """Expand selected clusters to key positions (static capacity, exact sink + tail first).

    Clustered keys are positions [n_sink, n_sink + Lc); perm holds them relative to n_sink.
    """
    check_rank("selected", selected, 2, "[Hs, C]")
    check_rank("scores", scores, 2, "[Hs, C]")
    check_rank("counts", counts, 2, "[Hkv, C]")
    check_rank("perm", perm, 2, "[Hkv, Lc]")
    check_rank("offsets", offsets, 2, "[Hkv, C+1]")
    check_same("selection heads", [("selected", selected.shape[0]), ("scores", scores.shape[0])])
    check_same("KV heads", [("counts", counts.shape[0]), ("perm", perm.shape[0]), ("offsets", offsets.shape[0])])
    check_same("clusters", [("selected", selected.shape[1]), ("scores", scores.shape[1]), ("counts", counts.shape[1]),
                            ("offsets - 1", offsets.shape[1] - 1)])
    check_gqa(selected.shape[0], counts.shape[0], "selection heads of selected and scores")
    check_count("n_tail", n_tail, 0)
    check_count("n_sink", n_sink, 0)
    hs = selected.shape[0]
    n_clustered = perm.shape[-1]
    if capacity < n_tail + n_sink:
        raise ValueError(f"capacity ({capacity}) must hold at least the exact sink + tail ({n_sink} + {n_tail})")
    capacity = min(capacity, n_sink + n_tail + n_clustered)
    f = lambda s, sc, cn, p, o: _retrieve_one(s, sc, cn, p, o, n_tail, n_clustered, capacity, n_sink)  # noqa: E731
    idx, count, overflow = jax.vmap(f)(
        selected, scores,
        per_selection_head(counts, hs), per_selection_head(perm, hs), per_selection_head(offsets, hs),
    )
    return Retrieval(idx, count, overflow)


def retrieval_mask(ret: Retrieval, n_fixed: int) -> jax.Array:
    """Boolean mask [Hs, L] of the retrieved positions."""
    valid = jnp.arange(ret.idx.shape[-1])[None, :] < ret.count[:, None]
    f = lambda i, v: jnp.zeros((n_fixed,), bool).at[i].max(v)  # noqa: E731
    return jax.vmap(f)(ret.idx, valid)


# ---------------------------------------------------------------------------------------------
# Index (per layer, stacked over layers)
# ---------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SqueezedLayerIndex:
    """Clusters of one layer's fixed-context keys (arrays may carry a leading layer axis)."""

    centroids: jax.Array   # [Hkv, C, d] means of the un-normalised keys
    counts: jax.Array      # [Hkv, C] int32
    labels: jax.Array      # [Hkv, Lc] int32 cluster of each clustered key
    perm: jax.Array        # [Hkv, Lc] int32 positions grouped by cluster
    offsets: jax.Array     # [Hkv, C+1] int32 CSR offsets into perm
    centroids1: jax.Array  # [Hkv, C1, d] level-1 centroids (C1 = 0 for one level)
    counts1: jax.Array     # [Hkv, C1] int32 keys under each level-1 cluster
    parent: jax.Array      # [Hkv, C] int32 level-1 parent of each level-2 cluster


def layer_scores(index: SqueezedLayerIndex, q: jax.Array, threshold1, scale: float, vote: str, q_valid=None,
                 int8: bool = False):
    """Final cluster scores [Hs, C] and centroids read [Hs] for one layer (1- or 2-level)."""
    hs = selection_heads(q.shape[0], index.centroids.shape[0], vote)
    if index.centroids1.shape[-2] == 0:
        s = cluster_scores(q, index.centroids, index.counts, scale, vote, q_valid, int8)
        touched = jnp.full((hs,), index.centroids.shape[1], jnp.int32)
        return s, touched
    h = hierarchical_scores(
        q, index.centroids1, index.counts1, index.centroids, index.counts, index.parent,
        threshold1, scale, vote, q_valid, int8,
    )
    return h.scores, h.n_touched


def lookup(
    index: SqueezedLayerIndex,
    q: jax.Array,  # [Hq, T, d]
    threshold,
    threshold1,
    *,
    scale: float,
    vote: str,
    n_tail: int,
    capacity: int,
    q_valid: jax.Array | None = None,
    n_sink: int = 0,
    int8: bool = False,
) -> tuple[Retrieval, jax.Array]:
    """Squeezed lookup for one layer: -> (Retrieval, centroids read [Hs])."""
    s, touched = layer_scores(index, q, threshold1, scale, vote, q_valid, int8)
    hs = s.shape[0]
    selected = (s > threshold) & per_selection_head(index.counts > 0, hs)
    ret = retrieve(selected, s, index.counts, index.perm, index.offsets, n_tail, capacity, n_sink)
    return ret, touched


# ---------------------------------------------------------------------------------------------
# Offline: clustering + global calibration for a whole fixed context
# ---------------------------------------------------------------------------------------------

DECODE_CALIBRATIONS = ("window", "token")


@dataclasses.dataclass(frozen=True)
class SqueezedConfig:
    """Squeezed Attention settings (paper defaults).

    sparsity:          fraction of clustered keys pruned on the calibration queries (0, 1).
    centroid_fraction: level-2 centroids per clustered key (0.05 → one per 20 keys), or
    n_centroids:       an explicit count (overrides the fraction).
    n_obs:             exact tail: last fixed-context tokens never clustered, always attended,
                       and whose queries calibrate the threshold (App. C).
    n_sink:            first tokens (the attention sink) never clustered, always attended.
                       0 = the paper's algorithm; see the README's quality section for why
                       small models want 1–4.
    hierarchical:      add a level-1 clustering of the centroids (§3.3, Eq. 2–3).
    level1_fraction:   level-1 centroids per clustered key (0.01).
    level1_prune:      fraction of keys the level-1 threshold rules out on calibration (~0.5).
    vote:              "kv" (group votes, one set per KV head) or "q" (per query head).
    capacity_fraction: static retrieval capacity as a fraction of clustered keys; None = from
                       calibration (1.5 × the largest per-head fraction seen, + 5 points).
    deterministic_build: k-means with deterministic scatter-adds: on GPU the same document and
                       seed then give a bit-identical index, at 1.3-2.2x the clustering time (128K-512K);
                       the sharded build (`sharding.cluster_sharded`) honours it too.
    decode_calibration: "window" (App. C, the paper's: one T, T1 from the n_obs-query window's
                       averaged scores serves prefill and decode; a single decode query's scores
                       are peakier, so a decode step keeps fewer keys than 1 − sparsity) or
                       "token" (decode steps use their own T, T1, calibrated the same way on each
                       observation query alone: a decode step then keeps about 1 − sparsity).
    lookup_int8:       a block's lookup (a prefill, and the calibration) takes its logits q·C from
                       int8 q (per token and head) and int8 centroids (per head), as
                       `pallas_kernels.centroid_lookup.INT8_PREFILL` does on the GPU (its lookup
                       kernels ~20% faster on an H100); the jnp path rounds the same way.  Decode
                       lookups are unchanged.
    """

    sparsity: float = 0.9
    centroid_fraction: float = 0.05
    n_centroids: int | None = None
    n_obs: int = 100
    n_sink: int = 0
    hierarchical: bool = False
    level1_fraction: float = 0.01
    level1_prune: float = 0.5
    vote: str = "kv"
    capacity_fraction: float | None = None
    kmeans_iters: int = 25
    kmeans_init: str = "kmeans++"
    seed: int = 0
    deterministic_build: bool = False
    decode_calibration: str = "window"
    lookup_int8: bool = False

    def __post_init__(self):
        from sqjax.kmeans import INITS

        check_fraction("sparsity", self.sparsity)
        check_fraction("centroid_fraction", self.centroid_fraction)
        check_fraction("level1_fraction", self.level1_fraction)
        check_fraction("level1_prune", self.level1_prune)
        # a level-1 fraction above the level-2 one is an error only where both fractions count
        if self.hierarchical and self.n_centroids is None and self.level1_fraction >= self.centroid_fraction:
            raise ValueError(
                f"level1_fraction ({self.level1_fraction}) must be below centroid_fraction ({self.centroid_fraction})"
            )
        check_count("n_centroids", self.n_centroids, 1, optional=True)
        check_count("n_obs", self.n_obs, 1)
        check_count("n_sink", self.n_sink, 0)
        check_count("kmeans_iters", self.kmeans_iters, 0)
        check_seed("seed", self.seed)
        _check_vote(self.vote)
        check_choice("kmeans_init", self.kmeans_init, INITS)
        check_choice("decode_calibration", self.decode_calibration, DECODE_CALIBRATIONS)
        if self.capacity_fraction is not None:
            check_fraction("capacity_fraction", self.capacity_fraction, inclusive_high=True)

    def capacity_fraction_for(self, *retrieved_fractions) -> float:
        """`capacity_fraction`, or from calibration: 1.5 × the largest retrieved fraction of any
        phase calibrated (arrays of per-head fractions) + 5 points, at most 1."""
        if self.capacity_fraction is not None:
            return self.capacity_fraction
        seen = max(float(np.max(np.asarray(f))) for f in retrieved_fractions)
        return min(1.0, 1.5 * seen + 0.05)

    def n_clusters(self, n_clustered: int) -> tuple[int, int]:
        """(C2, C1) for `n_clustered` keys; C1 = 0 without hierarchy."""
        c2 = self.n_centroids if self.n_centroids is not None else max(1, round(self.centroid_fraction * n_clustered))
        if c2 > n_clustered:
            raise ValueError(
                f"more centroids than keys: {c2} centroids for {n_clustered} clustered keys "
                f"(fixed context minus the {self.n_sink}-token sink and {self.n_obs}-token exact tail)"
            )
        c1 = max(1, round(self.level1_fraction * n_clustered)) if self.hierarchical else 0
        if self.hierarchical and c1 >= c2:
            raise ValueError(f"level-1 clusters ({c1}) must be fewer than level-2 clusters ({c2})")
        return c2, c1

    def check_length(self, length: int, label: str = "Squeezed Attention") -> None:
        """Raise ValueError, saying the shortest length that works, when a `length`-token fixed
        context leaves nothing to cluster: its first n_sink and last n_obs tokens are attended
        exactly and the rest (Lc keys) are clustered into `n_clusters(Lc)` clusters."""
        exact = self.n_obs + self.n_sink
        lc = length - exact
        why = (f"it is not longer than the exact sink + tail ({self.n_sink} + {self.n_obs})" if lc < 1
               else self._clustering_error(lc))
        if why is None:
            return
        longer = next((n for n in range(max(lc + 1, 1), 1 << 18) if self._clustering_error(n) is None), None)
        if longer is None:   # only a fixed n_centroids can fail for every longer context
            raise ValueError(f"{label} cannot index a {length}-token fixed context ({lc} clustered keys): {why}; "
                             "change n_centroids, centroid_fraction or level1_fraction")
        raise ValueError(
            f"the fixed context (the document and any chat template around it) has {length} tokens, too few for "
            f"{label}: it attends the first n_sink = {self.n_sink} and the last n_obs = {self.n_obs} tokens exactly "
            f"and clusters the rest, and {why}; it needs at least {exact + longer} tokens. Give a longer document, a "
            "smaller n_obs or n_sink, or a method that keeps every key (full)"
        )

    def _clustering_error(self, n_clustered: int) -> str | None:
        """Why `n_clusters(n_clustered)` fails, or None."""
        try:
            self.n_clusters(n_clustered)
        except ValueError as e:
            return str(e)
        return None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SqueezedIndex:
    """The whole fixed context's clusters (leading layer axis) and the global thresholds."""

    layers: SqueezedLayerIndex  # arrays [Lyr, Hkv, ...]
    threshold: jax.Array        # f32 scalar T (T2 when hierarchical)
    threshold1: jax.Array       # f32 scalar T1 (0 for one level: every level-1 cluster survives)
    n_tail: int = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    n_sink: int = dataclasses.field(default=0, metadata=dict(static=True))
    threshold_decode: jax.Array | None = None   # f32 scalar T for one-token steps; None = threshold
    threshold1_decode: jax.Array | None = None  # f32 scalar T1 for one-token steps; None = threshold1

    def layer(self, i: int) -> SqueezedLayerIndex:
        return jax.tree.map(lambda a: a[i], self.layers)

    def thresholds(self, n_tokens: int):
        """(T, T1) for a block of `n_tokens` query tokens (`thresholds_for`)."""
        return thresholds_for(self, n_tokens)


def thresholds_for(index, n_tokens: int):
    """(T, T1) that a block of `n_tokens` query tokens selects with: the decode pair for one token
    when the index has one (`decode_calibration="token"`), App. C's pair otherwise.

    index: anything holding threshold, threshold1, threshold_decode, threshold1_decode (the
    single-device and sharded indexes, the serving states)."""
    if n_tokens == 1 and index.threshold_decode is not None:
        return index.threshold_decode, index.threshold1_decode
    return index.threshold, index.threshold1


def cluster_fixed_context(k: jax.Array, cfg: SqueezedConfig) -> SqueezedLayerIndex:
    """Cluster every layer's clustered keys.  k [Lyr, Hkv, L, d] (roped) -> stacked layer index."""
    from sqjax.kmeans import KMeansConfig, assign_chunk, cluster_level_up, spherical_kmeans

    check_rank("k", k, 4, "[layers, Hkv, L, d]")
    n_layers, hkv, length, d = k.shape
    cfg.check_length(length)
    lc = length - cfg.n_obs - cfg.n_sink
    c2, c1 = cfg.n_clusters(lc)
    # Layers are clustered in groups whose similarity blocks stay under ~1 GB (heads vmapped); a single
    # layer's block [Hkv, chunk, C2] stays under 4 GiB by a shorter chunk of keys (`assign_chunk`).
    chunk = assign_chunk(hkv, c2)
    per_layer_bytes = 4 * hkv * (min(chunk, lc) * c2 + 2 * lc * d)
    group = max(1, min(n_layers, (1 << 30) // max(per_layer_bytes, 1)))
    from sqjax.progress import track

    out = []
    for start in track(range(0, n_layers, group), "clustering", total=-(-n_layers // group)):
        keys = k[start:start + group, :, cfg.n_sink:cfg.n_sink + lc]
        km = spherical_kmeans(keys, KMeansConfig(c2, cfg.kmeans_iters, chunk=chunk, seed=derived_seed(cfg.seed, start),
                                                  init=cfg.kmeans_init, deterministic=cfg.deterministic_build))
        perm, offsets = cluster_layout(km.labels, c2)
        g = keys.shape[0]
        if c1:
            parent, cent1, cnt1 = cluster_level_up(
                km.centroids, km.counts, KMeansConfig(c1, cfg.kmeans_iters, seed=derived_seed(cfg.seed, 7919 + start), init=cfg.kmeans_init,
                                                      deterministic=cfg.deterministic_build)
            )
        else:
            parent = jnp.zeros((g, hkv, c2), jnp.int32)
            cent1 = jnp.zeros((g, hkv, 0, d), jnp.float32)
            cnt1 = jnp.zeros((g, hkv, 0), jnp.int32)
        # centroids are stored in the keys' dtype (bf16 keys -> bf16 centroids: half the lookup bytes)
        out.append(SqueezedLayerIndex(km.centroids.astype(k.dtype), km.counts, km.labels, perm, offsets,
                                      cent1.astype(k.dtype), cnt1, parent))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *out)


_TOKEN_POOL = 1 << 26  # pooled (query, head, cluster) scores per decode calibration, at most


def token_queries(n_obs: int, per_query: int) -> list[int]:
    """Which observation queries calibrate the decode thresholds: all of them, or evenly spaced
    ones when `per_query` pooled scores each would exceed `_TOKEN_POOL` (a quantile over layers ×
    heads × clusters × ~10^2 queries needs no more)."""
    n = max(1, min(n_obs, _TOKEN_POOL // max(per_query, 1)))
    return sorted({round(i * (n_obs - 1) / max(n - 1, 1)) for i in range(n)})


def _per_token(fn, q: jax.Array) -> jax.Array:
    """fn applied to each token of q [Hq, n, d] alone ([Hq, 1, d]), jnp path: -> [n, ...]."""
    from sqjax import dispatch

    with dispatch.using("reference"):
        return jax.vmap(lambda qt: fn(qt[:, None, :]), in_axes=1)(q)


def token_thresholds(layers: list, q_obs: jax.Array, cfg: SqueezedConfig, scale: float, app_c=None,
                     t1: float | None = None):
    """Decode thresholds: App. C's quantiles with each observation query a block of its own.

    layers: per-layer `SqueezedLayerIndex`; q_obs [Lyr, Hq, n, d]. T1 prunes `level1_prune` and T
    `sparsity` of the pooled (query, layer, head, key) scores of single queries, each key scoring
    its cluster's Eq. 1 (Eq. 2 for T1: its parent's; Eq. 3 under T1 for T). A given `t1` (hierarchical
    only) replaces T1's quantile: T is then the quantile under that T1.
    -> (T, T1, retrieved fraction [Lyr, Hs] of single calibration queries at (T, T1), queries used,
    the same fraction at the pair `app_c` (App. C's T, T1: what decode reads without these) or None).
    """
    from sqjax.calibration import weighted_quantile

    hs = selection_heads(q_obs.shape[1], layers[0].centroids.shape[0], cfg.vote)
    n_c = layers[0].counts.shape[-1]
    cols = jnp.asarray(token_queries(q_obs.shape[2], len(layers) * hs * n_c), jnp.int32)
    qs = [jnp.take(q_obs[i], cols, axis=1) for i in range(len(layers))]
    w = [np.broadcast_to(np.asarray(per_selection_head(li.counts, hs)), (cols.shape[0], hs, n_c)) for li in layers]
    w_flat = np.concatenate([x.ravel() for x in w])  # the pooled weights, once (up to 2^26 entries)
    lc = float(np.asarray(layers[0].counts[0]).sum())

    def quantile(scores, frac):
        return weighted_quantile(np.concatenate([np.asarray(x).ravel() for x in scores]), w_flat, frac)

    def scores_at(t1):  # [n, Hs, C] per layer
        return [_per_token(lambda qt, li=li: layer_scores(li, qt, t1, scale, cfg.vote)[0], q) for li, q in zip(layers, qs)]

    def kept(scores, t):  # [Lyr, Hs]
        return np.stack([np.where(np.asarray(x) > t, wi, 0).sum(-1).mean(0) / lc for x, wi in zip(scores, w)])

    if t1 is not None:
        if not cfg.hierarchical:
            raise ValueError(f"t1={t1} given for a 1-level index: only a hierarchical index has a level-1 threshold")
        t1 = float(t1)
    elif cfg.hierarchical:
        parent_scores = [_per_token(lambda qt, li=li: jnp.take_along_axis(
            cluster_scores(qt, li.centroids1, li.counts1, scale, cfg.vote), per_selection_head(li.parent, hs), axis=-1),
            q) for li, q in zip(layers, qs)]
        t1 = quantile(parent_scores, cfg.level1_prune)
    else:
        t1 = 0.0
    scores = scores_at(t1)
    t = quantile(scores, cfg.sparsity)
    at_app_c = None
    if app_c is not None:
        at_app_c = kept(scores if float(app_c[1]) == t1 else scores_at(float(app_c[1])), float(app_c[0]))
    return t, t1, kept(scores, t), int(cols.shape[0]), at_app_c


def observation_window(q_obs: jax.Array, cfg: SqueezedConfig) -> jax.Array:
    """The calibration queries: those of the last n_obs tokens (App. C's window, the exact tail).
    q_obs [Lyr, Hq, n >= n_obs, d] -> [Lyr, Hq, n_obs, d]."""
    if q_obs.shape[2] < cfg.n_obs:
        raise ValueError(
            f"calibration needs the queries of the last n_obs = {cfg.n_obs} tokens; got {q_obs.shape[2]} (a context "
            "prefilled for another method keeps max(100, its window)): build it for this method with "
            "FixedContext.build(model, document, method)"
        )
    return q_obs[:, :, q_obs.shape[2] - cfg.n_obs:]


@precision.index_build
def build_squeezed_index(
    k: jax.Array,      # [Lyr, Hkv, L, d] roped fixed-context keys
    q_obs: jax.Array,  # [Lyr, Hq, n, d] roped queries of the last fixed-context tokens
    cfg: SqueezedConfig,
    scale: float,
) -> tuple[SqueezedIndex, dict]:
    """Cluster + calibrate (App. C).  Returns the index and calibration facts (fractions, T, T1)."""
    from sqjax.calibration import key_fraction, key_threshold

    check_rank("q_obs", q_obs, 4, "[layers, Hq, n_obs, d]")
    check_same("layers", [("k", k.shape[0]), ("q_obs", q_obs.shape[0])])
    check_same("head dim", [("k", k.shape[-1]), ("q_obs", q_obs.shape[-1])])
    check_gqa(q_obs.shape[1], k.shape[1])
    q_obs = observation_window(q_obs, cfg)
    layers = cluster_fixed_context(k, cfg)
    n_layers = k.shape[0]
    per_layer = [jax.tree.map(lambda a: a[i], layers) for i in range(n_layers)]
    threshold1 = 0.0
    if cfg.hierarchical:
        s1 = [cluster_scores(q_obs[i], li.centroids1, li.counts1, scale, cfg.vote, int8=cfg.lookup_int8)
              for i, li in enumerate(per_layer)]
        # a key's level-1 score is its parent's score: its level-2 cluster scores its parent's
        lvl1 = [jnp.take_along_axis(s, per_selection_head(li.parent, s.shape[0]), axis=-1) for s, li in zip(s1, per_layer)]
        threshold1 = key_threshold(lvl1, [li.counts for li in per_layer], cfg.level1_prune)
    from sqjax.progress import track

    scores = [layer_scores(li, q_obs[i], threshold1, scale, cfg.vote, int8=cfg.lookup_int8)[0]
              for i, li in track(list(enumerate(per_layer)), "calibration")]
    # App. C's quantile over every key, each scoring its cluster's S: the cluster scores weighted by counts
    threshold = key_threshold(scores, [li.counts for li in per_layer], cfg.sparsity)
    frac = jnp.stack([key_fraction(s, li.counts, threshold) for s, li in zip(scores, per_layer)])  # [Lyr, Hs]
    decode = {}
    if cfg.decode_calibration == "token":
        td, td1, dfrac, n_q, app_c = token_thresholds(per_layer, q_obs, cfg, scale, (threshold, threshold1))
        decode = {"threshold_decode": td, "threshold1_decode": td1, "decode_retrieved_fraction": jnp.asarray(dfrac),
                  "decode_calibration_queries": n_q, "decode_retrieved_fraction_app_c": jnp.asarray(app_c)}
    lc = k.shape[2] - cfg.n_obs - cfg.n_sink
    cap_frac = cfg.capacity_fraction_for(frac, *([decode["decode_retrieved_fraction"]] if decode else []))
    capacity = cfg.n_sink + cfg.n_obs + int(min(lc, -(-cap_frac * lc // 1)))
    index = SqueezedIndex(layers, jnp.float32(threshold), jnp.float32(threshold1), cfg.n_obs, capacity, cfg.n_sink,
                          *((jnp.float32(decode["threshold_decode"]), jnp.float32(decode["threshold1_decode"]))
                            if decode else ()))
    info = {
        "threshold": threshold,
        "threshold1": threshold1,
        "calibrated_retrieved_fraction": frac,
        "capacity": capacity,
        **decode,
    }
    return index, info
