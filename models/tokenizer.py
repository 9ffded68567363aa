"""A small tokenizer wrapper: a `tokenizers.Tokenizer` plus BOS/EOS handling and a chat template.

Built either from a Hugging Face checkpoint (``tokenizer.json`` + ``tokenizer_config.json``)
or from GGUF metadata (byte-level BPE from ``tokenizer.ggml.tokens``/``merges``, pre-tokenizer
chosen by ``tokenizer.ggml.pre`` as llama.cpp does). No torch, no transformers needed.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from .model_files import ModelFileError, one_line, read_json_object


class Tokenizer:
    """``encode``/``decode``/``apply_chat_template`` over a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        name: str,
        pad_id: int | None = None,
    ):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.name = name
        self.pad_id = pad_id
        self._compiled_template = None

    def __repr__(self):
        return f"Tokenizer({self.name!r}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_ids})"

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special token (e.g. ``<|im_end|>``)."""
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)

    def has_special_text(self, text: str) -> bool:
        """Whether `text` writes out a special token (which `encode` maps to the token itself)."""
        return any(s in text for s in self.special_texts)

    def encode(self, text: str, add_bos: bool | None = None, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos`` defaults to the model's convention.

        special: special tokens written in the text (e.g. ``<|im_start|>``) map to their ids; False
        tokenizes them as plain text (for user content, which must not open or close a chat turn).
        """
        if special or not self.has_special_text(text):
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            self.backend.encode_special_tokens = True
            try:
                ids = self.backend.encode(text, add_special_tokens=False).ids
            finally:
                self.backend.encode_special_tokens = False
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the model's jinja2 chat template.

        Encode the result with ``add_bos=False``: templates write BOS themselves when they want it.
        """
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        bos = self.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.id_to_token(self.eos_ids[0]) if self.eos_ids else ""
        return self._compiled_template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=bos or "", eos_token=eos or "", **kwargs,
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_dir(cls, path: str | Path, *, name: str | None = None, config: Mapping | None = None) -> "Tokenizer":
        """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json``) in a Hugging Face checkpoint directory."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: sqjax needs the fast-tokenizer file tokenizer.json in the checkpoint"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception that names no file
            raise ModelFileError(f"{tok_file} is not a readable tokenizer ({one_line(e)}); fix it or re-download "
                                 "the checkpoint") from e
        tcfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        config = dict(config or {})

        def tok_id(entry) -> int | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return backend.token_to_id(entry) if isinstance(entry, str) else None

        bos_id = tok_id(tcfg.get("bos_token"))
        if bos_id is None:
            bos_id = gen.get("bos_token_id", config.get("bos_token_id"))
        eos: list[int] = []
        for src in (tok_id(tcfg.get("eos_token")), gen.get("eos_token_id"), config.get("eos_token_id")):
            if src is None:
                continue
            eos.extend(src if isinstance(src, list) else [src])
        if "add_bos_token" in tcfg:
            add_bos = bool(tcfg["add_bos_token"])
        else:  # e.g. Llama-3: the post-processor adds BOS
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        pad_id = tok_id(tcfg.get("pad_token"))
        return cls(backend, bos_id=bos_id, eos_ids=eos, add_bos=add_bos, chat_template=template,
                   name=name or path.name, pad_id=pad_id)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, name: str | None = None) -> "Tokenizer":
        """From GGUF metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges_raw = meta.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        vocab = {t: i for i, t in enumerate(tokens)}
        pre = str(meta.get("tokenizer.ggml.pre") or "default")
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                       ignore_merges=pre in _IGNORE_MERGES)
        )
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
        if specials:
            backend.add_special_tokens(specials)
        if user:
            backend.add_tokens(user)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        eos_ids = [int(x) for x in (eos, eot) if x is not None]
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        pad = meta.get("tokenizer.ggml.padding_token_id")
        return cls(backend, bos_id=None if bos is None else int(bos), eos_ids=eos_ids, add_bos=add_bos,
                   chat_template=meta.get("tokenizer.chat_template"),
                   name=name or str(meta.get("general.name") or "gguf"),
                   pad_id=None if pad is None else int(pad))


# --------------------------------------------------------------------------- helpers
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names -> how the upstream tokenizer.json splits text
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2_LIKE = ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")
_LLAMA3_LIKE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
_QWEN2_LIKE = ("qwen2", "stablelm2", "deepseek-r1-qwen")
_IGNORE_MERGES = _LLAMA3_LIKE


def _gguf_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _GPT2_LIKE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3_LIKE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
    if pre in _QWEN2_LIKE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level])
    warnings.warn(
        f"GGUF pre-tokenizer {pre!r} is not known to sqjax; using the GPT-2 byte-level split "
        f"(tokenization may differ from the original). Known: "
        f"{', '.join(_DIGITS_THEN_GPT2 + _GPT2_LIKE + _LLAMA3_LIKE + _QWEN2_LIKE)}",
        stacklevel=3,
    )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _read_json(path: Path) -> dict:
    return read_json_object(path) if path.is_file() else {}


def _compile_template(source: str):
    """A sandboxed jinja2 template with what HF chat templates use (raise_exception, tojson, ...)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
