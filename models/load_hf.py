"""Load a Hugging Face checkpoint directory (no torch).

Reads ``config.json``, the ``*.safetensors`` weights (single file or sharded with
``model.safetensors.index.json``) with ``safetensors`` in numpy (BF16 tensors, which numpy
cannot name, are viewed as ``ml_dtypes.bfloat16`` from the raw file), and the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, chat template).

A corrupted ``config.json`` / index / tokenizer JSON or ``.safetensors`` file raises
`ModelFileError` (a ``ValueError``) whose one-line message names the file and says what to do;
the safetensors header is bounds-checked against the file size before anything is allocated.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from .config import LlamaConfig
from .model_files import ModelFileError, one_line, read_json_object
from .tokenizer import Tokenizer
from .weights import build_from_hf_tensors

_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


# bytes per element of the safetensors dtypes (others, e.g. sub-byte ones, are left to `safe_open`)
_DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header


def _bad_safetensors(path: Path, detail: str) -> ModelFileError:
    return ModelFileError(f"{path} is not a readable safetensors file ({detail}); re-download it")


def _check_entry(path: Path, name: str, info, data_len: int) -> None:
    """One header entry: dtype, shape and data_offsets that fit the data section."""
    if not isinstance(info, dict):
        raise _bad_safetensors(path, f"header entry {name!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise _bad_safetensors(path, f"tensor {name!r} has no dtype")
    if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
        raise _bad_safetensors(path, f"tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad_safetensors(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    a, b = offsets
    if b > data_len:
        raise _bad_safetensors(
            path, f"truncated: tensor {name!r} ends at data byte {b} but the data section has {data_len} bytes"
        )
    if dtype in _DTYPE_SIZES and math.prod(shape) * _DTYPE_SIZES[dtype] != b - a:
        raise _bad_safetensors(path, f"tensor {name!r} ({dtype} {shape}) does not match its {b - a} data bytes")


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section) of a .safetensors file.

    The header length is checked against the file size before it is read, and every tensor's
    extent against the data section; anything malformed raises `ModelFileError`.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad_safetensors(path, f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8 or n > _MAX_HEADER:
            raise _bad_safetensors(
                path, f"header length {n} does not fit the {size}-byte file: truncated or not a safetensors file"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _bad_safetensors(path, f"header is not valid JSON: {one_line(e)}") from e
    if not isinstance(header, dict):
        raise _bad_safetensors(path, "header is not a JSON object")
    for name, info in header.items():
        if name != "__metadata__":
            _check_entry(path, name, info, size - 8 - n)
    return header, 8 + n


class SafetensorsFiles:
    """Lazy name -> numpy tensor lookup over one or more .safetensors files."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, Path] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}
        for f in files:
            header, start = safetensors_header(f)
            self._headers[f] = (header, start)
            for name in header:
                if name != "__metadata__":
                    self._where[name] = f

    def names(self) -> set[str]:
        return set(self._where)

    def __call__(self, name: str) -> np.ndarray:
        f = self._where[name]
        header, start = self._headers[f]
        info = header[name]
        if info["dtype"] in _RAW_DTYPES:  # numpy has no name for these: view the raw bytes
            a, b = info["data_offsets"]
            raw = np.memmap(f, dtype=np.uint8, mode="r", offset=start + a, shape=(b - a,))
            return np.asarray(raw.view(_RAW_DTYPES[info["dtype"]]).reshape(info["shape"])).astype(np.float32)
        try:
            with safe_open(str(f), framework="numpy") as sf:
                return sf.get_tensor(name)
        except SafetensorError as e:
            raise _bad_safetensors(f, one_line(e)) from e


def find_safetensors(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ModelFileError(
                f"{index} has no \"weight_map\" object (tensor name -> shard file); "
                "fix it or re-download the checkpoint"
            )
        files = sorted({path / v for v in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path} (sqjax reads safetensors only; convert .bin/.pt checkpoints first)"
        )
    return files


def load_hf(path: str | Path, dtype=jnp.float32):
    """Read a HF checkpoint directory -> ``(graphdef, state, config, tokenizer)``.

    Raises `ModelFileError` (a ``ValueError``) when a JSON or safetensors file is corrupted.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face checkpoint directory")
    hf_cfg = read_json_object(cfg_file)
    config = LlamaConfig.from_hf_config(hf_cfg, name=path.name)
    reader = SafetensorsFiles(find_safetensors(path))
    names = reader.names()
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints still store it
    tokenizer = Tokenizer.from_hf_dir(path, name=path.name, config=hf_cfg)  # before the (slow) weights
    graphdef, state = build_from_hf_tensors(config, reader, names, dtype=dtype)
    return graphdef, state, config, tokenizer
