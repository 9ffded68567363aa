"""What limits the prefill lookup passes, and two tiles per loop iteration (H100, 4K tokens over 512K, Llama-3-8B
attention).

Part 1, ablations (their scores are meaningless; only their kernel times are read).  The two passes of
``lookup_prefill_scores`` on the shapes of the hierarchical lookup's two levels, int8 logits (``INT8_PREFILL``) and
bf16 (``DEFAULT_PREFILL``):
- "level 1": every level-1 centroid (1% of L), unbounded;
- "level 2": the level-2 centroids (5% of L) bounded at ``BOUND`` of the rows (what level 2 reads at prefill).
Variants, patched in around the library's call (the jit caches cleared per variant):
- ``shipped``;
- ``no_exp``: every per-element ``exp2`` replaced by ``max(x, -1) + 1`` (two ALU ops instead of a MUFU op);
- ``no_dot``: the logits ``q.C`` replaced by an outer product (the row multiplier times a column ramp): no MMA, and
  the q / centroid tile loads become dead code;
- ``no_dot_no_exp``: both: what is left is the loop, the per-element arithmetic and the counts.

Part 2, candidates, on the whole hierarchical lookup (``prefill_ab_calls``) and the 1-level one, int8 and bf16, two
alternating rounds, scores against the shipped kernels':
- ``rows_wait`` / ``nowait``: ``CentroidLookupConfig.stats_rows_wait`` True / False (every statistics pass loads its
  centroid rows only after their counts / without waiting).  At 1aaff9e, before that setting existed, this ran as
  ``nowait1`` (unbounded statistics passes without waiting) against the shipped kernels (all waiting): the H200 run
  behind the setting's automatic value (None: no wait for an unbounded int8 pass);
- ``no_fma``: ``CentroidLookupConfig.logits_fma`` off (the multiply and the bias subtraction apart, as before);
- ``score128x8``: scoring tiles of 128 tokens on 8 warps (two warpgroups, each its own 64 rows);
- ``stats128x8``: statistics blocks of 128 tokens on 8 warps.
Earlier candidates, removed after measuring at the commits named: ``pairs`` (two tiles per loop iteration in either
pass; 293dd38, the kernels of fd66490: slower), ``prefetch`` (the scoring pass's row statistics loaded an iteration ahead; 94ddc59, H200: level
2 unchanged) and ``stats_nowait`` on every statistics pass (94ddc59: level 1 -7%, level 2 +2%).

    python benchmarks/results/gpu_h100_lookup_limits/ab_limits.py OUT_DIR [ablations] [candidates | rows_wait nowait ...] [--interpret]
"""
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata, write_json
from benchmarks.lookup_engines import ab_inputs, kernels_str, prefill_ab_calls, rel, timed_lookup
from pallas_kernels import centroid_lookup as cl

BOUND = 0.38
_SCORE, _STATS, _LOGITS = cl._score_kernel, cl._stats_kernel, cl._logits


def _force(kernel, **kw):
  return lambda *a, **k: kernel(*a, **{**k, **kw})


def _fake_exp(x):
  return jnp.maximum(x, -1.0) + 1.0


def _fake_logits(q, c, mult, int8):
  ramp = jnp.arange(c.shape[0], dtype=jnp.float32)[None, :] * 0.01
  return jnp.broadcast_to(ramp * (mult[:, None] if int8 is not None else mult), (q.shape[0], c.shape[0]))


def _patch(variant: str):
  """Installs ``variant``'s kernels; returns the undo."""
  if "no_exp" in variant:
    cl._score_kernel, cl._stats_kernel = _force(_SCORE, ex2=_fake_exp), _force(_STATS, ex2=_fake_exp)
  if "no_dot" in variant:
    cl._logits = _fake_logits
  jax.clear_caches()   # the jitted lookups are keyed on their config, not on the kernels

  def undo():
    cl._score_kernel, cl._stats_kernel, cl._logits = _SCORE, _STATS, _LOGITS
  return undo


def _run(variant, make, reps, interpret):
  undo = _patch(variant)
  try:
    fn, args = make()
    return timed_lookup(fn, args, reps, profile=not interpret)
  finally:
    undo()


