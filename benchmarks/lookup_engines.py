"""The prefill centroid lookup (two passes, Eq. 1 averaged over a token block) on its two GPU
engines, side by side in one process: the Triton passes (``centroid_lookup``) and the Mosaic
GPU passes (``lookup_mosaic``), over several Mosaic tilings.

Shapes: Llama-3-8B attention (32 query heads, 8 KV heads, d = 128, bf16), T query tokens over
a fixed context of L keys with 5% centroids; the 1-level call (every centroid) and a bounded
call shaped like the hierarchical level 2 (each group's candidates compacted to the front,
``--bound`` of the rows).  Each engine's output is checked against an f32 XLA reference on
group 0 and against the other engine.  Median of ``--reps`` calls after warm-up, each ending
in ``block_until_ready``.

    python -m benchmarks.lookup_engines --out benchmarks/results/<run>
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata
from pallas_kernels.centroid_lookup import DEFAULT_PREFILL, lookup_prefill_scores
from pallas_kernels.hierarchical_lookup import hierarchical_lookup_prefill
from pallas_kernels.lookup_mosaic import DEFAULT_MOSAIC, MosaicLookupConfig, lookup_prefill_scores_mosaic
from sqjax.index_io import write_text_atomic

MOSAIC_CONFIGS = [DEFAULT_MOSAIC, MosaicLookupConfig()]


def reference_group0(q, c, n, nv, scale, groups):
  """f32 XLA Eq. 1 averaged over group 0's heads and tokens: [C]."""
  hq, _, _ = q.shape
  hkv, num_c, _ = c.shape
  r = hq // groups
  kv = 0
  x = jnp.einsum("htd,cd->htc", q[:r].astype(jnp.float32), c[kv].astype(jnp.float32)) * scale
  nn = n[kv].astype(jnp.float32)
  valid = nn > 0
  if nv is not None:
    valid = valid & (jnp.arange(num_c) < nv[0])
  x = jnp.where(valid, x, -jnp.inf)
  mx = jnp.max(x, axis=-1, keepdims=True)
  e = jnp.where(valid, jnp.exp(x - mx), 0.0)
  s = e / jnp.sum(e * nn, axis=-1, keepdims=True)
  return jnp.mean(s, axis=(0, 1))


def synthetic_tree(keys, hkv: int, length: int, d: int):
  """A two-level tree over ``length`` keys: random bf16 level-1 (1%) and level-2 (5%) centroids, level-2
  counts 1-39, random parents, level-1 counts their children's sums.  keys: four PRNG keys.
  -> (c1 [Hkv, C1, d], n1 [Hkv, C1], c2 [Hkv, C2, d], n2 [Hkv, C2], parent [Hkv, C2])."""
  k1, k2, k3, k4 = keys
  c1n, c2n = length // 100, length // 20
  c1 = jax.random.normal(k1, (hkv, c1n, d), jnp.bfloat16) * 0.5
  c2 = jax.random.normal(k2, (hkv, c2n, d), jnp.bfloat16) * 0.5
  n2 = jax.random.randint(k3, (hkv, c2n), 1, 40).astype(jnp.int32)
  parent = jax.random.randint(k4, (hkv, c2n), 0, c1n).astype(jnp.int32)
  n1 = jax.vmap(lambda p, n: jnp.zeros((c1n,), jnp.int32).at[p].add(n))(parent, n2)
  return c1, n1, c2, n2, parent


class AbInputs(NamedTuple):
  length: int
  tokens: int
  hq: int
  hkv: int
  d: int
  reps: int
  backend: str
  scale: float
  q: jax.Array      # [Hq, T, d] bf16
  tree: tuple       # synthetic_tree's (c1, n1, c2, n2, parent)


def ab_inputs(interpret: bool) -> AbInputs:
  """The A/B scripts' inputs: 4K tokens over 512K keys, Llama-3-8B attention (tiny shapes under the
  interpreter), Gaussian bf16 q and a ``synthetic_tree`` from PRNGKey(0)."""
  length, tokens, hq, hkv, d, reps = (524288, 4096, 32, 8, 128, 7) if not interpret else (4096, 64, 8, 2, 128, 1)
  kq, *ks = jax.random.split(jax.random.PRNGKey(0), 5)
  q = jax.random.normal(kq, (hq, tokens, d), jnp.bfloat16)
  return AbInputs(length, tokens, hq, hkv, d, reps, "interpret" if interpret else "pallas", d ** -0.5, q,
                  synthetic_tree(ks, hkv, length, d))


