"""The README's main job, `sqjax demo`, on the embedded SmolLM2 (one question, a few tokens)."""

import json
import os
import subprocess
import sys

import pytest
from _embedded import needs_embedded_model  # tests/ is on sys.path under pytest

from sqjax.cli import DEMO_QUESTIONS, main


@needs_embedded_model
@pytest.mark.slow
def test_demo_answers_with_squeezed_and_full_attention(tmp_path):
    """As a user runs it: its own process, XLA's default optimisation level (the suite's level 0
    makes the 6K-token prefill ~40% slower), a fresh compilation cache (not the user's)."""
    env = dict(os.environ, SQJAX_CACHE_DIR=str(tmp_path / "xla"))
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    done = subprocess.run([sys.executable, "-m", "sqjax.cli", "demo", "--questions", "1", "--max-new-tokens", "4",
                           "--json"], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["method"] == "squeezed+sink1@0.9" and 5000 < out["document_tokens"] <= 8192 - 256
    (row,) = out["answers"]
    assert row["question"] == DEMO_QUESTIONS[0]
    # Squeezed at 90% with 5% centroids reads ~0.125 of the document's K/V (+ the sink); full reads all
    assert 0.10 < row["squeezed_stats"]["kv_budget"] < 0.16 and row["full_stats"]["kv_budget"] == 1.0
    assert row["squeezed_stats"]["n_new_tokens"] == row["full_stats"]["n_new_tokens"] == 4
    assert row["full"].startswith("The json") and row["squeezed"].strip()
    assert 0.0 <= row["token_agreement"] <= 1.0


@pytest.mark.parametrize("argv,message", [(("--questions", "0"), "--questions must lie in [1, 3]"),
                                          (("--questions", "4"), "--questions must lie in [1, 3]"),
                                          (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1")])
def test_demo_options_are_checked_before_the_model_loads(capsys, argv, message):
    code = main(["demo", "--model", "nowhere", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("sqjax: error: ")
