"""B questions decoding over ONE shared fixed context: what batching does to Squeezed's decode advantage.

    python -m benchmarks.batch_decode --out DIR [--lengths 131072,524288] [--batches 1,2,4,8]
    python -m benchmarks.batch_decode --cpu-smoke --out DIR      # plumbing (Pallas interpret mode)
    python -m benchmarks.batch_decode --method hierarchical ...   # the two-level index (1% / 5%)

`FixedContext.ask_many` decodes B questions against one copy of the fixed context; its attention
hook runs each row on its own, so Squeezed reads each row's selected clusters (and every
centroid) once per row. Dense attention can do better than row by row here: the B rows' queries
can be folded into one call over the shared K/V ([Hkv, B, g] query heads), which reads the
context once per step for the whole batch. So for each length and batch size this times, at 90%
sparsity with 5% centroids (Llama-3-8B attention, bf16, tiled captured keys as in `benchmarks.speed`):

- ``squeezed``: B calls of the fused clustered decode (the library's decode thresholds,
  `decode_calibration="token"`), each with its row's own 16 new keys -- the hook before
  `clustered_decode_batched`;
- ``squeezed_batched``: one `clustered_decode_batched` call (centroids scored once for all rows,
  the union of the rows' clusters streamed once, a bit per row) -- what the hook does on GPU now;
With ``--method hierarchical`` (a `HierarchicalSqueezed` index, level 1 ruling out ~50% of the
keys) ``squeezed`` is B calls of `clustered_decode_hierarchical` -- what the hook did for a batch
before `clustered_decode_hierarchical_batched` (each row in turn through `lax.map`) -- and
``squeezed_batched`` one `clustered_decode_hierarchical_batched` call (each level's centroids
read once for all rows, each row its own level-1 survivors, the union streamed once).
``--ab-level2-rows N`` adds ``squeezed_batched_ab``: the same batched call with the level-2 kernel's
``CentroidLookupConfig(level2_rows=N)`` (an A/B of the level-2 program layout in one process;
N = 1: one program per (KV head, row), the layout before 2026-11-25).

- ``dense_rows``: B cuDNN calls over the fixed K/V -- what the hook does for full attention;
- ``dense_shared``: one cuDNN call with the B rows folded into the query heads -- the best dense
  for a shared document. Both dense variants leave out the rows' 16 new keys (a lower bound on
  dense; Squeezed's time includes them).

Each is timed as device time per step (`time_ms_looped`: 100 steps in one program, 4 query sets
rotated) and as kernel busy time per step from a profiler trace; speed-ups are against the faster
dense variant of the same run. Outputs are checked: folded dense equals row-by-row dense, every
Squeezed row equals the jnp reference of the clustered decode, and the batched call equals the
rows one by one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata, time_ms_looped, write_json
from benchmarks._profile import kernel_time_per_call
from sqjax.index_io import write_text_atomic

BF16 = jnp.bfloat16
N_NEW = 16          # each row's own new keys (question + answer so far)
N_SETS = 4          # query sets rotated through the timing


def _setup(plan, src, length: int, backend: str, method_name: str = "squeezed") -> dict:
    """Index one fixed context of `length` tokens (1 layer): cluster-sorted K/V, centroids (and for
    the hierarchical index the level-1 centroids, counts and parents), the decode thresholds, and
    the K/V in cuDNN's [1, L, Hkv, d] layout."""
    from pallas_kernels import cluster_sort_layout
    from sqjax import dispatch
    from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed

    scale = 1.0 / math.sqrt(plan.d)
    k, v = src.kv(length, seed=length)
    q_obs = src.queries(100, seed=length)[None]
    data = ContextData(k[None], v[None], q_obs, scale=scale)
    cls = HierarchicalSqueezed if method_name == "hierarchical" else Squeezed
    method = cls(sparsity=0.9, n_sink=1, decode_calibration="token")
    with dispatch.using(backend):
        index, info = method.build(data)
    li = index.layer(0)
    ks, vs, off, _ = cluster_sort_layout(k, v, li.labels, index.n_sink, index.n_tail, num_clusters=li.counts.shape[-1])
    t_dec, t1 = index.thresholds(1)
    kk, vv = k.swapaxes(0, 1)[None], v.swapaxes(0, 1)[None]          # [1, L, Hkv, d], laid out once
    s = {"ks": ks, "vs": vs, "off": off, "cent": li.centroids.astype(BF16), "t": jnp.float32(t_dec),
         "kk": kk, "vv": vv, "scale": scale, "vote": method.vote, "method": method_name,
         "decode_kept_calibration": float(np.mean(np.asarray(info["decode_retrieved_fraction"])))}
    if method_name == "hierarchical":
        s.update(c1=li.centroids1.astype(BF16), n1=li.counts1, parent=li.parent, t1=jnp.float32(t1))
    return s


