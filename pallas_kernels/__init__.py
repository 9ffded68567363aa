"""Pallas GPU kernels for sqjax, each beside its plain-jnp reference.

Depends only on jax/numpy.  Every public op takes ``backend`` in
{"auto", "pallas", "interpret", "reference"} (see ``pallas_kernels._dispatch``):
"auto" runs the compiled Pallas/Triton kernel on GPU and the reference elsewhere.

Shared conventions: query heads Hq, KV heads Hkv, group g = Hq // Hkv, selection
heads Hs in {Hkv ("kv" vote, default), Hq ("q")}; selection head s uses KV head
``s // (Hs // Hkv)``; query head h uses selection head ``h // (Hq // Hs)``.
"""
from pallas_kernels._attention_core import AttentionConfig
from pallas_kernels._dispatch import BACKENDS, resolve_backend
from pallas_kernels.centroid_lookup import (CentroidLookupConfig, centroid_lookup_decode,
                                            centroid_lookup_prefill, centroid_lookup_reference)
from pallas_kernels.clustered_attention import (ClusteredConfig, cluster_sort_layout, clustered_decode_attention, clustered_decode_attention_reference, clustered_decode_batched, clustered_decode_batched_reference, clustered_decode_hierarchical, clustered_decode_hierarchical_batched, clustered_decode_hierarchical_batched_reference, clustered_decode_hierarchical_reference, clustered_decode_partial, clustered_decode_selected, clustered_decode_selected_reference, clustered_prefill_attention, clustered_prefill_attention_reference, clustered_prefill_hierarchical, clustered_prefill_hierarchical_reference)  # noqa: E501
from pallas_kernels.dense_attention import dense_attention_reference, dense_decode_attention, dense_prefill_attention
from pallas_kernels.hierarchical_lookup import (hierarchical_lookup_decode, hierarchical_lookup_prefill,
                                                hierarchical_lookup_reference, hierarchical_scores)
from pallas_kernels.quest import (QuestScoreConfig, quest_decode_attention,
                                  quest_decode_attention_reference, quest_page_minmax,
                                  quest_page_scores, quest_page_scores_reference, quest_select)
from pallas_kernels.saap_attention import saap_attention, saap_attention_reference
from pallas_kernels.sparse_attention import (clusters_to_indices, gather_live_rows, gather_live_rows_reference,
                                             gather_then_dense_attention, sparse_attention,
                                             sparse_attention_reference)

__all__ = [
    "AttentionConfig", "BACKENDS", "CentroidLookupConfig", "ClusteredConfig", "QuestScoreConfig",
    "cluster_sort_layout", "clustered_decode_attention", "clustered_decode_attention_reference",
    "clustered_decode_batched", "clustered_decode_batched_reference",
    "clustered_decode_hierarchical", "clustered_decode_hierarchical_batched",
    "clustered_decode_hierarchical_batched_reference", "clustered_decode_hierarchical_reference",
    "clustered_decode_partial", "clustered_decode_selected", "clustered_decode_selected_reference",
    "clustered_prefill_attention", "clustered_prefill_attention_reference", "clustered_prefill_hierarchical",
    "clustered_prefill_hierarchical_reference",
    "centroid_lookup_decode", "centroid_lookup_prefill", "centroid_lookup_reference",
    "clusters_to_indices", "dense_attention_reference", "dense_decode_attention", "dense_prefill_attention", "gather_live_rows",
    "gather_live_rows_reference", "gather_then_dense_attention",
    "hierarchical_lookup_decode", "hierarchical_lookup_prefill", "hierarchical_lookup_reference", "hierarchical_scores",
    "quest_decode_attention",
    "quest_decode_attention_reference", "quest_page_minmax", "quest_page_scores",
    "quest_page_scores_reference", "quest_select", "resolve_backend", "saap_attention",
    "saap_attention_reference", "sparse_attention", "sparse_attention_reference",
]
