"""Run configuration of the SAAP query-classifier trainer (a frozen, validated dataclass).

Defaults follow SAAP (Mazaré et al. 2025, §4, App. A) where they make sense on a CPU and an
8K-context model, and say so where they differ:

* `n_buckets` None = scaled with the model's context: ``clip(max_positions // 64, 16, 1024)``
  (128 for SmolLM2's 8K, 1024 for a 64K+ context, as the paper's C = 1024 at 100K-500K tokens;
  the same rule as `sqjax.methods.saap_defaults`).
* `min_distance` 256 (paper: 1024 at 100K-500K tokens). A training query is *long-range* when
  its argmax-attention key (attention sink excluded) is more than `min_distance` tokens behind
  it; with ~6K-token documents 1024 would leave few queries (and SAAP's dense part covers
  only the last 63-511 tokens at these lengths).
* `lr` 1e-5 (the paper's Adam rate). The paper trains 40k iterations; on a CPU budget of
  minutes use a larger rate (e.g. ``--lr 1e-3 --schedule cosine``), as our committed run does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

SCHEDULES = ("constant", "cosine")


def default_buckets(max_positions: int) -> int:
    """C scaled with the model's context: 128 at 8K, 1024 from 64K on (never below 16)."""
    return int(min(1024, max(16, max_positions // 64)))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the training data and the trained classifier.

    Data:      max_tokens (tokens per document, longer ones are truncated), min_tokens (shorter
               documents are skipped), queries_per_doc (query positions sampled per document,
               uniformly from the ones that can be long-range), rows_per_head (long-range
               training queries kept per (document, layer, KV head)), n_sink (attention-sink
               tokens excluded from the keys), min_distance.
    Buckets:   n_buckets (None = `default_buckets`), kmeans_iters, kmeans_max_points (training
               keys sampled per (layer, KV head) for k-means).
    Model:     hidden, bn_momentum.
    Training:  steps, batch_queries (queries per (layer, KV head) per step, all from one
               document: one batch = one prompt), lr, schedule, warmup, seed, ckpt_every.
    """

    n_buckets: int | None = None
    hidden: int = 1024
    steps: int = 400
    lr: float = 1e-5
    schedule: str = "constant"
    warmup: int = 0
    batch_queries: int = 256
    min_distance: int = 256
    n_sink: int = 1
    max_tokens: int = 6144
    min_tokens: int = 1024
    queries_per_doc: int = 1024
    rows_per_head: int = 2048
    kmeans_iters: int = 10
    kmeans_max_points: int = 32768
    bn_momentum: float = 0.9
    seed: int = 0
    ckpt_every: int = 50
    prefill_chunk: int = 1024

    def __post_init__(self):
        positive = ("hidden", "steps", "batch_queries", "max_tokens", "queries_per_doc",
                    "rows_per_head", "kmeans_max_points", "ckpt_every", "prefill_chunk")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int; got {v!r}")
        for name in ("min_distance", "n_sink", "warmup", "kmeans_iters", "seed", "min_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0; got {v!r}")
        if self.n_buckets is not None and (not isinstance(self.n_buckets, int) or self.n_buckets < 2):
            raise ValueError(f"n_buckets must be None or an int >= 2; got {self.n_buckets!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0; got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}; got {self.schedule!r}")
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ValueError(f"bn_momentum must lie in [0, 1); got {self.bn_momentum}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) > max_tokens ({self.max_tokens})")
        if self.n_sink < 1:
            raise ValueError("n_sink must be >= 1: the attention sink (position 0) is never a training key")

    def buckets_for(self, max_positions: int) -> int:
        return self.n_buckets if self.n_buckets is not None else default_buckets(max_positions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {unknown}")
        return cls(**d)

    # fields that change the prepared data (documents -> shards -> targets)
    DATA_FIELDS = ("max_tokens", "min_tokens", "queries_per_doc", "rows_per_head", "n_sink",
                   "min_distance", "n_buckets", "kmeans_iters", "kmeans_max_points", "seed",
                   "prefill_chunk")
    # fields a resumed run may change (everything else must match the checkpointed run)
    RESUMABLE_FIELDS = ("steps", "ckpt_every")
