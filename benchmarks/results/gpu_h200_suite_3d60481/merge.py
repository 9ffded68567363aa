"""Merges the four runs of this folder (the suite's kernel section split by phase and length to fit the
lent machine's 10-minute limit per command; same commit, same keys, each row with its dense baselines
from its own run) into one speed.json / speed.md / Fig. 4 plot. Run from the repository root."""
import json
from pathlib import Path

from benchmarks.speed import plot, to_markdown

HERE = Path(__file__).parent
runs = [json.loads((HERE / n / "speed.json").read_text()) for n in ("decode_a", "decode_b", "prefill_a", "prefill")]
out = dict(runs[0])
out["kernels"] = [r for run in runs for r in run["kernels"]]
out["errors"] = [e for run in runs for e in run.get("errors", [])]
out["seconds"] = sum(run["seconds"] for run in runs)
plan = dict(runs[0]["plan"])
plan["lengths"] = sorted({n for run in runs for n in run["plan"]["lengths"]})
plan["phases"] = sorted({p for run in runs for p in run["plan"]["phases"]})
plan["sparsities"] = sorted({s for run in runs for s in run["plan"]["sparsities"]})
out["plan"] = plan
out["merged_from"] = {n: {"seconds": run["seconds"], "plan": run["plan"]}
                      for n, run in zip(("decode_a", "decode_b", "prefill_a", "prefill"), runs)}
assert len({run["meta"]["git_commit"] for run in runs}) == 1
(HERE / "speed.json").write_text(json.dumps(out, indent=1))
(HERE / "speed.md").write_text(to_markdown(out))
plot(out, HERE / "fig4_latency_vs_sparsity.png")
print(len(out["kernels"]), "rows")
