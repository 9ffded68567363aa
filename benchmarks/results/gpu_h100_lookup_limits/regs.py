"""The lookup kernels' machine code: compiles the hierarchical prefill lookup (int8 and bf16, 4K tokens over 512K)
with jax's persistent compilation cache on, pulls the ELF cubins out of the cache entries, and writes them to OUT_DIR
(``regs.sh`` then runs ``cuobjdump -res-usage`` and ``-sass`` on them).  XLA does not dump PTX for Pallas' Triton
kernels, and ncu gives no data on these machines.

    python benchmarks/results/gpu_h100_lookup_limits/regs.py OUT_DIR
"""
import struct
import sys
import zlib
from pathlib import Path

import jax

out = Path(sys.argv[1])
cache = out / "cache"
jax.config.update("jax_compilation_cache_dir", str(cache))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from benchmarks.lookup_engines import ab_inputs, prefill_ab_calls  # noqa: E402
from pallas_kernels import centroid_lookup as cl  # noqa: E402

x = ab_inputs(False)
calls, _, _ = prefill_ab_calls(x)
for cfg in (cl.INT8_PREFILL, cl.DEFAULT_PREFILL):
  fn, args = calls["hierarchical"](cfg)
  jax.block_until_ready(fn(*args))


def payload(raw: bytes) -> bytes:
  for dec in ("zstd", "zlib"):
    try:
      if dec == "zstd":
        import zstandard
        return zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 30)
      return zlib.decompress(raw)
    except Exception:  # noqa: BLE001 - try the next codec, else the raw bytes
      continue
  return raw


n = 0
for f in sorted(cache.rglob("*")):
  if not f.is_file():
    continue
  raw = f.read_bytes()
  data = payload(raw)
  print(f.name[:60], len(raw), len(data), "ELF" if b"\x7fELF" in data else "-", data.count(b"centroid_lookup"),
        data[:4])
  i = data.find(b"\x7fELF")
  while i >= 0:
    if len(data) >= i + 64 and data[i + 4] == 2:   # ELF64
      shoff, = struct.unpack_from("<Q", data, i + 0x28)
      shentsize, shnum = struct.unpack_from("<HH", data, i + 0x3A)
      size = shoff + shentsize * shnum
      blob = data[i:i + size]
      if b"centroid_lookup" in blob and 0 < size < 1 << 28:
        n += 1
        (out / f"k{n}.cubin").write_bytes(blob)
    i = data.find(b"\x7fELF", i + 4)
print("cubins with lookup kernels:", n)
