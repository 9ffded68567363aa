"""A/B of the prefill lookup's logits: the inputs' bf16 against int8 operands (`CentroidLookupConfig.prefill_int8`
"cvt" / "magic", and two tilings of "magic"), 4K tokens over 512K, Llama-3-8B attention.

The hierarchical lookup (1% / 5%, the synthetic tree of `benchmarks.lookup_engines.hierarchical_ab`, T1 at the
median level-1 score) and the 1-level lookup (every 5% centroid), each variant in two alternating rounds: kernel
busy time per call from a profiler trace (each lookup kernel's own time too), wall time per call (median), and the
outputs against the bf16 variant's (int8 changes the logits by design: a relative error of ~1e-2 is expected) and
against the int8 variants' own arithmetic (the 1-level reference over the quantized inputs, on 2 of the 8 KV heads).

    python benchmarks/results/gpu_h100_int8_lookup/ab_int8.py OUT_DIR [--interpret] [--sweep]

--sweep: instead, tilings of the int8 "cvt" passes (one round; bf16 and int8 at the shipped tiling first);
--sweep2: tilings and splits around `INT8_PREFILL` (one round).
"""
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata, write_json
from benchmarks.lookup_engines import ab_inputs, kernels_str, rel, timed_lookup
from pallas_kernels.centroid_lookup import (DEFAULT_PREFILL, centroid_lookup_reference, lookup_prefill_scores,
                                            quantized_inputs)
from pallas_kernels.hierarchical_lookup import hierarchical_lookup_prefill


