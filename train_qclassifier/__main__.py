"""Command line: ``python -m train_qclassifier`` (also ``sqjax train-qclassifier``).

Pipeline (every stage cached under ``-o DIR``; rerun with ``--resume`` after an interruption):

    DIR/run_config.json          the configuration, model fingerprint and corpus (checked on resume)
    DIR/data/train/doc_NNNN/     de-roped keys (all tokens) + de-roped queries (sampled positions)
    DIR/data/kmeans/*.npy        offline key centroids per (layer, KV head), de-roped and roped
    DIR/data/targets/doc_NNNN/   long-range training queries and their bucket targets
    DIR/checkpoints/<step>/      Orbax checkpoints (params, BatchNorm stats, Adam state, losses)
    DIR/metrics.json             loss curve, throughput, stage timings
    DIR/classifier/              the export: classifier.safetensors + config.json (load_classifier)
    DIR/data/heldout/doc_NNNN/   held-out activations (never used for training)
    DIR/eval/ (or --eval-out)    eval.md, eval.json, eval.png: recall vs selectivity
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from train_qclassifier.config import TrainConfig

PROG = "python -m train_qclassifier"


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train the SAAP query classifier f_q (one 2-layer MLP per layer and KV head) for a model, "
                    "export it for sqjax.methods.Saap(classifier=DIR/classifier) and evaluate it on held-out "
                    "documents against nearest-centroid assignment.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="model name, HF checkpoint dir or .gguf file")
    p.add_argument("--corpus", nargs="+", metavar="FILE", default=None,
                   help="training text files, one document each (default: pydoc pages of a fixed list of "
                        "standard-library modules)")
    p.add_argument("--heldout", nargs="+", metavar="FILE", default=None,
                   help="held-out text files for the evaluation (default: pydoc pages of a disjoint module list)")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many training documents")
    p.add_argument("--max-heldout", type=int, default=4, help="use at most this many held-out documents")
    p.add_argument("-o", "--output", default="qclassifier_run", help="run directory")
    p.add_argument("--buckets", type=int, default=None,
                   help="key buckets C (default: max_positions // 64 clipped to [16, 1024]; 128 at 8K)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="MLP hidden width")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (one document per step)")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate (paper: 1e-5 for 40k steps)")
    p.add_argument("--schedule", choices=("constant", "cosine"), default=d.schedule, help="learning-rate schedule")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--batch-queries", type=int, default=d.batch_queries,
                   help="long-range queries per (layer, KV head) per step")
    p.add_argument("--min-distance", type=int, default=d.min_distance,
                   help="long-range: argmax-attention key more than this many tokens back (paper: 1024 at 100K+ "
                        "tokens; 256 suits ~6K-token documents)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per document (longer: truncated)")
    p.add_argument("--queries-per-doc", type=int, default=d.queries_per_doc, help="query positions sampled per document")
    p.add_argument("--rows-per-head", type=int, default=d.rows_per_head,
                   help="long-range training queries kept per (document, layer, KV head)")
    p.add_argument("--kmeans-iters", type=int, default=d.kmeans_iters)
    p.add_argument("--kmeans-max-points", type=int, default=d.kmeans_max_points,
                   help="training keys sampled per (layer, KV head) for k-means")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="checkpoint period in steps")
    p.add_argument("--resume", action="store_true", help="continue the run in -o DIR from its latest checkpoint")
    p.add_argument("--eval-only", action="store_true", help="only evaluate the export in -o DIR on held-out documents")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    p.add_argument("--eval-out", default=None, help="evaluation output directory (default DIR/eval)")
    p.add_argument("--eval-first-layer", type=int, default=1, help="first layer evaluated (SAAP keeps layer 0 dense)")
    p.add_argument("--eval-seen", type=int, default=0, metavar="N",
                   help="also evaluate the first N *training* documents (eval_seen.*: the generalisation gap; "
                        "not a held-out result)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args) -> TrainConfig:
    return TrainConfig(
        n_buckets=args.buckets, hidden=args.hidden, steps=args.steps, lr=args.lr, schedule=args.schedule,
        warmup=args.warmup, batch_queries=args.batch_queries, min_distance=args.min_distance,
        max_tokens=args.max_tokens, queries_per_doc=args.queries_per_doc, rows_per_head=args.rows_per_head,
        kmeans_iters=args.kmeans_iters, kmeans_max_points=args.kmeans_max_points, seed=args.seed,
        ckpt_every=args.ckpt_every,
    )


def _log(msg: str) -> None:
    print(f"[train_qclassifier {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _model_info(model) -> dict[str, Any]:
    c = model.config
    return {"name": c.name, "source": str(model.source), "fingerprint": model.fingerprint,
            "num_layers": c.num_layers, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "max_position_embeddings": c.max_position_embeddings}


def check_run_config(path: Path, new: dict[str, Any], fingerprints: tuple[str, ...] = ()) -> None:
    """An existing run directory must have been made with the same data/model settings.

    fingerprints: every fingerprint the model answers to (`LoadedModel.fingerprints`); default the new one."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    diffs = []
    oc, nc = old.get("train_config", {}), new["train_config"]
    for k in sorted(set(oc) | set(nc)):
        if k in TrainConfig.RESUMABLE_FIELDS:
            continue
        if oc.get(k) != nc.get(k):
            diffs.append(f"{k}: run has {oc.get(k)!r}, now {nc.get(k)!r}")
    if old.get("model", {}).get("fingerprint") not in (fingerprints or (new["model"]["fingerprint"],)):
        diffs.append("model fingerprint differs")
    if [d["digest"] for d in old.get("corpus", [])] != [d["digest"] for d in new["corpus"]]:
        diffs.append("training corpus differs")
    if diffs:
        raise ValueError(f"{path.parent} was made with other settings ({'; '.join(diffs)}); "
                         "use a new -o directory or the original options")