def _fns(s: dict, backend: str, impl: str, lookup_config=None):
    from pallas_kernels import (clustered_decode_attention, clustered_decode_batched, clustered_decode_hierarchical,
                                clustered_decode_hierarchical_batched)

    scale, vote = s["scale"], s["vote"]
    tree = s["method"] == "hierarchical"

    def one_row(q, ks, vs, cent, off, t, kn, vn, qp, kp):
        if tree:
            return clustered_decode_hierarchical(q, ks, vs, s["c1"], s["n1"], cent, off, s["parent"], s["t1"], t, kn,
                                                 vn, qp, kp, scale=scale, vote=vote, backend=backend)
        return clustered_decode_attention(q, ks, vs, cent, off, t, kn, vn, qp, kp, scale=scale, vote=vote,
                                          backend=backend)

    def squeezed(qb, ks, vs, cent, off, t, kn, vn, qp, kp):   # qb [B, Hq, d]; kn, vn [B, Hkv, S, d]
        return jnp.stack([one_row(qb[b], ks, vs, cent, off, t, kn[b], vn[b], qp, kp) for b in range(qb.shape[0])])

    def squeezed_batched(qb, ks, vs, cent, off, t, kn, vn, qp, kp):   # one set of launches for all rows
        n_b = qb.shape[0]
        rows = (jnp.broadcast_to(qp, (n_b,)), jnp.broadcast_to(kp, (n_b, kp.shape[0])))
        if tree:
            return clustered_decode_hierarchical_batched(qb, ks, vs, s["c1"], s["n1"], cent, off, s["parent"], s["t1"],
                                                         t, kn, vn, *rows, scale=scale, vote=vote, backend=backend,
                                                         lookup_config=lookup_config)
        return clustered_decode_batched(qb, ks, vs, cent, off, t, kn, vn, *rows, scale=scale, vote=vote,
                                        backend=backend)

    def dense_rows(qb, kk, vv):
        return jnp.stack([jax.nn.dot_product_attention(qb[b][None, None], kk, vv, scale=scale, implementation=impl)[0, 0]
                          for b in range(qb.shape[0])])

    def dense_shared(qb, kk, vv):
        n_b, hq, d = qb.shape
        hkv = kk.shape[2]
        # [B, Hkv, g, d] -> [Hkv, B, g, d]: query head j = kv * B * g + b * g + i reads KV head j // (B g) = kv
        qf = qb.reshape(n_b, hkv, hq // hkv, d).swapaxes(0, 1).reshape(1, 1, n_b * hq, d)
        o = jax.nn.dot_product_attention(qf, kk, vv, scale=scale, implementation=impl)[0, 0]
        return o.reshape(hkv, n_b, hq // hkv, d).swapaxes(0, 1).reshape(n_b, hq, d)

    return squeezed, squeezed_batched, dense_rows, dense_shared


def _reference_row(s: dict, q, kn, vn, qp, kp):
    """One row through the jnp reference: (o [Hq, d], selected [Hs, C] bool, rows read [Hs])."""
    from pallas_kernels import hierarchical_lookup_reference
    from pallas_kernels.clustered_attention import (_counts, _rows_of_selection, clustered_decode_attention_reference,
                                                    clustered_decode_hierarchical_reference)

    if s["method"] != "hierarchical":
        return clustered_decode_attention_reference(q, s["ks"], s["vs"], s["cent"], s["off"], s["t"], kn, vn, qp, kp,
                                                    scale=s["scale"], vote=s["vote"], return_stats=True)
    num_l = s["ks"].shape[1]
    sel, _, _ = hierarchical_lookup_reference(q, s["c1"], s["n1"], s["cent"], _counts(s["off"], num_l), s["parent"],
                                              s["t1"], s["t"], scale=s["scale"], vote=s["vote"])
    o = clustered_decode_hierarchical_reference(q, s["ks"], s["vs"], s["c1"], s["n1"], s["cent"], s["off"],
                                                s["parent"], s["t1"], s["t"], kn, vn, qp, kp, scale=s["scale"],
                                                vote=s["vote"])
    return o, sel, _rows_of_selection(sel, s["off"], num_l)


def run(plan, src, lengths, batches, backend: str, impl: str, n_iter: int, log=print, save=None,
        method: str = "squeezed", ab_level2_rows: int | None = None) -> dict:
    """Every (length, batch) row; `save(result)` after each, so a run cut short keeps what it measured.
    ``ab_level2_rows`` (hierarchical): also the batched call with that ``level2_rows`` (``squeezed_batched_ab``)."""
    from pallas_kernels import CentroidLookupConfig

    if ab_level2_rows is not None and method != "hierarchical":
        raise ValueError("--ab-level2-rows applies to --method hierarchical")
    rows = []
    res = {"meta": metadata(), "keys": src.kind, "method": method, "dense_implementation": impl, "backend": backend,
           "n_iter": n_iter, "level2_rows": CentroidLookupConfig().level2_rows, "ab_level2_rows": ab_level2_rows,
           "rows": rows}
    for length in lengths:
        t0 = time.perf_counter()
        s = _setup(plan, src, length, backend, method)
        log(f"[L={length}] indexed in {time.perf_counter() - t0:.1f}s; decode threshold {float(s['t']):.3g}, "
            f"calibration queries keep {s['decode_kept_calibration']:.3f}")
        squeezed, squeezed_batched, dense_rows, dense_shared = _fns(s, backend, impl)
        ab = () if ab_level2_rows is None else (
            ("squeezed_batched_ab", _fns(s, backend, impl, CentroidLookupConfig(level2_rows=ab_level2_rows))[1]),)
        qp = jnp.full((1,), length + N_NEW - 1, jnp.int32)
        kp = (length + jnp.arange(N_NEW)).astype(jnp.int32)
        for n_b in batches:
            key = jax.random.key(n_b)
            q_all = src.queries(n_b * N_SETS, seed=length + 7 * n_b)                  # [Hq, B * sets, d]
            qsets = [jnp.moveaxis(q_all[:, i * n_b:(i + 1) * n_b], 1, 0) for i in range(N_SETS)]   # [B, Hq, d]
            kn = (0.5 * jax.random.normal(key, (n_b, plan.hkv, N_NEW, plan.d))).astype(BF16)
            vn = (0.5 * jax.random.normal(jax.random.fold_in(key, 1), kn.shape)).astype(BF16)
            sq_fixed = (s["ks"], s["vs"], s["cent"], s["off"], s["t"], kn, vn, qp, kp)
            dn_fixed = (s["kk"], s["vv"])
            row = {"L": length, "B": n_b, "Hq": plan.hq, "Hkv": plan.hkv, "d": plan.d, "dtype": "bfloat16",
                   "new_keys_per_row": N_NEW, "decode_threshold": float(s["t"]),
                   "decode_kept_calibration": s["decode_kept_calibration"]}
            # correctness: folded dense = row-by-row dense; Squeezed rows = the jnp reference
            q0 = qsets[0]
            a, b = jax.jit(dense_rows)(q0, *dn_fixed), jax.jit(dense_shared)(q0, *dn_fixed)
            row["dense_shared_vs_rows_max_err"] = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            got = jax.jit(squeezed)(q0, *sq_fixed)
            got_b = jax.jit(squeezed_batched)(q0, *sq_fixed)
            row["batched_vs_rows_max_err"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - got_b.astype(jnp.float32))))
            for name, fn in ab:
                got_ab = jax.jit(fn)(q0, *sq_fixed)
                row["batched_vs_rows_max_err"] = max(row["batched_vs_rows_max_err"], float(
                    jnp.max(jnp.abs(got.astype(jnp.float32) - got_ab.astype(jnp.float32)))))
            kept, errs, union = [], [], None
            for r in range(n_b):
                ref, sel, n_rows = _reference_row(s, q0[r], kn[r], vn[r], qp, kp)
                num = jnp.linalg.norm((got[r].astype(jnp.float32) - ref.astype(jnp.float32)).ravel())
                errs.append(float(num / jnp.linalg.norm(ref.astype(jnp.float32).ravel())))
                kept.append(float(np.asarray(n_rows).mean() / length))
                sel = np.asarray(sel).reshape(plan.hkv, -1, sel.shape[-1]).any(axis=1)      # [Hkv, C]
                union = sel if union is None else union | sel
            row["squeezed_rel_err_max"] = max(errs)
            row["kept_per_row"] = kept
            row["kept"] = float(np.mean(kept))
            off = np.asarray(s["off"])
            union_rows = np.sum(np.where(union, np.diff(off, axis=1), 0), axis=1) + (length - off[:, -1])
            row["kept_union"] = float(union_rows.mean() / length)   # what the batched call streams
            row["ok"] = bool(row["dense_shared_vs_rows_max_err"] < 2e-2 and row["squeezed_rel_err_max"] < 2e-2
                             and row["batched_vs_rows_max_err"] < 2e-2)
            for name, fn, fixed in (("squeezed", squeezed, sq_fixed), ("squeezed_batched", squeezed_batched, sq_fixed),
                                    *((n, f, sq_fixed) for n, f in ab), ("dense_rows", dense_rows, dn_fixed),
                                    ("dense_shared", dense_shared, dn_fixed)):
                row[f"{name}_loop_ms"] = time_ms_looped(fn, qsets, fixed=fixed, n_iter=n_iter, reps=5)
                call = jax.jit(fn)
                kt = kernel_time_per_call(call, [(q, *fixed) for q in qsets], n=8)
                row[f"{name}_busy_ms"] = None if kt is None else kt["busy_ms_per_call"]
            for t in ("loop", "busy"):
                dense = [x for x in (row[f"dense_rows_{t}_ms"], row[f"dense_shared_{t}_ms"]) if x is not None]
                for name in ("squeezed", "squeezed_batched", *(n for n, _ in ab)):
                    own = row[f"{name}_{t}_ms"]
                    row[f"speedup{name.removeprefix('squeezed')}_{t}"] = (
                        min(dense) / own if dense and own is not None else None)
            rows.append(row)
            if save:
                save(res)
            log(f"[L={length} B={n_b}] kept {row['kept']:.3f}; loop ms: squeezed {row['squeezed_loop_ms']:.4f}, "
                f"batched {row['squeezed_batched_loop_ms']:.4f} ({row['speedup_batched_loop']:.2f}x), dense rows {row['dense_rows_loop_ms']:.4f}, dense shared {row['dense_shared_loop_ms']:.4f} -> "
                f"{row['speedup_loop']:.2f}x; checks {'PASS' if row['ok'] else 'FAIL'}"
                + ("" if not ab else f"; level2_rows={ab_level2_rows}: {row['squeezed_batched_ab_loop_ms']:.4f}"))
        del s
    return res


