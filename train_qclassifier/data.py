"""Training data: model activations streamed to disk, key buckets, long-range query targets.

Three stages, each cached on disk under the run's ``data/`` directory (plain ``np.save``
arrays, loaded with ``allow_pickle=False``; JSON metadata; no pickle anywhere). Every
document directory is written to a temp dir and renamed, so an interrupted stage never
leaves a half-written shard and a rerun picks up where it stopped.

1. `collect_document`: prefill one document in chunks (≤ `prefill_chunk` tokens; CPU attention
   memory) and keep the de-roped keys of every token and the de-roped queries at sampled
   positions:  ``k_pre.npy [L, Hkv, T, d]``, ``q_pre.npy [L, Hq, n, d]``, ``q_pos.npy [n]``.
   Query positions are sampled uniformly among those that *can* be long-range
   (``t >= n_sink + min_distance + 1``). Memory is bounded by one document.
2. `train_kmeans`: spherical k-means per (layer, KV head) on (a sample of) the training keys,
   sink excluded: ``unit_centroids.npy [L, Hkv, C, d]``. Also k-means on the same keys
   *roped* (``unit_centroids_roped.npy``), the "roped" baseline of the evaluation.
3. `prepare_targets`: per document and layer, re-rope q/k (`models.rope`), compute each sampled
   query's argmax-attention key and bucket masses (`targets.query_stats`), keep the long-range
   ones, and store up to `rows_per_head` per (layer, KV head), pooled over the group's g query
   heads: ``x.npy [L, Hkv, R, d]`` (de-roped query = classifier input), ``t.npy [L, Hkv, R, C]``
   (target A·H_k), ``n_valid.npy [L, Hkv]`` (rows ``< n_valid`` are real).

`TrainingSet.batch(step)` then draws one document per step (a fixed permutation per epoch)
and `batch_queries` rows per (layer, KV head) from it, deterministically from (seed, step):
an interrupted run replays exactly the same batches.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from train_qclassifier.config import TrainConfig
from train_qclassifier.corpus import Document
from train_qclassifier.targets import long_range_mask, query_stats, rope_heads

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


def save_json_atomic(path: Path, obj: Any) -> None:
    from sqjax.index_io import write_text_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def load_array(path: Path, mmap: bool = False) -> np.ndarray:
    return np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)


def _write_dir_atomic(target: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        for name, arr in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(arr), allow_pickle=False)
        save_json_atomic(tmp / "meta.json", meta)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_meta(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------------------------
# Stage 1: activations
# --------------------------------------------------------------------------------------------


def sample_query_positions(n_tokens: int, n: int, *, min_distance: int, n_sink: int, seed: int) -> np.ndarray:
    """Sorted int32 positions, ≤ n of them, uniform without replacement in [n_sink+min_distance+1, T)."""
    lo = n_sink + min_distance + 1
    if lo >= n_tokens:
        return np.zeros((0,), np.int32)
    cand = np.arange(lo, n_tokens, dtype=np.int32)
    if len(cand) <= n:
        return cand
    rng = np.random.default_rng([seed, n_tokens, 0x51AA])
    return np.sort(rng.choice(cand, n, replace=False)).astype(np.int32)


def prefill_activations(model, ids: np.ndarray, keep_pos: np.ndarray, *, chunk: int = 1024,
                        capacity: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Prefill `ids` in chunks; return (k_pre [L, Hkv, T, d], q_pre [L, Hq, len(keep_pos), d]) float32.

    Every chunk is padded to `chunk` tokens (position −1, invisible) so one compilation serves
    all documents; `capacity` (default T rounded up to chunks) fixes the cache size likewise.
    """
    cfg = model.config
    ids = np.asarray(ids, np.int32)
    T = len(ids)
    n_chunks = -(-T // chunk)
    cap = capacity if capacity is not None else n_chunks * chunk
    if cap < n_chunks * chunk:
        raise ValueError(f"capacity {cap} < {n_chunks * chunk} (T={T} rounded up to chunks of {chunk})")
    L, hq, hkv, d = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    k_out = np.zeros((L, hkv, T, d), np.float32)
    q_out = np.zeros((L, hq, len(keep_pos), d), np.float32)
    keep_pos = np.asarray(keep_pos, np.int64)
    cache = model.new_cache(1, cap)
    for c in range(n_chunks):
        s, e = c * chunk, min(T, (c + 1) * chunk)
        tok = np.zeros((1, chunk), np.int32)
        pos = np.full((1, chunk), -1, np.int32)
        tok[0, : e - s] = ids[s:e]
        pos[0, : e - s] = np.arange(s, e)
        _, cache, caps = model.forward(jnp.asarray(tok), jnp.asarray(pos), cache, capture_last=None, logits="none")
        sel = np.nonzero((keep_pos >= s) & (keep_pos < e))[0]
        rel = keep_pos[sel] - s
        for layer, cap_l in enumerate(caps):
            k_out[layer, :, s:e] = np.asarray(cap_l["k_pre"][0, : e - s], np.float32).transpose(1, 0, 2)
            if len(sel):
                q_out[layer][:, sel] = np.asarray(cap_l["q_pre"][0], np.float32)[rel].transpose(1, 0, 2)
    return k_out, q_out


def collect_document(model, doc: Document, out_dir: Path, cfg: TrainConfig, *, index: int,
                     log: Log = _quiet) -> Path | None:
    """Stage 1 for one document -> ``out_dir`` (skipped if already there). None if too short."""
    out_dir = Path(out_dir)
    meta = _read_meta(out_dir)
    if meta is not None and meta.get("digest") == doc.digest and meta.get("stage") == "activations":
        return out_dir
    ids = np.asarray(model.tokenizer.encode(doc.text), np.int32)[: cfg.max_tokens]
    if len(ids) < cfg.min_tokens:
        log(f"skip {doc.name}: {len(ids)} tokens < min_tokens {cfg.min_tokens}")
        return None
    q_pos = sample_query_positions(len(ids), cfg.queries_per_doc, min_distance=cfg.min_distance,
                                   n_sink=cfg.n_sink, seed=cfg.seed * 100003 + index)
    cap = -(-cfg.max_tokens // cfg.prefill_chunk) * cfg.prefill_chunk
    t0 = time.perf_counter()
    k_pre, q_pre = prefill_activations(model, ids, q_pos, chunk=cfg.prefill_chunk, capacity=cap)
    _write_dir_atomic(out_dir, {"k_pre": k_pre, "q_pre": q_pre, "q_pos": q_pos, "ids": ids},
                      {"stage": "activations", "name": doc.name, "digest": doc.digest, "n_tokens": int(len(ids)),
                       "n_queries": int(len(q_pos)), "seconds": time.perf_counter() - t0})
    log(f"collected {doc.name}: {len(ids)} tokens, {len(q_pos)} query positions ({time.perf_counter() - t0:.1f}s)")
    return out_dir


# --------------------------------------------------------------------------------------------
# Stage 2: key buckets
# --------------------------------------------------------------------------------------------


def train_kmeans(doc_dirs: list[Path], n_buckets: int, cfg: TrainConfig, inv_freq, *,
                 log: Log = _quiet) -> dict[str, np.ndarray]:
    """Spherical k-means per (layer, KV head) on training keys (sink excluded), de-roped and roped.

    Returns ``{"unit_centroids": [L, Hkv, C, d], "unit_centroids_roped": ..., "counts": [L, Hkv, C],
    "counts_roped": ...}``.
    """
    from sqjax.kmeans import KMeansConfig, spherical_kmeans

    ks = [load_array(d / "k_pre.npy", mmap=True) for d in doc_dirs]
    L, hkv, _, dim = ks[0].shape
    spans = [(i, p) for i, k in enumerate(ks) for p in range(cfg.n_sink, k.shape[2])]
    rng = np.random.default_rng([cfg.seed, 0xC1A5])
    if len(spans) > cfg.kmeans_max_points:
        pick = np.sort(rng.choice(len(spans), cfg.kmeans_max_points, replace=False))
        spans = [spans[i] for i in pick]
    if len(spans) < n_buckets:
        raise ValueError(f"only {len(spans)} training keys for {n_buckets} buckets: add documents or lower --buckets")
    by_doc: dict[int, list[int]] = {}
    for i, p in spans:
        by_doc.setdefault(i, []).append(p)
    out = {k: [] for k in ("unit_centroids", "unit_centroids_roped", "counts", "counts_roped")}
    t0 = time.perf_counter()
    for layer in range(L):
        parts, pos = [], []
        for i, ps in by_doc.items():
            parts.append(np.asarray(ks[i][layer][:, ps], np.float32))
            pos.append(np.asarray(ps, np.int32))
        x = jnp.asarray(np.concatenate(parts, axis=1))  # [Hkv, N, d]
        positions = jnp.asarray(np.concatenate(pos))
        kcfg = KMeansConfig(n_buckets, cfg.kmeans_iters, seed=cfg.seed * 1000 + layer)
        r = spherical_kmeans(x, kcfg)
        rr = spherical_kmeans(rope_heads(x, positions, inv_freq), kcfg)
        out["unit_centroids"].append(np.asarray(r.unit_centroids))
        out["counts"].append(np.asarray(r.counts))
        out["unit_centroids_roped"].append(np.asarray(rr.unit_centroids))
        out["counts_roped"].append(np.asarray(rr.counts))
        log(f"k-means layer {layer}: {x.shape[1]} keys x {hkv} heads, C={n_buckets} "
            f"(empty buckets {int((r.counts == 0).sum())}; {time.perf_counter() - t0:.0f}s)")
    return {k: np.stack(v) for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Stage 3: long-range query targets
# --------------------------------------------------------------------------------------------


def layer_rows(q_pre, k_pre, q_pos, unit, *, inv_freq, n_buckets: int, n_sink: int, min_distance: int):
    """One layer: (dist [Hq, n], mass [Hq, n, C]) of the sampled queries under the key buckets `unit`."""
    from sqjax.saap import assign_keys

    T = k_pre.shape[1]
    k = rope_heads(jnp.asarray(k_pre), jnp.arange(T), inv_freq)
    q = rope_heads(jnp.asarray(q_pre), jnp.asarray(q_pos), inv_freq)
    labels = assign_keys(jnp.asarray(k_pre), jnp.asarray(unit))
    dist, mass, _ = query_stats(q, k, jnp.asarray(q_pos), labels[None], n_buckets=n_buckets, n_sink=n_sink)
    return np.asarray(dist), np.asarray(mass[0])


def select_rows(dist: np.ndarray, mass: np.ndarray, q_pre: np.ndarray, *, n_kv_heads: int, min_distance: int,
                rows: int, rng: np.random.Generator):
    """Pool the long-range (query head, position) pairs of each KV head's group; keep ≤ `rows`.

    dist [Hq, n], mass [Hq, n, C], q_pre [Hq, n, d] -> (x [Hkv, R, d], t [Hkv, R, C], n_valid [Hkv]).
    """
    hq, n = dist.shape
    g = hq // n_kv_heads
    C, d = mass.shape[-1], q_pre.shape[-1]
    x = np.zeros((n_kv_heads, rows, d), np.float32)
    t = np.zeros((n_kv_heads, rows, C), np.float32)
    n_valid = np.zeros((n_kv_heads,), np.int32)
    lr = np.asarray(long_range_mask(dist, min_distance))
    for kv in range(n_kv_heads):
        hs, ps = np.nonzero(lr[kv * g:(kv + 1) * g])
        hs = hs + kv * g
        if len(hs) > rows:
            pick = np.sort(rng.choice(len(hs), rows, replace=False))
            hs, ps = hs[pick], ps[pick]
        m = len(hs)
        x[kv, :m] = q_pre[hs, ps]
        t[kv, :m] = mass[hs, ps]
        n_valid[kv] = m
    return x, t, n_valid


def prepare_targets(act_dir: Path, out_dir: Path, unit: np.ndarray, cfg: TrainConfig, inv_freq, *,
                    index: int, log: Log = _quiet) -> Path:
    """Stage 3 for one collected document -> ``out_dir`` (x, t, n_valid, meta with statistics)."""
    out_dir = Path(out_dir)
    src = _read_meta(act_dir)
    meta = _read_meta(out_dir)
    if meta is not None and src is not None and meta.get("digest") == src.get("digest") and meta.get("stage") == "targets":
        return out_dir
    t0 = time.perf_counter()
    k_all = load_array(act_dir / "k_pre.npy", mmap=True)
    q_all = load_array(act_dir / "q_pre.npy", mmap=True)
    q_pos = load_array(act_dir / "q_pos.npy")
    L, hkv = k_all.shape[:2]
    C = unit.shape[2]
    rng = np.random.default_rng([cfg.seed, index, 0x7A6])
    xs, ts, nv, frac = [], [], [], []
    for layer in range(L):
        q_pre = np.asarray(q_all[layer])
        dist, mass = layer_rows(q_pre, k_all[layer], q_pos, unit[layer], inv_freq=inv_freq, n_buckets=C,
                                n_sink=cfg.n_sink, min_distance=cfg.min_distance)
        x, t, n_valid = select_rows(dist, mass, q_pre, n_kv_heads=hkv, min_distance=cfg.min_distance,
                                    rows=cfg.rows_per_head, rng=rng)
        xs.append(x), ts.append(t), nv.append(n_valid)
        frac.append(float(np.mean(dist > cfg.min_distance)) if dist.size else 0.0)
    _write_dir_atomic(out_dir, {"x": np.stack(xs), "t": np.stack(ts), "n_valid": np.stack(nv)},
                      {"stage": "targets", "name": src.get("name") if src else str(act_dir),
                       "digest": src.get("digest") if src else None, "long_range_fraction": frac,
                       "seconds": time.perf_counter() - t0})
    log(f"targets {src.get('name') if src else act_dir}: long-range fraction {np.mean(frac):.2f} "
        f"({time.perf_counter() - t0:.1f}s)")
    return out_dir


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


class TrainingSet:
    """Memory-mapped prepared documents; `batch(step)` is a pure function of (seed, step).

    Arrays per document: x [L, Hkv, R, d], t [L, Hkv, R, C], n_valid [L, Hkv]. Batches are
    flattened over heads: F = L·Hkv.
    """

    def __init__(self, doc_dirs: list[Path], *, batch_queries: int, seed: int):
        if not doc_dirs:
            raise ValueError("no prepared training documents")
        self.dirs = [Path(d) for d in doc_dirs]
        self.x = [load_array(d / "x.npy", mmap=True) for d in self.dirs]
        self.t = [load_array(d / "t.npy", mmap=True) for d in self.dirs]
        self.n_valid = [load_array(d / "n_valid.npy") for d in self.dirs]
        self.batch_queries = batch_queries
        self.seed = seed
        shapes = {(x.shape[0], x.shape[1], x.shape[3], t.shape[3]) for x, t in zip(self.x, self.t)}
        if len(shapes) != 1:
            raise ValueError(f"prepared documents disagree on (layers, Hkv, d, C): {sorted(shapes)}")
        self.num_layers, self.num_kv_heads, self.head_dim, self.n_buckets = shapes.pop()

    @classmethod
    def from_arrays(cls, xs, ts, nvs, *, batch_queries: int, seed: int) -> "TrainingSet":
        """In-memory variant (tests)."""
        self = cls.__new__(cls)
        self.dirs = []
        self.x, self.t, self.n_valid = [np.asarray(a) for a in xs], [np.asarray(a) for a in ts], [np.asarray(a) for a in nvs]
        self.batch_queries, self.seed = batch_queries, seed
        self.num_layers, self.num_kv_heads, _, self.head_dim = self.x[0].shape
        self.n_buckets = self.t[0].shape[-1]
        return self

    @property
    def n_docs(self) -> int:
        return len(self.x)

    @property
    def n_heads(self) -> int:
        return self.num_layers * self.num_kv_heads

    def doc_for_step(self, step: int) -> int:
        epoch, i = divmod(step, self.n_docs)
        return int(np.random.default_rng([self.seed, epoch, 0xD0C]).permutation(self.n_docs)[i])

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """{"x" [F, B, d], "t" [F, B, C], "head_valid" bool [F], "doc" int} for training step `step`."""
        doc = self.doc_for_step(step)
        B = self.batch_queries
        x = self.x[doc].reshape((self.n_heads,) + self.x[doc].shape[2:])
        t = self.t[doc].reshape((self.n_heads,) + self.t[doc].shape[2:])
        nv = np.asarray(self.n_valid[doc]).reshape(-1)
        R = x.shape[1]
        rng = np.random.default_rng([self.seed, step, 0xBA7])
        u = rng.random((self.n_heads, R))
        u[np.arange(R)[None, :] >= nv[:, None]] = np.inf  # padding rows last
        order = np.argsort(u, axis=1, kind="stable")
        cols = np.arange(B)[None, :] % np.maximum(nv, 1)[:, None]  # without replacement when possible
        idx = np.take_along_axis(order, cols, axis=1)  # [F, B]
        rows = np.arange(self.n_heads)[:, None]
        return {"x": np.asarray(x[rows, idx], np.float32), "t": np.asarray(t[rows, idx], np.float32),
                "head_valid": nv > 0, "doc": doc}
