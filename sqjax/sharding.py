"""Multi-device Squeezed Attention: context (sequence) and KV-head parallelism on a `Mesh`.

A fixed context too long (or too slow) for one device is split over a 2-D device mesh with
axes ``"ctx"`` (the sequence) × ``"heads"`` (KV heads); either axis may have size 1::

    mesh  = sharding.make_mesh(n_ctx=2, n_heads=1)            # ("ctx", "heads")
    k, v  = sharding.shard_fixed_context(k, mesh), sharding.shard_fixed_context(v, mesh)
    index, info = sharding.build_sharded_index(k, q_obs, cfg, scale, mesh)   # offline
    out = sharding.sharded_squeezed_attention(index.layer(i), index.threshold, index.threshold1,
                                              q, k[i], v[i], k_new, v_new, q_pos, kv_pos,
                                              mesh=mesh, capacity=index.capacity)
    # in a model: models.forward(..., attn_fn=sharding.ShardedSqueezedHook(mesh),
    #                            attn_state=sharding.fixed_context_state(index, k, v))

Layout. Fixed-context arrays ``[layers, Hkv, L, d]`` are sharded ``P(None, "heads", "ctx",
None)``: context shard p (of P = mesh size of "ctx") holds positions ``[p·Ls, (p+1)·Ls)``,
``Ls = L / P`` (L must be divisible by P). The exact sink (first ``n_sink`` tokens) lives on the
first context shard, the exact tail (last ``n_obs`` tokens) on the last one; all other
positions are clustered **per device**: each device runs spherical k-means on its own slice
(``C = round(centroid_fraction · Lc / P)`` clusters per device and KV head, where ``Lc`` is the
number of clustered keys of the whole context; ``n_centroids``, when given, is per device).
Index arrays are laid out per device and concatenated along the ctx axis, so one global array
holds every device's block (``centroids [layers, Hkv, P·C, d]``, ``perm [layers, Hkv, L]``...);
see `ShardedLayerIndex`.

Semantics (what "sharded = single device" means). Per-device clusters differ from the clusters
of one k-means over the whole context. Given the SAME clusters, sharded and single-device
results are equal: `to_single_device_index` assembles the single-device `SqueezedIndex` whose
clusters are the union of the per-device clusterings (concatenated centroids/counts, labels
offset by ``p·C``; clusters never span slices), and on that index

* Eq. 1 scores are identical: the denominator ``Σ_j N_j exp(s q·C_j)`` runs over every device's
  clusters — each device computes its local max and its local rescaled sum, one all-gather over
  "ctx" gives every device the global max and the global sum, so the threshold T means the same
  as on one device. Prefill (T > 1 query tokens) normalises each token by its own global
  denominator *before* the average over the block; hierarchical lookups do the same for Eq. 2
  (all level-1 clusters) and Eq. 3 (all surviving level-2 clusters);
* calibration (`calibrate_sharded`) computes the same global thresholds T (and T1): the
  quantile over all layers × heads × keys of the per-key scores. A key's score is its cluster's
  score, so the quantile inputs are the (cluster score, cluster size) pairs: these — ~C/Lc of the
  per-key data, 5% at the default — are gathered to the host and an exact weighted quantile
  (same linear interpolation as ``np.quantile``) is taken. Calibration is offline, so this
  host gather is acceptable; the keys themselves are never gathered;
* each device retrieves its selected clusters' keys (plus the exact sink / tail it holds) and
  runs exact sparse attention locally (`pallas_kernels.sparse_attention(return_lse=True)`:
  the Pallas kernel on GPU, the jnp reference elsewhere); the user input's own keys are attended
  on the last context shard only; partial results are merged by log-sum-exp over "ctx". The
  output equals single-device sparse attention over the same retrieved keys (f32: ≤ 1e-5
  relative; tests/test_sharding.py checks 8 CPU devices as 8×1, 1×8 and 4×2 meshes).

Fused decode over cluster-contiguous storage (one-level indexes). `clustered_layout` (offline,
per layer) sorts every device's K/V slice by its local clusters, exact keys last: a selected
cluster is then a contiguous row range and there is no capacity, no index list and no overflow.
`sharded_clustered_decode` runs `pallas_kernels.clustered_decode_partial` on each device: the
scoring kernel over its centroids, one all-gather of the per-head Eq. 1 (max, denominator)
(`_global_stats`, the same reduction as the scores above), the attention kernel over its
selected ranges + exact keys (+ the user input on the last shard), one all-gather for the
log-sum-exp merge. `ShardedClusteredHook` / `clustered_context_state` serve a model from that
storage (T > 1 blocks take the generic path over the same sorted rows).

The capacity (static number of retrieved keys, exact tokens included) is **per device**:
``capacity = max exact tokens on a device + ceil(capacity_fraction · max clustered keys on a
device)``. Overflow is per device and never silent (``overflow [Hs, P]``); with overflow the
sharded result keeps, per device, that device's best clusters, which is not what one device
with a global capacity keeps — the equality above holds when no device overflows.

Head parallelism needs no communication: KV head h and its g query heads live on the same
"heads" shard (Hkv must be divisible by the "heads" size).

Indexing, saving, loading: `cluster_sharded` clusters every device's block in one SPMD program
(no gather); `save_sharded` / `load_sharded` write and read the index (and optionally the
document's K/V) with Orbax: every process writes the shards it holds and a restore reads, on
each device, only that device's block (``load_sharded(path, mesh)`` returns arrays with the
requested `NamedSharding`; the number of context shards must match, the heads split may
change). A JSON manifest holds the format version, static fields, thresholds and per-array
checksums computed on device (wrapping uint32 sums; no gather).

Multi-host (one process per host, every process runs the same program):

1. call ``jax.distributed.initialize()`` before any other jax call (under SLURM or Open MPI
   it finds the coordinator itself; otherwise pass ``coordinator_address="host0:1234",
   num_processes=N, process_id=i``);
2. `make_mesh` then spans ``jax.devices()``, i.e. every device of every host (put "heads"
   inside a host and "ctx" across hosts: only the two tiny per-layer all-gathers cross hosts);
3. give fixed-context K/V as global `jax.Array`s: `shard_fixed_context` builds them with
   ``jax.make_array_from_callback``, so each process materialises only its own slices (the
   callback may read them from disk); `cluster_sharded` runs per device with no gather;
   `calibrate_sharded` all-gathers the (score, size) pairs with
   ``multihost_utils.process_allgather``;
4. `save_sharded` / `load_sharded` must be called on every process, with a path on a file
   system all hosts share (Orbax writes and reads each process's shards).
The multi-host path is written for and reasoned about, but tested only as one process with
several devices.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels._common import check_scale, static_jit
from sqjax import precision, squeezed
from sqjax._checks import check_gqa, check_rank, check_same
from sqjax.calibration import weighted_quantile

CTX = "ctx"
HEADS = "heads"
FORMAT = "sqjax-sharded-index"
VERSION = 1
ORDERS = ("score", "index")

__all__ = [
    "CTX", "HEADS", "make_mesh", "mesh_shape", "kv_spec", "kv_sharding", "shard_fixed_context",
    "ShardedLayerIndex", "ShardedSqueezedIndex", "layer_specs", "local_layout", "cluster_counts",
    "cluster_sharded", "calibrate_sharded", "build_sharded_index", "to_single_device_index",
    "weighted_quantile", "from_single_device_index", "ShardedRetrieval", "ShardedAttention", "sharded_layer_scores",
    "sharded_lookup", "global_positions", "sharded_attention", "sharded_squeezed_attention",
    "sharded_full_attention", "sharded_quest_bounds", "sharded_quest_attention", "ShardedFixedContext",
    "ShardedSqueezedHook", "fixed_context_state", "ShardedClusteredLayer", "clustered_layout",
    "sharded_clustered_decode", "ShardedClusteredContext", "ShardedClusteredHook", "clustered_context_state",
    "save_sharded", "load_sharded",
]


# ---------------------------------------------------------------------------------------------
# Mesh and shardings
# ---------------------------------------------------------------------------------------------

def make_mesh(n_ctx: int | None = None, n_heads: int = 1, *, devices=None) -> Mesh:
    """A ("ctx", "heads") mesh of n_ctx × n_heads devices (default: every device on "ctx").

    Axis types are `Auto` (shardings propagate as in plain `jax.jit`). With several hosts,
    `jax.devices()` (the default) spans all of them after `jax.distributed.initialize()`.
    """
    devs = list(jax.devices() if devices is None else devices)
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1; got {n_heads}")
    if n_ctx is None:
        n_ctx = len(devs) // n_heads
    if n_ctx < 1 or n_ctx * n_heads > len(devs):
        raise ValueError(f"a {n_ctx} x {n_heads} mesh needs {n_ctx * n_heads} devices; {len(devs)} available")
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((n_ctx, n_heads), (CTX, HEADS), axis_types=(auto, auto),
                         devices=devs[: n_ctx * n_heads])


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """(context shards, head shards) of a mesh that has the "ctx" and "heads" axes."""
    missing = [a for a in (CTX, HEADS) if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh needs axes {CTX!r} and {HEADS!r} (size 1 is fine); it has {dict(mesh.shape)}")
    return int(mesh.shape[CTX]), int(mesh.shape[HEADS])


def _spec(rank: int, lead: int = 0) -> P:
    """[lead axes..., Hkv, X, rest...] sharded over heads (Hkv) and ctx (X)."""
    return P(*([None] * lead), HEADS, CTX, *([None] * (rank - lead - 2)))


def kv_spec(stacked: bool = True) -> P:
    """Spec of fixed-context K/V: [layers, Hkv, L, d] (stacked) or [Hkv, L, d]."""
    return _spec(4, 1) if stacked else _spec(3)


def kv_sharding(mesh: Mesh, stacked: bool = True) -> NamedSharding:
    return NamedSharding(mesh, kv_spec(stacked))


def _put(x, sharding: NamedSharding) -> jax.Array:
    """Place x with `sharding`; a host array is cut by `make_array_from_callback` (multi-host safe)."""
    if isinstance(x, jax.Array):
        return x if x.sharding == sharding else jax.device_put(x, sharding)
    arr = np.asarray(x)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def shard_fixed_context(x, mesh: Mesh) -> jax.Array:
    """Fixed-context K or V, [layers, Hkv, L, d] or [Hkv, L, d], placed sharded over the mesh."""
    if x.ndim not in (3, 4):
        raise ValueError(f"expected [layers, Hkv, L, d] or [Hkv, L, d]; got shape {tuple(x.shape)}")
    n_ctx, n_heads = mesh_shape(mesh)
    _check_divisible(x.shape[-3], x.shape[-2], n_ctx, n_heads)
    return _put(x, kv_sharding(mesh, stacked=x.ndim == 4))


def _check_divisible(hkv: int, length: int, n_ctx: int, n_heads: int) -> None:
    if hkv % n_heads:
        raise ValueError(f"KV heads ({hkv}) must be divisible by the 'heads' mesh axis ({n_heads})")
    if length % n_ctx:
        raise ValueError(f"fixed context length ({length}) must be divisible by the 'ctx' mesh axis ({n_ctx})")


def _host(x) -> np.ndarray:
    """A global array to host numpy on every process (all-gather across hosts when needed)."""
    if jax.process_count() > 1 and isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ---------------------------------------------------------------------------------------------
# The sharded index
# ---------------------------------------------------------------------------------------------

_LAYER_FIELDS = ("centroids", "counts", "labels", "perm", "offsets", "centroids1", "counts1", "parent")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedLayerIndex:
    """Per-device clusters, device blocks concatenated along the ctx axis (optional leading layer axis).

    With P context shards, C (C1) level-2 (level-1) clusters per device, slice length Ls = L / P;
    block p of each array belongs to context shard p, and everything inside a block is LOCAL
    to that shard (cluster ids 0..C-1, positions 0..Ls-1):

        centroids  [Hkv, P·C, d]      means of the un-normalised keys
        counts     [Hkv, P·C] int32   keys per cluster (0 = empty)
        labels     [Hkv, L] int32     local cluster of each position; −1 = exact (sink / tail)
        perm       [Hkv, L] int32     local positions, exact ones first, then grouped by cluster
        offsets    [Hkv, P·(C+2)]     [0, e, e + cumsum(counts)]: exact keys are perm[0:e],
                                      cluster j's keys perm[offsets[j+1]:offsets[j+2]]
        centroids1 [Hkv, P·C1, d]     level-1 centroids (C1 = 0: one level)
        counts1    [Hkv, P·C1] int32
        parent     [Hkv, P·C] int32   local level-1 parent of each level-2 cluster
    """

    centroids: jax.Array
    counts: jax.Array
    labels: jax.Array
    perm: jax.Array
    offsets: jax.Array
    centroids1: jax.Array
    counts1: jax.Array
    parent: jax.Array


def _layer_specs(lead: int) -> ShardedLayerIndex:
    return ShardedLayerIndex(
        _spec(3 + lead, lead), _spec(2 + lead, lead), _spec(2 + lead, lead), _spec(2 + lead, lead),
        _spec(2 + lead, lead), _spec(3 + lead, lead), _spec(2 + lead, lead), _spec(2 + lead, lead),
    )


def layer_specs(stacked: bool = False) -> ShardedLayerIndex:
    """PartitionSpecs of a `ShardedLayerIndex` (with a leading layer axis when `stacked`)."""
    return _layer_specs(1 if stacked else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedSqueezedIndex:
    """A context-/head-sharded Squeezed index: stacked `ShardedLayerIndex` + global thresholds."""

    layers: ShardedLayerIndex    # arrays [layers, Hkv, ...]
    threshold: jax.Array         # f32 scalar T (T2 when hierarchical), global
    threshold1: jax.Array        # f32 scalar T1 (0 for one level)
    n_ctx: int = dataclasses.field(metadata=dict(static=True))
    n_obs: int = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))  # per device
    n_sink: int = dataclasses.field(default=0, metadata=dict(static=True))
    threshold_decode: jax.Array | None = None   # f32 scalar T of one-token steps (None: threshold)
    threshold1_decode: jax.Array | None = None  # f32 scalar T1 of one-token steps (None: threshold1)

    def thresholds(self, n_tokens: int):
        """(T, T1) for a block of `n_tokens` query tokens (`squeezed.thresholds_for`)."""
        return squeezed.thresholds_for(self, n_tokens)

    @property
    def n_layers(self) -> int:
        return self.layers.centroids.shape[0]

    @property
    def length(self) -> int:
        return self.layers.labels.shape[-1]

    @property
    def slice_len(self) -> int:
        return self.length // self.n_ctx

    @property
    def n_clusters(self) -> int:
        """Level-2 clusters per device and KV head."""
        return self.layers.counts.shape[-1] // self.n_ctx

    @property
    def n_clusters1(self) -> int:
        return self.layers.counts1.shape[-1] // self.n_ctx

    def layer(self, i: int) -> ShardedLayerIndex:
        """Layer i's arrays (a slice: inside a jitted model prefer `fixed_context_state`)."""
        return jax.tree.map(lambda a: a[i], self.layers)


