"""A GGUF container read in one linear pass: metadata as Python values, tensors as byte views.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every metadata field. The
embedded SmolLM2's tokenizer alone is ~98K strings (tokens and merges), so opening that file took
5 s of Python on a 2-core CPU, on every ``load_model`` and every ``sqjax ask``. This reader walks
the same bytes with ``struct`` and slices (~0.1 s) and maps the tensor data without copying it.
Dequantization stays with ``gguf.quants`` (every type gguf-py knows).

Layout (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
magic ``GGUF``, version u32, tensor count u64, key/value count u64; key/values (string key, u32
value type, value); tensor infos (string name, u32 n_dims, u64 dims[n_dims] innermost first, u32
ggml type, u64 offset into the data); padding to ``general.alignment`` (32 by default); data.

Every length and count is checked against the bytes left before it is used, so a truncated or
corrupted file raises `GGUFFormatError` (a ``ValueError``) naming the byte where it went wrong,
never a huge allocation or a silent short read.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF value types -> (struct format, byte size) for the fixed-size ones
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file (the message says where)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's place in the file. ``shape`` is in numpy order (GGUF's dims reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int      # absolute byte offset in the file
    n_bytes: int


class _Cursor:
    """Little-endian reads over a buffer, each checked against its end."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos, self.end = buf, pos, len(buf)

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.end:
            raise GGUFFormatError(f"{what} at byte {self.pos} needs {n} bytes, the file has {self.end - self.pos} left")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, vtype: int, what: str):
        fmt, size = _SCALARS[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what} at byte {start} is not UTF-8 ({e.reason})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        raise GGUFFormatError(f"{what} at byte {self.pos - 4} has unknown value type {vtype}")

    def array(self, what: str) -> list:
        etype, count = self.u32(what), self.u64(what)
        if etype in _NUMPY:  # numbers: one frombuffer
            size = _SCALARS[etype][1]
            start = self.take(count * size, what)
            return np.frombuffer(self.buf, _NUMPY[etype], count, start).tolist()
        if etype == _BOOL:
            start = self.take(count, what)
            return [b != 0 for b in bytes(self.buf[start:start + count])]
        if etype not in (_STRING, _ARRAY):
            raise GGUFFormatError(f"{what} at byte {self.pos - 12} has unknown element type {etype}")
        if count * 8 > self.end - self.pos:  # each element takes >= 8 bytes (a length, or a type + count)
            raise GGUFFormatError(f"{what} at byte {self.pos} claims {count} elements, more than the file holds")
        if etype == _STRING:
            return [self.string(what) for _ in range(count)]
        return [self.array(what) for _ in range(count)]


def _quant_sizes(ggml_type: int) -> tuple[int, int]:
    """(block size in elements, bytes per block) of a ggml type, from gguf-py's table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"unknown ggml tensor type {ggml_type}") from None


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> str / int / float / bool / list), ``tensors``
    (name -> `GGUFTensor`) and `raw` (a tensor's bytes, mapped, not copied)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # raises ValueError when empty
        buf = memoryview(self._map)
        c = _Cursor(buf)
        magic = bytes(buf[c.take(4, "magic"):4])
        if magic != MAGIC:
            raise GGUFFormatError(f"the file starts with {magic!r}, not {MAGIC!r}")
        self.version = c.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            why = " (a big-endian file)" if swapped in SUPPORTED_VERSIONS else ""
            raise GGUFFormatError(f"GGUF version {self.version}{why} is not supported (only {SUPPORTED_VERSIONS})")
        n_tensors, n_kv = c.u64("tensor count"), c.u64("key/value count")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"key {i}")
            self.metadata[key] = c.value(c.u32(f"type of {key!r}"), f"value of {key!r}")
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor {i}'s name")
            n_dims = c.u32(f"tensor {name!r}'s dimension count")
            if n_dims > MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = [c.u64(f"tensor {name!r}'s dims") for _ in range(n_dims)]
            infos.append((name, dims, c.u32(f"tensor {name!r}'s type"), c.u64(f"tensor {name!r}'s offset")))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"general.alignment is {align!r}, not a power of two")
        self.data_offset = -(-c.pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, ggml_type, rel in infos:
            block, type_size = _quant_sizes(ggml_type)
            n = math.prod(dims)  # Python ints: corrupt dims cannot wrap around to a small size
            if dims and dims[0] % block:
                raise GGUFFormatError(f"tensor {name!r}'s rows ({dims[0]}) are not whole blocks of {block}")
            n_bytes = n // block * type_size
            start = self.data_offset + rel
            if start + n_bytes > len(buf):
                raise GGUFFormatError(
                    f"tensor {name!r} ends at byte {start + n_bytes}, the file has {len(buf)} bytes")
            if name in self.tensors:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            self.tensors[name] = GGUFTensor(name, tuple(int(d) for d in reversed(dims)), ggml_type, start, n_bytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, bytes per row] (what ``gguf.quants.dequantize`` takes)."""
        t = self.tensors[name]
        rows = math.prod(t.shape[:-1])
        return np.frombuffer(self._map, np.uint8, t.n_bytes, t.offset).reshape(rows, -1)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 array of the tensor in numpy order, e.g. [out, in] for a weight."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        out = dequantize(self.raw(name), GGMLQuantizationType(t.ggml_type))
        return np.asarray(out, dtype=np.float32).reshape(t.shape)
