"""Flax NNX Llama-family port, weight loaders (HF safetensors, GGUF), KV cache and generation.

    from models import load_model, generate
    model = load_model("smollm2-135m")
    ids = model.tokenizer.encode(model.chat_prompt("What is the capital of France?"), add_bos=False)
    print(generate(model, ids, 24).text)

The cached forward pass (`forward`) exposes a per-layer attention hook (``attn_fn``), the
integration point for sparse attention methods; see `models.forward`.
"""

from .attention import dense_attention
from .config import Llama3RopeScaling, LlamaConfig
from .forward import forward, forward_jit, forward_new_cache_jit, full_logits
from .generate import Generation, decode_step, generate, left_pad, prefill, sample_logits
from .kv_cache import KVCache
from .model_files import ModelFileError
from .llama import Llama
from .registry import LoadedModel, MissingModelPackageError, embedded_gguf_path, load_model
from .rope import apply_rope, remove_rope, rope_frequencies
from .tokenizer import Tokenizer

__all__ = [
    "LlamaConfig",
    "Llama3RopeScaling",
    "Llama",
    "KVCache",
    "forward",
    "forward_jit",
    "forward_new_cache_jit",
    "full_logits",
    "dense_attention",
    "prefill",
    "decode_step",
    "sample_logits",
    "left_pad",
    "generate",
    "Generation",
    "load_model",
    "LoadedModel",
    "MissingModelPackageError",
    "ModelFileError",
    "embedded_gguf_path",
    "Tokenizer",
    "apply_rope",
    "remove_rope",
    "rope_frequencies",
]
