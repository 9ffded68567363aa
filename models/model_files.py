"""Errors for model files that exist but cannot be read, and the JSON reader that raises them."""

from __future__ import annotations

import json
from pathlib import Path


class ModelFileError(ValueError):
    """A model file that exists but cannot be read: empty, truncated, corrupted or not in the format
    its name claims. The message is one line that names the file and says what to do (the CLI
    prints it and exits 2)."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """``str(e)`` on one line (whitespace collapsed, at most ``limit`` characters), for error details."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; `ModelFileError` naming the file if it is not one."""
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        problem = f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except UnicodeDecodeError as e:
        problem = f"is not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})"
    else:
        if isinstance(data, dict):
            return data
        problem = f"must hold a JSON object, not a {type(data).__name__}"
    raise ModelFileError(f"{path} {problem}; fix it or re-download the checkpoint")
