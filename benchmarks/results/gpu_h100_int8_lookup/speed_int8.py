"""`python -m benchmarks.speed` with the prefill lookup's int8 logits as the default (`DEFAULT_PREFILL` with
`prefill_int8` = argv[1], set in both modules that read it), for the #8 prefill rows beside the bf16 ones.

    python benchmarks/results/gpu_h100_int8_lookup/speed_int8.py MODE SPEED_ARGS...
"""
import dataclasses
import sys

from pallas_kernels import centroid_lookup, hierarchical_lookup

mode = sys.argv[1]
cfg = dataclasses.replace(centroid_lookup.DEFAULT_PREFILL, prefill_int8=mode)
centroid_lookup.DEFAULT_PREFILL = hierarchical_lookup.DEFAULT_PREFILL = cfg
print("DEFAULT_PREFILL =", cfg, flush=True)

from benchmarks import speed  # noqa: E402

sys.exit(speed.main(sys.argv[2:]))
