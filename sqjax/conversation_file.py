"""A conversation's turns on disk: JSON text, written atomically, read back with every field checked.

    {"format": "sqjax-conversation", "version": 1,
     "document_sha256": "<the FixedContext's doc_sha256>",
     "turns": [["question 1", "answer 1"], ["question 2", "answer 2"], ...]}

Only text: the turns' K/V are not saved. A conversation resumed from the file prefills its turns
again with its first question (`FixedContext.load_conversation`) and keeps their K/V from then on.
The file is pure ASCII (``json.dumps`` escapes the rest), so no locale can garble it. An existing
file is overwritten only if it is a conversation file: another file at the path stays untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

from sqjax.index_io import write_text_atomic

FORMAT = "sqjax-conversation"
VERSION = 1


class ConversationFileError(ValueError):
    """A conversation file that cannot be used (not one, damaged, another version or document)."""


def read_conversation(path, document_sha256: str | None = None) -> list[tuple[str, str]]:
    """The turns [(question, answer), ...] saved in `path`, oldest first. document_sha256: the
    document the conversation must be about (None: any). A missing file raises FileNotFoundError;
    anything else wrong raises `ConversationFileError` saying what to do."""
    path = Path(path)
    if path.is_dir():
        raise ConversationFileError(f"{str(path)!r} is a directory; give a conversation file such as "
                                    f"{str(path / 'chat.json')!r}")
    raw = path.read_bytes()
    try:
        payload = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversationFileError(f"{str(path)!r} is not a sqjax conversation file (not JSON: {e}); "
                                    "give another path, or delete it to start a new conversation there") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ConversationFileError(f"{str(path)!r} is not a sqjax conversation file (no \"format\": \"{FORMAT}\"); "
                                    "give another path, or delete it to start a new conversation there")
    if payload.get("version") != VERSION:
        raise ConversationFileError(f"{str(path)!r} holds conversation format version {payload.get('version')!r}; "
                                    f"this sqjax reads version {VERSION}: use the sqjax that wrote it")
    saved = payload.get("document_sha256")
    if not isinstance(saved, str):
        raise ConversationFileError(f"{str(path)!r} is damaged: its \"document_sha256\" is {saved!r}, not a "
                                    "string; delete it to start a new conversation there")
    if document_sha256 is not None and saved != document_sha256:
        raise ConversationFileError(f"{str(path)!r} holds a conversation about another document (sha256 "
                                    f"{saved[:12]}..., this index's document {document_sha256[:12]}...); give "
                                    "the index it was saved with, or another conversation file")
    turns = payload.get("turns")
    if not isinstance(turns, list) or not all(
            isinstance(t, list) and len(t) == 2 and all(isinstance(s, str) for s in t) for t in turns):
        raise ConversationFileError(f"{str(path)!r} is damaged: \"turns\" must be a list of [question, answer] "
                                    "string pairs; delete it to start a new conversation there")
    return [(q, a) for q, a in turns]


def write_conversation(path, document_sha256: str, turns) -> None:
    """Write turns [(question, answer), ...] about the document with `document_sha256` to `path`,
    atomically; refuses (`ConversationFileError`) to overwrite a file that is not a conversation."""
    path = Path(path)
    if path.exists():
        read_conversation(path)   # raises unless it is a conversation file (of any document)
    payload = {"format": FORMAT, "version": VERSION, "document_sha256": document_sha256,
               "turns": [[q, a] for q, a in turns]}
    write_text_atomic(path, json.dumps(payload, ensure_ascii=True, indent=1) + "\n")
