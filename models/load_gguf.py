"""Load a Llama-family model from a GGUF file (no torch, no llama.cpp).

`models.gguf_file` reads the container; every tensor is dequantized with
``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0/Q4_1/Q8_0, K-quants: whatever gguf-py supports)
to float32. llama.cpp's ``convert_hf_to_gguf`` permutes the rows of ``attn_q``/``attn_k`` of
``llama`` models (its rotary kernel rotates adjacent pairs, HF rotates halves); `unpermute_qk`
undoes it so the HF ``rotate_half`` RoPE applies.
The tokenizer and chat template come from the GGUF metadata.

An empty, foreign, truncated or corrupted file raises `ModelFileError` (a ``ValueError``) whose
one-line message names the file and says what to do.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from .config import LlamaConfig
from .gguf_file import MAGIC as GGUF_MAGIC, GGUFFile, GGUFFormatError
from .model_files import ModelFileError, one_line
from .tokenizer import Tokenizer
from .weights import build_from_hf_tensors


# GGUF name -> HF name (per layer names use {i})
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# architectures whose Q/K rows convert_hf_to_gguf permuted
_PERMUTED_ARCHS = ("llama",)


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None if unknown)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute``: rows [H, d/2, 2] (pairs interleaved) -> [H, 2, d/2] (halves).

    w: [n_heads * d, ...] (a weight [out, in] or a bias [out]).
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (what convert_hf_to_gguf applies); inverse of `unpermute_qk`."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path) -> GGUFFile:
    """The `GGUFFile` at ``path``; `ModelFileError` for an empty, foreign, truncated or corrupted
    file. Every tensor's bytes are checked to lie inside the file while it opens, so a cut-off
    download fails here, before any weight is dequantized."""
    size = path.stat().st_size
    if size == 0:
        raise ModelFileError(f"{path} is empty (0 bytes), not a GGUF model; re-download it")
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ModelFileError(
            f"{path} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}); "
            "pass a .gguf model file, or re-download it if it should be one"
        )
    try:
        return GGUFFile(path)
    except GGUFFormatError as e:
        raise ModelFileError(
            f"{path} is not a readable GGUF model ({size} bytes; truncated or corrupted: {one_line(e)}); "
            "re-download it"
        ) from e


def load_gguf(path: str | Path, dtype=jnp.float32):
    """Read ``path`` -> ``(graphdef, state, config, tokenizer)``.

    Raises `ModelFileError` (a ``ValueError``) when the file is empty, not GGUF, truncated or corrupted.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    gguf_file = open_gguf(path)
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    arch = str(meta.get("general.architecture", ""))
    rope_factors = None
    if "rope_freqs.weight" in tensors:
        rope_factors = tuple(float(x) for x in gguf_file.dequantize("rope_freqs.weight").ravel())
    config = LlamaConfig.from_gguf_metadata(
        meta, tensor_names=set(tensors), rope_freq_factors=rope_factors, name=path.stem
    )
    tokenizer = Tokenizer.from_gguf_metadata(meta, name=path.stem)

    hf_to_gguf = {}
    for name in tensors:
        hf = gguf_to_hf_name(name)
        if hf is not None:
            hf_to_gguf[hf] = name
    # name what is missing in GGUF terms
    expected_gguf = {v: k for k, v in _GLOBAL_NAMES.items()}
    for i in range(config.num_layers):
        for g, h in _LAYER_NAMES.items():
            expected_gguf[f"model.layers.{i}.{h}"] = f"blk.{i}.{g}"

    permuted = arch in _PERMUTED_ARCHS

    def get_tensor(hf_name: str) -> np.ndarray:
        w = gguf_file.dequantize(hf_to_gguf[hf_name])
        if permuted and (".q_proj." in hf_name):
            w = unpermute_qk(w, config.num_heads)
        elif permuted and (".k_proj." in hf_name):
            w = unpermute_qk(w, config.num_kv_heads)
        return w

    graphdef, state = build_from_hf_tensors(
        config, get_tensor, set(hf_to_gguf), dtype=dtype, source_names=expected_gguf
    )
    return graphdef, state, config, tokenizer
