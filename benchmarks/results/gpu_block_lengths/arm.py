"""`python -m benchmarks.speed ARGS...` with the question blocks padded one way or the other:

    python benchmarks/results/gpu_block_lengths/arm.py {ladder|multiple16} ARGS...

`ladder` is the library's `_block_length` (multiples of 16 up to 128 tokens, four steps per
doubling up to 2048, then multiples of 256); `multiple16` puts back the earlier rule, every block
padded to a multiple of 16. Nothing else differs."""
import runpy
import sys

import sqjax.fixed_context as fc

arm = sys.argv[1]
if arm == "multiple16":
    fc._block_length = lambda n: -(-max(int(n), 1) // 16) * 16
elif arm != "ladder":
    sys.exit(f"arm must be ladder or multiple16, not {arm!r}")
sys.argv = ["benchmarks.speed", *sys.argv[2:]]
runpy.run_module("benchmarks.speed", run_name="__main__")