def local_layout(labels: jax.Array, n_clusters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-device layout from local labels [..., Ls] (−1 = exact).

    -> (perm [..., Ls], counts [..., C], offsets [..., C+2]).

    perm lists the exact positions first (ascending), then the clustered ones grouped by cluster.
    """
    perm = jnp.argsort(labels, axis=-1, stable=True).astype(jnp.int32)
    flat = labels.reshape(-1, labels.shape[-1])
    idx = jnp.where(flat >= 0, flat, n_clusters)
    counts = jax.vmap(lambda l: jnp.bincount(l, length=n_clusters + 1))(idx)[:, :n_clusters].astype(jnp.int32)
    n_exact = jnp.sum(flat < 0, axis=-1).astype(jnp.int32)[:, None]
    offsets = jnp.concatenate([jnp.zeros_like(n_exact), n_exact, n_exact + jnp.cumsum(counts, axis=-1)], axis=-1)
    shape = labels.shape[:-1]
    return perm, counts.reshape(shape + (n_clusters,)), offsets.astype(jnp.int32).reshape(shape + (n_clusters + 2,))


def _exact_mask(p, n_ctx: int, slice_len: int, n_sink: int, n_obs: int) -> jax.Array:
    """[Ls] bool: local positions of context shard p (traced) that are exact (never clustered)."""
    pos = jnp.arange(slice_len)
    return ((p == 0) & (pos < n_sink)) | ((p == n_ctx - 1) & (pos >= slice_len - n_obs))


def _shard_sizes(length: int, n_ctx: int, n_sink: int, n_obs: int) -> tuple[int, list[int]]:
    """(Ls, clustered keys per context shard)."""
    ls = length // n_ctx
    if n_sink > ls or n_obs > ls:
        raise ValueError(f"slice length {ls} (= {length} / {n_ctx}) must hold the exact sink ({n_sink}) "
                         f"and tail ({n_obs})")
    lcs = [ls - (n_sink if p == 0 else 0) - (n_obs if p == n_ctx - 1 else 0) for p in range(n_ctx)]
    return ls, lcs


def cluster_counts(cfg: squeezed.SqueezedConfig, length: int, n_ctx: int) -> tuple[int, int]:
    """(C, C1) per device and KV head for a context of `length` tokens over n_ctx shards."""
    _, lcs = _shard_sizes(length, n_ctx, cfg.n_sink, cfg.n_obs)
    lc = sum(lcs)
    if min(lcs) < 1:
        raise ValueError(f"a context shard has no key to cluster (clustered keys per shard: {lcs})")
    c2 = cfg.n_centroids if cfg.n_centroids is not None else max(1, round(cfg.centroid_fraction * lc / n_ctx))
    if c2 > min(lcs):
        raise ValueError(f"{c2} centroids per device but a context shard clusters only {min(lcs)} keys")
    c1 = max(1, round(cfg.level1_fraction * lc / n_ctx)) if cfg.hierarchical else 0
    if cfg.hierarchical and c1 >= c2:
        raise ValueError(f"level-1 clusters per device ({c1}) must be fewer than level-2 clusters ({c2})")
    return c2, c1


# ---------------------------------------------------------------------------------------------
# Offline: per-device clustering
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cluster_fn(mesh: Mesh, n_ctx: int, hkv: int, slice_len: int, c2: int, c1: int, n_sink: int, n_obs: int,
                iters: int, chunk: int, deterministic: bool = False):
    from sqjax.kmeans import DETERMINISTIC
    from sqjax.masked_kmeans import level_up, masked_spherical_kmeans

    def body(k, seed, layer0):  # k [G, Hkv_loc, Ls, d] on one device
        g, h_loc, _, d = k.shape
        p = jax.lax.axis_index(CTX)
        valid = ~_exact_mask(p, n_ctx, slice_len, n_sink, n_obs)
        # One PRNG stream per (global layer, global KV head, context shard): the clusters do not
        # depend on how layers are grouped or how heads are split over the mesh.
        h0 = jax.lax.axis_index(HEADS) * h_loc
        ids = ((layer0 + jnp.arange(g))[:, None] * hkv + h0 + jnp.arange(h_loc)[None, :]) * n_ctx + p
        km = masked_spherical_kmeans(k, valid, seed, ids.astype(jnp.uint32), n_clusters=c2, max_iters=iters,
                                     chunk=chunk)
        perm, _, offsets = local_layout(km.labels, c2)
        if c1:
            parent, cent1, cnt1 = level_up(km.centroids, km.counts, seed + jnp.uint32(7919), ids.astype(jnp.uint32),
                                           n_clusters=c1, max_iters=iters, chunk=chunk)
        else:
            parent = jnp.zeros((g, h_loc, c2), jnp.int32)
            cent1 = jnp.zeros((g, h_loc, 0, d), jnp.float32)
            cnt1 = jnp.zeros((g, h_loc, 0), jnp.int32)
        return ShardedLayerIndex(km.centroids, km.counts, km.labels, perm, offsets, cent1, cnt1, parent)

    f = jax.shard_map(body, mesh=mesh, in_specs=(kv_spec(True), P(), P()), out_specs=_layer_specs(1),
                      check_vma=False)
    # deterministic: scatter-adds without atomics on GPU (SqueezedConfig.deterministic_build)
    return jax.jit(f, compiler_options=DETERMINISTIC if deterministic else None)


def cluster_sharded(k, cfg: squeezed.SqueezedConfig, mesh: Mesh, *, layers_per_group: int | None = None
                    ) -> ShardedLayerIndex:
    """Cluster every device's slice of the fixed-context keys on that device.

    k [layers, Hkv, L, d] roped keys (a global array, or host data that is placed sharded).
    Layers are clustered in groups (default: as many as keep each device's similarity blocks
    under ~1 GB); the result does not depend on the grouping, nor on the heads split (every
    (layer, KV head, context shard) has its own PRNG stream).
    Returns the stacked `ShardedLayerIndex` (no thresholds yet: see `calibrate_sharded`).
    """
    check_rank("k", k, 4, "[layers, Hkv, L, d]")
    n_ctx, n_heads = mesh_shape(mesh)
    n_layers, hkv, length, d = k.shape
    _check_divisible(hkv, length, n_ctx, n_heads)
    c2, c1 = cluster_counts(cfg, length, n_ctx)
    ls, _ = _shard_sizes(length, n_ctx, cfg.n_sink, cfg.n_obs)
    k = _put(k, kv_sharding(mesh))
    from sqjax.kmeans import assign_chunk

    chunk = assign_chunk(hkv // n_heads, c2)  # one device's block [heads, chunk, C2] under 4 GiB
    fn = _cluster_fn(mesh, n_ctx, hkv, ls, c2, c1, cfg.n_sink, cfg.n_obs, cfg.kmeans_iters, chunk,
                     cfg.deterministic_build)
    # Layers in groups whose per-device similarity blocks stay under ~1 GB.
    per_layer = 4 * (hkv // n_heads) * (min(chunk, ls) * c2 + 2 * ls * d)
    group = max(1, min(n_layers, (1 << 30) // max(per_layer, 1)))
    if layers_per_group is not None:
        group = max(1, min(n_layers, int(layers_per_group)))
    parts = [fn(k[s:s + group], jnp.uint32(cfg.seed), jnp.int32(s)) for s in range(0, n_layers, group)]
    if len(parts) == 1:
        return parts[0]
    cat = jax.jit(lambda *a: jax.tree.map(lambda *x: jnp.concatenate(x), *a),
                  out_shardings=_named(mesh, _layer_specs(1)))
    return cat(*parts)


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# ---------------------------------------------------------------------------------------------
# Scores with the global denominator (inside shard_map)
# ---------------------------------------------------------------------------------------------

def _global_scores(logits: jax.Array, weights: jax.Array, live: jax.Array) -> jax.Array:
    """Eq. 1 with the denominator summed over every context shard.  -> like logits, f32.

    logits [Hkv, g, T, C]; weights/live broadcast to it. One all-gather of (local max, local sum
    rescaled to it) per call; each device then rescales to the global max.
    """
    x = jnp.where(live, logits, -jnp.inf)
    m = jnp.max(x, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    den = jnp.sum(weights * jnp.where(live, jnp.exp(x - m_safe[..., None]), 0.0), axis=-1)
    mx_safe, total = _global_stats(m, den)
    e = jnp.where(live, jnp.exp(x - mx_safe[..., None]), 0.0)
    return jnp.where(total[..., None] > 0, e / jnp.maximum(total[..., None], 1e-30), 0.0)


def _global_stats(m: jax.Array, den: jax.Array) -> tuple[jax.Array, jax.Array]:
    """This device's Eq. 1 softmax (max, denominator) -> the global pair over every context shard.

    Elementwise over any shape; one all-gather over "ctx". A device whose denominator is 0 (no
    live cluster) takes no part in the max; the global max is 0 when no device has any.
    """
    stats = jax.lax.all_gather(jnp.stack([m, den]), CTX)  # [P, 2, ...]
    ms, dens = stats[:, 0], stats[:, 1]
    mx = jnp.max(jnp.where(dens > 0, ms, -jnp.inf), axis=0)
    mx_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    total = jnp.sum(jnp.where(dens > 0, dens * jnp.exp(ms - mx_safe), 0.0), axis=0)
    return mx_safe, total


def _logits(q, centroids, scale):
    """s·q·C [Hkv, g, T, C] f32; the dot runs in the centroids' dtype with f32 accumulation
    (no f32 copy of bf16 centroids is made; f32 centroids give the plain f32 product)."""
    hq, t, d = q.shape
    hkv = centroids.shape[0]
    qg = q.astype(centroids.dtype).reshape(hkv, hq // hkv, t, d)
    return jnp.einsum("kgtd,kcd->kgtc", qg, centroids, preferred_element_type=jnp.float32) * scale


def _mean_vote(s, q_valid, vote):
    """[Hkv, g, T, C] -> [Hs, C]: mean over (valid) tokens, then the group vote."""
    if q_valid is None:
        s = jnp.mean(s, axis=2)
    else:
        w = q_valid.astype(jnp.float32)[None, None, :, None]
        s = jnp.sum(s * w, axis=2) / jnp.maximum(jnp.sum(w), 1.0)
    return jnp.mean(s, axis=1) if vote == "kv" else s.reshape(-1, s.shape[-1])


def _rep(x, hs):
    return x if x.shape[0] == hs else jnp.repeat(x, hs // x.shape[0], axis=0)


class _Scores(NamedTuple):
    s: jax.Array        # [Hs, C] final level-2 scores (local clusters, global normalisation)
    s1: jax.Array       # [Hs, C1] level-1 scores (C1 = 0: empty)
    touched: jax.Array  # [Hs] int32 centroids read on all devices together


def _local_scores(lay: ShardedLayerIndex, q, threshold1, q_valid, *, scale, vote, n_ctx) -> _Scores:
    hq = q.shape[0]
    hkv, c2 = lay.counts.shape
    g = hq // hkv
    hs = hkv if vote == "kv" else hq
    w2 = lay.counts.astype(jnp.float32)[:, None, None, :]
    if lay.counts1.shape[-1] == 0:
        s = _mean_vote(_global_scores(_logits(q, lay.centroids, scale), w2, (lay.counts > 0)[:, None, None, :]),
                       q_valid, vote)
        return _Scores(s, jnp.zeros((hs, 0), jnp.float32), jnp.full((hs,), n_ctx * c2, jnp.int32))
    w1 = lay.counts1.astype(jnp.float32)[:, None, None, :]
    s1 = _mean_vote(_global_scores(_logits(q, lay.centroids1, scale), w1, (lay.counts1 > 0)[:, None, None, :]),
                    q_valid, vote)
    keep1 = (s1 >= threshold1) & _rep(lay.counts1 > 0, hs)
    cand = jnp.take_along_axis(keep1, _rep(lay.parent, hs), axis=-1) & _rep(lay.counts > 0, hs)  # [Hs, C2]
    cand_q = cand.reshape(hkv, -1, c2)
    cand_q = jnp.broadcast_to(cand_q, (hkv, g, c2)) if vote == "kv" else cand_q
    s = _mean_vote(_global_scores(_logits(q, lay.centroids, scale), w2, cand_q[:, :, None, :]), q_valid, vote)
    n_cand = jax.lax.psum(jnp.sum(cand, axis=-1).astype(jnp.int32), CTX)
    return _Scores(s, s1, n_ctx * lay.counts1.shape[-1] + n_cand)


def _local_retrieve(lay: ShardedLayerIndex, s, threshold, capacity: int, order: str):
    """Selected local clusters + the exact keys this device holds -> (idx [Hs, cap], count [Hs], overflow [Hs]).

    The exact keys form a pseudo-cluster ranked first; then whole clusters are taken in
    descending score order (order="score", as `squeezed.retrieve`) or in index order
    ("index": no sort) while they fit the capacity; a selected cluster left out sets overflow.
    Positions are expanded with one marker scatter + cumsum per head (no search, no loop).
    Entries past count are −1.
    """
    hs, c = s.shape
    hkv, ls = lay.perm.shape
    cap = min(capacity, ls)
    selected = (s > threshold) & _rep(lay.counts > 0, hs)
    n_exact = lay.offsets[:, 1:2]
    sel = jnp.concatenate([jnp.ones((hs, 1), bool), selected], axis=1)                  # [Hs, R]
    size = _rep(jnp.concatenate([n_exact, lay.counts], axis=1), hs)                      # [Hs, R]
    start = _rep(lay.offsets[:, :-1], hs)                                                # [Hs, R]
    if order == "score":
        key = jnp.where(sel, jnp.concatenate([jnp.full((hs, 1), jnp.inf, s.dtype), s], axis=1), -jnp.inf)
        rank = jnp.argsort(-key, axis=1, stable=True)
        sel, size, start = (jnp.take_along_axis(x, rank, axis=1) for x in (sel, size, start))
    size = jnp.where(sel, size, 0)
    keep = sel & (jnp.cumsum(size, axis=1) <= cap)
    overflow = jnp.any(sel & ~keep, axis=1)
    size = jnp.where(keep, size, 0)
    ends = jnp.cumsum(size, axis=1)
    begins = ends - size
    total = ends[:, -1]
    live = size > 0
    r = c + 1
    rows = jnp.arange(hs)[:, None]
    slot_rank = jnp.cumsum(live.astype(jnp.int32), axis=1) - 1
    range_of = jnp.zeros((hs, r), jnp.int32).at[rows, jnp.where(live, slot_rank, r)].set(
        jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32), (hs, r)), mode="drop")
    mark = jnp.zeros((hs, cap), jnp.int32).at[rows, jnp.where(live, begins, cap)].add(1, mode="drop")
    which = jnp.take_along_axis(range_of, jnp.maximum(jnp.cumsum(mark, axis=1) - 1, 0), axis=1)   # [Hs, cap]
    j = jnp.arange(cap, dtype=jnp.int32)[None, :]
    src = jnp.take_along_axis(start, which, axis=1) + j - jnp.take_along_axis(begins, which, axis=1)
    kv_row = (jnp.arange(hs, dtype=jnp.int32) // (hs // hkv))[:, None]
    pos = jnp.take(lay.perm.reshape(-1), kv_row * ls + jnp.clip(src, 0, ls - 1), axis=0)
    idx = jnp.where(j < total[:, None], pos, -1).astype(jnp.int32)
    return idx, total.astype(jnp.int32), overflow


def _resolve_backend(backend: str) -> str:
    from sqjax import dispatch

    if backend == "auto":
        return dispatch.resolved()
    if backend not in dispatch.BACKENDS:
        raise ValueError(f"backend must be one of {dispatch.BACKENDS}; got {backend!r}")
    return backend


def _merge_ctx(o, lse):
    """Log-sum-exp merge of partial (o [Hq, T, d], lse [Hq, T]) over the ctx axis (one all-gather)."""
    d = o.shape[-1]
    packed = jax.lax.all_gather(jnp.concatenate([o.astype(jnp.float32), lse[..., None]], axis=-1), CTX)
    os_, lses = packed[..., :d], packed[..., d]
    mx = jnp.max(lses, axis=0)
    mx_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lses - mx_safe)
    tot = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * os_, axis=0) / jnp.maximum(tot, 1e-30)[..., None]
    return out, jnp.where(tot > 0, mx_safe + jnp.log(jnp.maximum(tot, 1e-30)), -jnp.inf)


def _local_sparse(q, k, v, idx, count, k_new, v_new, q_pos, kv_pos, *, n_ctx, scale, backend):
    """Partial attention of this device: its retrieved keys (+ the user input on the last shard)."""
    from pallas_kernels import sparse_attention

    last = jax.lax.axis_index(CTX) == n_ctx - 1
    kv_pos = jnp.where(last, kv_pos, -1)
    return sparse_attention(q, k, v, idx.astype(jnp.int32), count.astype(jnp.int32), k_new, v_new,
                            q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32), scale=scale, return_lse=True,
                            backend=backend)


# ---------------------------------------------------------------------------------------------
# Online: lookup and attention (public, jitted)
# ---------------------------------------------------------------------------------------------

class ShardedRetrieval(NamedTuple):
    idx: jax.Array       # [Hs, P·cap] int32 LOCAL positions (block p: context shard p), exact keys first
    count: jax.Array     # [Hs, P] int32 valid entries of each device's block
    overflow: jax.Array  # [Hs, P] bool: that device's selected clusters did not all fit
    touched: jax.Array   # [Hs] int32 centroids read (all devices)


class ShardedAttention(NamedTuple):
    o: jax.Array         # [Hq, T, d] in q's dtype
    lse: jax.Array       # [Hq, T] f32 log-sum-exp of the scaled scores over every attended key
    count: jax.Array     # [Hs, P] int32 keys attended per device (exact ones included)
    overflow: jax.Array  # [Hs, P] bool
    touched: jax.Array   # [Hs] int32 centroids read


def _check_layer_inputs(lay: ShardedLayerIndex, q, n_ctx, n_heads, vote):
    check_rank("q", q, 3, "[Hq, T, d]")
    check_rank("centroids", lay.centroids, 3, "[Hkv, P*C, d] (one layer)")
    check_same("head dim", [("q", q.shape[-1]), ("centroids", lay.centroids.shape[-1])])
    check_gqa(q.shape[0], lay.centroids.shape[0])
    if vote not in squeezed.VOTES:
        raise ValueError(f"vote must be one of {squeezed.VOTES}; got {vote!r}")
    _check_divisible(lay.centroids.shape[0], lay.labels.shape[-1], n_ctx, n_heads)


def _scale(scale, d):
    return check_scale(1.0 / math.sqrt(d) if scale is None else scale)


_H3 = P(HEADS, None, None)
_H2 = P(HEADS, None)
_HC = P(HEADS, CTX)


@static_jit(("mesh", "scale", "vote"))
def _scores_jit(lay, q, threshold1, q_valid, *, mesh, scale, vote):
    n_ctx, _ = mesh_shape(mesh)

    def body(lay, q, t1, qv):
        r = _local_scores(lay, q, t1, qv, scale=scale, vote=vote, n_ctx=n_ctx)
        return r.s, r.s1, r.touched

    qv_spec = None if q_valid is None else P()
    f = jax.shard_map(body, mesh=mesh, in_specs=(_layer_specs(0), _H3, P(), qv_spec),
                      out_specs=(_HC, _HC, P(HEADS)), check_vma=False)
    return f(lay, q, threshold1, q_valid)


def sharded_layer_scores(lay: ShardedLayerIndex, q, threshold1, *, mesh: Mesh, scale: float | None = None,
                         vote: str = "kv", q_valid=None):
    """Eq. 1 (or Eq. 2→3) scores of one layer's clusters, globally normalised.

    q [Hq, T, d] (T > 1: averaged over the block). -> (scores [Hs, P·C], level-1 scores
    [Hs, P·C1], centroids read [Hs]); block p of the cluster axis = context shard p.
    """
    n_ctx, n_heads = mesh_shape(mesh)
    _check_layer_inputs(lay, q, n_ctx, n_heads, vote)
    return _scores_jit(lay, q, jnp.asarray(threshold1, jnp.float32), q_valid, mesh=mesh,
                       scale=_scale(scale, q.shape[-1]),
                       vote=vote)


@static_jit(("mesh", "scale", "vote", "capacity", "order"))
def _lookup_jit(lay, q, threshold, threshold1, q_valid, *, mesh, scale, vote, capacity, order):
    n_ctx, _ = mesh_shape(mesh)

    def body(lay, q, t, t1, qv):
        r = _local_scores(lay, q, t1, qv, scale=scale, vote=vote, n_ctx=n_ctx)
        idx, count, ovf = _local_retrieve(lay, r.s, t, capacity, order)
        return idx, count[:, None], ovf[:, None], r.touched

    qv_spec = None if q_valid is None else P()
    f = jax.shard_map(body, mesh=mesh, in_specs=(_layer_specs(0), _H3, P(), P(), qv_spec),
                      out_specs=(_HC, _HC, _HC, P(HEADS)), check_vma=False)
    return ShardedRetrieval(*f(lay, q, threshold, threshold1, q_valid))


def sharded_lookup(lay: ShardedLayerIndex, q, threshold, threshold1, *, mesh: Mesh, capacity: int,
                   scale: float | None = None, vote: str = "kv", q_valid=None, order: str = "score"
                   ) -> ShardedRetrieval:
    """Squeezed lookup of one layer on every device (global Eq. 1 denominators).

    order="score": on overflow a device keeps its best-scoring clusters (as `squeezed.retrieve`);
    "index": clusters in index order (no sort; overflow still flagged). Without overflow both
    retrieve the same keys.
    """
    n_ctx, n_heads = mesh_shape(mesh)
    _check_layer_inputs(lay, q, n_ctx, n_heads, vote)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}; got {order!r}")
    return _lookup_jit(lay, q, jnp.asarray(threshold, jnp.float32), jnp.asarray(threshold1, jnp.float32), q_valid,
                       mesh=mesh,
                       scale=_scale(scale, q.shape[-1]), vote=vote, capacity=int(capacity), order=order)


def global_positions(ret: ShardedRetrieval, slice_len: int) -> tuple[jax.Array, jax.Array]:
    """Retrieved GLOBAL positions per selection head: (pos [Hs, P·cap] (−1 = unused), valid [Hs, P·cap])."""
    hs, n_ctx = ret.count.shape
    cap = ret.idx.shape[-1] // n_ctx
    idx = ret.idx.reshape(hs, n_ctx, cap)
    valid = (jnp.arange(cap)[None, None, :] < ret.count[:, :, None]) & (idx >= 0)
    pos = idx + (jnp.arange(n_ctx) * slice_len)[None, :, None]
    return jnp.where(valid, pos, -1).reshape(hs, -1), valid.reshape(hs, -1)


@static_jit(("mesh", "scale", "backend"))
def _attention_jit(q, k, v, idx, count, k_new, v_new, q_pos, kv_pos, *, mesh, scale, backend):
    n_ctx, _ = mesh_shape(mesh)

    def body(q, k, v, idx, count, k_new, v_new, q_pos, kv_pos):
        o, lse = _local_sparse(q, k, v, idx, count[:, 0], k_new, v_new, q_pos, kv_pos, n_ctx=n_ctx, scale=scale,
                               backend=backend)
        o, lse = _merge_ctx(o, lse)
        return o.astype(q.dtype), lse

    f = jax.shard_map(body, mesh=mesh, in_specs=(_H3, kv_spec(False), kv_spec(False), _HC, _HC, _H3, _H3, P(), P()),
                      out_specs=(_H3, _H2), check_vma=False)
    return f(q, k, v, idx, count, k_new, v_new, q_pos, kv_pos)


def sharded_attention(q, k, v, ret: ShardedRetrieval, k_new, v_new, q_pos, kv_pos, *, mesh: Mesh,
                      scale: float | None = None, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Exact attention over each device's retrieved keys + the user input, merged over "ctx".

    q [Hq, T, d]; k, v [Hkv, L, d] (one layer, sharded); k_new, v_new [Hkv, S, d]; q_pos [T],
    kv_pos [S] (−1 = empty slot). -> (o [Hq, T, d], lse [Hq, T]).
    """
    mesh_shape(mesh)
    return _attention_jit(q, k, v, ret.idx, ret.count, k_new, v_new, jnp.asarray(q_pos, jnp.int32),
                          jnp.asarray(kv_pos, jnp.int32), mesh=mesh, scale=_scale(scale, q.shape[-1]),
                          backend=_resolve_backend(backend))


@static_jit(("mesh", "scale", "vote", "capacity", "order", "backend"))
def _fused_jit(lay, threshold, threshold1, q, k, v, k_new, v_new, q_pos, kv_pos, q_valid, *, mesh, scale, vote,
               capacity, order, backend):
    n_ctx, _ = mesh_shape(mesh)

    def body(lay, t, t1, q, k, v, k_new, v_new, q_pos, kv_pos, qv):
        r = _local_scores(lay, q, t1, qv, scale=scale, vote=vote, n_ctx=n_ctx)
        idx, count, ovf = _local_retrieve(lay, r.s, t, capacity, order)
        o, lse = _local_sparse(q, k, v, idx, count, k_new, v_new, q_pos, kv_pos, n_ctx=n_ctx, scale=scale,
                               backend=backend)
        o, lse = _merge_ctx(o, lse)
        return o.astype(q.dtype), lse, count[:, None], ovf[:, None], r.touched

    qv_spec = None if q_valid is None else P()
    f = jax.shard_map(
        body, mesh=mesh,
        in_specs=(_layer_specs(0), P(), P(), _H3, kv_spec(False), kv_spec(False), _H3, _H3, P(), P(), qv_spec),
        out_specs=(_H3, _H2, _HC, _HC, P(HEADS)), check_vma=False)
    return ShardedAttention(*f(lay, threshold, threshold1, q, k, v, k_new, v_new, q_pos, kv_pos, q_valid))


def sharded_squeezed_attention(
    lay: ShardedLayerIndex,
    threshold,
    threshold1,
    q: jax.Array,       # [Hq, T, d] roped queries of the user input
    k: jax.Array,       # [Hkv, L, d] this layer's fixed-context keys (sharded "heads" × "ctx")
    v: jax.Array,       # [Hkv, L, d]
    k_new: jax.Array,   # [Hkv, S, d] the user input's own keys (replicated over "ctx")
    v_new: jax.Array,   # [Hkv, S, d]
    q_pos: jax.Array,   # [T] int32 absolute positions
    kv_pos: jax.Array,  # [S] int32 absolute positions of the new keys (−1 = empty slot)
    *,
    mesh: Mesh,
    capacity: int,
    scale: float | None = None,
    vote: str = "kv",
    q_valid: jax.Array | None = None,
    backend: str = "auto",
    order: str = "score",
) -> ShardedAttention:
    """Lookup + sparse attention + log-sum-exp merge of one layer in ONE shard_map program.

    Collectives per layer, all over "ctx" and all tiny at decode: one all-gather of the Eq. 1
    statistics (per query head and token: local max and rescaled sum) and one all-gather of the
    partial (o, lse); hierarchical adds one all-gather for Eq. 2 and a psum of the candidate
    count. Equal to the single-device
    `squeezed.lookup` + sparse attention on `to_single_device_index(index)` (no overflow).
    """
    n_ctx, n_heads = mesh_shape(mesh)
    _check_layer_inputs(lay, q, n_ctx, n_heads, vote)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}; got {order!r}")
    return _fused_jit(lay, jnp.asarray(threshold, jnp.float32), jnp.asarray(threshold1, jnp.float32), q, k, v,
                      k_new, v_new,
                      jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32), q_valid, mesh=mesh,
                      scale=_scale(scale, q.shape[-1]), vote=vote, capacity=int(capacity), order=order,
                      backend=_resolve_backend(backend))


