"""`models.gguf_file` against gguf-py's own reader: the same metadata (values and Python types) and
the same dequantized tensors; malformed bytes raise `GGUFFormatError` naming the place."""

import json
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from _embedded import needs_embedded_model  # tests/ is on sys.path under pytest
from _gguf_write import encode, finish
from models.gguf_file import GGUFFile, GGUFFormatError
from models.load_gguf import open_gguf
from models.model_files import ModelFileError


def _reference_metadata(path):
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, reader


def _write(path, rng, *, alignment=None):
    """A file with every value type, nested arrays, and tensors of several ggml types and shapes."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ✓ " + "x" * int(rng.integers(0, 50)))
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "ü" * 3] + [str(i) for i in range(int(rng.integers(1, 300)))])
    w.add_array("t.ints", [int(x) for x in rng.integers(-(2**31), 2**31 - 1, int(rng.integers(1, 100)))])
    w.add_array("t.floats", [float(x) for x in rng.standard_normal(7)])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    stored = {}
    shapes = {"a": (3, 64), "b": (5, 96), "c": (64,), "d": (2, 3, 32), "e": (4, 256)}
    types = {"a": QT.F32, "b": QT.F16, "c": QT.F32, "d": QT.Q8_0, "e": QT.Q4_1}
    for name, shape in shapes.items():
        data, raw_dtype, _ = encode(rng.standard_normal(shape).astype(np.float32), types[name])
        stored[name] = (shape, types[name])
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    finish(w)
    return stored


@pytest.mark.parametrize("alignment", [None, 64])
def test_matches_gguf_reader(tmp_path, rng, alignment):
    path = tmp_path / "t.gguf"
    stored = _write(path, rng, alignment=alignment)
    f = GGUFFile(path)
    ref, reader = _reference_metadata(path)
    assert f.metadata.keys() == ref.keys() and f.version == 3 and f.data_offset == reader.data_offset
    assert ref.pop("t.nested") == [1, 2, 3]  # gguf-py flattens nested arrays; the file nests them
    for k, v in ref.items():
        assert f.metadata[k] == v and type(f.metadata[k]) is type(v), k
    assert f.metadata["t.nested"] == [[1, 2], [3]] and f.metadata["t.strs"][:3] == ["a", "", "üüü"]
    assert set(f.tensors) == set(stored)
    for t in reader.tensors:
        shape, qt = stored[t.name]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        got = f.dequantize(t.name)
        assert got.dtype == np.float32 and got.shape == shape and f.tensors[t.name].ggml_type == qt
        np.testing.assert_array_equal(got, want)


def _header(n_tensors=0, kvs=b"", n_kv=1, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs


def _key(name):
    return struct.pack("<Q", len(name)) + name.encode()


def test_empty_arrays_and_no_tensors(tmp_path):
    """gguf-py's writer refuses empty arrays; other writers may make them."""
    path = tmp_path / "e.gguf"
    path.write_bytes(_header(n_kv=2, kvs=_key("s") + struct.pack("<IIQ", 9, 8, 0) + _key("n") + struct.pack("<IIQ", 9, 9, 0)))
    f = GGUFFile(path)
    assert f.metadata == {"s": [], "n": []} and f.tensors == {} and f.data_offset == 96  # 74 bytes, aligned to 32


@pytest.mark.parametrize("raw, where", [
    (_header(kvs=_key("k") + struct.pack("<IQ", 8, 2**60)), "value of 'k' at byte 45 needs 1152921504606846976 bytes, the file has 0 left"),
    (_header(kvs=_key("k") + struct.pack("<IIQ", 9, 8, 2**40)), "claims 1099511627776 elements"),
    (_header(kvs=_key("k") + struct.pack("<IIQ", 9, 4, 2**40)), "value of 'k' at byte 49 needs 4398046511104 bytes"),
    (_header(kvs=_key("k") + struct.pack("<I", 13)), "unknown value type 13"),
    (_header(kvs=_key("k") + struct.pack("<II", 9, 13) + struct.pack("<Q", 1)), "unknown element type 13"),
    (_header(kvs=_key("k") + struct.pack("<IQ", 8, 2) + b"\xff\xfe"), "is not UTF-8"),
    (_header(kvs=_key("general.alignment") + struct.pack("<II", 4, 48)), "general.alignment is 48"),
    (_header(version=1), "GGUF version 1 is not supported"),
    (b"GGUF" + struct.pack(">I", 3) + bytes(16), "(a big-endian file)"),
    (_header(n_tensors=1, n_kv=0) + _key("w") + struct.pack("<I", 5), "has 5 dimensions"),
    (_header(n_tensors=1, n_kv=0) + _key("w") + struct.pack("<IQIQ", 1, 64, 0, 0), "tensor 'w' ends at byte 320, the file has 57 bytes"),
    (_header(n_tensors=1, n_kv=0) + _key("w") + struct.pack("<IQIQ", 1, 64, 99, 0), "unknown ggml tensor type 99"),
    (_header(n_tensors=1, n_kv=0) + _key("w") + struct.pack("<IQIQ", 1, 40, 8, 0), "not whole blocks of 32"),
    (_header(n_tensors=2, n_kv=0) + (_key("w") + struct.pack("<IQIQ", 1, 4, 0, 0)) * 2 + bytes(64), "appears twice"),
    (_header(n_kv=0)[:20], "key/value count at byte 16 needs 8 bytes, the file has 4 left"),
])
def test_malformed(tmp_path, raw, where):
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(GGUFFormatError) as e:
        GGUFFile(path)
    assert where in str(e.value)
    with pytest.raises(ModelFileError, match="truncated or corrupted.*re-download it"):
        open_gguf(path)


def test_every_cut_fails_cleanly(tmp_path, rng):
    """Cut anywhere before the last tensor's end, the file fails to open with a format error."""
    path = tmp_path / "t.gguf"
    _write(path, rng)
    raw = path.read_bytes()
    cuts = sorted({4, 8, 23, len(raw) - 1, *rng.integers(5, len(raw) - 1, 40).tolist()})
    for n in cuts:
        path.write_bytes(raw[:n])
        with pytest.raises(GGUFFormatError):
            GGUFFile(path)


@needs_embedded_model
def test_embedded_model_metadata_equals_gguf_reader():
    from models import embedded_gguf_path

    f = GGUFFile(embedded_gguf_path())
    ref, reader = _reference_metadata(embedded_gguf_path())
    assert f.metadata == ref and len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert {t.name: t.data.nbytes for t in reader.tensors} == {n: t.n_bytes for n, t in f.tensors.items()}
    t = reader.tensors[0]
    np.testing.assert_array_equal(f.raw(t.name).ravel(), np.asarray(t.data).view(np.uint8).ravel())


@needs_embedded_model
def test_load_benchmark_writes_json_and_markdown(tmp_path, capsys):
    from benchmarks.gguf_load import main

    assert main(["--reps", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gguf_load.json").read_text())
    assert {"device", "jax", "git_commit", "model", "median_s"} <= res.keys() and res["n_tensors"] == 272
    assert len(res["median_s"]) == 3 and all(v > 0 for v in res["median_s"].values())
    assert (tmp_path / "gguf_load.md").read_text() in capsys.readouterr().out
