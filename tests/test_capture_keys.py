"""benchmarks.capture_keys: the real-model keys the GPU benchmarks tile (pairing, file, bad input)."""

import numpy as np
import pytest

from benchmarks import capture_keys as ck
from benchmarks.speed import KeySource, Plan
from _embedded import needs_embedded_model  # tests/ is on sys.path under pytest


def test_assemble_keeps_each_query_head_with_its_kv_head():
    rng = np.random.default_rng(0)
    n_layers, t, tq, d = 30, 12, 5, 8
    k = rng.standard_normal((n_layers, 3, t, d))
    v = rng.standard_normal((n_layers, 3, t, d))
    q = rng.standard_normal((n_layers, 9, tq, d))
    kk, vv, qq = ck.assemble(k, v, q, group_src=3)
    assert kk.shape == vv.shape == (8, t, 2 * d) and qq.shape == (32, tq, 2 * d)
    for i, (a, c) in enumerate(ck.head_plan(n_layers, 3, 3)):
        np.testing.assert_array_equal(kk[i], np.concatenate([k[a, c], k[a + 1, c]], -1))
        np.testing.assert_array_equal(vv[i], np.concatenate([v[a, c], v[a + 1, c]], -1))
        for h in range(4 * i, 4 * i + 4):   # the benchmark's query head h reads KV head h // 4
            logits = qq[h] @ kk[i].T
            # = one real query head of each layer against its own KV head (heads 3c..3c+2 share c)
            pairs = [(x, y) for x in range(3 * c, 3 * c + 3) for y in range(3 * c, 3 * c + 3)
                     if np.allclose(qq[h, :, :d], q[a, x]) and np.allclose(qq[h, :, d:], q[a + 1, y])]
            assert len(pairs) == 1
            x, y = pairs[0]
            np.testing.assert_allclose(logits, q[a, x] @ k[a, c].T + q[a + 1, y] @ k[a + 1, c].T, rtol=1e-12)


def test_assemble_rejects_a_model_too_small():
    with pytest.raises(ValueError, match="layers"):
        ck.assemble(np.zeros((10, 3, 4, 8)), np.zeros((10, 3, 4, 8)), np.zeros((10, 9, 2, 8)), group_src=3)
    with pytest.raises(ValueError, match="query heads per KV head"):
        ck.head_plan(30, 3, 2)


@needs_embedded_model
def test_capture_writes_keys_the_benchmarks_read(tmp_path):
    out = tmp_path / "qkv.npz"
    assert ck.main(["--out", str(out), "--tokens", "96", "--queries", "16"]) == 0
    z = np.load(out, allow_pickle=False)
    assert z["k"].shape == z["v"].shape == (8, 96, 128) and z["q"].shape == (32, 16, 128)
    assert all(z[n].dtype == np.float16 and np.isfinite(z[n]).all() for n in ("k", "v", "q"))
    assert [p.name for p in tmp_path.iterdir()] == ["qkv.npz"]     # written atomically, no leftovers
    src = KeySource(str(out), Plan())
    assert src.kind.startswith("captured")
    kk, vv = src.kv(300, seed=0)                                    # tiled past the captured length
    assert kk.shape == (8, 300, 128) and src.queries(4, seed=0).shape == (32, 4, 128)
    with pytest.raises(ValueError, match="must not exceed"):
        ck.capture(n_tokens=16, n_queries=32)
    with pytest.raises(ValueError, match="fewer than"):
        ck.capture(n_tokens=10_000_000, n_queries=16)
