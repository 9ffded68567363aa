"""A/B of the prefill lookup passes' exp2: ``ex2.approx.ftz.f32`` (``CentroidLookupConfig.exp2_ftz``, one MUFU op
per element) against ``jnp.exp2`` (libdevice's ``__nv_exp2f`` compiled without flush-to-zero: the MUFU op plus a
range test and two predicated multiplies), 4K tokens over 512K, Llama-3-8B attention, bf16 and int8 logits.

The hierarchical lookup (1% / 5%, the synthetic tree of `benchmarks.lookup_engines`, T1 at the median level-1
score) and the 1-level lookup (every 5% centroid), each variant in two alternating rounds: kernel busy time per call
from a profiler trace (each lookup kernel's own time too), wall time per call (median), and the scores against the
same logits without ftz (they may differ only where a term is below 2^-126: expected equal to ~1e-6).

    python benchmarks/results/gpu_h100_ftz_exp2/ab_ftz.py OUT_DIR [--interpret]
"""
import dataclasses
import sys
from pathlib import Path

import numpy as np

from benchmarks._meta import metadata, write_json
from benchmarks.lookup_engines import ab_inputs, kernels_str, prefill_ab_calls, rel, timed_lookup
from pallas_kernels.centroid_lookup import DEFAULT_PREFILL, INT8_PREFILL


def main(out: Path, interpret: bool) -> int:
  x = ab_inputs(interpret)
  calls, _, survivors = prefill_ab_calls(x)
  r = dataclasses.replace
  # (name, config, the variant with the same logits and jnp.exp2)
  variants = {"bf16, jnp.exp2": (r(DEFAULT_PREFILL, exp2_ftz=False), None),
              "bf16, ftz": (r(DEFAULT_PREFILL, exp2_ftz=True), "bf16, jnp.exp2"),
              "int8, jnp.exp2": (r(INT8_PREFILL, exp2_ftz=False), None),
              "int8, ftz": (r(INT8_PREFILL, exp2_ftz=True), "int8, jnp.exp2"),
              "int8 magic, ftz": (r(INT8_PREFILL, exp2_ftz=True, prefill_int8="magic"), "int8, jnp.exp2")}
  res = {"meta": metadata(), "shape": dict(L=x.length, T=x.tokens, Hq=x.hq, Hkv=x.hkv, d=x.d, dtype="bfloat16"),
         "level1_survivors": survivors, "rows": []}
  scores = {}
  for rnd in range(2):
    for what, make in calls.items():
      items = list(variants.items())
      for name, (cfg, same_logits) in (items if rnd == 0 else items[::-1]):
        fn, args = make(cfg)
        timing, got = timed_lookup(fn, args, x.reps, profile=not interpret)
        sc = np.asarray(got[1] if what == "hierarchical" else got)
        scores[what, name] = sc
        row = {"round": rnd, "lookup": what, "variant": name, "prefill_int8": cfg.prefill_int8,
               "exp2_ftz": cfg.exp2_ftz}
        if same_logits and (what, same_logits) in scores and "magic" not in name:
          row["scores_rel_err_vs_jnp_exp2"] = rel(sc, scores[what, same_logits])
        if what == "hierarchical":
          row["candidates"] = int(np.asarray(got[2]).sum())
        row.update(timing)
        res["rows"].append(row)
        print(f"[{rnd}] {what:12s} {name:18s} wall {row['wall_ms']:.3f} ms, busy {row.get('busy_ms', 0):.3f} ms"
              + (f", vs jnp.exp2 {row['scores_rel_err_vs_jnp_exp2']:.1e}" if "scores_rel_err_vs_jnp_exp2" in row else "")
              + kernels_str(row), flush=True)
        write_json(out / "ab_ftz.json", res)
  errs = [row["scores_rel_err_vs_jnp_exp2"] for row in res["rows"] if "scores_rel_err_vs_jnp_exp2" in row]
  ok = bool(errs) and max(errs) < 1e-5
  print("checks", "PASS" if ok else "FAIL", f"(max rel err ftz vs jnp.exp2 {max(errs):.1e} over {len(errs)} rows)")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1]), "--interpret" in sys.argv))