def to_markdown(res: dict) -> str:
    m = res["meta"]
    tree = res.get("method") == "hierarchical"
    lines = [f"B decode rows over one shared fixed context{', hierarchical index' if tree else ''} ({m['device']}, jax {m['jax']}, {m['git_commit'][:12]}; "
             f"{res['keys']}; dense = `jax.nn.dot_product_attention(implementation={res['dense_implementation']!r})`)", "",
             f"| L | B | kept (mean / union) | {'hierarchical' if tree else 'Squeezed'} (B fused calls) | "
             f"{'hierarchical' if tree else 'Squeezed'} batched (one call) | dense, row by row | "
             "dense, rows folded (shared reads) | speed-up vs best dense: row by row / batched | checks |",
             "|---|---|---|---|---|---|---|---|---|"]

    def pair(r, name):
        busy = r.get(f"{name}_busy_ms")
        return f"{r[f'{name}_loop_ms']:.4f}" + ("" if busy is None else f" ({busy:.4f})")

    for r in res["rows"]:
        def sp(key):
            b = r.get(f"{key}_busy")
            return f"{r[f'{key}_loop']:.2f}×" + ("" if b is None else f" ({b:.2f}×)")

        lines.append(f"| {r['L']} | {r['B']} | {r['kept']:.3f} / {r['kept_union']:.3f} | {pair(r, 'squeezed')} | {pair(r, 'squeezed_batched')} | "
                     f"{pair(r, 'dense_rows')} | {pair(r, 'dense_shared')} | {sp('speedup')} / {sp('speedup_batched')} "
                     f"| {'PASS' if r['ok'] else 'FAIL'} |")
    lines += ["", "ms per decode step for the whole batch: device loop of "
              f"{res['n_iter']} steps (kernel busy time from a profiler trace in brackets)."]
    ab = res.get("ab_level2_rows")
    if ab is not None:
        lines += ["", f"A/B of the level-2 program layout (`CentroidLookupConfig.level2_rows`), batched call, same process:",
                  "", f"| L | B | level2_rows = {res['level2_rows']} (default) | level2_rows = {ab} | A/B loop time / default's |",
                  "|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append(f"| {r['L']} | {r['B']} | {pair(r, 'squeezed_batched')} | {pair(r, 'squeezed_batched_ab')} | "
                         f"{r['squeezed_batched_ab_loop_ms'] / r['squeezed_batched_loop_ms']:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from benchmarks.speed import KeySource, Plan, cpu_plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="131072,524288")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--keys", default=".scratch/captured/smollm2_qkv.npz")
    ap.add_argument("--n-iter", type=int, default=100)
    ap.add_argument("--method", choices=("squeezed", "hierarchical"), default="squeezed")
    ap.add_argument("--ab-level2-rows", type=int, default=None,
                    help="hierarchical: also time the batched call with CentroidLookupConfig(level2_rows=N)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode, XLA dense (plumbing)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        plan = cpu_plan()
        lengths, batches, backend, impl, n_iter = (1024,), (1, 2), "interpret", "xla", 2
    else:
        if jax.default_backend() != "gpu":
            print("batch_decode needs a GPU (use --cpu-smoke to check the plumbing)", file=sys.stderr)
            return 2
        plan = Plan()
        lengths = tuple(int(x) for x in args.lengths.split(","))
        batches = tuple(int(x) for x in args.batches.split(","))
        backend, impl, n_iter = "auto", "cudnn", args.n_iter
    plan = dataclasses.replace(plan, hq=plan.shapes[0][0], hkv=plan.shapes[0][1])
    out = Path(args.out)

    def save(res):
        write_json(out / "batch_decode.json", res)
        write_text_atomic(out / "batch_decode.md", to_markdown(res))

    res = run(plan, KeySource(args.keys, plan), lengths, batches, backend, impl, n_iter, save=save,
              method=args.method, ab_level2_rows=args.ab_level2_rows)
    print(to_markdown(res))
    return 0 if all(r["ok"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
