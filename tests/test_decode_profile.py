"""benchmarks/decode_profile.py: the whole plumbing at tiny shapes on CPU, and its no-GPU error."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pos(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.bench_smoke
def test_decode_profile_cpu_smoke(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CAPTURED_CONSTANTS_WARN_BYTES="16384",
             XLA_FLAGS="--xla_backend_optimization_level=0")
  r = subprocess.run([sys.executable, "-m", "benchmarks.decode_profile", "--cpu-smoke",
                      "--out", str(tmp_path)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
  assert "constants were captured" not in r.stderr   # big arrays reach every jit as arguments
  res = json.loads((tmp_path / "decode_profile.json").read_text())
  md = (tmp_path / "decode_profile.md").read_text()
  for key in ("device", "jax_version", "git_commit", "dtype", "shapes", "plan", "copy_bandwidth",
              "cases", "errors", "sweep_budget_exhausted", "wall_s"):
    assert key in res, key
  assert res["dtype"] == "bfloat16" and res["mode"] == "cpu-smoke" and not res["errors"]
  assert _pos(res["copy_bandwidth"]["tb_per_s"])
  (case,) = res["cases"]
  assert not case["errors"], case["errors"]
  for piece in ("score", "attend", "merge", "whole", "sum_of_pieces"):
    assert _pos(case["split_ms"][piece]), piece
  for impl in ("xla", "pallas"):                 # cuDNN: GPU only
    assert _pos(case["dense_ms"][impl]) and _pos(case["ratio_dense_over_sparse"][impl])
  assert _pos(case["ratio_best_dense_over_sparse"])
  assert _pos(case["whole_loop_ms"]) and _pos(case["ratio_best_dense_over_sparse_loop"])
  assert all(_pos(t) for t in case["dense_loop_ms"].values()) and case["dense_loop_ms"]
  b = case["bytes"]
  for key in ("centroid_bytes", "kv_rows_bytes", "kv_new_bytes", "logits_bytes_each_way",
              "partials_bytes_each_way", "rows_attended_mean"):
    assert _pos(b[key]), key
  assert 0.05 < b["retrieved_frac"] < 0.2        # 90% sparsity + the exact part
  for piece in ("score", "attend", "merge", "whole"):
    assert _pos(b["bytes"][piece]) and _pos(b["tb_per_s"][piece]) and _pos(b["frac_of_copy"][piece])
  assert b["bytes"]["whole"] == sum(b["bytes"][p] for p in ("score", "attend", "merge"))
  chk = case["check"]
  assert chk["status"] == "PASS" and chk["max_rel_err"] <= 2e-2 and chk["hard_flips"] == 0
  assert len(case["rows_per_kv_head_first_set"]) == res["shapes"]["Hkv"]
  sweep = case["sweep"]
  assert [s["label"] for s in sweep][0] == "default" and len(sweep) == 3
  assert len({s["label"] for s in sweep}) == 3
  for s in sweep:
    assert s["status"] == "PASS", s
    assert _pos(s["ms"]) and s["max_rel_err"] <= 2e-2 and s["hard_flips"] == 0
  assert "sweep_stopped" not in case and not res["sweep_budget_exhausted"]
  assert r.stdout.rstrip().endswith(md.rstrip())  # the markdown is printed last
  assert "## Config sweep, L=512" in md


def test_decode_profile_without_gpu_is_a_clear_error(tmp_path, capsys):
  from benchmarks import decode_profile

  assert decode_profile.main(["--out", str(tmp_path)]) == 2
  assert "no GPU" in capsys.readouterr().err
  assert not (tmp_path / "decode_profile.json").exists()


def test_budget_stops_the_sweep_and_says_so():
  from benchmarks import decode_profile as dp

  plan = dp.Plan(smoke=True, backend="interpret")
  case = {"sweep": [], "split_ms": {}}
  dp.run_sweep(plan, case, {"L": 1}, {}, deadline=0.0, log=lambda m: None)
  assert case["sweep"] == [] and "time budget spent" in case["sweep_stopped"]
  assert len(dp.sweep_configs(plan)) >= 20
  labels = [dp.config_label(c) for c in dp.sweep_configs(plan)]
  assert labels[0] == "default" and len(set(labels)) == len(labels)
