"""Model configuration for the Llama family (Llama-2/3/3.1, SmolLM2, Qwen2-style QKV bias).

`LlamaConfig` is a frozen, validated dataclass. Build it from a Hugging Face ``config.json``
dict (`LlamaConfig.from_hf_config`) or from GGUF metadata (`LlamaConfig.from_gguf_metadata`).
Architectures outside the supported set fail with a ValueError naming them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

# HF `model_type` / `architectures[0]` and GGUF `general.architecture` values we can run.
SUPPORTED_HF_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
# Attention-bias (Qwen2) architectures: q/k/v projections carry a bias, o_proj does not.
_BIAS_ARCHITECTURES = ("qwen2",)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 RoPE frequency scaling (HF ``rope_type: "llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"llama3 rope scaling factor must be > 0, got {self.factor}")
        if not (0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(
                "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor}, {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError("original_max_position_embeddings must be > 0")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder.

    ``rope_freq_factors`` (optional, length head_dim/2) are per-frequency divisors as GGUF files
    store them (``rope_freqs.weight``, llama.cpp's way of writing llama3 scaling); when given
    they are used instead of ``rope_scaling``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    name: str = "llama"
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"rope_scaling must be None or Llama3RopeScaling, got {self.rope_scaling!r}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.rope_freq_factors is not None:
            factors = tuple(float(f) for f in self.rope_freq_factors)
            if len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors):
                raise ValueError(
                    f"rope_freq_factors must be {self.head_dim // 2} positive numbers, got {len(factors)}"
                )
            object.__setattr__(self, "rope_freq_factors", factors)

    # ------------------------------------------------------------------ derived
    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size g = Hq / Hkv)."""
        return self.num_heads // self.num_kv_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): stable input for fingerprints."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Inverse of `to_dict`."""
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = Llama3RopeScaling(**d["rope_scaling"])
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**d)

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], *, name: str | None = None) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dict (LlamaForCausalLM, Qwen2ForCausalLM, Mistral)."""
        model_type = str(cfg.get("model_type") or "").lower()
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_HF_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type or archs!r} (model_type={model_type!r}, "
                f"architectures={archs}); supported model types: {', '.join(SUPPORTED_HF_MODEL_TYPES)}"
            )
        if model_type == "mistral" and cfg.get("sliding_window") not in (None, 0):
            raise ValueError(
                f"unsupported architecture: mistral with sliding_window={cfg['sliding_window']} "
                "(only full attention is implemented)"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
        rope_params = cfg.get("rope_parameters") or {}
        theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling_dict = cfg.get("rope_scaling") or (rope_params if rope_params else None)
        rope_scaling = _parse_hf_rope_scaling(scaling_dict)
        tie_default = False  # LlamaConfig, Qwen2Config and MistralConfig all default to untied
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if model_type == "qwen2" else 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            attention_bias=bool(cfg.get("attention_bias", model_type in _BIAS_ARCHITECTURES)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=_as_eos(cfg.get("eos_token_id")),
            name=name or str(cfg.get("_name_or_path") or model_type),
        )

    # ------------------------------------------------------------------ GGUF
    @classmethod
    def from_gguf_metadata(
        cls,
        meta: Mapping[str, Any],
        *,
        tensor_names: set[str] | None = None,
        rope_freq_factors: tuple[float, ...] | None = None,
        name: str | None = None,
    ) -> "LlamaConfig":
        """From GGUF key/value metadata (already decoded to Python values).

        ``tensor_names`` (optional) decides ``tie_word_embeddings`` (no ``output.weight``) and
        ``attention_bias`` (``blk.0.attn_q.bias`` present).
        """
        arch = str(meta.get("general.architecture", "")).lower()
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in GGUF; supported: "
                f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

        def get(key, default=None, required=False):
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if required:
                raise ValueError(f"GGUF metadata is missing {full!r}")
            return default

        hidden = int(get("embedding_length", required=True))
        heads = int(get("attention.head_count", required=True))
        kv_heads = get("attention.head_count_kv", heads)
        head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or hidden // heads)
        if int(get("rope.dimension_count", head_dim)) != head_dim:
            raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
        scaling_type = str(get("rope.scaling.type", "none") or "none").lower()
        if scaling_type not in ("none", ""):
            raise ValueError(
                f"unsupported GGUF rope scaling {scaling_type!r}; supported: none, or llama3 factors "
                "stored as the rope_freqs tensor"
            )
        vocab = get("vocab_size")
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
            vocab = len(tokens)
        tie = True
        bias = arch in _BIAS_ARCHITECTURES
        if tensor_names is not None:
            tie = "output.weight" not in tensor_names
            bias = "blk.0.attn_q.bias" in tensor_names
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=None,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=tie,
            max_position_embeddings=int(get("context_length", 4096)),
            attention_bias=bias,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            name=name or str(meta.get("general.name") or arch),
            rope_freq_factors=rope_freq_factors,
        )


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


def _as_eos(x):
    if isinstance(x, list):
        return tuple(int(i) for i in x)
    return x


def _parse_hf_rope_scaling(d: Mapping[str, Any] | None) -> Llama3RopeScaling | None:
    if not d:
        return None
    kind = str(d.get("rope_type") or d.get("type") or "default").lower()
    if kind == "default":
        return None
    if kind == "llama3":
        return Llama3RopeScaling(
            factor=float(d["factor"]),
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default (none), llama3")
