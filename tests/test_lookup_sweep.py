"""benchmarks/lookup_sweep.py at tiny shapes on CPU (Pallas interpret mode): every config is
checked against the jnp reference and timed; the default and the fastest passing one are named."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench_smoke
def test_lookup_sweep_cpu_smoke(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "benchmarks.lookup_sweep", "--cpu-smoke", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads((tmp_path / "lookup_sweep.json").read_text())
    assert res["meta"]["jax"] and res["meta"]["git_commit"]
    assert len(res["rows"]) == 9 and sum(r["default"] for r in res["rows"]) == 1
    assert any(r["config"]["tile_acc"] for r in res["rows"])
    for row in res["rows"]:
        assert row["pass"] and row["max_rel_err"] < 1e-5 and row["ms"] > 0, row
    assert res["best"]["ms"] == min(r["ms"] for r in res["rows"])
    assert res["speedup_best_vs_default"] >= 1.0
    assert "Fastest passing" in (tmp_path / "lookup_sweep.md").read_text()


@pytest.mark.bench_smoke
def test_lookup_decode_sweep_cpu_smoke(tmp_path):
    """--decode: 1-level and hierarchical decode lookups, each config checked against its reference."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "benchmarks.lookup_sweep", "--decode", "--cpu-smoke", "--out",
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads((tmp_path / "lookup_decode_sweep.json").read_text())
    assert len(res["rows"]) == 3
    for row in res["rows"]:
        assert row["hierarchical_pass"] and row["touched_max_diff"] == 0 and row["hierarchical_ms"] > 0, row
        assert (row["level2_blocks"] > 1) != row.get("one_level_pass", False), row  # 1-level: once per tiling
    assert 0 < res["touched_ref_mean"] < res["level2_rows"]      # level 1 prunes
    assert res["best_ratio"] > 0 and "Fastest 1-level" in (tmp_path / "lookup_decode_sweep.md").read_text()


def test_grid_option_replaces_given_fields_and_names_bad_ones():
    import pytest

    from benchmarks.lookup_sweep import Plan, configs, parse_grid

    grid = parse_grid('{"block_t": [128, 256], "num_warps": 8}', Plan().grid)
    d = dict(grid)
    assert d["block_t"] == (128, 256) and d["num_warps"] == (8,) and d["block_c"] == dict(Plan().grid)["block_c"]
    n_other = 1
    for k, v in d.items():
        n_other *= len(v) if k != "block_t" else 1
    assert len(list(configs(Plan(grid=grid)))) == 2 * n_other
    for bad in ('{"block_q": [1]}', "[1, 2]", "{not json", '{"block_t": []}'):
        with pytest.raises(SystemExit, match="grid"):
            parse_grid(bad, Plan().grid)