@static_jit(("mesh", "scale"))
def _full_jit(q, k, v, k_new, v_new, q_pos, kv_pos, *, mesh, scale):
    from sqjax.attention import attend_partial, causal_mask, merge_partials

    n_ctx, _ = mesh_shape(mesh)

    def body(q, k, v, k_new, v_new, q_pos, kv_pos):
        last = jax.lax.axis_index(CTX) == n_ctx - 1
        fixed = attend_partial(q, k, v, None, scale)
        new = attend_partial(q, k_new, v_new, causal_mask(q_pos, jnp.where(last, kv_pos, -1)), scale)
        part = merge_partials(fixed, new)
        o, lse = _merge_ctx(part.o, part.lse)
        return o.astype(q.dtype), lse

    f = jax.shard_map(body, mesh=mesh, in_specs=(_H3, kv_spec(False), kv_spec(False), _H3, _H3, P(), P()),
                      out_specs=(_H3, _H2), check_vma=False)
    return f(q, k, v, k_new, v_new, q_pos, kv_pos)


def sharded_full_attention(q, k, v, k_new, v_new, q_pos, kv_pos, *, mesh: Mesh, scale: float | None = None):
    """Exact (dense) attention over the whole sharded fixed context + the causal user input.

    Same shapes as `sharded_squeezed_attention`; plain jnp per device (the reference method).
    -> (o [Hq, T, d], lse [Hq, T]).
    """
    n_ctx, n_heads = mesh_shape(mesh)
    _check_divisible(k.shape[0], k.shape[1], n_ctx, n_heads)
    return _full_jit(q, k, v, k_new, v_new, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32),
                     mesh=mesh, scale=_scale(scale, q.shape[-1]))


