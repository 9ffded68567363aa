"""Per-layer diagnosis of the attention sink under each method (why Squeezed without a sink loses).

    python -m benchmarks.quality_diagnose [--doc pydoc:argparse] [--level 0.9] [-o benchmarks/results/quality]

On one document of the quality run (same fixed context and continuation), with full
attention's queries of the continuation (every `stride`-th token), per layer and KV head:

- `mass0`: true attention mass on the first fixed-context token (group mean, as the lookups vote);
- `ret0[m]`: fraction of per-token lookups of method m that read that token;
- for Squeezed (no sink): the size of the cluster holding token 0, the cluster score S of that
  cluster (Eq. 1, the per-key attention it predicts) against token 0's true attention, and the
  threshold T;
- `recall[m]` and `recall_nosink[m]`: attention mass retrieved, over all keys / over the keys
  other than token 0 (renormalised): whether a method loses the sink or the rest.

Writes `diagnose_sink.json` and `diagnose_sink.png` into the output directory.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import quality as Q
from benchmarks.quality_engine import Runner, _sparse, canonical, compute_reference, layer_index, share_compilation
from sqjax import squeezed as sq
from sqjax.attention import expand_heads
from sqjax.baselines import true_attention
from sqjax.index_io import write_figure_atomic, write_text_atomic


@functools.partial(jax.jit, static_argnames=("method",))
def _layer(method, index_l, q, q_pre, k):
    """q [Hq, T, d] -> ret0 [Hs], recall [Hs], recall_nosink [Hs] (per-token lookups)."""
    scale = 1.0 / math.sqrt(q.shape[-1])

    def one(qt, qpt):
        return method.select(index_l, 0, qt[:, None], qpt[:, None], k).mask[:, 0]

    mask = jnp.swapaxes(jax.vmap(one, in_axes=(1, 1))(q, q_pre), 0, 1)  # [Hs, T, L]
    p = true_attention(q, k, scale, "kv")  # [Hkv, T, L]
    hs = mask.shape[0]
    p = expand_heads(p, hs) if p.shape[0] != hs else p
    rec = jnp.sum(jnp.where(mask, p, 0.0), -1)
    rest = jnp.sum(jnp.where(mask[..., 1:], p[..., 1:], 0.0), -1) / jnp.maximum(jnp.sum(p[..., 1:], -1), 1e-30)
    return jnp.mean(mask[..., 0], -1), jnp.mean(rec, -1), jnp.mean(rest, -1)


@jax.jit
def _squeezed_sink(q, k, centroids, counts, label0, threshold):
    """Squeezed (no sink): per KV head, mean over tokens of [true attention on token 0, S of its
    cluster, S of its cluster > T, true mean attention per key of that cluster]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = true_attention(q, k, scale, "kv")  # [Hkv, T, L]
    s = jax.vmap(lambda qt: sq.cluster_scores(qt[:, None], centroids, counts, scale, "kv"), in_axes=1)(q)  # [T, Hkv, C]
    s0 = jnp.take_along_axis(s, label0[None, :, None], axis=-1)[..., 0].T  # [Hkv, T]
    return jnp.mean(p[..., 0], -1), jnp.mean(s0, -1), jnp.mean((s0 > threshold).astype(jnp.float32), -1)


