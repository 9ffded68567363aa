"""The on-disk fixed-context index (`.sqx`): one safetensors file, no pickle.

Layout: every array of the index pytree is a safetensors tensor named by its tree path; the
header metadata holds JSON: format name and version, the pytree structure (dicts, lists,
None and an allow-list of our frozen dataclasses with their static fields), the model
fingerprint, the tokenizer id, the method and its parameters, document facts, and a SHA-256
over every tensor's name, dtype, shape and bytes.

Writing is atomic (temp file in the same directory, fsync, `os.replace`): an interrupted save
leaves the previous file (or none) and no partial file under the final name. Loading verifies
format, version, checksum and model fingerprint and says what to do when one does not match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "sqjax-index"
VERSION = 1


class IndexFileError(ValueError):
    """A `.sqx` file that cannot be used (corrupted, another version, another model, ...)."""


def _registered_classes() -> dict:
    from sqjax.methods import ContextData
    from sqjax.squeezed import SqueezedIndex, SqueezedLayerIndex

    return {c.__name__: c for c in (ContextData, SqueezedIndex, SqueezedLayerIndex)}


def _encode(tree, arrays: dict, path: str):
    """Pytree -> JSON structure; arrays collected under their path names."""
    if tree is None:
        return {"t": "none"}
    if isinstance(tree, dict):
        return {"t": "dict", "items": {str(k): _encode(v, arrays, f"{path}/{k}") for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)):
        return {"t": "list" if isinstance(tree, list) else "tuple",
                "items": [_encode(v, arrays, f"{path}/{i}") for i, v in enumerate(tree)]}
    if dataclasses.is_dataclass(tree):
        name = type(tree).__name__
        if name not in _registered_classes():
            raise TypeError(f"cannot serialise dataclass {name}")
        fields, static = {}, {}
        for f in dataclasses.fields(tree):
            val = getattr(tree, f.name)
            if f.metadata.get("static"):
                static[f.name] = val
            else:
                fields[f.name] = _encode(val, arrays, f"{path}/{f.name}")
        return {"t": "dc", "cls": name, "fields": fields, "static": static}
    if isinstance(tree, (int, float, bool, str)) and not hasattr(tree, "shape"):
        return {"t": "scalar", "v": tree}
    arr = np.asarray(tree)
    name = path or "/"
    arrays[name] = arr
    return {"t": "array", "name": name, "dtype": str(arr.dtype), "shape": list(arr.shape)}


def _decode(node, arrays: dict):
    t = node["t"]
    if t == "none":
        return None
    if t == "dict":
        return {k: _decode(v, arrays) for k, v in node["items"].items()}
    if t in ("list", "tuple"):
        items = [_decode(v, arrays) for v in node["items"]]
        return items if t == "list" else tuple(items)
    if t == "dc":
        classes = _registered_classes()
        if node["cls"] not in classes:
            raise IndexFileError(f"unknown structure {node['cls']!r} in index file")
        kwargs = {k: _decode(v, arrays) for k, v in node["fields"].items()}
        kwargs.update(node["static"])
        return classes[node["cls"]](**kwargs)
    if t == "scalar":
        return node["v"]
    if t == "array":
        a = arrays[node["name"]]
        if node["dtype"] == "bfloat16":
            a = a.view(jnp.bfloat16) if a.dtype != jnp.bfloat16 else a
        if "shape" in node:  # safetensors gives 0-d arrays back as [1]
            a = a.reshape(node["shape"])
        return jnp.asarray(a)
    raise IndexFileError(f"unknown node type {t!r} in index file")


def _to_storable(arr: np.ndarray) -> np.ndarray:
    # safetensors' numpy API has no bfloat16: store its bits as uint16 (dtype recorded in the tree)
    return arr.view(np.uint16) if arr.dtype == jnp.bfloat16 else np.ascontiguousarray(arr)


def _checksum(arrays: dict, *texts: str) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _new_file_mode(path: Path) -> int:
    """The permission bits of an overwritten file, else those of a new one (0666 less the umask)."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_atomic(path: str | os.PathLike, write_fn) -> None:
    """Call write_fn(tmp_path) then rename over `path`; nothing partial is left on failure."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"output directory {str(parent)!r} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        try:
            write_fn(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        except Exception as e:  # e.g. a full disk: say which file, and that the old one is intact
            raise OSError(f"could not write {str(path)!r} ({e}); "
                          f"{'it is unchanged' if path.exists() else 'nothing was written'}") from e
        # mkstemp (and writers such as safetensors) make it 0600: give it the mode `open` would
        os.chmod(tmp, _new_file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def check_index_target(path) -> None:
    """`path` may receive an index: not a directory, in a directory that exists, and not a file of
    the user's -- an existing file is overwritten only if it is a sqjax index, or named ``*.sqx``
    (a damaged index is rebuilt in place)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a directory; give a file path such as {str(path / 'doc.sqx')!r}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"output directory {str(parent)!r} does not exist; create it first")
    if path.exists() and path.suffix != ".sqx":
        try:
            read_header(path)
        except (IndexFileError, OSError):
            raise FileExistsError(f"{str(path)!r} exists and is not a sqjax index, so it is not overwritten; "
                                  "delete it or write the index to another path") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`write_atomic` of a text file (JSON, markdown)."""
    write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def write_figure_atomic(fig, path: str | os.PathLike, **savefig_kwargs) -> None:
    """`write_atomic` of a matplotlib figure (``fig.savefig``; the format comes from `path`'s suffix,
    since the temporary file's name ends in .tmp)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    write_atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig_kwargs))


def save_index(path, tree, header: dict) -> None:
    """Write `tree` (the index pytree) and `header` (JSON-able facts) atomically to `path`
    (`check_index_target` first: nothing but an index is ever overwritten)."""
    from safetensors.numpy import save_file

    check_index_target(path)

    arrays: dict = {}
    structure = _encode(jax.device_get(tree), arrays, "")
    stored = {k: _to_storable(np.asarray(v)) for k, v in arrays.items()}
    structure_json, header_json = json.dumps(structure), json.dumps(header)
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "structure": structure_json,
        "header": header_json,
        "sha256": _checksum(stored, structure_json, header_json),
    }
    write_atomic(path, lambda tmp: save_file(stored, tmp, metadata=meta))


