"""benchmarks/speed.py (``sqjax bench``) end to end at tiny shapes on CPU: the decode rows of every
method with their per-call and device-loop timings, dense baselines from the same run, and no
big array captured as a compile-time constant (the GPU run would embed gigabytes)."""

import dataclasses
import json
import os

import numpy as np
import pytest
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.speed import _ASK_TIMED_CALLS

ROOT = Path(__file__).resolve().parents[1]


def _kernel_rows_smoke(tmp_path, phase: str) -> dict:
    """`benchmarks.speed --cpu-smoke` for one phase's kernel rows (4/2 heads, 90%) -> its JSON; it must
    capture no big array as a compile-time constant."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CAPTURED_CONSTANTS_WARN_BYTES="65536")
    r = subprocess.run([sys.executable, "-m", "benchmarks.speed", "--cpu-smoke", "--only-kernels", "--phases",
                        phase, "--shapes", "4x2", "--sparsities", "0.9", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "constants were captured" not in r.stderr
    return json.loads((tmp_path / "speed.json").read_text())


@pytest.mark.bench_smoke
def test_speed_decode_rows_cpu_smoke(tmp_path):
    res = _kernel_rows_smoke(tmp_path, "decode")
    for key in ("meta", "plan", "kernels"):
        assert key in res
    for k in ("device", "jax", "git_commit"):
        assert res["meta"][k]
    rows = [x for x in res["kernels"] if "method" in x]
    assert {x["method"] for x in rows} == {"squeezed", "hsqueezed", "quest", "saap"}
    for x in rows:
        assert "error" not in x, x.get("error")
        assert x["total_ms"] > 0 and x["total_loop_ms"] > 0 and 0 < x["retrieved_frac"] <= 1
        assert x["dense_ms"] and x["dense_loop_ms"]
        assert x["speedup_vs_best_dense_loop"] == min(x["dense_loop_ms"].values()) / x["total_loop_ms"]
        assert x["total_unrolled_ms"] > 0 and x["dense_unrolled_ms"]
        assert x["speedup_vs_best_dense_unrolled"] == min(x["dense_unrolled_ms"].values()) / x["total_unrolled_ms"]
    # the 1-level row again at the threshold calibrated on single queries (decode's own scores)
    dc = [x for x in rows if x.get("decode_calibrated")]
    assert len(dc) == 1 and dc[0]["method"] == "squeezed" and "single queries" in dc[0]["budget"]
    assert np.isfinite(dc[0]["threshold"]) and np.isfinite(dc[0]["threshold_app_c"])
    md = (tmp_path / "speed.md").read_text()
    assert "device time per call" in md and "T calibrated on single queries" in md
    # the kernel-trace table (GPU only: a CPU trace has no device plane) renders from the row fields
    from benchmarks.speed import to_markdown

    row = next(x for x in rows if x["method"] == "squeezed")
    row.update(kernel_busy_ms=0.05, lookup_kernel_busy_ms=0.01, kernels=[{"name": "clustered_attention", "ms_per_call": 0.03, "per_call": 1.0}],
               dense_kernel_busy_ms={"cudnn": 0.15, "pallas": 0.16})
    md = to_markdown(res)
    assert "kernel time per call" in md and "| 3.00× |" in md and "`clustered_attention` 0.0300" in md
    # bytes / kernel busy time, and its fraction of the datasheet bandwidth floor where the device is known
    from benchmarks._meta import hbm_peak_tbps

    assert [hbm_peak_tbps(f"gpu:NVIDIA {n}") for n in ("H200", "H100 80GB HBM3", "H100 PCIe")] == [4.8, 3.35, 2.0]
    assert hbm_peak_tbps("cpu:cpu") is None and "| 4.80 |" not in md
    res["meta"]["device"] = "gpu:NVIDIA H200"
    row["bytes"] = 1.2e8  # in 0.05 ms: 2.40 TB/s, half of the H200's 4.8
    assert "| 2.40 (50%) |" in to_markdown(res)
    # the prefill device-time table carries the steady-state column (GPU runs fill it)
    res["kernels"].append({**row, "phase": "prefill_1k", "total_steady_ms": 2.0, "dense_steady_ms": {"cudnn": 9.0},
                           "speedup_vs_best_dense_steady": 4.5})
    assert "| 2.000 | 9.000 | 4.50× |" in to_markdown(res)


def test_time_ms_steady_is_the_cost_of_one_more_call(monkeypatch):
    """(T(2n) - T(n)) / n: on a clock where each call costs 3 ms and each batch's final sync 2 ms
    (a fixed cost the difference cancels), every sample is 3 ms. (A real sleep on the loaded 2-core CI
    machine made this a timing test: 2.43 ms once.)"""
    import types

    import jax.numpy as jnp

    from benchmarks import _meta

    now = [0.0]

    def call(a):
        now[0] += 0.003
        return a

    def sync(x):
        now[0] += 0.002
        return x

    monkeypatch.setattr(_meta, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(_meta.jax, "block_until_ready", sync)
    x = jnp.ones(3)
    assert _meta.time_ms_steady(call, [(x,)], n=4, reps=3) == pytest.approx(3.0)
    assert _meta.time_ms(call, [(x,)], reps=3, inner=4) == pytest.approx(3.5)   # the sync charged to 4 calls


def test_time_ms_looped_folds():
    """Both folds time a real loop; an unknown fold is refused by name."""
    import jax.numpy as jnp
    import pytest

    from benchmarks._meta import looped_program, time_ms_looped

    qs = [jnp.full((2, 3), float(i)) for i in range(3)]
    for fold in ("sum", "add"):
        assert time_ms_looped(lambda q: q * 2.0, qs, n_iter=5, reps=2, fold=fold) > 0
    # 5 calls over queries 0, 1, 2, 0, 1 -> each entry of the carried array is 2 * 4
    assert float(looped_program(lambda q: q * 2.0, 3, n_iter=5, fold="add")(jnp.stack(qs), ())[0, 0]) == 8.0
    with pytest.raises(ValueError, match="fold"):
        looped_program(lambda q: q, 3, n_iter=5, fold="mean")


@pytest.mark.bench_smoke
def test_speed_prefill_rows_take_the_clustered_route(tmp_path):
    """The Squeezed prefill rows time the route FixedContext's question prefill takes on a GPU (the
    lookup kernels, then the selected clusters' rows of the cluster-contiguous copy), checked against
    the library route (`Method.select` -> `dispatch.attention`), which the row times too."""
    rows = [x for x in _kernel_rows_smoke(tmp_path, "prefill")["kernels"] if "method" in x]
    assert {x["method"] for x in rows} == {"squeezed", "hsqueezed"} and {x["phase"] for x in rows} == {"prefill_32"}
    for x in rows:
        assert "error" not in x, x.get("error")
        assert "lookup kernels + the selected clusters' rows gathered + cuDNN" in x["path"]
        assert x["total_ms"] > 0 and x["generic_total_ms"] > 0 and x["total_loop_ms"] > 0
        # bf16 outputs of the same selection; where the library's capacity overflowed it dropped clusters
        # that the clustered route (no capacity) attends, so only the rows without overflow must agree
        assert x["rel_diff_vs_library"] < 2e-2 or x["overflow_heads"] > 0
    assert any(x["overflow_heads"] == 0 for x in rows)


@pytest.mark.bench_smoke
def test_speed_end_to_end_cpu_smoke(tmp_path):
    """The end-to-end section: synced and pipelined decode of every variant, speed-ups, the table."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "benchmarks.speed", "--cpu-smoke", "--skip", "offline,kernels",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    e2e = json.loads((tmp_path / "speed.json").read_text())["e2e"]
    for name in ("squeezed", "full", "full-xla", "no-attention"):
        row = e2e[name]
        assert "error" not in row, row
        assert row["ms_per_token"] > 0 and row["ms_per_token_pipelined"] > 0
        assert row["tokens_per_s_pipelined"] == 1e3 / row["ms_per_token_pipelined"]
        assert row["ms_per_token_pipelined_stable"] > 0 and row["host_dispatch_stable_ms"] > 0
    assert e2e["decode_speedup_pipelined"] == (e2e["squeezed"]["tokens_per_s_pipelined"]
                                               / e2e["full"]["tokens_per_s_pipelined"])
    assert e2e["decode_speedup_pipelined_stable"] == (e2e["squeezed"]["tokens_per_s_pipelined_stable"]
                                                      / e2e["full"]["tokens_per_s_pipelined_stable"])
    assert "ms / token pipelined" in (tmp_path / "speed.md").read_text()
    assert "ms / token stable" in (tmp_path / "speed.md").read_text()
    ask = e2e["ask"]   # FixedContext.ask on the same model and context
    for name in ("squeezed", "full"):
        row = ask[name]
        assert "error" not in row, row
        assert row["n_new_tokens"] == 3 and row["n_prompt_tokens"] > 0 and row["ms_per_token"] > 0
        assert row["tokens_per_s"] == pytest.approx(1e3 / row["ms_per_token"]) and row["ask_s"] >= row["ttft_s"] > 0
        assert 0 < row["accounting_s"] + row["stats_s"] < row["after_last_token_s"] < row["ask_s"]   # the stats come last
        assert row["question_prefill_s"]["with_captures"] > 0 and row["question_prefill_s"]["without_captures"] > 0
        # medians over the timed calls (the first, compiling, call is left out); every call kept
        assert len(row["ttft_s_calls"]) == len(row["ms_per_token_calls"]) == _ASK_TIMED_CALLS == 5
        assert row["ttft_s"] == pytest.approx(float(np.median(row["ttft_s_calls"])))
        assert row["ms_per_token"] == pytest.approx(float(np.median(row["ms_per_token_calls"])))
        stages = row["question_prefill_s"]["ask_stages"]
        assert set(stages) == {"forward_with_captures", "first_token"} and min(stages.values()) > 0
    assert ask["full"]["kv_budget"] == 1.0 and 0 < ask["squeezed"]["kv_budget"] < 1.0
    assert ask["speedup"] == ask["squeezed"]["tokens_per_s"] / ask["full"]["tokens_per_s"]
    assert "`FixedContext.ask` on the same model" in (tmp_path / "speed.md").read_text()
    for name in ("squeezed", "full"):   # ask_many with 2 questions over the same context
        b = ask[name]["batches"]["2"]
        assert "error" not in b, b
        assert b["rows"] == 2 and b["n_new_tokens"] == 3 and len(b["ms_per_step_calls"]) == _ASK_TIMED_CALLS
        assert b["tokens_per_s"] == pytest.approx(2e3 / b["ms_per_step"]) and b["ask_many_s"] >= b["ttft_s"] > 0
        assert len(b["kv_budget_rows"]) == 2 and 0 < b["accounting_s"] + b["stats_s"] < b["after_last_token_s"] < b["ask_many_s"]
    assert ask["batch_speedup"]["2"] == ask["squeezed"]["batches"]["2"]["tokens_per_s"] / ask["full"]["batches"]["2"]["tokens_per_s"]
    assert "| squeezed | 2 |" in (tmp_path / "speed.md").read_text()
    sq = ask["squeezed"]
    assert f"{1e3 * sq['ask_s']:.1f} ({1e3 * sq['after_last_token_s']:.1f} / {1e3 * sq['accounting_s']:.1f})" in \
        (tmp_path / "speed.md").read_text()
    for name in ("squeezed", "full"):   # a longer question's time to first token (the CPU plan's 40 tokens)
        t = ask[name]["ttft_by_question_tokens"]["40"]
        assert "error" not in t, t
        assert t["n_prompt_tokens"] == 40 and t["ttft_s"] > 0 and len(t["ttft_s_calls"]) == _ASK_TIMED_CALLS
    assert "| squeezed | 40 |" in (tmp_path / "speed.md").read_text()
    for name in ("squeezed", "full"):   # a follow-up after a ~48-token first turn: turns' K/V kept or prefilled again
        t = ask[name]["ttft_follow_up"]["48"]
        assert "error" not in t, t
        assert 0 < t["n_reused_tokens"] < t["n_prompt_tokens"] and len(t["ttft_kept_s_calls"]) == _ASK_TIMED_CALLS
        assert all(0 < n < t["n_prompt_tokens"] for n in t["n_reused_tokens_calls"])   # the first follow-up too
        assert t["ttft_kept_s"] == pytest.approx(float(np.median(t["ttft_kept_s_calls"])))
        assert t["kept_speedup"] == pytest.approx(t["ttft_again_s"] / t["ttft_kept_s"])
    assert f"| squeezed | {ask['squeezed']['ttft_follow_up']['48']['n_prompt_tokens']} |" in (tmp_path / "speed.md").read_text()