def diagnose(model, doc, settings: Q.Settings, level: float, store: Q.Store | None, stride: int = 4,
             log=print) -> dict:
    from sqjax.fixed_context import FixedContext

    ids = Q.doc_tokens(model, doc)
    n_ctx = min(settings.context_tokens, len(ids) - settings.continuation - 1)
    limit = model.config.max_position_embeddings
    full = FixedContext.build(model, doc.text, Q.make_method("full", "-", settings), chat=False, truncate=True,
                              reserve=limit - n_ctx)
    cont = ids[n_ctx:n_ctx + settings.continuation + 1]
    q_ids = model.tokenizer.encode("\n\nQuestion: " + doc.question + "\nAnswer:", add_bos=False)
    shapes = Q._shapes(settings, len(q_ids))
    run = Runner(full, shapes)
    _, _, q, q_pre = run.block(cont[:-1])
    q, q_pre = q[:, :, ::stride], q_pre[:, :, ::stride]
    lv = Q.level_name(level)
    matched = {}
    if store is not None:
        for r in store.of_kind("cell", settings.setup_key()):
            if r["doc"] == doc.name and r["family"] == Q.MATCH_SOURCE and r.get("doc_sha256") == doc.sha256:
                matched[r["level"]] = r["budget"]["decode"]["token_fraction"]
    fams = ["squeezed", "squeezed+sink1", "quest", "oracle", "streaming"]
    out = {"doc": doc.name, "level": lv, "context_tokens": n_ctx, "tokens_evaluated": int(q.shape[2]),
           "matched_token_fraction": matched.get(lv), "methods": {}}
    n_layers = q.shape[0]
    for fam in fams:
        method = Q.make_method(fam, lv, settings, matched, n_ctx)
        ctx = share_compilation(full.with_method(method))
        sparse = _sparse(canonical(method))
        ret0, rec, rest = [], [], []
        for layer in range(n_layers):
            if layer < method.dense_layers:
                hs = method.selection_heads(q.shape[1], full.kv.k[0].shape[0])
                ret0.append(np.ones(hs))
                rec.append(np.ones(hs))
                rest.append(np.ones(hs))
                continue
            a, b, c = _layer(sparse, layer_index(ctx.index, layer), q[layer], q_pre[layer], full.kv.k[layer])
            ret0.append(np.asarray(a))
            rec.append(np.asarray(b))
            rest.append(np.asarray(c))
        out["methods"][fam] = {"label": method.label, "ret0": np.stack(ret0).tolist(), "recall": np.stack(rec).tolist(),
                               "recall_nosink": np.stack(rest).tolist()}
        if fam == "squeezed":
            idx = ctx.index
            rows = []
            for layer in range(n_layers):
                li = idx.layer(layer)
                label0 = li.labels[:, 0]
                m0, s0, r0 = _squeezed_sink(q[layer], full.kv.k[layer], li.centroids, li.counts, label0, idx.threshold)
                size0 = jnp.take_along_axis(li.counts, label0[:, None], axis=-1)[:, 0]
                rows.append({"mass0": np.asarray(m0).tolist(), "S0": np.asarray(s0).tolist(),
                             "retrieved0": np.asarray(r0).tolist(), "cluster0_size": np.asarray(size0).tolist()})
            out["squeezed_sink_cluster"] = {"threshold": float(idx.threshold), "layers": rows}
        log(f"{method.label}: ret0 {np.mean(out['methods'][fam]['ret0']):.2f} recall {np.mean(rec):.3f} "
            f"recall without token 0 {np.mean(rest):.3f}")
    return out


def plot(out_dir: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    sc = res["squeezed_sink_cluster"]["layers"]
    axes[0].plot([np.mean(r["mass0"]) for r in sc], "k-o", label="true attention on token 0 (mean over heads)")
    for fam, m in res["methods"].items():
        axes[0].plot(np.mean(m["ret0"], axis=1), marker=".", label=f"{m['label']}: lookups reading token 0")
        axes[1].plot(np.mean(m["recall"], axis=1), marker=".", label=m["label"])
        axes[2].plot(np.mean(m["recall_nosink"], axis=1), marker=".", label=m["label"])
    axes[0].set_title("the attention sink per layer")
    axes[1].set_title("attention-mass recall (all keys)")
    axes[2].set_title("recall over keys other than token 0 (renormalised)")
    for ax in axes:
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{res['doc']}, level {res['level']}, decode lookups on full attention's queries "
                 f"({res['tokens_evaluated']} continuation tokens)")
    fig.tight_layout()
    write_figure_atomic(fig, out_dir / "diagnose_sink.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import sqjax
    from benchmarks.quality_data import default_documents

    p = argparse.ArgumentParser(prog="python -m benchmarks.quality_diagnose", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--doc", default="pydoc:argparse", help="a default document's name")
    p.add_argument("--level", type=float, default=0.9, help="Squeezed sparsity (matched budgets from the run)")
    p.add_argument("-o", "--out", default=Q.DEFAULT_OUT)
    args = p.parse_args(argv)
    docs = {d.name: d for d in default_documents()}
    if args.doc not in docs:
        print(f"unknown document {args.doc!r}; choose from {sorted(docs)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = Q.Store(out / "cells.jsonl") if (out / "cells.jsonl").exists() else None
    model = sqjax.load_model(args.model)
    res = diagnose(model, docs[args.doc], Q.Settings(), args.level, store)
    write_text_atomic(out / "diagnose_sink.json", json.dumps(res))
    plot(out, res)
    print(f"wrote {out / 'diagnose_sink.json'} and {out / 'diagnose_sink.png'}")
    return 0


if __name__ == "__main__":
    from sqjax.cli import _enable_compilation_cache

    _enable_compilation_cache()
    sys.exit(main())