def _read(path, with_arrays: bool) -> tuple[dict, dict]:
    """(metadata, arrays) of a `.sqx` file, with the errors a user can act on."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a directory, not an index file; give the .sqx file's path")
    if not path.is_file():
        raise FileNotFoundError(f"index file {str(path)!r} not found; build one with `sqjax index DOC.txt -o {path}`")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()} if with_arrays else {}
    except Exception as e:  # safetensors raises its own types for truncated/garbled headers
        if path.suffix != ".sqx" and _looks_like_text(path):
            raise IndexFileError(f"{path} is a text file, not a sqjax index; index it first: "
                                 f"`sqjax index {path} -o {path.with_suffix('.sqx')}`") from None
        raise IndexFileError(
            f"{path} is not a readable sqjax index (corrupted or truncated: {e}); rebuild it with `sqjax index`"
        ) from None
    return meta, arrays


def _looks_like_text(path: Path) -> bool:
    """Whether the file starts as UTF-8 text (a document given where its index belongs). An index
    starts with its header's length, 8 bytes little-endian: zero bytes for any real header."""
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:   # not merely a character cut at the end of the read
            return False
    return bool(head) and b"\0" not in head


def read_header(path) -> dict:
    """The JSON header of a `.sqx` file (no arrays read, nothing verified but the format)."""
    meta, _ = _read(path, with_arrays=False)
    if meta.get("format") != FORMAT:
        raise IndexFileError(f"{path} is not a sqjax index file; build one with `sqjax index DOC.txt -o {path}`")
    try:
        return json.loads(meta["header"])
    except (KeyError, json.JSONDecodeError):
        raise IndexFileError(f"{path} has a damaged header; rebuild it with `sqjax index`") from None


def load_index(path, expected_fingerprint: str | tuple[str, ...] | None = None) -> tuple[object, dict]:
    """Read and verify a `.sqx` file -> (tree, header).

    expected_fingerprint: the loading model's fingerprint, or every one it answers to (the first
    named in the mismatch message); None skips the check."""
    path = Path(path)
    meta, arrays = _read(path, with_arrays=True)
    if meta.get("format") != FORMAT:
        raise IndexFileError(f"{path} is not a sqjax index file (format {meta.get('format')!r}); build one with "
                             f"`sqjax index DOC.txt -o {path}`")
    if meta.get("version") != str(VERSION):
        raise IndexFileError(
            f"{path} has index format version {meta.get('version')}, this sqjax reads version {VERSION}; "
            "rebuild the index with this version (`sqjax index`)"
        )
    if _checksum(arrays, meta.get("structure", ""), meta.get("header", "")) != meta.get("sha256"):
        raise IndexFileError(f"{path} failed its checksum (the file is corrupted); rebuild it with `sqjax index`")
    try:
        header = json.loads(meta["header"])
        tree = _decode(json.loads(meta["structure"]), arrays)
    except (KeyError, json.JSONDecodeError, TypeError) as e:
        raise IndexFileError(f"{path} has a damaged header ({e}); rebuild it with `sqjax index`") from None
    accepted = (expected_fingerprint,) if isinstance(expected_fingerprint, str) else expected_fingerprint
    if accepted is not None and header.get("model_fingerprint") not in accepted:
        source = f" from {header['model_source']}" if header.get("model_source") else ""
        raise IndexFileError(
            f"{path} was built with another model ({header.get('model_name', '?')}{source}, fingerprint "
            f"{str(header.get('model_fingerprint'))[:12]}…) than this one (fingerprint {accepted[0][:12]}…; the "
            "fingerprint covers the config and the weights' contents); load it with that model or rebuild the index"
        )
    return tree, header
