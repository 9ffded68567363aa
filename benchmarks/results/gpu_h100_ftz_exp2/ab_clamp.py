"""A/B of the prefill scoring pass's clamp ``exp2(min(s - M - log2 D, 0))`` against ``exp2(s - M - log2 D)`` (the
argument of a valid column is <= 0 up to rounding: D >= 1), both with ``exp2_ftz``: the scoring kernel with
``clamp=False`` patched in, 4K tokens over 512K, Llama-3-8B attention, bf16 and int8 logits, two alternating
rounds; the scores against the clamped ones.

    python benchmarks/results/gpu_h100_ftz_exp2/ab_clamp.py OUT_DIR [--interpret]
"""
import functools
import sys
from pathlib import Path

import numpy as np

from benchmarks._meta import metadata, write_json
from benchmarks.lookup_engines import ab_inputs, kernels_str, prefill_ab_calls, rel, timed_lookup
from pallas_kernels import centroid_lookup as cl

_SCORE = cl._score_kernel


def main(out: Path, interpret: bool) -> int:
  x = ab_inputs(interpret)
  calls, _, _ = prefill_ab_calls(x)
  res = {"meta": metadata(), "shape": dict(L=x.length, T=x.tokens, Hq=x.hq, Hkv=x.hkv, d=x.d, dtype="bfloat16"),
         "rows": []}
  variants = [(f"{lo}, {'clamp' if c else 'no clamp'}", cfg, c)
              for lo, cfg in (("bf16", cl.DEFAULT_PREFILL), ("int8", cl.INT8_PREFILL)) for c in (True, False)]
  scores = {}
  for rnd in range(2):
    for what, make in calls.items():
      for name, cfg, clamp in (variants if rnd == 0 else variants[::-1]):
        cl._score_kernel = functools.partial(_SCORE, clamp=clamp)
        try:
          fn, args = make(cfg)
          timing, got = timed_lookup(fn, args, x.reps, profile=not interpret)
        finally:
          cl._score_kernel = _SCORE
        sc = np.asarray(got[1] if what == "hierarchical" else got)
        scores[what, name] = sc
        row = {"round": rnd, "lookup": what, "variant": name, "clamp": clamp}
        if not clamp:
          row["scores_rel_err_vs_clamp"] = rel(sc, scores[what, name.replace("no clamp", "clamp")])
        row.update(timing)
        res["rows"].append(row)
        print(f"[{rnd}] {what:12s} {name:16s} wall {row['wall_ms']:.3f} ms, busy {row.get('busy_ms', 0):.3f} ms"
              + (f", vs clamp {row['scores_rel_err_vs_clamp']:.1e}" if not clamp else "") + kernels_str(row), flush=True)
        write_json(out / "ab_clamp.json", res)
  errs = [row["scores_rel_err_vs_clamp"] for row in res["rows"] if "scores_rel_err_vs_clamp" in row]
  ok = max(errs) < 1e-5
  print("checks", "PASS" if ok else "FAIL", f"(max rel err without the clamp {max(errs):.1e} over {len(errs)} rows)")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1]), "--interpret" in sys.argv))