def main(out: Path, interpret: bool, sweep: bool = False) -> int:
  x = ab_inputs(interpret)
  length, tokens, hq, hkv, d, reps, backend, scale, q = x[:9]
  c1, n1, c2, n2, parent = x.tree
  s1 = lookup_prefill_scores(q, c1, n1, scale=scale, groups=hkv, cfg=DEFAULT_PREFILL, backend=backend)
  t1 = jnp.median(s1[n1 > 0])
  magic = dataclasses.replace(DEFAULT_PREFILL, prefill_int8="magic")
  variants = {"bf16": DEFAULT_PREFILL,
              "int8 cvt": dataclasses.replace(DEFAULT_PREFILL, prefill_int8="cvt"),
              "int8 magic": magic,
              "int8 magic, scoring 128 tokens": dataclasses.replace(magic, score_block_t=128),
              "int8 magic, 3 stages": dataclasses.replace(magic, num_stages=3)}
  if sweep:
    cvt = dataclasses.replace(DEFAULT_PREFILL, prefill_int8="cvt")
    r = dataclasses.replace
    variants = {"bf16": DEFAULT_PREFILL, "int8 cvt": cvt,
                "int8 cvt, stats 8 warps": r(cvt, num_warps=8),
                "int8 cvt, stats 64 tokens": r(cvt, block_t=64),
                "int8 cvt, stats 256 centroids": r(cvt, block_c=256),
                "int8 cvt, stats 256 tok 8 warps": r(cvt, block_t=256, num_warps=8),
                "int8 cvt, scoring 8 warps": r(cvt, score_warps=8),
                "int8 cvt, scoring 64 centroids": r(cvt, score_block_c=64),
                "int8 cvt, scoring 256 centroids 8 warps": r(cvt, score_block_c=256, score_warps=8),
                "int8 cvt, scoring 32 tokens": r(cvt, score_block_t=32)}
  if sweep == 2:   # around INT8_PREFILL (64-token statistics blocks)
    from pallas_kernels.centroid_lookup import INT8_PREFILL as i8
    r = dataclasses.replace
    variants = {"bf16": DEFAULT_PREFILL, "INT8_PREFILL": i8,
                "INT8_PREFILL, stats 32 tokens": r(i8, block_t=32),
                "INT8_PREFILL, stats 64 centroids": r(i8, block_c=64),
                "INT8_PREFILL, 1 stage": r(i8, num_stages=1),
                "INT8_PREFILL, stats splits 1": r(i8, stats_splits=1),
                "INT8_PREFILL, stats splits 4": r(i8, stats_splits=4),
                "INT8_PREFILL, score splits 2": r(i8, score_splits=2),
                "INT8_PREFILL, score splits 8": r(i8, score_splits=8),
                "INT8_PREFILL, stats 2 warps": r(i8, num_warps=2),
                "INT8_PREFILL, scoring 2 warps": r(i8, score_warps=2)}
  calls = {
      "hierarchical": lambda cfg: (jax.jit(lambda *a: hierarchical_lookup_prefill(
          *a, scale=scale, config=cfg, backend=backend)), (q, c1, n1, c2, n2, parent, t1, jnp.float32(0.0))),
      "one level": lambda cfg: (jax.jit(lambda *a: lookup_prefill_scores(
          *a, scale=scale, groups=hkv, cfg=cfg, backend=backend)), (q, c2, n2)),
  }
  res = {"meta": metadata(), "shape": dict(L=length, T=tokens, Hq=hq, Hkv=hkv, d=d, dtype="bfloat16"),
         "level1_survivors": float(jnp.mean((s1 >= t1)[n1 > 0])), "rows": []}
  # the int8 arithmetic itself: 1-level scores of KV heads 0-1 against the reference over the quantized inputs
  sub = 2 * hq // hkv
  qd, cd = quantized_inputs(q[:sub], c2[:2])
  ref_sub = np.asarray(centroid_lookup_reference(qd, cd, n2[:2], 0.0, scale=scale)[1])
  base = {}
  for rnd in range(1 if sweep else 2):
    for what, make in calls.items():
      for name, cfg in (variants.items() if rnd == 0 else reversed(variants.items())):
        fn, args = make(cfg)
        timing, got = timed_lookup(fn, args, reps, profile=not interpret)
        scores = np.asarray(got[1] if what == "hierarchical" else got)
        row = {"round": rnd, "lookup": what, "variant": name, "prefill_int8": cfg.prefill_int8,
               "score_block_t": cfg.score_block_t, "num_stages": cfg.num_stages}
        if name == "bf16":
          base[what] = (scores, None if what != "hierarchical" else np.asarray(got[2]))
        ref, cand = base[what]
        row["scores_rel_err_vs_bf16"] = rel(scores, ref)
        if cand is not None:
          got_c = np.asarray(got[2])
          row["candidates_jaccard_vs_bf16"] = float((got_c & cand).sum() / max((got_c | cand).sum(), 1))
        if what == "one level" and cfg.prefill_int8:
          sub_got = lookup_prefill_scores(q[:sub], c2[:2], n2[:2], scale=scale, groups=2, cfg=cfg, backend=backend)
          row["scores_rel_err_vs_int8_reference"] = rel(sub_got, ref_sub)
        row.update(timing)
        res["rows"].append(row)
        print(f"[{rnd}] {what:12s} {name:32s} wall {row['wall_ms']:.3f} ms, busy {row.get('busy_ms', 0):.3f} ms, "
              f"vs bf16 {row['scores_rel_err_vs_bf16']:.1e}, vs int8 ref {row.get('scores_rel_err_vs_int8_reference', 0):.1e}"
              + (f", candidates J {row['candidates_jaccard_vs_bf16']:.4f}" if cand is not None else "")
              + kernels_str(row), flush=True)
        write_json(out / "ab_int8.json", res)
  # correctness: each int8 variant's 1-level scores against the reference over the int8 inputs (the hierarchical
  # scores differ from bf16's wherever a level-1 survivor flips, by design; the compiled checks cover them)
  ok = all(r.get("scores_rel_err_vs_int8_reference", 0) < 1e-3 for r in res["rows"])
  print("checks", "PASS" if ok else "FAIL")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1]), "--interpret" in sys.argv, 2 if "--sweep2" in sys.argv else "--sweep" in sys.argv))