def test_stable_step_matches_forward_and_reuses_its_buffers():
    """The e2e section's stable-buffer step: the same greedy token as `forward_jit` + argmax, the
    position advanced by one, and token / position / cache donated (consumed by the call)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.speed import _stable_step_jit
    from models import LlamaConfig
    from models.forward import forward_jit
    from models.kv_cache import KVCache
    from models.llama import Llama

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, max_position_embeddings=64, eos_token_id=2, name="tiny")
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(3)))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 61, size=(1, 6)), jnp.int32)
    _, cache, _ = forward_jit(graphdef, state, ids, jnp.arange(6, dtype=jnp.int32)[None], KVCache.init(cfg, 1, 16))
    ref_cache = jax.tree.map(jnp.copy, cache)
    tok, pos = jnp.asarray([[7]], jnp.int32), jnp.asarray([[6]], jnp.int32)
    ref_lg, ref_cache, _ = forward_jit(graphdef, state, tok, pos, ref_cache, logits="last")
    nxt, pos2, cache2 = _stable_step_jit(graphdef, state, tok, pos, cache, None, attn_fn=None)
    assert nxt.shape == (1, 1) and int(nxt[0, 0]) == int(jnp.argmax(ref_lg[0, -1]))
    assert int(pos2[0, 0]) == 7
    np.testing.assert_array_equal(np.asarray(cache2.stacked()[0]), np.asarray(ref_cache.stacked()[0]))
    assert int(cache2.length[0]) == 7
    assert tok.is_deleted() and pos.is_deleted()     # donated: the next step reuses their buffers


def test_phase_thresholds_keep_the_nominal_fraction():
    """Thresholds calibrated on blocks of the phase's size keep ~1 - sparsity of the keys on those
    blocks (one and two levels), and the level-1 threshold rules out `level1_prune` of them."""
    import jax
    import jax.numpy as jnp

    from benchmarks.speed import phase_thresholds
    from sqjax import squeezed
    from sqjax.calibration import key_scores
    from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed

    rng = np.random.default_rng(5)
    hkv, hq, length, d = 2, 4, 3000, 16
    k = jnp.asarray(rng.normal(size=(1, hkv, length, d)), jnp.float32)
    q_obs = jnp.asarray(rng.normal(size=(1, hq, 100, d)), jnp.float32)
    data = ContextData(k, k, q_obs, k_pre=k, scale=1.0 / np.sqrt(d))
    methods = (Squeezed(sparsity=0.8), HierarchicalSqueezed(sparsity=0.8, level1_prune=0.5),
               HierarchicalSqueezed(sparsity=0.8, level1_prune=0.5, lookup_int8=True))   # int8 block scores
    for method in methods:
        index = method.build(data)[0]
        li = index.layer(0)
        i8 = method.lookup_int8
        for t in ((64,) if i8 else (1, 64)):
            blocks = [jnp.asarray(rng.normal(size=(hq, t, d)), jnp.float32) for _ in range(6)]
            thr, thr1 = phase_thresholds(index, blocks, 1.0 / np.sqrt(d), "kv", 0.8, "reference",
                                         getattr(method, "level1_prune", None), i8)
            kept = [np.asarray(key_scores(squeezed.layer_scores(li, b, jnp.float32(thr1), 1.0 / np.sqrt(d), "kv",
                                                                int8=i8)[0], li.labels) > thr).mean() for b in blocks]
            assert abs(np.mean(kept) - 0.2) < 0.01, (method.name, t, kept)
            if li.centroids1.shape[-2]:
                s1 = [squeezed.cluster_scores(b, li.centroids1, li.counts1, 1.0 / np.sqrt(d), "kv", int8=i8)
                      for b in blocks]
                ruled_out = [np.asarray(key_scores(jnp.take_along_axis(s, li.parent, axis=-1), li.labels) <= thr1).mean()
                             for s in s1]
                assert abs(np.mean(ruled_out) - 0.5) < 0.01
            else:
                assert thr1 == float(index.threshold1) == 0.0
    jax.clear_caches()


def _run(commit, lengths, phases, rows, seconds, **sections):
    return {"meta": {"git_commit": commit, "device": "gpu:test", "jax": "0.11.2"},
            "plan": {"lengths": lengths, "sparsities": [0.9], "phases": phases, "shapes": [[32, 8]], "d": 128,
                     "hq": 32, "hkv": 8},
            "keys": "test", "kernels": rows, "errors": [f"{phases[0]} error"], "seconds": seconds, **sections}


def test_merge_runs_joins_split_runs_of_one_commit(tmp_path):
    """A suite split by phase/length (a machine's time limit) merges into one result: rows and errors
    concatenated in order, plan axes united, seconds summed, each run's plan kept; the e2e section comes
    from the one run that has it; runs of two commits or a section twice are refused."""
    from benchmarks.speed import main, merge_runs

    a = _run("abc", [32768, 131072], ["decode"], [{"L": 32768, "tag": 1}, {"L": 131072, "tag": 2}], 10.0)
    b = _run("abc", [524288], ["prefill"], [{"L": 524288, "tag": 3}], 5.0, e2e={"speedup": 1.5})
    m = merge_runs([a, b], ["a", "b"])
    assert [r["tag"] for r in m["kernels"]] == [1, 2, 3]
    assert m["plan"]["lengths"] == [32768, 131072, 524288] and m["plan"]["phases"] == ["decode", "prefill"]
    assert m["plan"]["shapes"] == [[32, 8]] and m["seconds"] == 15.0
    assert m["errors"] == ["decode error", "prefill error"] and m["e2e"] == {"speedup": 1.5}
    assert m["merged_from"]["b"]["plan"]["lengths"] == [524288] and m["meta"]["git_commit"] == "abc"
    with pytest.raises(ValueError, match="different commits"):
        merge_runs([a, _run("def", [1], ["decode"], [], 1.0)], ["a", "c"])
    with pytest.raises(ValueError, match="e2e section is in more than one run"):
        merge_runs([b, b], ["b1", "b2"])
    i8 = _run("abc", [524288], ["prefill"], [], 1.0)
    i8["plan"]["lookup_int8"] = True
    with pytest.raises(ValueError, match="different lookup_int8"):
        merge_runs([a, i8], ["a", "int8"])
    # a length one run's deadline cut and another run measured is not reported as not run; one that
    # no run measured still is; the kernel axes come from the runs that swept kernels
    cut = _run("abc", [32768, 131072], ["prefill"],
               [{"L": 32768, "Hq": 32, "Hkv": 8, "method": "squeezed", "tag": 4},
                {"L": 131072, "Hq": 32, "Hkv": 8, "method": "", "error": "not run: deadline", "tag": 5},
                {"L": 524288, "Hq": 32, "Hkv": 8, "method": "", "error": "not run: deadline", "tag": 6}], 1.0)
    later = _run("abc", [131072], ["prefill"], [{"L": 131072, "Hq": 32, "Hkv": 8, "method": "squeezed", "tag": 7}], 1.0)
    offline = _run("abc", [1, 2], ["decode"], [], 1.0, offline={"seconds": 3.0})
    m = merge_runs([cut, later, offline], ["cut", "later", "offline"])
    assert [r["tag"] for r in m["kernels"]] == [4, 6, 7]
    assert m["plan"]["lengths"] == [32768, 131072] and m["plan"]["phases"] == ["prefill"]
    # the command line: reads each --out directory, writes the merged files, measures nothing
    for name, run in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "speed.json").write_text(json.dumps(run))
    assert main(["--merge", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "speed.json").read_text())
    assert [r["tag"] for r in merged["kernels"]] == [1, 2, 3] and (tmp_path / "m" / "speed.md").is_file()
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--merge", str(tmp_path / "missing"), "--out", str(tmp_path / "m2")])


def test_offline_section_times_the_decode_calibration_too():
    """The offline section builds 1-level and hierarchical indexes with App. C's calibration and
    with decode thresholds, records what each keeps on its calibration queries, and tabulates it."""
    from benchmarks.speed import KeySource, cpu_plan, offline_cost, to_markdown

    plan = dataclasses.replace(cpu_plan(), backend="reference")
    off = offline_cost(plan, KeySource(None, plan), log=lambda *a: None)
    for name in ("squeezed", "hsqueezed", "squeezed_token", "hsqueezed_token"):
        assert off[f"{name}_seconds"] > 0 and off[f"{name}_seconds_warm"] > 0
        assert 0 < off[f"{name}_calibrated_kept"] < 0.3
    for name in ("squeezed_token", "hsqueezed_token"):
        # the same clusters and App. C threshold; the decode pair keeps ~1 - sparsity of single queries
        assert off[f"{name}_threshold"] == off[name.replace("_token", "") + "_threshold"]
        assert abs(off[f"{name}_decode_kept"] - 0.1) < 0.02 and off[f"{name}_decode_queries"] == 100
        assert 0 < off[f"{name}_decode_kept_app_c"] < 1
    res = {"plan": dataclasses.asdict(plan), "meta": {"device": "cpu", "jax": "x", "git_commit": "c"},
           "keys": "gaussian", "offline": {k: v for k, v in off.items() if not k.endswith("_index") and k != "data"}}
    md = to_markdown(res)
    assert "With decode thresholds" in md and "| hsqueezed |" in md


def test_offline_section_stops_at_its_deadline_and_saves_each_build():
    """Builds not started by the deadline are listed as not run (and said so in the markdown);
    every finished build is handed to ``on_build`` at once, so a killed run keeps it."""
    from benchmarks.speed import KeySource, cpu_plan, offline_cost, to_markdown

    plan = dataclasses.replace(cpu_plan(), backend="reference", offline_token=False)
    seen = []
    t0 = time.perf_counter()
    off = offline_cost(plan, KeySource(None, plan), log=lambda *a: None, deadline=t0 + 1e9,
                       on_build=lambda o: seen.append(sorted(k for k in o if k.endswith("_seconds_warm"))))
    assert seen == [["squeezed_seconds_warm"], ["hsqueezed_seconds_warm", "squeezed_seconds_warm"]]
    assert "not_run" not in off
    late = offline_cost(plan, KeySource(None, plan), log=lambda *a: None, deadline=time.perf_counter() - 1)
    assert late["not_run"] == ["squeezed", "hsqueezed"] and "squeezed_seconds" not in late
    res = {"plan": dataclasses.asdict(plan), "meta": {"device": "cpu", "jax": "x", "git_commit": "c"},
           "keys": "gaussian", "offline": {k: v for k, v in late.items() if not k.endswith("_index") and k != "data"}}
    assert "Not run (the run's deadline came first): squeezed, hsqueezed." in to_markdown(res)


def test_rows_past_the_deadline_are_listed_as_not_run():
    """A deadline that comes after the indexes are built cuts rows; each is listed (log, JSON row
    with its error, the markdown table), never silently missing."""
    from benchmarks.speed import _ROW_LATE, KeySource, _length_rows, cpu_plan, to_markdown

    plan = dataclasses.replace(cpu_plan(), sparsities=(0.9,), shapes=((4, 2),), hier_sparsities=(0.9,))
    logged = []
    rows = _length_rows(plan, KeySource(None, plan), logged.append, time.perf_counter() - 1.0, 1024, 0)
    assert rows and all(r["error"] == _ROW_LATE for r in rows)
    assert {r["phase"] for r in rows} == {"decode", "prefill_32"} and {r["sparsity"] for r in rows} == {0.9}
    assert sum("not run (deadline)" in line for line in logged) == len(rows)
    md = to_markdown({"meta": {"device": "cpu:cpu", "jax": "x", "git_commit": "x"}, "plan": dataclasses.asdict(plan),
                      "keys": "gaussian", "errors": [], "kernels": rows})
    assert md.count("not run: the run's deadline came first") == len(rows)


def test_out_of_memory_errors_carry_the_allocator_figures(monkeypatch):
    """An OOM row says how full the device was, and that the named executable may not be the culprit."""
    import jax

    from benchmarks import speed

    class Dev:
        def memory_stats(self):
            return {"bytes_in_use": 28 * 2**30, "peak_bytes_in_use": 50 * 2**30, "bytes_limit": 59 * 2**30}

    monkeypatch.setattr(jax, "devices", lambda *a: [Dev()])
    msg = speed._err(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 29.16GiB"))
    assert "28.0 GiB in use, peak 50.0, limit 59.0" in msg and "next to run" in msg
    assert speed._err(ValueError("bad shape")) == "ValueError: bad shape"


def test_byte_tokenizer_reads_its_answers_back():
    """The end-to-end model's tokenizer: text below U+0100 is one id per UTF-8 byte (as before);
    every id decodes to a character that encodes back to it (surrogates skipped), so a random
    model's answer round-trips in a conversation's kept prompt."""
    from benchmarks.speed import _ByteTokenizer

    tok = _ByteTokenizer(128256)
    ids = list(range(0, 128256, 97)) + [0xD6FF, 0xD700, 0xDEFF, 0xDF00, 128255]
    text = tok.decode(ids)
    text.encode()                                    # no surrogate: valid UTF-8
    assert tok.encode(text) == ids
    assert tok.encode("ab é") == [3 + b for b in "ab é".encode()]
    assert tok.encode(tok.decode([5]) + "?") == [5, 3 + ord("?")]


@pytest.mark.bench_smoke
def test_follow_up_probe_cpu_smoke(tmp_path, monkeypatch):
    """`benchmarks.follow_up_probe --ab-routes` on the CPU plan: for both methods, every series' median
    is its timed calls' median, the follow-ups reuse the first turn, and the two routes of the
    follow-up's new part, one computation off the GPU, give the same tokens in every follow-up."""
    from benchmarks import follow_up_probe as fp

    monkeypatch.setattr(fp, "_N_WARM", 1)
    monkeypatch.setattr(fp, "_N_TIMED", 2)
    monkeypatch.setattr(sys, "argv", ["follow_up_probe", "--cpu-smoke", "--out", str(tmp_path), "--skip",
                                      "offline,kernels", "--e2e-ask-only", "--e2e-batches", "0",
                                      "--e2e-question-tokens", "0", "--probe-turn", "96", "--ab-routes"])
    assert fp.main() == 0
    rows = json.loads((tmp_path / "probe.json").read_text())["rows"]
    for name in ("squeezed", "full"):
        r = rows[name]
        assert r["routes_agree"] == [True] * 4, name
        assert all(0 < n < r["n_prompt_kept"] for n in r["n_reused"])
        for label in ("lone", "kept_masked", "kept_prefix", "kept_masked_2", "kept_prefix_2", "lone_2"):
            assert len(r[label]["calls_ms"]) == 3 and r[label]["median_ms"] == float(np.median(r[label]["calls_ms"][1:]))
        assert set(r["stages_kept_synced"]["median_ms_since_start"]) == {"ttft_ms", "kept", "prefill", "first_token"}