def _save_npy_atomic(path: Path, arr) -> None:
    import numpy as np

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run(args) -> int:
    import numpy as np

    from models.rope import config_frequencies
    from train_qclassifier import corpus, data
    from train_qclassifier.classifier import export_classifier, load_classifier
    from train_qclassifier.evaluate import evaluate, write_report
    from train_qclassifier.train import Trainer

    out = Path(args.output)
    t_start = time.perf_counter()
    stages: dict[str, float] = {}

    if args.eval_only:
        rc_path = out / "run_config.json"
        if not rc_path.exists():
            raise FileNotFoundError(f"{rc_path} not found: --eval-only needs a finished run directory")
        cfg = TrainConfig.from_dict(json.loads(rc_path.read_text())["train_config"])
    else:
        cfg = config_from_args(args)
    # everything that needs no model is checked before it loads: the run directory, the documents
    if out.exists() and not out.is_dir():
        raise ValueError(f"-o {out} exists and is not a directory: give a run directory (new, or a run to --resume)")
    if args.eval_out and Path(args.eval_out).exists() and not Path(args.eval_out).is_dir():
        raise ValueError(f"--eval-out {args.eval_out} exists and is not a directory: give a directory")
    train_docs = corpus.load_documents(args.corpus, corpus.DEFAULT_TRAIN_MODULES, args.max_docs)
    held_docs = corpus.load_documents(args.heldout, corpus.DEFAULT_HELDOUT_MODULES, args.max_heldout)
    corpus.check_disjoint(train_docs, held_docs)

    import sqjax

    _log(f"loading model {args.model}")
    model = sqjax.load_model(args.model)
    mc = model.config
    C = cfg.buckets_for(mc.max_position_embeddings)
    cfg_eff = TrainConfig.from_dict({**cfg.to_dict(), "n_buckets": C})
    inv_freq = config_frequencies(mc)
    run_config = {"train_config": cfg_eff.to_dict(), "model": _model_info(model),
                  "corpus": [{"name": d.name, "digest": d.digest} for d in train_docs],
                  "heldout": [{"name": d.name, "digest": d.digest} for d in held_docs]}

    if not args.eval_only:
        out.mkdir(parents=True, exist_ok=True)
        check_run_config(out / "run_config.json", run_config, model.fingerprints)
        if (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()) and not args.resume:
            raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose a new -o")
        data.save_json_atomic(out / "run_config.json", run_config)

        # stage 1: activations
        t0 = time.perf_counter()
        act_dirs = _collect(model, train_docs, out / "data" / "train", cfg_eff, 0, "training")
        stages["collect_train_s"] = time.perf_counter() - t0

        # stage 2: k-means
        t0 = time.perf_counter()
        km_dir = out / "data" / "kmeans"
        names = ("unit_centroids", "unit_centroids_roped", "counts", "counts_roped")
        if not all((km_dir / f"{n}.npy").exists() for n in names):
            km = data.train_kmeans(act_dirs, C, cfg_eff, inv_freq, log=_log)
            km_dir.mkdir(parents=True, exist_ok=True)
            for n in names:
                _save_npy_atomic(km_dir / f"{n}.npy", km[n])
        unit = data.load_array(km_dir / "unit_centroids.npy")
        stages["kmeans_s"] = time.perf_counter() - t0

        # stage 3: targets
        t0 = time.perf_counter()
        tgt_dirs = [data.prepare_targets(a, out / "data" / "targets" / a.name, unit, cfg_eff, inv_freq,
                                         index=i, log=_log) for i, a in enumerate(act_dirs)]
        stages["targets_s"] = time.perf_counter() - t0
        fr = [json.loads((d / "meta.json").read_text())["long_range_fraction"] for d in tgt_dirs]
        _log(f"long-range fraction of sampled queries: {np.mean(fr):.3f}")

        # training
        t0 = time.perf_counter()
        ts = data.TrainingSet(tgt_dirs, batch_queries=cfg_eff.batch_queries, seed=cfg_eff.seed)
        trainer = Trainer(cfg_eff, n_heads=ts.n_heads, head_dim=ts.head_dim, n_buckets=ts.n_buckets)
        extra = {"stages": stages, "model": run_config["model"], "train_docs": [d.name for d in train_docs],
                 "long_range_fraction": float(np.mean(fr))}
        state, history = trainer.fit(ts, out / "checkpoints", resume=args.resume, progress=not args.no_progress,
                                     metrics_path=out / "metrics.json", extra_metrics=extra)
        stages["train_s"] = time.perf_counter() - t0
        losses = history["loss"]
        _log(f"trained {len(losses)} steps: loss {losses[0]:.4f} -> {np.mean(losses[-10:]):.4f} (mean of last 10)")

        # export
        flat = trainer.export_params(state)
        params = {a: {b: np.asarray(v).reshape((mc.num_layers, mc.num_kv_heads) + np.shape(v)[1:])
                      for b, v in sub.items()} for a, sub in flat.items()}
        training = {"steps": len(losses), "final_loss_mean_last10": float(np.mean(losses[-10:])),
                    "first_loss": float(losses[0]), "config": cfg_eff.to_dict(),
                    "train_docs": [d.name for d in train_docs]}
        export_classifier(out / "classifier", unit, params, num_heads=mc.num_heads, model_info=run_config["model"],
                          training=training)
        _log(f"exported {out / 'classifier'}")

    if args.no_eval:
        stages["total_s"] = time.perf_counter() - t_start
        _log(f"done in {stages['total_s']:.0f}s")
        return 0

    # evaluation on held-out documents
    t0 = time.perf_counter()
    clf = load_classifier(out / "classifier", num_layers=mc.num_layers, num_heads=mc.num_heads,
                          num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)
    held_dirs = _collect(model, held_docs, out / "data" / "heldout", cfg_eff, 1_000_000, "held-out")
    stages["collect_heldout_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    unit_roped = data.load_array(out / "data" / "kmeans" / "unit_centroids_roped.npy")
    res = evaluate(held_dirs, clf, unit_roped, inv_freq, min_distance=cfg_eff.min_distance, n_sink=cfg_eff.n_sink,
                   first_layer=args.eval_first_layer, kmeans_iters=cfg_eff.kmeans_iters, seed=cfg_eff.seed, log=_log)
    stages["eval_s"] = time.perf_counter() - t1
    stages["total_s"] = time.perf_counter() - t_start
    res["run_info"] = {
        "model": f"{mc.name} ({mc.num_layers} layers, {mc.num_heads} query / {mc.num_kv_heads} KV heads, d={mc.head_dim})",
        "training documents": f"{len(train_docs)} ({', '.join(d.name for d in train_docs)})",
        "held-out documents": ", ".join(f"{d['name']} ({d['n_tokens']} tokens)" for d in res["docs"]),
        "classifier": f"hidden {clf.config['hidden']}, C = {clf.n_buckets}, "
                      f"{clf.config.get('training', {}).get('steps', '?')} steps",
        "long-range": f"argmax-attention key (sink excluded) more than {cfg_eff.min_distance} tokens back; "
                      f"{cfg_eff.queries_per_doc} sampled query positions per document",
    }
    res["config"] = cfg_eff.to_dict()
    res["stages_s"] = stages
    eval_out = Path(args.eval_out) if args.eval_out else out / "eval"
    if args.eval_seen > 0:  # training documents, for the generalisation gap (written first: eval.md stays last)
        seen = sorted(p for p in (out / "data" / "train").glob("doc_*") if (p / "meta.json").exists())[: args.eval_seen]
        t2 = time.perf_counter()
        res_seen = evaluate(seen, clf, unit_roped, inv_freq, min_distance=cfg_eff.min_distance, n_sink=cfg_eff.n_sink,
                            first_layer=args.eval_first_layer, kmeans_iters=cfg_eff.kmeans_iters, seed=cfg_eff.seed,
                            log=_log)
        res_seen["run_info"] = {**res["run_info"], "held-out documents": "NONE: these are training documents",
                                "seen documents": ", ".join(f"{d['name']} ({d['n_tokens']} tokens)" for d in res_seen["docs"])}
        res_seen["config"] = cfg_eff.to_dict()
        stages["eval_seen_s"] = time.perf_counter() - t2
        write_report(res_seen, eval_out, stem="eval_seen",
                     title="SAAP query classifier on TRAINING documents (generalisation check, not held-out)")
        stages["total_s"] = time.perf_counter() - t_start
    paths = write_report(res, eval_out)
    _log(f"evaluation written to {paths['md']}")
    print(paths["md"].read_text())
    return 0


def _collect(model, docs, folder: Path, cfg, first_index: int, what: str) -> list:
    """Activations of every long-enough document, one shard folder each; error if none qualifies."""
    dirs = [dd for i, doc in enumerate(docs)
            if (dd := data.collect_document(model, doc, folder / f"doc_{i:04d}", cfg, index=first_index + i,
                                            log=_log)) is not None]
    if not dirs:
        raise ValueError(f"no {what} document is long enough: each needs at least {cfg.min_tokens} tokens "
                         f"(min_tokens; {len(docs)} given); give longer documents")
    return dirs


def main(argv: list[str] | None = None) -> int:
    """Entry point (`sqjax train-qclassifier` calls ``main(rest_of_argv)``); returns the exit status."""
    from train_qclassifier.classifier import ClassifierFormatError
    from train_qclassifier.train import CheckpointMismatchError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `sqjax train-qclassifier -- OPTIONS` forwards the separator too
        argv = argv[1:]
    args = parser.parse_args(argv)
    if args.eval_only and args.no_eval:
        parser.error("--eval-only and --no-eval exclude each other")
    for opt in ("max_docs", "max_heldout"):
        if getattr(args, opt) is not None and getattr(args, opt) < 1:
            parser.error(f"--{opt.replace('_', '-')} must be >= 1; got {getattr(args, opt)}")

    def _term(signum, frame):  # a `kill` checkpoints like Ctrl-C does
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term) if _is_main_thread() else None
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; continue with the same options and --resume", file=sys.stderr)
        return 130
    except (ValueError, OSError, ClassifierFormatError, CheckpointMismatchError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
