"""Load a Hugging Face checkpoint directory (no torch).

Reads ``config.json``, the ``*.safetensors`` weights (single file or sharded with
``model.safetensors.index.json``) with ``safetensors`` in numpy (BF16 tensors, which numpy
cannot name, are viewed as ``ml_dtypes.bfloat16`` from the raw file), and the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, chat template).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from .config import LlamaConfig
from .tokenizer import Tokenizer
from .weights import build_from_hf_tensors

_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section) of a .safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
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
        with safe_open(str(f), framework="numpy") as sf:
            return sf.get_tensor(name)


def find_safetensors(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
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
    """Read a HF checkpoint directory -> ``(graphdef, state, config, tokenizer)``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face checkpoint directory")
    with open(cfg_file) as fh:
        hf_cfg = json.load(fh)
    config = LlamaConfig.from_hf_config(hf_cfg, name=path.name)
    reader = SafetensorsFiles(find_safetensors(path))
    names = reader.names()
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints still store it
    graphdef, state = build_from_hf_tensors(config, reader, names, dtype=dtype)
    tokenizer = Tokenizer.from_hf_dir(path, name=path.name, config=hf_cfg)
    return graphdef, state, config, tokenizer
