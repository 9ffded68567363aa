"""`benchmarks.follow_up_quality` (kept vs re-prefilled follow-ups against full attention) on the
tiny model: its per-turn numbers, summary and table."""

import json

from _tiny_model import save_hf_checkpoint, tiny_model

from benchmarks import follow_up_quality


def test_agree_counts_tokens_before_the_first_difference():
    assert follow_up_quality._agree([1, 2, 3], [1, 2, 4]) == 2
    assert follow_up_quality._agree([1, 2], [1, 2, 3]) == 2
    assert follow_up_quality._agree([5], [1]) == 0


def test_follow_up_quality_reports_each_turn(tmp_path):
    ckpt = save_hf_checkpoint(tiny_model(), tmp_path / "ckpt")
    out = tmp_path / "out"
    assert follow_up_quality.main(["--model", str(ckpt), "--docs", "1", "--turns", "2", "--doc-tokens", "300",
                                   "--max-new-tokens", "4", "--out", str(out)]) == 0
    res = json.loads((out / "follow_up_quality.json").read_text())
    (doc,) = res["documents"]
    first, follow = doc["turns"]
    assert first["n_reused_tokens"] == 0 and first["kept_equals_again"]      # nothing to reuse on turn 1
    assert 0 < follow["n_reused_tokens"] < follow["n_prompt_tokens"]
    for t in (first, follow):
        assert 0 <= t["agree_kept"] <= t["n_ref_tokens"] and 0 <= t["agree_again"] <= t["n_ref_tokens"]
        assert t["same_kept"] <= (t["agree_kept"] == t["n_ref_tokens"])
        assert set(t["answers"]) == {"kept", "again", "full"}
    summary = res["follow_ups"]
    assert summary["n"] == 1 and summary["mean_agree_kept"] == follow["agree_kept"]
    assert summary["kept_equals_again"] == int(follow["kept_equals_again"])
    md = (out / "follow_up_quality.md").read_text()
    assert f"| {doc['name']} | 2 | {follow['n_prompt_tokens']} | {follow['n_reused_tokens']} |" in md