def prefill_ab_calls(x: AbInputs, t1_cfg=DEFAULT_PREFILL) -> tuple[dict, jax.Array, float]:
  """The prefill A/B scripts' two lookups over ``x``: ``{"hierarchical" | "one level": cfg -> (jitted fn, args)}``
  (the hierarchical one over ``x.tree`` with T1 at the median level-1 score under ``t1_cfg``, T2 = 0; the 1-level one
  over every level-2 centroid), T1, and the fraction of non-empty level-1 clusters at or above it."""
  c1, n1, c2, n2, parent = x.tree
  s1 = lookup_prefill_scores(x.q, c1, n1, scale=x.scale, groups=x.hkv, cfg=t1_cfg, backend=x.backend)
  t1 = jnp.median(s1[n1 > 0])
  calls = {
      "hierarchical": lambda cfg: (jax.jit(lambda *a: hierarchical_lookup_prefill(
          *a, scale=x.scale, config=cfg, backend=x.backend)), (x.q, c1, n1, c2, n2, parent, t1, jnp.float32(0.0))),
      "one level": lambda cfg: (jax.jit(lambda *a: lookup_prefill_scores(
          *a, scale=x.scale, groups=x.hkv, cfg=cfg, backend=x.backend)), (x.q, c2, n2)),
  }
  return calls, t1, float(jnp.mean((s1 >= t1)[n1 > 0]))


def hierarchical_ab(q, length, scale, groups, reps):
  """``hierarchical_lookup_prefill`` (level 1 at 1%, its survivors' level-2 children at 5%,
  candidates compacted, both levels' two passes) with each engine, and cuDNN dense attention
  over the same context for scale.  A synthetic tree: random level-2 centroids and parents,
  T1 at the median level-1 score (about half the level-1 clusters survive)."""
  hq, t, d = q.shape
  hkv, c1n, c2n = 8, length // 100, length // 20
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(1), 4)
  c1, n1, c2, n2, parent = synthetic_tree((k1, k2, k3, k4), hkv, length, d)
  s1 = lookup_prefill_scores(q, c1, n1, scale=scale, groups=groups, cfg=DEFAULT_PREFILL, backend="pallas")
  t1 = jnp.median(s1[n1 > 0])
  t2 = jnp.float32(0.0)
  out = {"level1_survivors": float(jnp.mean((s1 >= t1)[n1 > 0]))}
  sels = {}
  for engine in ("triton", "mosaic"):
    cfg = dataclasses.replace(DEFAULT_PREFILL, prefill_engine=engine)
    fn = jax.jit(lambda *a, cfg=cfg: hierarchical_lookup_prefill(*a, scale=scale, config=cfg,
                                                                 backend="pallas"))
    sec, (sel, scores, touched) = timed(fn, (q, c1, n1, c2, n2, parent, t1, t2), reps)
    sels[engine] = (np.asarray(scores), np.asarray(touched))
    out[engine] = {"seconds": sec, "touched_fraction": float(np.mean(np.asarray(touched)) / (c1n + c2n))}
    print(f"  hierarchical lookup, {engine}: {sec * 1e3:.3f} ms", flush=True)
  out["ratio_mosaic_vs_triton"] = out["mosaic"]["seconds"] / out["triton"]["seconds"]
  out["scores_rel_err"] = rel(sels["mosaic"][0], sels["triton"][0])
  out["same_candidates"] = bool(np.array_equal(sels["mosaic"][1], sels["triton"][1]))
  kk = jax.random.normal(k1, (1, length, hkv, d), jnp.bfloat16)
  vv = jax.random.normal(k2, (1, length, hkv, d), jnp.bfloat16)
  qq = jnp.transpose(q, (1, 0, 2))[None]
  dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn"))
  out["cudnn_dense_seconds"], _ = timed(dense, (qq, kk, vv), reps)
  print(f"  ratio {out['ratio_mosaic_vs_triton']:.3f}, scores rel err {out['scores_rel_err']:.1e}, same "
        f"candidates {out['same_candidates']}; cuDNN dense {out['cudnn_dense_seconds'] * 1e3:.2f} ms", flush=True)
  return out


def timed(fn, args, reps):
  out = fn(*args)
  jax.block_until_ready(out)
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts), out


def timed_lookup(fn, args, reps, profile: bool = True):
  """``timed`` plus, with ``profile``, the kernel busy time per call from a profiler trace and each lookup
  kernel's own time.  -> (row fields {wall_ms, busy_ms?, kernels?}, the outputs)."""
  from benchmarks._profile import kernel_time_per_call
  sec, out = timed(fn, args, reps)
  row = {"wall_ms": sec * 1e3}
  kt = kernel_time_per_call(fn, [args], n=6) if profile else None
  if kt:
    row["busy_ms"] = kt["busy_ms_per_call"]
    row["kernels"] = [k for k in kt["kernels"] if "lookup" in k["name"]]
  return row, out


