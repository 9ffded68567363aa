"""The GPU benchmark script's plumbing, exercised on CPU (``--cpu-smoke``)."""
import json

import pytest

from benchmarks import gpu_kernels


@pytest.mark.bench_smoke
def test_cpu_smoke_writes_json_and_markdown(tmp_path, capsys):
  rc = gpu_kernels.main(["--cpu-smoke", "--out", str(tmp_path)])
  res = json.loads((tmp_path / "gpu_kernels.json").read_text())
  md = (tmp_path / "gpu_kernels.md").read_text()
  assert rc == 0, [c for c in res["checks"] if c["status"] != "PASS"]
  for key in ("device", "jax_version", "git_commit", "dtype", "cases", "checks", "copy_bandwidth"):
    assert key in res
  # --cpu-smoke runs every kind of check of the GPU run (hierarchical, QUEST, SAAP too).
  assert len(res["checks"]) == 21
  assert all(c["status"] == "PASS" for c in res["checks"])
  assert all(c["aligned"] for c in res["checks"] if "aligned" in c) and sum("aligned" in c for c in res["checks"]) == 3
  assert {c["phase"] for c in res["cases"]} == {"decode", "prefill_16"}
  for c in res["cases"]:
    assert not c["errors"], c["errors"]
    for k in ("lookup_ms", "attn_ms", "pipeline_ms", "dense_ms", "ratio"):
      assert c[k] is not None and c[k] > 0, k
  assert res["cases"][0]["attn_tb_per_s"] > 0
  assert "| L | phase |" in md and md in capsys.readouterr().out


def test_no_gpu_is_a_clear_error(tmp_path, capsys):
  assert gpu_kernels.main(["--quick", "--out", str(tmp_path)]) == 2
  assert "no GPU" in capsys.readouterr().err
