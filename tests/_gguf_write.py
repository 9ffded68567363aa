"""Writing GGUF test files with gguf-py: a tensor stored as a ggml type, and the file finished."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants


def encode(x: np.ndarray, qt: QT) -> tuple[np.ndarray, QT | None, np.ndarray]:
    """float32 x -> (the bytes' array to add, the ``raw_dtype`` to add it with, what the file then
    holds dequantized as float32)."""
    if qt == QT.F32:
        return x, None, x
    if qt == QT.F16:
        data = x.astype(np.float16)
        return data, None, data.astype(np.float32)
    data = quants.quantize(x, qt)
    return data, qt, quants.dequantize(data, qt).astype(np.float32)


def finish(w) -> None:
    """Header, metadata and tensors of a `gguf.GGUFWriter` to its file, then close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
