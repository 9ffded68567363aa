"""`benchmarks.cpu_decode` on a tiny checkpoint: a method's two routes beside full attention."""

import json

import pytest
from _tiny_model import save_hf_checkpoint, tiny_model

from benchmarks import cpu_decode
from sqjax import dispatch


@pytest.mark.bench_smoke
def test_cpu_decode_benchmark_writes_both_routes_beside_full_attention(tmp_path):
    ckpt = save_hf_checkpoint(tiny_model(), tmp_path / "ckpt")
    out = tmp_path / "res" / "d.json"
    code = cpu_decode.main(["--model", str(ckpt), "--methods", "squeezed", "--tokens", "3", "--rounds", "1",
                            "--budget", "0.25", "--out", str(out)])
    assert code == 0 and dispatch.CPU_GATHER      # every route gave the mask's tokens; the flag is restored
    res = json.loads(out.read_text())
    assert res["meta"]["device"].startswith("cpu") and res["meta"]["git_commit"]
    rows = res["rows"]
    assert [(r["method"], r["route"], r["label"]) for r in rows] == [
        ("full", "dense", "full"), ("squeezed", "gathered", "squeezed+sink1@0.9"),
        ("squeezed", "mask", "squeezed+sink1@0.9")]
    full = rows[0]
    assert full["kv_budget"] == pytest.approx(1.0)
    for r in rows:
        assert len(r["samples_ms_per_output_token"]) == len(res["questions"]) == 3
        assert r["ms_per_output_token"] > 0 and r["ttft_ms"] > 0 and r["first_ask_s"] > 0
        assert all(len(ids) == 3 for ids in r["token_ids"])
    gathered, mask = rows[1:]
    assert gathered["same_tokens_as_mask"] and gathered["token_ids"] == mask["token_ids"]
    assert gathered["kv_budget"] == pytest.approx(mask["kv_budget"]) and gathered["kv_budget"] < 0.3
    assert gathered["full_over_route"] == pytest.approx(full["ms_per_output_token"] / gathered["ms_per_output_token"])
    md = out.with_suffix(".md").read_text()
    assert "| full | dense | " in md and md.count("| mask |") == 1


def test_cpu_decode_benchmark_rejects_bad_options(capsys):
    assert cpu_decode.main(["--methods", "squeezed,nope"]) == 2
    assert "unknown method(s) nope" in capsys.readouterr().err
    assert cpu_decode.main(["--budget", "0"]) == 2
    assert "0 < --budget <= 1" in capsys.readouterr().err
