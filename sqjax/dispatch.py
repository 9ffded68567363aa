"""The one point where sqjax calls `pallas_kernels`: compiled kernels on GPU, references elsewhere.

Backends (as in `pallas_kernels`): "auto" (compiled Pallas on GPU, plain jnp elsewhere),
"pallas", "interpret" (the Pallas interpreter: what the CPU tests use), "reference".
The backend is chosen per call site (`SparseAttentionHook.backend`) or globally with
`using(...)`; it is read at trace time, so it is part of what a jitted function was built for.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

from sqjax.attention import fixed_context_attention, retrieved_attention
from sqjax.squeezed import Retrieval

# Without a GPU, "auto" attends a compact retrieval (positions + counts: Squeezed's, QUEST's decode pages, SnapKV's)
# by gathering its rows (`retrieved_attention`, CPU_GATHER_CHUNK rows at a time up to the largest count)
# instead of masking the whole fixed context: the demo's SmolLM2 decode on a 2-core CPU
# (benchmarks/results/cpu_gather_decode/).
# Read at trace time; False restores the mask route ("reference" always takes it).
CPU_GATHER = True
CPU_GATHER_CHUNK = 512

_state = threading.local()
BACKENDS = ("auto", "pallas", "interpret", "reference")


def current() -> str:
    return getattr(_state, "backend", "auto")


@contextlib.contextmanager
def using(backend: str):
    """Run (trace) the enclosed code with `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    prev = current()
    _state.backend = backend
    try:
        yield
    finally:
        _state.backend = prev


def resolved() -> str:
    """"pallas", "interpret" or "reference" for the current setting."""
    b = current()
    if b == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return b


def _prefill_config(int8: bool):
    """The prefill lookup kernels' config: the default, or the int8 one (`SqueezedConfig.lookup_int8`)."""
    from pallas_kernels.centroid_lookup import INT8_PREFILL

    return INT8_PREFILL if int8 else None


def cluster_scores(q, centroids, counts, scale: float, vote: str, q_valid=None, int8: bool = False):
    """Eq. 1 scores [Hs, C] through the centroid-lookup kernel (a block: averaged over the tokens
    q_valid [T] marks, all when None; ``int8``: int8 logits), or None to use the jnp path."""
    b = resolved()
    if b == "reference":
        return None
    from pallas_kernels import centroid_lookup_decode, centroid_lookup_prefill

    thr = jax.numpy.float32(0.0)
    centroids = centroids.astype(q.dtype)  # the index stores centroids in the keys' dtype; no-op then
    if q.shape[1] == 1 and q_valid is None:
        _, s = centroid_lookup_decode(q[:, 0], centroids, counts, thr, scale=scale, vote=vote, backend=b)
    else:
        _, s = centroid_lookup_prefill(q, centroids, counts, thr, scale=scale, vote=vote, backend=b, q_valid=q_valid,
                                       config=_prefill_config(int8))
    return s


def hierarchical_scores(q, centroids1, counts1, centroids2, counts2, parent, threshold1, scale: float, vote: str,
                        q_valid=None, int8: bool = False):
    """Eq. 2-3 through the hierarchical lookup kernels (a block: averaged over the tokens q_valid
    [T] marks; ``int8``: int8 logits), or None to use the jnp path.

    -> (s2 [Hs, C2], s1 [Hs, C1], candidates [Hs, C2], centroids read [Hs]) as
    `squeezed.HierarchicalScores` holds them.
    """
    b = resolved()
    if b == "reference":
        return None
    from pallas_kernels import hierarchical_scores as kernel

    dt = q.dtype  # the index stores centroids in the keys' dtype; no-op then
    if q.shape[1] == 1 and q_valid is None:  # decode
        q = q[:, 0]
    return kernel(q, centroids1.astype(dt), counts1, centroids2.astype(dt), counts2, parent,
                  jax.numpy.asarray(threshold1, jax.numpy.float32), scale=scale, vote=vote, backend=b,
                  q_valid=q_valid, config=_prefill_config(int8))   # int8: blocks only (the caller's rule)


def cpu_gathers() -> bool:
    """Whether `attention` gathers a compact retrieval's rows: the "auto" backend without a GPU."""
    return CPU_GATHER and current() == "auto" and resolved() == "reference"


def attention(q, k_fixed, v_fixed, selection, k_new, v_new, q_pos, kv_pos, scale: float, *, new_part: str = "causal"):
    """Exact attention over a selection of the fixed context + the causal user input.

    Dense selections (mask None: full attention, dense layers) go to the split-KV dense kernel
    (decode) or flash attention (blocks of tokens, bf16/f16: cuDNN on GPU);
    compact selections (positions + counts, e.g. Squeezed) to the split-KV sparse kernel,
    QUEST's pages and SAAP's buckets (decode) to their kernels;
    masks (per-token selections) and the "reference" backend use `fixed_context_attention`;
    "auto" without a GPU gathers a compact selection's rows (`CPU_GATHER`).
    new_part: how a block attends its own keys on GPU: "causal" (cuDNN's causal mask when the
    positions allow it, checked on the device; exact either way), "causal_left_padded" (the same
    for left-padded blocks), "prefix_causal_left_padded" (the same after earlier slots every query
    sees: a conversation's follow-up) or "mask" (`pallas_kernels.sparse_attention._new_part`).
    """
    b = resolved()
    ret = selection.retrieval
    if isinstance(ret, Retrieval) and cpu_gathers():
        # no GPU: gather the retrieved rows and attend those (what the GPU kernels compute), not
        # the whole fixed context under a mask, which made a sparse method slower than full attention
        return retrieved_attention(q, k_fixed, v_fixed, ret.idx, ret.count, k_new, v_new, q_pos, kv_pos, scale,
                                   CPU_GATHER_CHUNK)
    if b != "reference" and ret is None and selection.mask is None:
        # dense (full attention, a method's dense layers) over the contiguous fixed context, never
        # concatenated with the new keys and never cast to f32
        return _dense(q, k_fixed, v_fixed, k_new, v_new, q_pos, kv_pos, scale, b, new_part=new_part)
    if b == "reference" or ret is None:
        return fixed_context_attention(q, k_fixed, v_fixed, selection.mask, k_new, v_new, q_pos, kv_pos, scale)
    from pallas_kernels import gather_then_dense_attention, quest_decode_attention, saap_attention, sparse_attention
    from sqjax.selection import Buckets, Pages

    if isinstance(ret, Pages):  # QUEST decode: page-sparse split-KV kernel
        return quest_decode_attention(q, k_fixed, v_fixed, ret.page_idx, k_new, v_new, q_pos, kv_pos,
                                      scale=scale, page_size=ret.page_size, backend=b)
    if isinstance(ret, Buckets):  # SAAP decode: one program per visited bucket + the dense part
        return saap_attention(q, k_fixed, v_fixed, ret.off, ret.lst, ret.bucket_idx, k_new, v_new, q_pos, kv_pos,
                              scale=scale, n_sink=ret.n_sink, n_recent=ret.n_recent, backend=b)

    if q.shape[1] > 1 and b == "pallas":
        # prefill: gather the retrieved rows compactly, then cuDNN (1.9x faster than the
        # in-kernel gather for 4K queries over 512K on an H200: benchmarks/results/gpu_h200_first)
        return gather_then_dense_attention(q, k_fixed, v_fixed, ret.idx, ret.count, k_new, v_new, q_pos, kv_pos,
                                           scale=scale, backend=b, compact=True,  # retrieve() builds it compact
                                           new_part=new_part)
    return sparse_attention(q, k_fixed, v_fixed, ret.idx, ret.count, k_new, v_new, q_pos, kv_pos,
                            scale=scale, backend=b)


def _dense(q, k_fixed, v_fixed, k_new, v_new, q_pos, kv_pos, scale, b, return_lse=False, new_part="causal"):
    """Dense attention on a Pallas backend: split-KV Flash-Decoding for decode steps (a few rows per
    KV head: the fixed context is read once), flash attention (cuDNN on GPU) for blocks of tokens
    in bf16/f16 (the split-KV kernel would read the fixed context once per block of rows)."""
    from pallas_kernels import dense_decode_attention, dense_prefill_attention

    flash = q.shape[1] > 1 and q.dtype in (jnp.bfloat16, jnp.float16)
    if flash:
        return dense_prefill_attention(q, k_fixed, v_fixed, k_new, v_new, q_pos, kv_pos, scale=scale,
                                       return_lse=return_lse, backend=b, new_part=new_part)
    return dense_decode_attention(q, k_fixed, v_fixed, k_new, v_new, q_pos, kv_pos, scale=scale, return_lse=return_lse,
                                  backend=b)


def dense_attention_batched(q, k_fixed, v_fixed, k_new, v_new, q_pos, kv_pos, scale: float):
    """B rows (questions) over the WHOLE shared fixed context + each row's own causal keys (full
    attention, a method's dense layers), reading the fixed context once per call, not once per row:
    the rows' tokens are folded into one query block over the fixed keys (no mask there: every fixed
    key is visible to every token), the split-KV dense kernel (decode) or flash attention (prefill)
    on a Pallas backend (`_dense`) and `attend_partial` on the reference one; each row's new keys are attended apart (causal by
    position; left-padding tokens see none) and the two parts merged by log-sum-exp.

    q [B, Hq, T, d] (T = 1: a decode step; T > 1: the questions' prefill); k_fixed, v_fixed
    [Hkv, L, d]; k_new, v_new [B, Hkv, S, d]; q_pos [B, T]; kv_pos [B, S] -> [B, Hq, T, d] in q's dtype.
    """
    from sqjax.attention import Partial, attend_partial, causal_mask, merge_partials

    b = resolved()
    n_rows, hq, t, d = q.shape
    rows = jnp.swapaxes(q, 0, 1).reshape(hq, n_rows * t, d)                # the rows' tokens as one block
    if b == "reference":
        fixed = attend_partial(rows, k_fixed, v_fixed, None, scale)
    else:
        none = jnp.zeros((k_fixed.shape[0], 0, k_fixed.shape[2]), k_fixed.dtype)
        o, lse = _dense(rows, k_fixed, v_fixed, none, none, jnp.zeros((n_rows * t,), jnp.int32),
                        jnp.zeros((0,), jnp.int32), scale, b, return_lse=True)
        fixed = Partial(o.astype(jnp.float32), lse)
    fixed = Partial(jnp.swapaxes(fixed.o.reshape(hq, n_rows, t, d), 0, 1),
                    jnp.swapaxes(fixed.lse.reshape(hq, n_rows, t), 0, 1))          # [B, Hq, T(, d)]
    if not k_new.shape[2]:
        return fixed.o.astype(q.dtype)
    new = jax.vmap(lambda qb, kb, vb, qp, kp: attend_partial(qb, kb, vb, causal_mask(qp, kp), scale))(
        q, k_new, v_new, q_pos, kv_pos)
    return jax.vmap(merge_partials)(fixed, new).o.astype(q.dtype)


def clustered_decode_batched(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos,
                             scale: float, vote: str, level1=None, threshold1=0.0):
    """One token of each of B rows over one shared cluster-contiguous fixed context, in one set
    of launches (`pallas_kernels.clustered_decode_batched`: centroids scored once, the union of
    the rows' clusters streamed once; hierarchical with `level1` = (centroids1, counts1, parent)
    and `threshold1` = T1: `clustered_decode_hierarchical_batched`, each level's centroids read
    once), or None (use the rows one by one) unless the backend is a Pallas one and the batch
    fits the kernel's vote bits.

    q [B, Hq, 1, d]; k_new, v_new [B, Hkv, S, d]; q_pos [B, 1]; kv_pos [B, S] -> [B, Hq, 1, d].
    """
    b = resolved()
    if b == "reference":
        return None
    from pallas_kernels.clustered_attention import (check_batched, clustered_decode_batched as kernel,
                                                    clustered_decode_hierarchical_batched as tree_kernel)

    if check_batched(q.shape[0], q.shape[1], k_sorted.shape[0], vote) is not None:
        return None
    dt = k_sorted.dtype  # the index stores centroids in the keys' dtype; no-op then
    if level1 is None:
        o = kernel(q[:, :, 0], k_sorted, v_sorted, centroids.astype(dt), offsets, threshold, k_new, v_new,
                   q_pos[:, 0], kv_pos, scale=scale, vote=vote, backend=b)
        return o[:, :, None]
    c1, n1, parent = level1
    f32 = jnp.float32
    o = tree_kernel(q[:, :, 0], k_sorted, v_sorted, c1.astype(dt), n1, centroids.astype(dt), offsets, parent,
                    jnp.asarray(threshold1, f32), jnp.asarray(threshold, f32), k_new, v_new, q_pos[:, 0], kv_pos,
                    scale=scale, vote=vote, backend=b)
    return o[:, :, None]


def clustered_prefill(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos,
                      scale: float, vote: str, level1=None, threshold1=0.0, q_valid=None, int8: bool = False,
                      new_part: str = "causal"):
    """A block's Squeezed attention over the cluster-contiguous layout, or None off the Pallas backends.

    q [Hq, T, d] (S averaged over the tokens q_valid [T] marks); one level, or hierarchical with
    `level1` = (centroids1, counts1, parent) and `threshold1` as in `clustered_decode`. The lookup
    kernels select clusters; their row ranges (contiguous in the layout), the exact part and the new
    keys are attended exactly: every selected row, no capacity, no score sort (the generic
    `Method.select` route sorts the clusters by score for its capacity's overflow policy).
    """
    b = resolved()
    if b == "reference":
        return None
    from pallas_kernels import clustered_prefill_attention, clustered_prefill_hierarchical

    dt = k_sorted.dtype  # the index stores centroids in the keys' dtype; no-op then
    f32 = jnp.float32
    kw = dict(scale=scale, vote=vote, backend=b, config=_prefill_config(int8), q_valid=q_valid, new_part=new_part)
    if level1 is None:
        return clustered_prefill_attention(q, k_sorted, v_sorted, centroids.astype(dt), offsets,
                                           jnp.asarray(threshold, f32), k_new, v_new, q_pos, kv_pos, **kw)
    c1, n1, parent = level1
    return clustered_prefill_hierarchical(q, k_sorted, v_sorted, c1.astype(dt), n1, centroids.astype(dt), offsets,
                                          parent, jnp.asarray(threshold1, f32), jnp.asarray(threshold, f32), k_new,
                                          v_new, q_pos, kv_pos, **kw)


def clustered_decode(q, k_sorted, v_sorted, centroids, offsets, threshold, k_new, v_new, q_pos, kv_pos,
                     scale: float, vote: str, level1=None, threshold1=0.0):
    """One-token Squeezed attention over the cluster-contiguous layout (fused kernels), or None.

    None (use the generic path) unless the backend is a Pallas one. One level: the kernel scores
    the centroids, attends to the selected clusters' contiguous row ranges plus the exact part
    and the new keys, and merges -- three launches, no index list, no capacity. Hierarchical
    (`level1` = (centroids1, counts1, parent) of the layer, `threshold1` = T1): the
    level-1 lookup kernel (Eq. 2), the level-2 kernel writing Eq. 3's logits over the survivors'
    children, and the same attention kernel normalising, voting (S2 > T) and attending, then the
    merge -- four launches.
    """
    b = resolved()
    if b == "reference":
        return None
    from pallas_kernels import clustered_decode_attention, clustered_decode_hierarchical

    dt = k_sorted.dtype  # the index stores centroids in the keys' dtype; no-op then
    if level1 is None:
        o = clustered_decode_attention(q[:, 0], k_sorted, v_sorted, centroids.astype(dt), offsets, threshold,
                                       k_new, v_new, q_pos, kv_pos, scale=scale, vote=vote, backend=b)
        return o[:, None]
    c1, n1, parent = level1  # level-2 counts: the kernels take them from the layout's offsets
    f32 = jax.numpy.float32
    o = clustered_decode_hierarchical(q[:, 0], k_sorted, v_sorted, c1.astype(dt), n1, centroids.astype(dt), offsets,
                                      parent, jax.numpy.asarray(threshold1, f32), jax.numpy.asarray(threshold, f32),
                                      k_new, v_new, q_pos, kv_pos, scale=scale, vote=vote, backend=b)
    return o[:, None]
