"""Fill a `Llama` from Hugging Face-named numpy tensors (the bonsai pattern).

    abstract = nnx.eval_shape(lambda: Llama(config, ...))   # no memory allocated
    graphdef, state = nnx.split(abstract)
    ... assign every leaf from the checkpoint ...
    model = nnx.merge(graphdef, state)

Tensors use HF names and HF layouts (``[out, in]`` for Linear weights); both loaders
(`load_hf`, `load_gguf`) produce them. Missing tensors raise a ValueError naming them (under the
checkpoint's own names when the caller passes ``source_names``); shapes are checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import LlamaConfig
from .llama import Llama

# (our module path, HF suffix, transpose?) for each per-layer parameter
_LAYER_PARAMS = (
    (("input_layernorm", "weight"), "input_layernorm.weight", False),
    (("post_attention_layernorm", "weight"), "post_attention_layernorm.weight", False),
    (("self_attn", "q_proj", "kernel"), "self_attn.q_proj.weight", True),
    (("self_attn", "k_proj", "kernel"), "self_attn.k_proj.weight", True),
    (("self_attn", "v_proj", "kernel"), "self_attn.v_proj.weight", True),
    (("self_attn", "o_proj", "kernel"), "self_attn.o_proj.weight", True),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", True),
)
_BIAS_PARAMS = (
    (("self_attn", "q_proj", "bias"), "self_attn.q_proj.bias", False),
    (("self_attn", "k_proj", "bias"), "self_attn.k_proj.bias", False),
    (("self_attn", "v_proj", "bias"), "self_attn.v_proj.bias", False),
)


def expected_hf_names(config: LlamaConfig) -> list[str]:
    """Every tensor name a checkpoint of ``config`` must provide (HF naming)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        specs = _LAYER_PARAMS + (_BIAS_PARAMS if config.attention_bias else ())
        names += [f"model.layers.{i}.{suffix}" for _, suffix, _ in specs]
    return names


def _assignments(config: LlamaConfig):
    """(path tuple in the pure state dict, HF name, transpose?) for every parameter."""
    out = [
        (("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
        (("norm", "weight"), "model.norm.weight", False),
    ]
    if not config.tie_word_embeddings:
        out.append((("lm_head", "kernel"), "lm_head.weight", True))
    specs = _LAYER_PARAMS + (_BIAS_PARAMS if config.attention_bias else ())
    for i in range(config.num_layers):
        out += [(("layers", i) + path, f"model.layers.{i}.{suffix}", t) for path, suffix, t in specs]
    return out


def build_from_hf_tensors(
    config: LlamaConfig,
    get_tensor: Callable[[str], np.ndarray] | Mapping[str, np.ndarray],
    available: set[str],
    *,
    dtype=jnp.float32,
    source_names: Mapping[str, str] | None = None,
):
    """Build ``(graphdef, state)`` of a `Llama` from HF-named tensors.

    ``get_tensor(name)`` returns the numpy tensor (called once per name, so loaders can read
    lazily); ``available`` is the set of names present. ``source_names`` maps HF names to the
    checkpoint's own names for error messages.
    """
    if isinstance(get_tensor, Mapping):
        get_tensor = get_tensor.__getitem__
    assignments = _assignments(config)
    missing = [hf for _, hf, _ in assignments if hf not in available]
    if missing:
        shown = [source_names.get(m, m) if source_names else m for m in missing]
        more = f" (+{len(shown) - 20} more)" if len(shown) > 20 else ""
        raise ValueError(f"checkpoint is missing {len(shown)} tensor(s): {', '.join(shown[:20])}{more}")

    abstract = nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    pure = nnx.to_pure_dict(abs_state)
    for path, hf_name, transpose in assignments:
        node = pure
        for key in path[:-1]:
            node = node[key]
        want = node[path[-1]]
        arr = np.asarray(get_tensor(hf_name))
        if transpose:
            arr = arr.T
        if tuple(arr.shape) != tuple(want.shape):
            src = source_names.get(hf_name, hf_name) if source_names else hf_name
            raise ValueError(f"tensor {src} has shape {tuple(arr.shape)}, expected {tuple(want.shape)}")
        node[path[-1]] = jnp.asarray(arr, dtype=want.dtype)
    nnx.replace_by_pure_dict(abs_state, pure)
    model = nnx.merge(graphdef, abs_state)
    return nnx.split(model)
