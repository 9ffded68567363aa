"""Held-out evaluation of bucket assigners: attention-mass recall vs selectivity.

For every held-out document, layer (layer 0 is skipped by default: SAAP keeps it dense) and
sampled **long-range** query (same definition as training: argmax-attention key, sink excluded,
more than `min_distance` tokens behind), an assigner scores the C buckets per KV head (the g
query heads of a group share one visit set, as `sqjax.methods.Saap` does) and the top-ℓ are
visited. With A the query's true attention over its causal keys except the sink:

    recall(ℓ)      = Σ A_j over keys j in the visited buckets     (true softmax mass retrieved)
    selectivity(ℓ) = |keys j ≤ t, j ≥ n_sink, in visited buckets| / |keys j ≤ t, j ≥ n_sink|

Both are averaged over the long-range queries of each (layer, query head), then over layers and
heads. Assigners:

* ``classifier``      trained f_q on de-roped queries, buckets = offline de-roped k-means (SAAP)
* ``nc-deroped``      nearest centroid (cosine, Σ over the group) on the same de-roped buckets
* ``nc-roped``        nearest centroid with roped keys/queries: k-means on roped training keys,
                      roped queries assigned (the paper's "K-means (roped inputs)")
* ``nc-doc``          nearest centroid with de-roped k-means fitted on the document's own keys
                      (what ``sqjax.methods.Saap(classifier=None)`` does)
* ``oracle``          the buckets with the most true mass for the group (upper bound for the
                      offline de-roped buckets)

"At equal selectivity": besides recall/selectivity at each ℓ, each baseline's recall is
interpolated (linearly, over its full ℓ = 1..C curve) at the classifier's selectivity.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sqjax.index_io import write_figure_atomic, write_text_atomic
from train_qclassifier.classifier import TrainedClassifier, bucket_distribution
from train_qclassifier.data import load_array, save_json_atomic
from train_qclassifier.targets import long_range_mask, query_stats, rope_heads

ASSIGNERS = ("classifier", "nc-deroped", "nc-roped", "nc-doc", "oracle")
LABELS = {
    "classifier": "SAAP classifier f_q (de-roped)",
    "nc-deroped": "nearest centroid, de-roped",
    "nc-roped": "nearest centroid, roped",
    "nc-doc": "nearest centroid, de-roped, per-document k-means",
    "oracle": "oracle buckets (true mass), de-roped",
}
PARTITION = {"classifier": 0, "nc-deroped": 0, "nc-roped": 1, "nc-doc": 2, "oracle": 0}
TABLE_PROBES = (4, 8, 16, 32)


@jax.jit
def curve_sums(scores, mass, counts, q_pos, lr, n_sink):
    """Recall and selectivity at every ℓ = 1..C, summed over long-range queries.

    scores [Hkv, n, C] (higher = visit first), mass [Hq, n, C], counts [Hkv, n, C], q_pos [n],
    lr bool [Hq, n] -> (recall_sum [Hq, C], sel_sum [Hq, C], n_lr [Hq]); index ℓ−1 holds ℓ probes.
    """
    hkv = scores.shape[0]
    hq = mass.shape[0]
    g = hq // hkv
    order = jnp.argsort(-scores, axis=-1, stable=True)  # [Hkv, n, C]
    order_q = jnp.repeat(order, g, axis=0)  # head h -> KV head h // g
    rec = jnp.cumsum(jnp.take_along_axis(mass, order_q, axis=-1), axis=-1)  # [Hq, n, C]
    cnt = jnp.cumsum(jnp.take_along_axis(counts, order, axis=-1), axis=-1).astype(jnp.float32)
    n_keys = jnp.maximum(q_pos - n_sink + 1, 1).astype(jnp.float32)
    sel = jnp.repeat(cnt / n_keys[None, :, None], g, axis=0)  # [Hq, n, C]
    w = lr.astype(jnp.float32)[..., None]
    return jnp.sum(rec * w, axis=1), jnp.sum(sel * w, axis=1), jnp.sum(lr, axis=1)


def evaluate_layer(q_pre, k_pre, q_pos, *, layer_params, unit, unit_roped, inv_freq, n_buckets: int,
                   n_sink: int, min_distance: int, kmeans_iters: int = 10, seed: int = 0) -> dict[str, Any]:
    """One (document, layer): {assigner: (recall_sum [Hq,C], sel_sum [Hq,C], n_lr [Hq])}."""
    from sqjax.kmeans import KMeansConfig, spherical_kmeans
    from sqjax.saap import assign_keys, nearest_centroid_scores

    q_pre = jnp.asarray(q_pre, jnp.float32)
    k_pre = jnp.asarray(k_pre, jnp.float32)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    T = k_pre.shape[1]
    hq = q_pre.shape[0]
    hkv = k_pre.shape[0]
    k = rope_heads(k_pre, jnp.arange(T), inv_freq)
    q = rope_heads(q_pre, q_pos, inv_freq)
    doc_km = spherical_kmeans(k_pre[:, n_sink:], KMeansConfig(min(n_buckets, T - n_sink), kmeans_iters, seed=seed))
    unit_doc = doc_km.unit_centroids
    if unit_doc.shape[1] < n_buckets:  # very short document: pad with never-chosen duplicates
        unit_doc = jnp.concatenate([unit_doc, jnp.repeat(unit_doc[:, :1], n_buckets - unit_doc.shape[1], 1)], 1)
    labels = jnp.stack([assign_keys(k_pre, unit), assign_keys(k, unit_roped), assign_keys(k_pre, unit_doc)])
    dist, mass, counts = query_stats(q, k, q_pos, labels, n_buckets=n_buckets, n_sink=n_sink, with_counts=True)
    lr = long_range_mask(dist, min_distance)
    g = hq // hkv
    scores = {
        "classifier": bucket_distribution(layer_params, q_pre),
        "nc-deroped": nearest_centroid_scores(q_pre, unit),
        "nc-roped": nearest_centroid_scores(q, unit_roped),
        "nc-doc": nearest_centroid_scores(q_pre, unit_doc),
        "oracle": mass[0].reshape(hkv, g, -1, n_buckets).sum(axis=1),
    }
    out = {}
    for name, s in scores.items():
        p = PARTITION[name]
        out[name] = tuple(np.asarray(a) for a in curve_sums(s, mass[p], counts[p], q_pos, lr, n_sink))
    return out


def evaluate(doc_dirs: list[Path], clf: TrainedClassifier, unit_roped: np.ndarray, inv_freq, *,
             min_distance: int, n_sink: int = 1, first_layer: int = 1, kmeans_iters: int = 10,
             seed: int = 0, log=print) -> dict[str, Any]:
    """Evaluate every assigner on the collected held-out documents; returns the results dict."""
    C = clf.n_buckets
    L = clf.num_layers
    layers = list(range(first_layer, L))
    if not layers:
        raise ValueError(f"no layers to evaluate (first_layer={first_layer}, layers={L})")
    acc: dict[str, list[np.ndarray]] = {}
    docs = []
    t0 = time.perf_counter()
    for di, d in enumerate(doc_dirs):
        meta = json.loads((Path(d) / "meta.json").read_text())
        k_all = load_array(Path(d) / "k_pre.npy", mmap=True)
        q_all = load_array(Path(d) / "q_pre.npy", mmap=True)
        q_pos = load_array(Path(d) / "q_pos.npy")
        docs.append({"name": meta.get("name"), "n_tokens": meta.get("n_tokens"), "n_queries": int(len(q_pos))})
        for layer in layers:
            r = evaluate_layer(np.asarray(q_all[layer]), np.asarray(k_all[layer]), q_pos,
                               layer_params=clf.layer_params(layer), unit=clf.unit_centroids[layer],
                               unit_roped=jnp.asarray(unit_roped[layer]), inv_freq=inv_freq, n_buckets=C,
                               n_sink=n_sink, min_distance=min_distance, kmeans_iters=kmeans_iters,
                               seed=seed * 1000 + layer)
            for name, (rs, ss, n) in r.items():
                a = acc.setdefault(name, [np.zeros((L, rs.shape[0], C)), np.zeros((L, rs.shape[0], C)),
                                          np.zeros((L, rs.shape[0]))])
                a[0][layer] += rs
                a[1][layer] += ss
                a[2][layer] += n
        log(f"evaluated {meta.get('name')} ({time.perf_counter() - t0:.0f}s)")
    return summarize(acc, layers, C, docs=docs, min_distance=min_distance, n_sink=n_sink)


def summarize(acc: dict[str, list[np.ndarray]], layers: list[int], n_buckets: int, **info) -> dict[str, Any]:
    """Per-(layer, head) means -> averages over layers and heads; matched-selectivity comparison."""
    res: dict[str, Any] = {"layers": layers, "n_buckets": n_buckets, "probes": list(range(1, n_buckets + 1)),
                           "table_probes": [p for p in TABLE_PROBES if p <= n_buckets], "assigners": {}, **info}
    for name, (rs, ss, n) in acc.items():
        rs, ss, n = rs[layers], ss[layers], n[layers]  # [Ly, Hq, C], [Ly, Hq]
        ok = n > 0
        rec_lh = np.where(ok[..., None], rs / np.maximum(n, 1)[..., None], np.nan)
        sel_lh = np.where(ok[..., None], ss / np.maximum(n, 1)[..., None], np.nan)
        res["assigners"][name] = {
            "label": LABELS.get(name, name),
            "recall": np.nanmean(rec_lh, axis=(0, 1)).tolist(),
            "selectivity": np.nanmean(sel_lh, axis=(0, 1)).tolist(),
            "recall_per_layer": np.nanmean(rec_lh, axis=1).tolist(),
            "selectivity_per_layer": np.nanmean(sel_lh, axis=1).tolist(),
            "long_range_queries": int(n.sum()),
            "heads_with_queries": int(ok.sum()),
        }
    if "classifier" in res["assigners"]:
        clf = res["assigners"]["classifier"]
        matched = {}
        for name, a in res["assigners"].items():
            if name == "classifier":
                continue
            rows = []
            for p in res["table_probes"]:
                s_star = clf["selectivity"][p - 1]
                r_b = float(np.interp(s_star, [0.0] + a["selectivity"], [0.0] + a["recall"]))
                rows.append({"probes": p, "selectivity": s_star, "classifier_recall": clf["recall"][p - 1],
                             "baseline_recall": r_b, "delta": clf["recall"][p - 1] - r_b})
            matched[name] = rows
        res["matched_selectivity"] = matched
    return res


def markdown_table(res: dict[str, Any], title: str = "SAAP query classifier: held-out evaluation") -> str:
    names = [n for n in ASSIGNERS if n in res["assigners"]]
    lines = [f"# {title}", ""]
    if res.get("run_info"):
        for k, v in res["run_info"].items():
            lines.append(f"- {k}: {v}")
        lines.append("")
    lines += [f"Recall (true attention mass of long-range queries in the visited buckets) @ selectivity "
              f"(fraction of keys visited), C = {res['n_buckets']} buckets, averaged over layers "
              f"{res['layers'][0]}–{res['layers'][-1]} and query heads.", ""]
    lines.append("| ℓ | " + " | ".join(res["assigners"][n]["label"] for n in names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for p in res["table_probes"]:
        cells = [f"{res['assigners'][n]['recall'][p - 1]:.3f} @ {100 * res['assigners'][n]['selectivity'][p - 1]:.1f}%"
                 for n in names]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    if "matched_selectivity" in res:
        lines += ["", "Recall at the classifier's selectivity (each baseline interpolated along its ℓ = 1..C curve):", ""]
        base = [n for n in names if n != "classifier"]
        lines.append("| ℓ | selectivity | classifier | " + " | ".join(res["assigners"][n]["label"] for n in base) + " |")
        lines.append("|---|---|---|" + "---|" * len(base))
        for i, p in enumerate(res["table_probes"]):
            m0 = res["matched_selectivity"][base[0]][i]
            cells = [f"{res['matched_selectivity'][n][i]['baseline_recall']:.3f} "
                     f"({res['matched_selectivity'][n][i]['delta']:+.3f})" for n in base]
            lines.append(f"| {p} | {100 * m0['selectivity']:.1f}% | {m0['classifier_recall']:.3f} | " + " | ".join(cells) + " |")
        lines += ["", "(in parentheses: classifier recall minus baseline recall at equal selectivity)"]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    styles = {"classifier": "-o", "nc-deroped": "-s", "nc-roped": "-^", "nc-doc": "-v", "oracle": ":"}
    for name in ASSIGNERS:
        if name not in res["assigners"]:
            continue
        a = res["assigners"][name]
        sel = np.asarray(a["selectivity"])
        rec = np.asarray(a["recall"])
        line, = ax.plot(sel, rec, styles.get(name, "-")[:-1] if name != "oracle" else ":", label=a["label"])
        marks = [p - 1 for p in res["table_probes"]]
        if name != "oracle":
            ax.plot(sel[marks], rec[marks], styles[name][-1], color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("selectivity (fraction of keys visited, log scale)")
    ax.set_ylabel("attention-mass recall of long-range queries")
    ax.set_title(f"SAAP bucket assignment, held-out docs (C={res['n_buckets']}; markers: ℓ = "
                 f"{', '.join(map(str, res['table_probes']))})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    write_figure_atomic(fig, path, dpi=120)
    plt.close(fig)


def write_report(res: dict[str, Any], out_dir: str | Path, stem: str = "eval",
                 title: str = "SAAP query classifier: held-out evaluation") -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    save_json_atomic(paths["json"], json.loads(json.dumps(res, default=float)))
    write_text_atomic(paths["md"], markdown_table(res, title))
    plot(res, paths["png"])
    return paths
