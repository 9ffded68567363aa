"""Documents for the quality harness: real long text every machine has, and pass-key prompts.

Default documents (all offline):
- plain-text pydoc renderings of standard-library modules (rendered at run time; the Python
  version and each text's sha256 go into the run's config.json, since pydoc output changes
  a little between Python versions);
- excerpts of papers shipped in `benchmarks/data/` (QUEST, SnapKV; the first ~40K characters,
  enough for a 6K-token fixed context and its continuation).

Pass key (Mohtashami & Jaggi 2023 / LongLoRA style): a key of 5 digits hidden at a depth of a
repetitive filler, asked for after the fixed context. SmolLM2's tokenizer splits digits, so
every key has the same token count and every prompt of one length has the same tokens count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pydoc
import random
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"

#: (name, kind, source) of the default documents; pydoc modules need >= ~6.2K SmolLM2 tokens.
DEFAULT_DOCS = (
    ("pydoc:argparse", "pydoc", "argparse"),
    ("pydoc:re", "pydoc", "re"),
    ("pydoc:random", "pydoc", "random"),
    ("paper:quest", "file", "quest_excerpt.txt"),
    ("paper:snapkv", "file", "snapkv_excerpt.txt"),
    ("pydoc:zipfile", "pydoc", "zipfile"),
)

QUESTIONS = {
    "pydoc": "What does the Python module described above provide? Answer in one sentence.",
    "file": "What problem does the paper above address, and what does it propose?",
}


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    text: str
    kind: str = "file"      # "pydoc" | "file"
    source: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def question(self) -> str:
        return QUESTIONS.get(self.kind, QUESTIONS["file"])


def pydoc_document(module: str) -> Document:
    text = pydoc.render_doc(module, renderer=pydoc.plaintext)
    # object reprs carry memory addresses ("<object object at 0x7f...>"): scrub them, or the
    # text (and its tokens) would change from one process to the next
    text = re.sub(r" at 0x[0-9a-fA-F]+>", ">", text)
    return Document(f"pydoc:{module}", text, "pydoc", module)


def file_document(path: str | Path, name: str | None = None) -> Document:
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"document {str(p)!r} is a directory: name its text files (e.g. {p}/*.txt)")
    if not p.is_file():
        raise FileNotFoundError(f"document {str(p)!r} not found")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{p} is not UTF-8 text") from None
    if not text.strip():
        raise ValueError(f"document {p} is empty")
    return Document(name or f"file:{p.name}", text, "file", str(p))


def default_documents(n: int | None = None) -> list[Document]:
    docs = []
    for name, kind, src in DEFAULT_DOCS[:n]:
        if kind == "pydoc":
            docs.append(pydoc_document(src))
        else:
            docs.append(file_document(DATA_DIR / src, name))
    return docs


# ---------------------------------------------------------------------------------------------
# Pass key
# ---------------------------------------------------------------------------------------------

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"


@dataclasses.dataclass(frozen=True)
class PassKeyPrompt:
    text: str
    key: str
    depth: float
    n_filler: int


def passkey_text(n_filler: int, depth: float, key: str) -> str:
    """The intro, `n_filler` filler units with the needle after round(depth * n_filler) of them."""
    at = max(0, min(n_filler, round(depth * n_filler)))
    parts = [PASSKEY_INTRO] + [PASSKEY_FILLER] * at + [PASSKEY_NEEDLE.format(key=key)]
    parts += [PASSKEY_FILLER] * (n_filler - at)
    return " ".join(parts)


def passkey_prompts(target_tokens: int, n_trials: int, count_tokens, seed: int = 0) -> list[PassKeyPrompt]:
    """`n_trials` prompts of about `target_tokens` tokens (counted by `count_tokens(text)`),
    needle depths spread evenly over (0, 1), random 5-digit keys (fixed seed)."""
    unit = count_tokens(passkey_text(101, 0.5, "12345")) - count_tokens(passkey_text(100, 0.5, "12345"))
    base = count_tokens(passkey_text(0, 0.5, "12345"))
    n_filler = max(1, (target_tokens - base) // max(unit, 1))
    rng = random.Random(seed + target_tokens)
    out = []
    for i in range(n_trials):
        depth = (i + 0.5) / n_trials
        key = str(rng.randint(10000, 99999))
        out.append(PassKeyPrompt(passkey_text(n_filler, depth, key), key, depth, n_filler))
    return out
