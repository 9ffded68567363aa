"""A/B of the prefill lookup's statistics pass: the running max (shipped until 2026-11-25) against the anchored pass
(`CentroidLookupConfig.stats_anchor` "rows" / "tile"), 4K tokens over 512K, Llama-3-8B attention, bf16.

The hierarchical lookup (1% / 5%, the synthetic tree of `benchmarks.lookup_engines.hierarchical_ab`,
T1 at the median level-1 score) and the 1-level lookup (every 5% centroid), each variant in two
alternating rounds: kernel busy time per call from a profiler trace (and the statistics kernel's own
time), wall time per call (median), and the outputs against the running-max variant's.

    python benchmarks/results/gpu_h100_stats_anchor/ab_anchor.py OUT_DIR [--interpret]
"""
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata, write_json
from benchmarks.lookup_engines import ab_inputs, kernels_str, rel, timed_lookup
from pallas_kernels.centroid_lookup import DEFAULT_PREFILL, lookup_prefill_scores
from pallas_kernels.hierarchical_lookup import hierarchical_lookup_prefill


def main(out: Path, interpret: bool) -> int:
  x = ab_inputs(interpret)
  length, tokens, hq, hkv, d, reps, backend, scale, q = x[:9]
  c1, n1, c2, n2, parent = x.tree
  s1 = lookup_prefill_scores(q, c1, n1, scale=scale, groups=hkv, cfg=dataclasses.replace(DEFAULT_PREFILL, stats_anchor=None),
                             backend=backend)
  t1 = jnp.median(s1[n1 > 0])
  variants = {"running max": dataclasses.replace(DEFAULT_PREFILL, stats_anchor=None),
              "anchored, row sums": dataclasses.replace(DEFAULT_PREFILL, stats_anchor="rows"),
              "anchored, tile": dataclasses.replace(DEFAULT_PREFILL, stats_anchor="tile")}
  calls = {
      "hierarchical": lambda cfg: (jax.jit(lambda *a: hierarchical_lookup_prefill(
          *a, scale=scale, config=cfg, backend=backend)), (q, c1, n1, c2, n2, parent, t1, jnp.float32(0.0))),
      "one level": lambda cfg: (jax.jit(lambda *a: lookup_prefill_scores(
          *a, scale=scale, groups=hkv, cfg=cfg, backend=backend)), (q, c2, n2)),
  }
  res = {"meta": metadata(), "shape": dict(L=length, T=tokens, Hq=hq, Hkv=hkv, d=d, dtype="bfloat16"),
         "level1_survivors": float(jnp.mean((s1 >= t1)[n1 > 0])), "rows": []}
  base = {}
  for rnd in range(2):
    for what, make in calls.items():
      for name, cfg in (variants.items() if rnd == 0 else reversed(variants.items())):
        fn, args = make(cfg)
        timing, got = timed_lookup(fn, args, reps, profile=not interpret)
        scores = np.asarray(got[1] if what == "hierarchical" else got)
        row = {"round": rnd, "lookup": what, "variant": name, "stats_anchor": cfg.stats_anchor}
        if name == "running max":
          base[what] = (scores, None if what != "hierarchical" else np.asarray(got[2]))
        ref, touched = base.get(what, (None, None))
        if ref is not None:
          row["scores_rel_err_vs_running_max"] = rel(scores, ref)
          if touched is not None:
            row["same_candidates"] = bool(np.array_equal(np.asarray(got[2]), touched))
        row.update(timing)
        res["rows"].append(row)
        print(f"[{rnd}] {what:12s} {name:20s} wall {row['wall_ms']:.3f} ms, busy {row.get('busy_ms', 0):.3f} ms, "
              f"err {row.get('scores_rel_err_vs_running_max', 0):.1e}" + kernels_str(row), flush=True)
        write_json(out / "ab_anchor.json", res)
  ok = all(r.get("scores_rel_err_vs_running_max", 0) < 1e-3 and r.get("same_candidates", True) for r in res["rows"])
  print("checks", "PASS" if ok else "FAIL")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1]), "--interpret" in sys.argv))