# ---------------------------------------------------------------------------------------------
# Cluster-contiguous storage per device: the fused clustered decode kernel
# ---------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedClusteredLayer:
    """One layer's fixed context stored cluster-contiguous on every context shard.

    Block p of each array belongs to context shard p and is LOCAL to it (Ls = L / P rows, C
    clusters per device), in the layout of `pallas_kernels.clustered_attention`:

        k_sorted, v_sorted [Hkv, L, d]    block p: shard p's clusters 0..C-1 in order, then its
                                          exact keys (sink / tail) in rows [offsets[C], Ls)
        centroids          [Hkv, P·C, d]
        offsets            [Hkv, P·(C+1)] int32 cluster j = rows [offsets[j], offsets[j+1])
        index              ShardedLayerIndex describing the SAME sorted rows (perm/labels point
                                          into k_sorted), for the generic path (prefill, T > 1)

    Attention over the fixed context does not depend on the order of its keys (their positions
    live in the roped keys), so the sorted copy can replace the position-ordered one.
    """

    k_sorted: jax.Array
    v_sorted: jax.Array
    centroids: jax.Array
    offsets: jax.Array
    index: ShardedLayerIndex


def _clustered_specs() -> ShardedClusteredLayer:
    return ShardedClusteredLayer(kv_spec(False), kv_spec(False), _spec(3), _spec(2), _layer_specs(0))


