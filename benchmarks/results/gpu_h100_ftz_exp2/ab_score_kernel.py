"""A/B of one keyword of the prefill scoring kernel (``centroid_lookup._score_kernel``), patched in around the
library's call, 4K tokens over 512K, Llama-3-8B attention, bf16 and int8 logits (both with ``exp2_ftz``), two
alternating rounds; the scores against the default's.

- ``clamp`` (the default): ``exp2(min(s - M - log2 D, 0))`` against ``exp2(s - M - log2 D)`` (a valid column's
  argument is <= 0 up to rounding: D >= 1).  It ran as ``ab_clamp.py`` at f5d0951, without clearing the jit caches:
  there the hierarchical rows of both variants ran the first one's compiled code; only its 1-level rows compare.
- ``contiguous``: each token block's q rows and int8 multipliers as one aligned slice against the masked row
  gather.  At 99ab83d, where it ran, the kernel chose it by default when T was a multiple of the scoring block (as
  T = 4096 is); within 2% either way, it is off by default since.

    python benchmarks/results/gpu_h100_ftz_exp2/ab_score_kernel.py OUT_DIR [clamp|contiguous] [--interpret]
"""
import functools
import sys
from pathlib import Path

import jax
import numpy as np

from benchmarks._meta import metadata, write_json
from benchmarks.lookup_engines import ab_inputs, kernels_str, prefill_ab_calls, rel, timed_lookup
from pallas_kernels import centroid_lookup as cl

_SCORE = cl._score_kernel
_DEFAULTS = {"clamp": True, "contiguous": True}   # contiguous: the kernel's default at 99ab83d (auto: True at T = 4096)


def main(out: Path, param: str, interpret: bool) -> int:
  x = ab_inputs(interpret)
  calls, _, _ = prefill_ab_calls(x)
  res = {"meta": metadata(), "shape": dict(L=x.length, T=x.tokens, Hq=x.hq, Hkv=x.hkv, d=x.d, dtype="bfloat16"),
         "param": param, "rows": []}
  base = _DEFAULTS[param]
  variants = [(f"{lo}, {param}={v}", cfg, v) for lo, cfg in (("bf16", cl.DEFAULT_PREFILL), ("int8", cl.INT8_PREFILL))
              for v in (base, not base)]
  scores = {}
  for rnd in range(2):
    for what, make in calls.items():
      for name, cfg, v in (variants if rnd == 0 else variants[::-1]):
        cl._score_kernel = functools.partial(_SCORE, **{param: v})
        jax.clear_caches()   # hierarchical_lookup_prefill is jitted on its config: trace it again with the patch
        try:
          fn, args = make(cfg)
          timing, got = timed_lookup(fn, args, x.reps, profile=not interpret)
        finally:
          cl._score_kernel = _SCORE
        sc = np.asarray(got[1] if what == "hierarchical" else got)
        scores[what, name] = sc
        row = {"round": rnd, "lookup": what, "variant": name, param: v}
        if v != base:
          row["scores_rel_err_vs_default"] = rel(sc, scores[what, name.replace(f"={v}", f"={base}")])
        row.update(timing)
        res["rows"].append(row)
        print(f"[{rnd}] {what:12s} {name:22s} wall {row['wall_ms']:.3f} ms, busy {row.get('busy_ms', 0):.3f} ms"
              + (f", vs default {row['scores_rel_err_vs_default']:.1e}" if v != base else "") + kernels_str(row),
              flush=True)
        write_json(out / f"ab_{param}.json", res)
  errs = [row["scores_rel_err_vs_default"] for row in res["rows"] if "scores_rel_err_vs_default" in row]
  ok = max(errs) < 1e-5
  print("checks", "PASS" if ok else "FAIL", f"(max rel err of {param}={not base} {max(errs):.1e} over {len(errs)} rows)")
  return 0 if ok else 1


if __name__ == "__main__":
  args = [a for a in sys.argv[2:] if not a.startswith("--")]
  sys.exit(main(Path(sys.argv[1]), args[0] if args else "clamp", "--interpret" in sys.argv))
