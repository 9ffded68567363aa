"""Training and held-out documents.

Files given on the command line are read as UTF-8 text, one document each. Without files the
default corpus is offline and deterministic: plain-text `pydoc` renderings of standard-library
modules (``pydoc.render_doc(mod, renderer=pydoc.plaintext)``), with a fixed training list and a
disjoint held-out list (`check_disjoint` also rejects a held-out text identical to a training
one). Lists are ordered; ``--max-docs`` takes a prefix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import pydoc
import re
import warnings
from pathlib import Path

# Long (>= 5K SmolLM2 tokens) renderings first, so a prefix gives full-length prompts. The
# documents of the quality harness (benchmarks/quality_data.py: argparse, re, random, zipfile)
# are never training documents, so SAAP-with-classifier quality numbers stay held-out.
DEFAULT_TRAIN_MODULES = (
    "typing", "os", "socket", "enum", "asyncio", "ssl", "mailbox", "ast", "unittest", "inspect",
    "decimal", "configparser", "xml.dom.minidom", "ipaddress", "smtplib", "calendar", "collections",
    "pathlib", "http.client", "logging", "tarfile", "urllib.request", "imaplib", "sqlite3", "signal",
    "threading", "weakref", "optparse", "doctest", "io", "types", "codecs",
)
DEFAULT_HELDOUT_MODULES = (
    "json", "re", "zipfile", "difflib", "urllib.parse", "email.message", "pdb", "http.server",
    "statistics", "random", "argparse",
)


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def pydoc_document(module: str) -> Document:
    """The module's plain-text pydoc page; object addresses (``<... at 0x7f...>``, which change
    from process to process) are replaced by ``0x0`` so the text is reproducible."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module(module)
        text = pydoc.render_doc(mod, renderer=pydoc.plaintext)
    return Document(f"pydoc:{module}", _ADDRESS.sub("0x0", text))


def file_document(path: str | Path) -> Document:
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"corpus file {p} is a directory: name its text files (e.g. {p}/*.txt)")
    if not p.is_file():
        raise FileNotFoundError(f"corpus file {p} does not exist")
    return Document(str(p), p.read_text(encoding="utf-8", errors="replace"))


def load_documents(files: list[str] | None, default_modules: tuple[str, ...], max_docs: int | None = None) -> list[Document]:
    """Documents from `files`, or the default pydoc modules; at most `max_docs` (a prefix)."""
    if files:
        docs = [file_document(f) for f in files]
    else:
        names = default_modules if max_docs is None else default_modules[:max_docs]
        docs = [pydoc_document(m) for m in names]
    return docs if max_docs is None else docs[:max_docs]


def check_disjoint(train: list[Document], heldout: list[Document]) -> None:
    names = {d.name for d in train} & {d.name for d in heldout}
    digests = {d.digest: d.name for d in train}
    same = [f"{d.name} == {digests[d.digest]}" for d in heldout if d.digest in digests]
    if names or same:
        raise ValueError(f"held-out documents overlap the training corpus: {sorted(names) + same}")