@functools.partial(jax.jit, static_argnames=("mesh",))
def _clustered_layout_jit(lay, k, v, *, mesh):
    def body(labels, perm, offsets, k, v):
        hkv, ls = perm.shape
        e = offsets[:, 1]                                                        # [Hkv] exact keys
        rows = (jnp.arange(ls, dtype=jnp.int32)[None, :] + e[:, None]) % ls      # clusters, then exact
        perm = jnp.take_along_axis(perm, rows, axis=1)                           # sorted row -> position
        ks = jnp.take_along_axis(k, perm[..., None], axis=1)
        vs = jnp.take_along_axis(v, perm[..., None], axis=1)
        offsets = (offsets[:, 1:] - e[:, None]).astype(jnp.int32)                # [Hkv, C + 1]
        # The generic index over the sorted rows: exact keys are rows Ls-e.., clusters start at 0.
        sorted_perm = ((jnp.arange(ls, dtype=jnp.int32)[None, :] - e[:, None]) % ls).astype(jnp.int32)
        return ks, vs, offsets, jnp.take_along_axis(labels, perm, axis=1), sorted_perm

    # Only what changes goes through shard_map (zero-size outputs such as a one-level index's
    # centroids1 crash XLA's CPU compiler there).
    f = jax.shard_map(body, mesh=mesh, in_specs=(_spec(2), _spec(2), _spec(2), kv_spec(False), kv_spec(False)),
                      out_specs=(kv_spec(False), kv_spec(False), _spec(2), _spec(2), _spec(2)), check_vma=False)
    ks, vs, offsets, labels, perm = f(lay.labels, lay.perm, lay.offsets, k, v)
    return ShardedClusteredLayer(ks, vs, lay.centroids, offsets, dataclasses.replace(lay, labels=labels, perm=perm))


def clustered_layout(lay: ShardedLayerIndex, k: jax.Array, v: jax.Array, *, mesh: Mesh) -> ShardedClusteredLayer:
    """One layer's sharded index + position-ordered K/V [Hkv, L, d] -> `ShardedClusteredLayer`.

    Offline, once per fixed context (each device permutes its own slice; nothing moves between
    devices). One-level indexes only: the fused kernel has no hierarchical variant.
    """
    n_ctx, n_heads = mesh_shape(mesh)
    check_rank("k", k, 3, "[Hkv, L, d] (one layer)")
    check_same("k/v shape", [("k", tuple(k.shape)), ("v", tuple(v.shape))])
    check_same("fixed context length", [("k", k.shape[1]), ("index labels", lay.labels.shape[-1])])
    _check_divisible(k.shape[0], k.shape[1], n_ctx, n_heads)
    if lay.counts1.shape[-1]:
        raise ValueError("the clustered decode kernel serves one-level indexes; this index is hierarchical "
                         "(use sharded_squeezed_attention, or build with hierarchical=False)")
    return _clustered_layout_jit(lay, k, v, mesh=mesh)


@static_jit(("mesh", "scale", "vote", "backend", "config", "_parts"))
def _clustered_decode_jit(cl, threshold, q, k_new, v_new, q_pos, kv_pos, *, mesh, scale, vote, backend, config,
                          _parts="all"):
    """_parts (benchmark diagnostics only; anything but "all" gives WRONG answers on > 1 shard):
    "no_stats" skips the statistics all-gather, "local" skips both collectives."""
    from pallas_kernels.clustered_attention import clustered_decode_partial

    n_ctx, _ = mesh_shape(mesh)
    q_pos = q_pos.reshape(1)   # inside the program: no eager op on a (multi-device) array per call

    # One context shard (KV-head parallelism alone): its Eq. 1 statistics and its output are
    # already the global ones, so no collective and no merge (the 1-device kernel path exactly).
    across = n_ctx > 1

    def body(cl, t, q, k_new, v_new, q_pos, kv_pos):
        if across:  # the user input is attended on the last context shard only
            kv_pos = jnp.where(jax.lax.axis_index(CTX) == n_ctx - 1, kv_pos, -1)
        o, lse = clustered_decode_partial(
            q, cl.k_sorted, cl.v_sorted, cl.centroids, cl.offsets, t, k_new, v_new, q_pos,
            kv_pos, scale=scale, vote=vote,
            reduce_stats=_global_stats if _parts == "all" and across else None, backend=backend, config=config,
            # whole heads per device: the merge kernel writes q's dtype (no separate convert)
            out_dtype=jnp.float32 if across else q.dtype)
        if _parts != "local" and across:
            o, lse = _merge_ctx(o[:, None], lse[:, None])
            o, lse = o[:, 0], lse[:, 0]
        return o.astype(q.dtype), lse

    f = jax.shard_map(body, mesh=mesh, in_specs=(_clustered_specs(), P(), _H2, _H3, _H3, P(), P()),
                      out_specs=(_H2, P(HEADS)), check_vma=False)
    return f(cl, threshold, q, k_new, v_new, q_pos, kv_pos)


