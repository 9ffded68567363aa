"""A tiny random-weight GQA Llama with the real SmolLM2 tokenizer, in memory or as a HF checkpoint dir.

Workflow and CLI tests run on it: it exercises every code path of the real model in a fraction
of the compile and run time (2 layers, hidden 64).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import LlamaConfig, LoadedModel
from models.llama import Llama
from models.weights import _assignments


@lru_cache(maxsize=1)
def smollm2_tokenizer():
    from models import embedded_gguf_path
    from models.gguf_file import GGUFFile
    from models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(GGUFFile(embedded_gguf_path()).metadata, name="smollm2-tokenizer")


def tiny_config(max_positions: int = 2048) -> LlamaConfig:
    tok = smollm2_tokenizer()
    return LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=max_positions, eos_token_id=tuple(tok.eos_ids), name="tiny-llama",
    )


def tiny_model(seed: int = 0, max_positions: int = 2048) -> LoadedModel:
    cfg = tiny_config(max_positions)
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(model):  # non-trivial norms; larger logits so answers vary
        if isinstance(var, nnx.Param):
            val = var[...]
            var[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(val.shape) if val.ndim == 1 else 3.0 * val, val.dtype)
    graphdef, state = nnx.split(model)
    return LoadedModel(graphdef, state, cfg, smollm2_tokenizer(), source="tiny")


def save_hf_checkpoint(model: LoadedModel, path: Path) -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config, safetensors, tokenizer)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    pure = nnx.to_pure_dict(model.state)
    tensors = {}
    for p, hf_name, transpose in _assignments(cfg):
        node = pure
        for key in p:
            node = node[key]
        arr = np.asarray(node, np.float32)
        tensors[hf_name] = np.ascontiguousarray(arr.T if transpose else arr)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "eos_token_id": list(cfg.eos_token_ids),
    }))
    tok = model.tokenizer
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "eos_token": tok.id_to_token(tok.eos_ids[0]), "add_bos_token": False,
    }))
    return path
