"""KV-budget and bytes-moved accounting (DESIGN §3.1), the same for every method.

KV budget of one lookup = bytes of the fixed-context K and V rows read (exact tail included)
plus bytes of the metadata rows read (centroids, page bounds, bucket centroids, classifier
weights — counted in key-sized rows), over the bytes of the whole fixed context's K and V:

    budget = (2·rows + meta_rows) · d / (2 · L · d).

So 90% sparsity with 5% centroids is 0.10 + 0.05/2 = 0.125 (Squeezed Attention Table 2).
Reported per layer, per selection head and overall (mean over heads and layers, dense layers
count 1.0), next to the bytes the kernels read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from sqjax.selection import Selection


@dataclasses.dataclass(frozen=True)
class BudgetReport:
    """Accounting over the layers of one lookup (averaged over the query tokens of a block)."""

    per_head: np.ndarray   # [layers, Hs] KV budget of each selection head
    per_layer: np.ndarray  # [layers]
    overall: float
    rows: np.ndarray       # [layers, Hs] mean K/V rows read per lookup
    meta_rows: np.ndarray  # [layers, Hs] mean key-sized metadata rows read per lookup
    bytes_moved: float     # K/V + metadata bytes read per lookup, all layers and heads
    bytes_dense: float     # K/V bytes of the whole fixed context, all layers

    def to_dict(self) -> dict:
        return {
            "kv_budget": self.overall,
            "kv_budget_per_layer": self.per_layer.tolist(),
            "kv_budget_per_head": self.per_head.tolist(),
            "bytes_moved": self.bytes_moved,
            "bytes_dense": self.bytes_dense,
        }


def account(
    selections: Sequence[Selection],
    n_fixed: int,
    head_dim: int,
    n_kv_heads: int,
    bytes_per_elem: int = 2,
) -> BudgetReport:
    """Accounting for one selection per layer (a lookup over `n_fixed` fixed-context keys)."""
    if not selections:
        raise ValueError("need at least one layer's selection")
    rows = np.stack([np.asarray(s.kv_rows, np.float64).mean(axis=-1) for s in selections])
    meta = np.stack([np.asarray(s.meta_rows, np.float64).mean(axis=-1) for s in selections])
    per_head = (2.0 * rows + meta) / (2.0 * n_fixed)
    per_layer = per_head.mean(axis=-1)
    row_bytes = head_dim * bytes_per_elem
    bytes_moved = float(np.sum(2.0 * rows + meta) * row_bytes)
    bytes_dense = float(len(selections) * n_kv_heads * n_fixed * 2 * row_bytes)
    return BudgetReport(per_head, per_layer, float(per_layer.mean()), rows, meta, bytes_moved, bytes_dense)