def sharded_clustered_decode(
    cl: ShardedClusteredLayer,
    threshold,
    q: jax.Array,       # [Hq, d] roped query of the one decoded token
    k_new: jax.Array,   # [Hkv, S, d] the user input's keys (replicated over "ctx")
    v_new: jax.Array,   # [Hkv, S, d]
    q_pos: jax.Array,   # [1] int32 absolute position of the token
    kv_pos: jax.Array,  # [S] int32 absolute positions of the new keys (−1 = empty slot)
    *,
    mesh: Mesh,
    scale: float | None = None,
    vote: str = "kv",
    backend: str = "auto",
    config=None,
) -> tuple[jax.Array, jax.Array]:
    """Squeezed decode of one layer through the fused clustered kernel on every device.

    Per device: the scoring kernel (its centroids), one all-gather of the Eq. 1 (max,
    denominator) per query head so that the global threshold means what it means on one device,
    the attention kernel over its selected clusters' contiguous rows + its exact keys (+ the user
    input on the last shard), then one all-gather to merge the partial outputs by log-sum-exp.
    On a mesh with one context shard (KV heads split over "heads" only) neither collective runs:
    each device holds whole heads. The output is sharded by KV head over "heads".
    Equal to `pallas_kernels.clustered_decode_attention` on the union of the devices' clusters.
    -> (o [Hq, d] in q's dtype, lse [Hq] f32).
    """
    n_ctx, n_heads = mesh_shape(mesh)
    check_rank("q", q, 2, "[Hq, d] (one decoded token)")
    check_rank("centroids", cl.centroids, 3, "[Hkv, P*C, d] (one layer)")
    check_gqa(q.shape[0], cl.centroids.shape[0])
    check_same("head dim", [("q", q.shape[-1]), ("k_sorted", cl.k_sorted.shape[-1])])
    if vote not in squeezed.VOTES:
        raise ValueError(f"vote must be one of {squeezed.VOTES}; got {vote!r}")
    _check_divisible(cl.k_sorted.shape[0], cl.k_sorted.shape[1], n_ctx, n_heads)
    return _clustered_decode_jit(cl, jnp.asarray(threshold, jnp.float32), q, k_new, v_new,
                                 jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32), mesh=mesh,
                                 scale=_scale(scale, q.shape[-1]), vote=vote, backend=_resolve_backend(backend),
                                 config=config)


# ---------------------------------------------------------------------------------------------
# QUEST (page-sparse, per token) over a context-sharded fixed context
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("mesh", "page"))
def _quest_bounds_jit(k, *, mesh, page):
    from sqjax.quest import page_bounds

    f = jax.shard_map(lambda kl: page_bounds(kl, page), mesh=mesh, in_specs=kv_spec(False),
                      out_specs=(kv_spec(False), kv_spec(False)), check_vma=False)
    return f(k)