def kernels_str(row) -> str:
  """'; name ms, ...' of a ``timed_lookup`` row's kernels ('' without a trace)."""
  return "" if "kernels" not in row else "; " + ", ".join(f"{k['name']} {k['ms_per_call']:.3f}" for k in row["kernels"])


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--length", type=int, default=512 * 1024)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--bound", type=float, default=0.47)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--interpret", action="store_true",
                  help="run both engines' kernels in their CPU interpreters (a smoke test, no timing value)")
  args = ap.parse_args(argv)
  hq, hkv, d, groups = 32, 8, 128, 8
  num_c = int(round(0.05 * args.length))
  scale = d ** -0.5
  key = jax.random.PRNGKey(0)
  kq, kc, kn = jax.random.split(key, 3)
  q = jax.random.normal(kq, (hq, args.tokens, d), jnp.bfloat16)
  c = jax.random.normal(kc, (hkv, num_c, d), jnp.bfloat16) * 0.5
  n = jax.random.randint(kn, (hkv, num_c), 0, 40).astype(jnp.int32)
  nv = jnp.full((groups,), int(args.bound * num_c), jnp.int32)
  flops = lambda cols: 2 * 2 * hq * args.tokens * cols * d   # noqa: E731  two passes
  be = "interpret" if args.interpret else "pallas"
  rows = []
  print(f"prefill lookup, {args.tokens} tokens over {args.length} keys ({num_c} centroids)", flush=True)
  for bounded in (False, True):
    nvx = nv if bounded else None
    cols = int(args.bound * num_c) if bounded else num_c
    ref = np.asarray(reference_group0(q, c, n, nvx, scale, groups))
    tri = jax.jit(lambda q, c, n, nv=nvx: lookup_prefill_scores(q, c, n, nv, scale=scale, groups=groups,
                                                                  cfg=DEFAULT_PREFILL, backend=be))
    t_tri, o_tri = timed(tri, (q, c, n), args.reps)
    rows.append(dict(engine="triton", bounded=bounded, config="DEFAULT_PREFILL", seconds=t_tri,
                     tflops=flops(cols) / t_tri / 1e12, rel_err_ref=rel(o_tri[0], ref)))
    print(f"  {'bounded' if bounded else '1-level'} triton {t_tri * 1e3:.3f} ms "
          f"({rows[-1]['tflops']:.0f} TFLOP/s) err {rows[-1]['rel_err_ref']:.2e}", flush=True)
    for cfg in (MOSAIC_CONFIGS[:2] if args.interpret else MOSAIC_CONFIGS):
      label = (f"stats 64x{cfg.stats_block_c} score {cfg.score_block_c}x"
               f"{cfg.score_block_t} stages {cfg.stages}")
      try:
        mos = jax.jit(lambda q, c, n, nv=nvx, cfg=cfg: lookup_prefill_scores_mosaic(
            q, c, n, nv, scale=scale, groups=groups, cfg=cfg, interpret=args.interpret))
        t, o = timed(mos, (q, c, n), args.reps)
        stats_only = jax.jit(lambda q, c, n, nv=nvx, cfg=cfg: lookup_prefill_scores_mosaic(
            q, c, n, nv, scale=scale, groups=groups, cfg=cfg, stats_only=True, interpret=args.interpret))
        t_stats, _ = timed(stats_only, (q, c, n), args.reps)
        row = dict(engine="mosaic", bounded=bounded, config=label, seconds=t, stats_seconds=t_stats,
                   tflops=flops(cols) / t / 1e12, rel_err_ref=rel(o[0], ref),
                   rel_err_triton=rel(o, o_tri), ratio_vs_triton=t / t_tri)
        print(f"  {'bounded' if bounded else '1-level'} mosaic [{label}] {t * 1e3:.3f} ms "
              f"({row['tflops']:.0f} TFLOP/s, {t / t_tri:.2f}x triton; pass 1 alone {t_stats * 1e3:.3f} ms) "
              f"err {row['rel_err_ref']:.2e} "
              f"vs triton {row['rel_err_triton']:.2e}", flush=True)
      except Exception as e:  # a tiling that does not compile is reported, not fatal
        row = dict(engine="mosaic", bounded=bounded, config=label, error=f"{type(e).__name__}: {str(e)[:600]}")
        print(f"  mosaic [{label}] FAILED {row['error'][:300]}", flush=True)
      rows.append(row)
  hier = None if args.interpret else hierarchical_ab(q, args.length, scale, groups, args.reps)
  res = dict(meta=metadata(), hierarchical=hier, shape=dict(hq=hq, hkv=hkv, d=d, tokens=args.tokens, length=args.length,
                                          centroids=num_c, bound=args.bound, dtype="bfloat16"),
             reps=args.reps, timing="median of reps calls, each ending in block_until_ready", rows=rows)
  args.out.mkdir(parents=True, exist_ok=True)
  write_text_atomic(args.out / "lookup_engines.json", json.dumps(res, indent=1))
  md = ["| call | engine | tiling | ms | TFLOP/s | vs Triton | rel. err. vs f32 |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      md.append(f"| {'bounded' if r['bounded'] else '1-level'} | {r['engine']} | {r['config']} | failed | | | |")
      continue
    md.append(f"| {'bounded' if r['bounded'] else '1-level'} | {r['engine']} | {r['config']} | "
              f"{r['seconds'] * 1e3:.3f} | {r['tflops']:.0f} | {r.get('ratio_vs_triton', 1.0):.2f} | "
              f"{r['rel_err_ref']:.1e} |")
  write_text_atomic(args.out / "lookup_engines.md", "\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