def main(out: Path, parts: list, interpret: bool) -> int:
  x = ab_inputs(interpret)
  c1, n1, c2, n2, _ = x.tree
  res = {"meta": metadata(), "shape": dict(L=x.length, T=x.tokens, Hq=x.hq, Hkv=x.hkv, d=x.d, dtype="bfloat16",
                                           bound=BOUND), "ablations": [], "candidate": []}
  cfgs = (("int8", cl.INT8_PREFILL), ("bf16", cl.DEFAULT_PREFILL))

  def level_call(cfg, level):
    c, n = (c1, n1) if level == "level 1" else (c2, n2)
    nv = None if level == "level 1" else jnp.full((x.hkv,), int(BOUND * c.shape[1]), jnp.int32)
    q8 = cl._int8_q(x.q) if cfg.prefill_int8 else None
    c8 = cl._int8_c(c) if cfg.prefill_int8 else None
    fn = jax.jit(lambda q, c, n, nv, q8, c8: lookup_scores(q, c, n, nv, q8, c8, cfg))
    return fn, (x.q, c8[0] if c8 else c, n, nv, q8, c8)

  def lookup_scores(q, c, n, nv, q8, c8, cfg):
    return cl.lookup_prefill_scores(q, c, n, nv, scale=x.scale, groups=x.hkv, cfg=cfg, backend=x.backend,
                                    q_int8=q8, c_int8=c8)

  for lo, cfg in (cfgs if "ablations" in parts else ()):
    for level in ("level 1", "level 2"):
      for variant in ("shipped", "no_exp", "no_dot", "no_dot_no_exp"):
        row, _ = _run(variant, functools.partial(level_call, cfg, level), x.reps, interpret)
        row.update(logits=lo, level=level, variant=variant)
        res["ablations"].append(row)
        print(f"[ablation] {lo} {level} {variant:14s} wall {row['wall_ms']:.3f} ms, busy {row.get('busy_ms', 0):.3f}"
              + kernels_str(row), flush=True)
        write_json(out / "ab_limits.json", res)

  calls, _, _ = prefill_ab_calls(x)
  tilings = {"rows_wait": dict(stats_rows_wait=True), "nowait": dict(stats_rows_wait=False),
             "no_fma": dict(logits_fma=False),
             "score128x8": dict(score_block_t=128, score_warps=8), "stats128x8": dict(block_t=128, num_warps=8)}
  variants = ("shipped", *[v for v in tilings if v in parts or "candidates" in parts]) if set(parts) & {
      "candidates", *tilings} else ()
  scores = {}
  for rnd in range(2 if variants else 0):
    for what, make in calls.items():
      for lo, cfg in cfgs:
        for variant in (variants if rnd == 0 else variants[::-1]):
          vcfg = dataclasses.replace(cfg, **tilings.get(variant, {}))
          row, got = _run(variant, functools.partial(make, vcfg), x.reps, interpret)
          sc = scores[what, lo, variant] = np.asarray(got[1] if what == "hierarchical" else got)
          row.update({"round": rnd, "lookup": what, "logits": lo, "variant": variant})
          if variant != "shipped" and (what, lo, "shipped") in scores:
            row["scores_rel_err_vs_shipped"] = rel(sc, scores[what, lo, "shipped"])
          res["candidate"].append(row)
          print(f"[{rnd}] {what:12s} {lo} {variant:10s} wall {row['wall_ms']:.3f} ms, busy {row.get('busy_ms', 0):.3f}"
                + (f", vs shipped {row['scores_rel_err_vs_shipped']:.1e}" if "scores_rel_err_vs_shipped" in row else "")
                + kernels_str(row), flush=True)
          write_json(out / "ab_limits.json", res)
  errs = [r["scores_rel_err_vs_shipped"] for r in res["candidate"] if "scores_rel_err_vs_shipped" in r]
  ok = bool(errs) and max(errs) < 1e-4
  print("checks", "PASS" if ok else "FAIL", f"({variants[1:]}: max rel err vs shipped {max(errs, default=-1):.1e} over "
        f"{len(errs)} rows)")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1]), sys.argv[2:], "--interpret" in sys.argv))