def sharded_quest_bounds(k, *, mesh: Mesh, page: int = 16) -> tuple[jax.Array, jax.Array]:
    """Per-page channel min/max of one layer's sharded keys k [Hkv, L, d] -> (kmin, kmax) [Hkv, L/page, d].

    Pages never straddle devices: the slice length L / P must be a multiple of `page`.
    """
    n_ctx, n_heads = mesh_shape(mesh)
    check_rank("k", k, 3, "[Hkv, L, d]")
    _check_divisible(k.shape[0], k.shape[1], n_ctx, n_heads)
    if (k.shape[1] // n_ctx) % page:
        raise ValueError(f"slice length {k.shape[1] // n_ctx} must be a multiple of the page size {page}")
    return _quest_bounds_jit(k, mesh=mesh, page=int(page))


def _global_topk_mask(scores, n_keep: int, n_ctx: int):
    """Exact global top-n_keep over the ctx-concatenated last axis (ties: lower global index first,
    as `jax.lax.top_k`).  scores [..., P_loc] local -> bool [..., P_loc]."""
    p_loc = scores.shape[-1]
    n_keep = max(0, min(n_keep, p_loc * n_ctx))
    if n_keep == 0:
        return jnp.zeros(scores.shape, bool)
    top_loc, _ = jax.lax.top_k(scores, min(n_keep, p_loc))
    pool = jnp.moveaxis(jax.lax.all_gather(top_loc, CTX), 0, -2)       # [..., P, k']
    pool = pool.reshape(pool.shape[:-2] + (-1,))
    kth = jax.lax.top_k(pool, n_keep)[0][..., -1:]                       # [..., 1] the n_keep-th value
    gt = scores > kth
    tie = scores == kth
    need = n_keep - jax.lax.psum(jnp.sum(gt, axis=-1, keepdims=True), CTX)
    ties_per_dev = jax.lax.all_gather(jnp.sum(tie, axis=-1, keepdims=True), CTX)  # [P, ..., 1]
    p = jax.lax.axis_index(CTX)
    before = jnp.sum(jnp.where((jnp.arange(n_ctx) < p).reshape((n_ctx,) + (1,) * (ties_per_dev.ndim - 1)),
                               ties_per_dev, 0), axis=0)
    rank = before + jnp.cumsum(tie, axis=-1) - 1
    return gt | (tie & (rank < need))


@static_jit(("mesh", "n_pages", "page", "vote", "scale"))
def _quest_jit(q, kmin, kmax, k, v, k_new, v_new, q_pos, kv_pos, *, mesh, n_pages, page, vote, scale):
    from sqjax import quest
    from sqjax.attention import attend_partial, causal_mask, merge_partials

    n_ctx, _ = mesh_shape(mesh)

    def body(q, kmin, kmax, k, v, k_new, v_new, q_pos, kv_pos):
        last = jax.lax.axis_index(CTX) == n_ctx - 1
        sc = quest.page_scores(q, kmin, kmax, vote)                                     # [Hs, T, P_loc]
        forced = last & (jnp.arange(sc.shape[-1]) == sc.shape[-1] - 1)                  # newest page
        sc = jnp.where(forced, jnp.inf, sc)
        pages = _global_topk_mask(sc, n_pages, n_ctx)
        mask = quest.pages_to_keys(pages, k.shape[1], page)                              # [Hs, T, Ls]
        fixed = attend_partial(q, k, v, mask, scale)
        new = attend_partial(q, k_new, v_new, causal_mask(q_pos, jnp.where(last, kv_pos, -1)), scale)
        part = merge_partials(fixed, new)
        o, lse = _merge_ctx(part.o, part.lse)
        return o.astype(q.dtype), lse, jnp.sum(pages, axis=-1)[..., None]

    f = jax.shard_map(body, mesh=mesh,
                      in_specs=(_H3,) + (kv_spec(False),) * 4 + (_H3, _H3, P(), P()),
                      out_specs=(_H3, _H2, P(HEADS, None, CTX)), check_vma=False)
    return f(q, kmin, kmax, k, v, k_new, v_new, q_pos, kv_pos)


def sharded_quest_attention(q, kmin, kmax, k, v, k_new, v_new, q_pos, kv_pos, *, mesh: Mesh, n_pages: int,
                            page: int = 16, vote: str = "kv", scale: float | None = None):
    """QUEST over a context-sharded fixed context (the `methods.Quest` selection, per token).

    Page scores are local; the top-`n_pages` pages are chosen GLOBALLY (local top-k, one
    all-gather of the candidates, exact tie handling), the newest page (last shard) is always
    kept; attention is exact over the kept pages (plain jnp per device) + the user input, merged
    by log-sum-exp. -> (o [Hq, T, d], lse [Hq, T], pages kept [Hs, T, P] per device).
    Equal to `Quest(...).select` + `fixed_context_attention` on one device.
    """
    n_ctx, n_heads = mesh_shape(mesh)
    _check_divisible(k.shape[0], k.shape[1], n_ctx, n_heads)
    if vote not in squeezed.VOTES:
        raise ValueError(f"vote must be one of {squeezed.VOTES}; got {vote!r}")
    return _quest_jit(q, kmin, kmax, k, v, k_new, v_new, jnp.asarray(q_pos, jnp.int32),
                      jnp.asarray(kv_pos, jnp.int32), mesh=mesh, n_pages=int(n_pages), page=int(page), vote=vote,
                      scale=_scale(scale, q.shape[-1]))


# ---------------------------------------------------------------------------------------------
# Offline: global calibration over all devices
# ---------------------------------------------------------------------------------------------

@static_jit(("mesh", "scale", "vote", "per_token"))
def _calib_jit(lay, q, threshold1, *, mesh, scale, vote, per_token=False):
    """Per level-2 cluster: (its final score, its level-1 parent's score), each [Hs, P·C] for the
    block q [Hq, n, d], or [n, Hs, P·C] with each token a block of its own (`per_token`)."""
    n_ctx, _ = mesh_shape(mesh)

    def block(lay, q, t1):
        r = _local_scores(lay, q, t1, None, scale=scale, vote=vote, n_ctx=n_ctx)
        hs = r.s.shape[0]
        if lay.counts1.shape[-1]:
            s1p = jnp.take_along_axis(r.s1, _rep(lay.parent, hs), axis=-1)
        else:
            s1p = jnp.zeros_like(r.s)
        return r.s, s1p

    body = block
    if per_token:
        def body(lay, q, t1):
            return jax.vmap(lambda qt: block(lay, qt[:, None], t1), in_axes=1)(q)
    out = P(None, HEADS, CTX) if per_token else _HC
    f = jax.shard_map(body, mesh=mesh, in_specs=(_layer_specs(0), _H3, P()), out_specs=(out, out),
                      check_vma=False)
    return f(lay, q, threshold1)


def calibrate_sharded(layers: ShardedLayerIndex, q_obs, cfg: squeezed.SqueezedConfig, scale: float, mesh: Mesh
                      ) -> tuple[ShardedSqueezedIndex, dict]:
    """Global thresholds T1 (hierarchical) and T over all layers × heads × keys of all devices (App. C).

    q_obs [layers, Hq, n, d]: roped queries of the last fixed-context tokens. Only the
    (cluster score, cluster size) pairs reach the host (see the module docstring).
    """
    if cfg.lookup_int8:
        raise ValueError("lookup_int8 is not implemented for the sharded index (its lookups score in f32/bf16); "
                         "build it with lookup_int8=False")
    check_rank("q_obs", q_obs, 4, "[layers, Hq, n_obs, d]")
    n_ctx, n_heads = mesh_shape(mesh)
    n_layers = layers.centroids.shape[0]
    check_same("layers", [("index", n_layers), ("q_obs", q_obs.shape[0])])
    length = layers.labels.shape[-1]
    ls, lcs = _shard_sizes(length, n_ctx, cfg.n_sink, cfg.n_obs)
    vote = cfg.vote
    hier = layers.counts1.shape[-1] > 0
    per_layer = [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n_layers)]
    q_obs = _put(q_obs, NamedSharding(mesh, P(None, HEADS, None, None)))
    counts = [_host(li.counts) for li in per_layer]  # [Hkv, P·C] each

    def pairs(t1, qs, per_token=False):
        out = [_calib_jit(li, qs[i], jnp.float32(t1), mesh=mesh, scale=float(scale), vote=vote, per_token=per_token)
               for i, li in enumerate(per_layer)]
        return [(_host(s), _host(s1)) for s, s1 in out]

    def weights(shape):
        """Per-layer cluster sizes broadcast to the scores' shape ([Hs, P·C] or [n, Hs, P·C]), and
        all of them pooled."""
        w = [np.broadcast_to(np.repeat(c, shape[-2] // c.shape[0], axis=0), shape) for c in counts]
        return w, np.concatenate([x.ravel() for x in w])

    def quantile(res, j, w_flat, frac):
        return weighted_quantile(np.concatenate([r[j].ravel() for r in res]), w_flat, frac)

    def kept(res, w, t):
        """Retrieved fraction of each device's clustered keys at T: [layers, Hs, P] (mean over tokens)."""
        c = counts[0].shape[-1] // n_ctx
        return np.stack([
            (np.where(r[0] > t, wi, 0).reshape(wi.shape[:-1] + (n_ctx, c)).sum(-1) / np.asarray(lcs))
            .reshape(-1, wi.shape[-2], n_ctx).mean(0) for r, wi in zip(res, w)
        ])

    def calibrate(qs, per_token=False):
        """(T, T1, retrieved fraction, scores, weights) App. C's way on the blocks qs (`per_token`:
        each token alone, the fraction averaged over them)."""
        res = pairs(0.0, qs, per_token)
        w, w_flat = weights(res[0][0].shape)
        t1 = 0.0
        if hier:
            t1 = quantile(res, 1, w_flat, cfg.level1_prune)
            res = pairs(t1, qs, per_token)
        t = quantile(res, 0, w_flat, cfg.sparsity)
        return t, t1, kept(res, w, t), res, w

    threshold, threshold1, frac, _, _ = calibrate(q_obs)
    decode = {}
    if cfg.decode_calibration == "token":
        hs = squeezed.selection_heads(q_obs.shape[1], counts[0].shape[0], vote)
        cols = squeezed.token_queries(q_obs.shape[2], n_layers * hs * counts[0].shape[-1])
        q_tok = q_obs[:, :, np.asarray(cols)]
        td, td1, dfrac, res, w = calibrate(q_tok, per_token=True)
        res_app_c = res if threshold1 == td1 else pairs(threshold1, q_tok, True)
        decode = {"threshold_decode": td, "threshold1_decode": td1, "decode_retrieved_fraction": dfrac,
                  "decode_calibration_queries": len(cols),
                  "decode_retrieved_fraction_app_c": kept(res_app_c, w, threshold)}
    cap_frac = cfg.capacity_fraction_for(frac, *([decode["decode_retrieved_fraction"]] if decode else []))
    n_exact = max((cfg.n_sink if p == 0 else 0) + (cfg.n_obs if p == n_ctx - 1 else 0) for p in range(n_ctx))
    capacity = min(ls, n_exact + int(math.ceil(cap_frac * max(lcs))))
    rep = NamedSharding(mesh, P())
    index = ShardedSqueezedIndex(
        layers, _put(np.float32(threshold), rep), _put(np.float32(threshold1), rep),
        n_ctx=n_ctx, n_obs=cfg.n_obs, capacity=capacity, n_sink=cfg.n_sink,
        **({k: _put(np.float32(decode[k]), rep) for k in ("threshold_decode", "threshold1_decode")} if decode else {}),
    )
    info = {"threshold": threshold, "threshold1": threshold1, "calibrated_retrieved_fraction": frac,
            "capacity": capacity, "clusters_per_device": layers.counts.shape[-1] // n_ctx,
            "level1_clusters_per_device": layers.counts1.shape[-1] // n_ctx, **decode}
    return index, info


@precision.index_build
def build_sharded_index(k, q_obs, cfg: squeezed.SqueezedConfig, scale: float, mesh: Mesh
                        ) -> tuple[ShardedSqueezedIndex, dict]:
    """Cluster per device + calibrate globally: the sharded counterpart of `build_squeezed_index`."""
    check_rank("q_obs", q_obs, 4, "[layers, Hq, n_obs, d]")
    check_rank("k", k, 4, "[layers, Hkv, L, d]")
    check_gqa(q_obs.shape[1], k.shape[1])
    layers = cluster_sharded(k, cfg, mesh)
    return calibrate_sharded(layers, squeezed.observation_window(q_obs, cfg), cfg, scale, mesh)


def to_single_device_index(index: ShardedSqueezedIndex, capacity: int | None = None) -> squeezed.SqueezedIndex:
    """The single-device `SqueezedIndex` with exactly the sharded index's clusters.

    Clusters are the union of the per-device clusterings (device p's cluster j becomes cluster
    p·C + j); labels, perm and offsets are rebuilt over global positions; thresholds are shared.
    capacity (default: every clustered key, i.e. never overflows). Gathers the index to one
    device: for tests and small contexts.
    """
    lay = index.layers
    n_ctx, c2, c1 = index.n_ctx, index.n_clusters, index.n_clusters1
    length, ls = index.length, index.slice_len
    labels = _host(lay.labels)  # [Lyr, Hkv, L] local, −1 exact
    shard = np.arange(length) // ls
    glab = np.where(labels >= 0, labels + shard * c2, -1)[..., index.n_sink:length - index.n_obs]
    if (glab < 0).any():
        raise ValueError("exact positions found inside the clustered range: index layout is inconsistent")
    glab = jnp.asarray(glab.astype(np.int32))
    perm, offsets = squeezed.cluster_layout(glab, n_ctx * c2)
    parent = _host(lay.parent)
    parent = parent + (np.arange(n_ctx * c2) // c2 * c1).astype(parent.dtype)
    lc = length - index.n_sink - index.n_obs
    cap = index.n_sink + index.n_obs + lc if capacity is None else int(capacity)
    single = squeezed.SqueezedLayerIndex(
        jnp.asarray(_host(lay.centroids)), jnp.asarray(_host(lay.counts)), glab, perm, offsets,
        jnp.asarray(_host(lay.centroids1)), jnp.asarray(_host(lay.counts1)), jnp.asarray(parent.astype(np.int32)),
    )
    return squeezed.SqueezedIndex(single, jnp.float32(_host(index.threshold)), jnp.float32(_host(index.threshold1)),
                                  index.n_obs, cap, index.n_sink, **_decode_thresholds(index, jnp.float32))


def from_single_device_index(index: squeezed.SqueezedIndex, mesh: Mesh) -> ShardedSqueezedIndex:
    """The inverse of `to_single_device_index`: a single-device index whose clusters never span
    context slices, as a `ShardedSqueezedIndex` on `mesh`.

    With one context shard (mesh "ctx" size 1) every index qualifies: this runs a single-device
    index head-parallel. With P > 1 shards, cluster j must hold keys of slice j // (C / P) only
    (true of `to_single_device_index` output, false of a global `build_squeezed_index` clustering:
    build with `build_sharded_index` instead). The capacity is kept (it becomes per device).
    """
    n_ctx, n_heads = mesh_shape(mesh)
    lay = index.layers
    labels = _host(lay.labels)                              # [Lyr, Hkv, Lc] global cluster ids
    n_layers, hkv, lc = labels.shape
    length = lc + index.n_sink + index.n_tail
    _check_divisible(hkv, length, n_ctx, n_heads)
    ls, _ = _shard_sizes(length, n_ctx, index.n_sink, index.n_tail)
    c_tot = lay.counts.shape[-1]
    c1_tot = lay.counts1.shape[-1]
    if c_tot % n_ctx or c1_tot % n_ctx:
        raise ValueError(f"{c_tot} level-2 / {c1_tot} level-1 clusters cannot be split evenly over "
                         f"{n_ctx} context shards")
    c2, c1 = c_tot // n_ctx, c1_tot // n_ctx
    shard = (np.arange(lc) + index.n_sink) // ls            # slice of each clustered position
    if (labels // c2 != shard).any():
        raise ValueError("clusters of this index span context slices; build a sharded index with "
                         "build_sharded_index (per-device clustering) instead")
    local = np.full((n_layers, hkv, length), -1, np.int32)
    local[..., index.n_sink:index.n_sink + lc] = labels - shard * c2
    parent = _host(lay.parent)
    if c1:
        owner = np.arange(c_tot) // c2
        if (parent // c1 != owner).any():
            raise ValueError("level-1 clusters of this index span context slices")
        parent = parent - owner * c1
    blocks = local.reshape(n_layers, hkv, n_ctx, ls)
    perm, _, offsets = local_layout(jnp.asarray(blocks), c2)
    perm = np.asarray(perm).reshape(n_layers, hkv, length)
    offsets = np.asarray(offsets).reshape(n_layers, hkv, n_ctx * (c2 + 2))
    host = ShardedLayerIndex(_host(lay.centroids), _host(lay.counts), local, perm, offsets,
                             _host(lay.centroids1), _host(lay.counts1), parent.astype(np.int32))
    sh = _named(mesh, _layer_specs(1))
    layers = jax.tree.map(_put, host, sh)
    rep = NamedSharding(mesh, P())
    return ShardedSqueezedIndex(layers, _put(np.float32(_host(index.threshold)), rep),
                                _put(np.float32(_host(index.threshold1)), rep), n_ctx=n_ctx,
                                n_obs=index.n_tail, capacity=min(index.capacity, ls), n_sink=index.n_sink,
                                **_decode_thresholds(index, lambda x: _put(np.float32(x), rep)))


def _decode_thresholds(index, put) -> dict:
    """The index's decode thresholds (when it has them) as keyword arguments, each through `put`."""
    if index.threshold_decode is None:
        return {}
    return {k: put(_host(getattr(index, k))) for k in ("threshold_decode", "threshold1_decode")}


# ---------------------------------------------------------------------------------------------
# Serving a model: per-layer state + an attention hook for models.forward
# ---------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedFixedContext:
    """What a model's decode loop needs: per-layer fixed K/V and index as SEPARATE buffers.

    Lists (not stacked arrays) so that no layer's slice is copied inside the jitted step
    (a kernel operand sliced from a stacked array would be materialised).
    """

    k: list            # per layer [Hkv, L, d]
    v: list
    layers: list       # per layer ShardedLayerIndex
    threshold: jax.Array
    threshold1: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    threshold_decode: jax.Array | None = None   # one-token steps' T, T1 (None: threshold, threshold1)
    threshold1_decode: jax.Array | None = None


def fixed_context_state(index: ShardedSqueezedIndex, k, v) -> ShardedFixedContext:
    """Split a stacked index and K/V [layers, Hkv, L, d] into per-layer buffers (sharding kept)."""
    mesh = k.sharding.mesh
    take = jax.jit(lambda a, i: a[i], static_argnums=1)
    kv_sh = kv_sharding(mesh, stacked=False)
    ks = [jax.device_put(take(k, i), kv_sh) for i in range(k.shape[0])]
    vs = [jax.device_put(take(v, i), kv_sh) for i in range(v.shape[0])]
    sh = _named(mesh, _layer_specs(0))
    lays = [jax.tree.map(lambda a, s, i=i: jax.device_put(take(a, i), s), index.layers, sh)
            for i in range(index.n_layers)]
    return ShardedFixedContext(ks, vs, lays, index.threshold, index.threshold1, index.capacity,
                               index.threshold_decode, index.threshold1_decode)


@dataclasses.dataclass(frozen=True)
class ShardedSqueezedHook:
    """`attn_fn` for `models.forward`: Squeezed attention over a sharded fixed context.

    attn_state is a `ShardedFixedContext`; the model's own cache (the user input) is the new
    part. Positions of the user input must follow the fixed context (start at L).
    """

    mesh: Mesh
    vote: str = "kv"
    backend: str = "auto"
    order: str = "score"

    def __call__(self, layer, q, cache_k, cache_v, q_pos, kv_pos, attn_state: ShardedFixedContext):
        outs = []
        for b in range(q.shape[0]):
            qb = jnp.swapaxes(q[b], 0, 1)  # [Hq, T, d]
            qv = (q_pos[b] >= 0) if q.shape[1] > 1 else None
            r = sharded_squeezed_attention(
                attn_state.layers[layer], *squeezed.thresholds_for(attn_state, q.shape[1]), qb,
                attn_state.k[layer], attn_state.v[layer], cache_k[b], cache_v[b], q_pos[b], kv_pos[b],
                mesh=self.mesh, capacity=attn_state.capacity, vote=self.vote, q_valid=qv, backend=self.backend,
                order=self.order)
            outs.append(jnp.swapaxes(r.o, 0, 1))
        return jnp.stack(outs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedClusteredContext:
    """`ShardedFixedContext`'s counterpart over cluster-contiguous storage (one-level indexes)."""

    layers: list       # per layer ShardedClusteredLayer
    threshold: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    threshold_decode: jax.Array | None = None  # one-token steps' T (None: threshold)


def clustered_context_state(index: ShardedSqueezedIndex, k, v) -> ShardedClusteredContext:
    """A stacked one-level index + K/V [layers, Hkv, L, d] -> per-layer cluster-contiguous state.

    Builds one layer at a time (peak extra memory: one layer's sorted K/V)."""
    state = fixed_context_state(index, k, v)
    mesh = k.sharding.mesh
    layers = []
    for i in range(index.n_layers):
        layers.append(clustered_layout(state.layers[i], state.k[i], state.v[i], mesh=mesh))
        state.k[i] = state.v[i] = None
    return ShardedClusteredContext(layers, index.threshold, index.capacity, index.threshold_decode)


@dataclasses.dataclass(frozen=True)
class ShardedClusteredHook:
    """`attn_fn` for `models.forward` over a `ShardedClusteredContext`.

    A decode step (one token) goes through `sharded_clustered_decode` (the fused kernel on every
    device); a block of T > 1 tokens (prefill of the question) through the generic
    `sharded_squeezed_attention` over the same sorted storage. Positions of the user input must
    follow the fixed context (start at L).
    """

    mesh: Mesh
    vote: str = "kv"
    backend: str = "auto"
    config: object = None

    def __call__(self, layer, q, cache_k, cache_v, q_pos, kv_pos, attn_state: ShardedClusteredContext):
        cl = attn_state.layers[layer]
        zero = jnp.zeros((), jnp.float32)
        outs = []
        for b in range(q.shape[0]):
            if q.shape[1] == 1:
                t = attn_state.threshold if attn_state.threshold_decode is None else attn_state.threshold_decode
                o, _ = sharded_clustered_decode(cl, t, q[b, 0], cache_k[b], cache_v[b], q_pos[b],
                                                kv_pos[b], mesh=self.mesh, vote=self.vote, backend=self.backend,
                                                config=self.config)
                outs.append(o[None])
                continue
            r = sharded_squeezed_attention(
                cl.index, attn_state.threshold, zero, jnp.swapaxes(q[b], 0, 1), cl.k_sorted, cl.v_sorted, cache_k[b],
                cache_v[b], q_pos[b], kv_pos[b], mesh=self.mesh, capacity=attn_state.capacity, vote=self.vote,
                q_valid=q_pos[b] >= 0, backend=self.backend, order="index")
            outs.append(jnp.swapaxes(r.o, 0, 1))
        return jnp.stack(outs)


# ---------------------------------------------------------------------------------------------
# Saving and loading with Orbax (sharded; no gather)
# ---------------------------------------------------------------------------------------------

@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    """Position-weighted wrapping uint32 sum of the bits of x: independent of the sharding."""
    width = jnp.dtype(x.dtype).itemsize
    utype = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
    if width == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        bits = bits[..., 0] ^ (bits[..., 1] * jnp.uint32(0x9E3779B1))
    else:
        bits = jax.lax.bitcast_convert_type(x, utype).astype(jnp.uint32)
    pos = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for ax in range(x.ndim - 1, -1, -1):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, x.shape, ax) * jnp.uint32(stride % (1 << 32))
        stride *= x.shape[ax]
    return jnp.sum(bits * (pos * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)


def _array_entries(tree: dict) -> dict:
    flat = {}
    for group, sub in tree.items():
        for name, a in sub.items():
            flat[f"{group}/{name}"] = {"shape": list(a.shape), "dtype": str(a.dtype), "checksum": int(_checksum(a))}
    return flat


def save_sharded(path, index: ShardedSqueezedIndex, *, k=None, v=None, metadata: dict | None = None,
                 overwrite: bool = False) -> None:
    """Write the sharded index (and optionally the document's K/V) to directory `path` with Orbax.

    Every process writes the shards it holds (call it on every process). The directory appears
    atomically: it is written under a temporary name and renamed when complete. `metadata`
    (JSON-serialisable: model fingerprint, tokenizer id, method parameters...) is stored as is.
    """
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{str(path)!r} exists; pass overwrite=True to replace it")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v, or neither")
    tmp = path.parent / f".{path.name}.partial"
    lead = jax.process_index() == 0
    if lead and tmp.exists():
        shutil.rmtree(tmp)
    multihost_utils.sync_global_devices("sqjax-save-start")
    trees = {"index": {f: getattr(index.layers, f) for f in _LAYER_FIELDS}}
    if k is not None:
        trees["kv"] = {"k": k, "v": v}
    ckptr = ocp.StandardCheckpointer()
    for name, tree in trees.items():
        ckptr.save(tmp / name, tree)
    ckptr.wait_until_finished()
    manifest = {
        "format": FORMAT, "version": VERSION, "n_ctx": index.n_ctx, "n_obs": index.n_obs, "n_sink": index.n_sink,
        "capacity": index.capacity, "threshold": float(_host(index.threshold)),
        "threshold1": float(_host(index.threshold1)), "has_kv": k is not None,
        **_decode_thresholds(index, float),
        "arrays": _array_entries(trees), "metadata": metadata or {},
    }
    if lead:
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if path.exists():
            old = path.parent / f".{path.name}.old"
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    multihost_utils.sync_global_devices("sqjax-save-done")


def load_sharded(path, mesh: Mesh, *, load_kv: bool = True, verify: bool = True):
    """Restore a `save_sharded` directory onto `mesh`: -> (index, k, v, metadata).

    Each device reads only its own block (arrays come back with NamedSharding(mesh, spec));
    k, v are None when not saved or `load_kv=False`. The mesh's "ctx" size must equal the one
    the index was built for; the "heads" split may differ (it must divide Hkv).
    """
    import orbax.checkpoint as ocp

    from sqjax.index_io import IndexFileError

    path = Path(path).absolute()
    mf = path / "manifest.json"
    if not mf.is_file():
        raise IndexFileError(f"{str(path)!r} is not a sharded sqjax index (no manifest.json)")
    try:
        manifest = json.loads(mf.read_text())
    except ValueError as e:
        raise IndexFileError(f"{str(mf)!r} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise IndexFileError(f"{str(path)!r} is not a sharded sqjax index (format {manifest.get('format')!r})")
    if manifest.get("version") != VERSION:
        raise IndexFileError(f"sharded index version {manifest.get('version')} is not supported (this sqjax reads "
                             f"version {VERSION}); rebuild the index")
    n_ctx, n_heads = mesh_shape(mesh)
    if manifest["n_ctx"] != n_ctx:
        raise IndexFileError(f"index was built for {manifest['n_ctx']} context shards; the mesh has {n_ctx} "
                             f"(per-device clusters cannot be re-split: rebuild, or use a mesh with "
                             f"{manifest['n_ctx']} 'ctx' devices)")
    arrays = manifest["arrays"]
    hkv = arrays["index/centroids"]["shape"][1]
    if hkv % n_heads:
        raise IndexFileError(f"{hkv} KV heads cannot be split over a 'heads' axis of {n_heads}")
    lspec = _layer_specs(1)
    specs = {"index": {f: getattr(lspec, f) for f in _LAYER_FIELDS}}
    if manifest["has_kv"] and load_kv:
        specs["kv"] = {"k": kv_spec(True), "v": kv_spec(True)}
    ckptr = ocp.StandardCheckpointer()
    out = {}
    for group, sub in specs.items():
        abstract = {n: jax.ShapeDtypeStruct(tuple(arrays[f"{group}/{n}"]["shape"]),
                                            jnp.dtype(arrays[f"{group}/{n}"]["dtype"]),
                                            sharding=NamedSharding(mesh, s)) for n, s in sub.items()}
        out[group] = ckptr.restore(path / group, abstract)
    if verify:
        for group, sub in out.items():
            for n, a in sub.items():
                want = arrays[f"{group}/{n}"]["checksum"]
                if int(_checksum(a)) != want:
                    raise IndexFileError(f"checksum mismatch for {group}/{n} in {str(path)!r}: the file is corrupted")
    rep = NamedSharding(mesh, P())
    index = ShardedSqueezedIndex(
        ShardedLayerIndex(**out["index"]), _put(np.float32(manifest["threshold"]), rep),
        _put(np.float32(manifest["threshold1"]), rep), n_ctx=n_ctx, n_obs=manifest["n_obs"],
        capacity=manifest["capacity"], n_sink=manifest["n_sink"],
        **({k: _put(np.float32(manifest[k]), rep) for k in ("threshold_decode", "threshold1_decode")}
           if "threshold_decode" in manifest else {}),
    )
    kv = out.get("kv")
    return index, (kv["k"] if kv else None), (kv["v"] if kv else None), manifest["metadata"]
