"""`python -m benchmarks.speed` with the prefill lookup's int8 logits as the default (`DEFAULT_PREFILL` with the
fields of the JSON argv[1] replaced, e.g. '{"prefill_int8": "cvt", "block_t": 64}', set in both modules that read
it), for the #8 prefill rows beside the bf16 ones.

    python benchmarks/results/gpu_h100_int8_lookup/speed_int8.py JSON SPEED_ARGS...
"""
import dataclasses
import json
import sys

from pallas_kernels import centroid_lookup, hierarchical_lookup

cfg = dataclasses.replace(centroid_lookup.DEFAULT_PREFILL, **json.loads(sys.argv[1]))
centroid_lookup.DEFAULT_PREFILL = hierarchical_lookup.DEFAULT_PREFILL = cfg
print("DEFAULT_PREFILL =", cfg, flush=True)

from benchmarks import speed  # noqa: E402

sys.exit(speed.main(sys.argv[2:]))
