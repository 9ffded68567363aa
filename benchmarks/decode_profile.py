"""Where the time of the fused clustered decode goes, on one GPU, in one run.

    python -m benchmarks.decode_profile --out DIR [--cpu-smoke] [--lengths 131072,524288]
        [--budget-s 420] [--no-sweep]

Case: Llama-3-8B attention shape (Hq=32, Hkv=8, d=128), bf16, one decode token over a fixed
context of L in {128K, 512K} tokens laid out by cluster (``cluster_sort_layout`` through
``benchmarks.gpu_kernels.build_clustered_layout``: synthetic lognormal cluster sizes, 4 sink +
100 exact-tail rows), C = 5% of L centroids, and a 1K-token user input so far (all visible).
The threshold gives 90% sparsity: it is calibrated on the Eq. 1 scores of the timed queries
and centroids of every input set together (``gpu_kernels.calibrate_threshold``), then moved
half-way to the next larger score so that no score sits on it.  3 input sets (query,
centroids, new keys/values) rotate so that L2 does not flatter; the big sorted K/V and the
offsets are shared (they never fit in L2).

(1) Split timing of the pipeline of ``clustered_decode_attention`` (default
    ``ClusteredConfig``), each piece its own jit:
      score  = kernel A alone (``clustered_attention._score_call``: the pallas_call that
               ``_decode_pallas`` makes),
      attend = kernel B alone (``_attend_call``) on precomputed logits x and block stats,
      merge  = the log-sum-exp merge of B's partials (the ``_merge_pallas`` kernel, which writes
               the output dtype),
      whole  = ``clustered_decode_attention`` end to end (whole - the three = glue);
    against, in the same run, dense attention over all L + S keys (cuDNN, XLA and the Pallas
    split-KV dense kernel, timed by ``benchmarks.speed._dense_times``) and a device-to-device
    copy bandwidth (``gpu_kernels.copy_bandwidth``).  Ratio = dense / whole.
(2) Config sweep of the whole call over ``ClusteredConfig`` fields (~25 configs per L: one or
    two fields off the default, then a few combinations).  Every config is checked against
    ``clustered_decode_attention_reference`` on the first input set: max relative error (tol
    2e-2, bf16), NaN, selection flips and "hard" flips (flipped clusters whose reference
    score is not within 1e-3 (relative) of the threshold); PASS = within tol, no NaN, no hard
    flip.  A config that fails to compile or run is recorded and the sweep goes on.  The sweep
    (shared evenly by the lengths) stops when --budget-s seconds since the start are spent,
    and the output says so.
(3) Bytes per call: centroids (non-empty clusters), retrieved K/V rows (the rows each KV head
    attends, exact part included, from ``return_stats``; + the new part), logits / block
    statistics / partials written and read back, offsets, q, output.  Achieved TB/s of the
    whole call and of each kernel, and their fraction of the copy bandwidth.

Timing: ``benchmarks._meta.time_ms`` (compile + warm-up on every set, then the median over
repetitions of the mean time of back-to-back calls cycling over the sets, each repetition
ending in ``block_until_ready``).  Failures are caught per piece and per config.  Writes
``DIR/decode_profile.json`` and ``DIR/decode_profile.md`` and prints the markdown last.
``--cpu-smoke`` runs the same plumbing at tiny shapes on CPU (kernels in Pallas interpret
mode, XLA dense attention, 3 configs); its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import speed
from benchmarks._meta import metadata, time_ms, time_ms_looped, write_json
from benchmarks.gpu_kernels import (build_clustered_layout, calibrate_threshold, copy_bandwidth,
                                    rel_err, short_error)
from pallas_kernels import clustered_attention as clat
from sqjax.index_io import write_text_atomic
from pallas_kernels.centroid_lookup import centroid_lookup_reference
from pallas_kernels.clustered_attention import (ClusteredConfig, clustered_decode_attention,
                                                clustered_decode_attention_reference)

BF16 = jnp.bfloat16
VOTE = "kv"
DEFAULT = ClusteredConfig()


@dataclasses.dataclass
class Plan:
  smoke: bool
  backend: str                     # kernels: "pallas" (GPU) or "interpret" (CPU smoke)
  lengths: tuple[int, ...] = (131072, 524288)
  hq: int = 32
  hkv: int = 8
  d: int = 128
  n_new: int = 1024                # user-input keys so far
  sparsity: float = 0.9
  centroid_frac: float = 0.05
  n_sets: int = 3
  reps: int = 15
  inner: int = 10
  loop_iters: int = 30             # calls per device loop (time_ms_looped)
  copy_bytes: int = 1 << 30
  sweep: bool = True
  max_configs: int | None = None   # None = the whole list
  tol: float = 2e-2
  flip_margin: float = 1e-3        # |S - thr| <= margin * thr: a flip there is a tie, not a bug
  budget_s: float = 420.0


def make_plan(args) -> Plan:
  if args.cpu_smoke:
    plan = Plan(smoke=True, backend="interpret", lengths=(512,), hq=4, hkv=2, d=32, n_new=16,
                n_sets=2, reps=1, inner=1, loop_iters=2, copy_bytes=1 << 20, max_configs=3,
                budget_s=600.0)
  else:
    plan = Plan(smoke=False, backend="pallas")
  if args.lengths:
    plan.lengths = tuple(int(x) for x in args.lengths.split(","))
  if args.no_sweep:
    plan.sweep = False
  if args.budget_s is not None:
    plan.budget_s = float(args.budget_s)
  return plan


# ----------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------
def _off_scores(thr, scores):
  """thr (one of the scores) -> half-way to the next larger score: same selection, no tie."""
  s = np.asarray(scores, np.float64).reshape(-1)
  above = s[s > thr]
  return np.float32(0.5 * (thr + above.min())) if above.size else np.float32(thr)


def make_inputs(plan: Plan, num_l: int, log) -> dict:
  """Sorted K/V + offsets (shared), rotated input sets, the calibrated threshold and the
  reference Eq. 1 scores of set 0 (f32 matmuls, as in the reference the checks use)."""
  hq, hkv, d, num_s = plan.hq, plan.hkv, plan.d, plan.n_new
  num_c = max(1, round(plan.centroid_frac * num_l))
  scale = d ** -0.5
  key = jax.random.PRNGKey(num_l)
  kk, kv_, kl, kr = jax.random.split(key, 4)
  t0 = time.perf_counter()
  layout = build_clustered_layout(plan, jax.random.normal(kk, (hkv, num_l, d), BF16),
                                  jax.random.normal(kv_, (hkv, num_l, d), BF16), num_c, kl)
  log(f"[inputs] L={num_l}: layout C={num_c} built in {time.perf_counter() - t0:.1f}s")
  ks, vs, offs, cnt = layout["k"], layout["v"], layout["offs"], layout["counts"]
  kvp = (num_l + jnp.arange(num_s)).astype(jnp.int32)                   # [S]
  qp = jnp.full((1,), num_l + num_s - 1, jnp.int32)                     # [1]
  sets = []
  for i in range(plan.n_sets):
    r = jax.random.split(jax.random.fold_in(kr, i), 4)
    sets.append(dict(q=jax.random.normal(r[0], (hq, d), BF16),            # [Hq, d]
                     cent=jax.random.normal(r[1], (hkv, num_c, d), BF16),  # [Hkv, C, d]
                     kn=jax.random.normal(r[2], (hkv, num_s, d), BF16),    # [Hkv, S, d]
                     vn=jax.random.normal(r[3], (hkv, num_s, d), BF16)))
  with jax.default_matmul_precision("highest"):                        # no TF32 on the GPU
    sc = np.stack([np.asarray(centroid_lookup_reference(s["q"], s["cent"], cnt, 0.0, scale=scale,
                                                        vote=VOTE)[1])
                   for s in sets])                                       # [sets, Hkv, C]
  thr = calibrate_threshold(sc, np.broadcast_to(np.asarray(cnt), sc.shape), 1.0 - plan.sparsity)
  thr = _off_scores(thr, sc)
  thr_j = jnp.float32(thr)
  whole = [(s["q"], ks, vs, s["cent"], offs, thr_j, s["kn"], s["vn"], qp, kvp) for s in sets]
  return dict(L=num_l, C=num_c, S=num_s, scale=scale, layout=layout, ks=ks, vs=vs, offs=offs,
              counts=cnt, sets=sets, qp=qp, kvp=kvp, thr=thr, thr_j=thr_j, whole=whole,
              scores0=sc[0])


def reference(ctx: dict) -> dict:
  """clustered_decode_attention_reference on set 0 (f32 matmuls)."""
  with jax.default_matmul_precision("highest"):
    o, sel, rows = clustered_decode_attention_reference(*ctx["whole"][0], scale=ctx["scale"],
                                                        vote=VOTE, return_stats=True)
  return dict(o=o, sel=np.asarray(sel), rows=np.asarray(rows))


# ----------------------------------------------------------------------------
# (1) Split timing.
# ----------------------------------------------------------------------------
def split_fns(plan: Plan, ctx: dict, p, cfg: ClusteredConfig) -> dict[str, Callable]:
  """Jitted pieces: score / attend / merge / whole (the kernel plan ``p`` is static)."""
  be, scale, num_l, num_s = plan.backend, ctx["scale"], ctx["L"], ctx["S"]
  hq, d = plan.hq, plan.d
  score_kw = dict(num_l=num_l, num_s=num_s, scale=scale, vote=VOTE, cfg=cfg, backend=be)

  def score_all(q, cent, offs):        # -> qf [Hq, dp], offs flat, x [Hkv, g, Cx], ms, ls
    return clat._score_call(q, cent, offs, **score_kw)[1:]

  def attend(thr, qf, offs, x, ms, ls, k, v, kn, vn, qp, kvp):   # -> o, m, l partials
    return clat._attend_call(p, qf, offs, x, ms, ls, k, v, thr, kn, vn, qp, kvp, scale=scale,
                             return_stats=False, cfg=cfg, backend=be)[:3]

  def merge(o, m, l):                  # [Hkv, P, g, dp] partials -> [Hq, d] bf16 (what the library runs)
    return clat._merge_pallas(o, m, l, d=d, out_dtype=BF16, backend=be)[0].reshape(hq, d)

  return {"score_all": jax.jit(score_all),
          "score": jax.jit(lambda *a: score_all(*a)[2:]),
          "attend": jax.jit(attend),
          "merge": jax.jit(merge),
          "whole": jax.jit(functools.partial(clustered_decode_attention, scale=scale, vote=VOTE,
                                             backend=be, config=cfg))}


def time_split(plan: Plan, case: dict, ctx: dict, log):
  """Times each piece (default config), inputs of a piece made by the one before it;
  -> the kernel plan (for the bytes)."""
  p = clat._make_plan(plan.hq, plan.hkv, ctx["L"], ctx["C"], ctx["S"], plan.d, VOTE, DEFAULT)
  fns = split_fns(plan, ctx, p, DEFAULT)
  sets: dict[str, list] = {"score": [(s["q"], s["cent"], ctx["offs"]) for s in ctx["sets"]],
                           "whole": ctx["whole"]}
  nxt = {"score": ("attend", lambda a, s: (ctx["thr_j"], *fns["score_all"](*a), ctx["ks"],
                                           ctx["vs"], s["kn"], s["vn"], ctx["qp"], ctx["kvp"])),
         "attend": ("merge", lambda a, s: tuple(fns["attend"](*a)))}
  for name in ("score", "attend", "merge", "whole"):
    if name not in sets:
      case["errors"][f"split/{name}"] = "skipped: the piece before it failed"
      continue
    try:
      case["split_ms"][name] = time_ms(fns[name], sets[name], reps=plan.reps, inner=plan.inner)
      log(f"[split] L={ctx['L']} {name:7s} {case['split_ms'][name]:.4f} ms")
      if name in nxt:
        to, make = nxt[name]
        sets[to] = [make(a, s) for a, s in zip(sets[name], ctx["sets"])]
    except Exception as e:  # noqa: BLE001 - the other pieces still run
      case["errors"][f"split/{name}"] = short_error(e)
      log(f"[split] L={ctx['L']} {name}: ERROR {short_error(e)}")
      traceback.print_exc(file=sys.stderr)
  if "whole" in case["split_ms"]:   # device time: calls in one jitted loop (q rotates, the rest set 0's)
    try:
      w0 = ctx["whole"][0]
      case["whole_loop_ms"] = time_ms_looped(lambda q, *rest: fns["whole"](q, *rest), [a[0] for a in ctx["whole"]],
                                             fixed=tuple(w0[1:]), n_iter=plan.loop_iters, reps=plan.reps)
      log(f"[split] L={ctx['L']} whole (device loop) {case['whole_loop_ms']:.4f} ms")
    except Exception as e:  # noqa: BLE001
      case["errors"]["split/whole_loop"] = short_error(e)
  ms = case["split_ms"]
  if all(k in ms for k in ("score", "attend", "merge")):
    ms["sum_of_pieces"] = ms["score"] + ms["attend"] + ms["merge"]
    if "whole" in ms:
      ms["glue"] = ms["whole"] - ms["sum_of_pieces"]
  return p


def dense_baselines(plan: Plan, case: dict, ctx: dict, log) -> None:
  """cuDNN / XLA / Pallas split-KV dense over all L + S keys (``speed._dense_times``)."""
  sp = speed.Plan(d=plan.d, cpu=plan.smoke, backend=plan.backend, reps=plan.reps)
  s0 = ctx["sets"][0]
  dctx = (ctx["ks"], ctx["vs"], s0["kn"], s0["vn"], ctx["qp"], ctx["kvp"])
  qs = [s["q"][:, None, :] for s in ctx["sets"]]                         # [Hq, 1, d]
  dense = speed._dense_times(dataclasses.replace(sp, loop_iters=plan.loop_iters), log, qs, dctx,
                             f"L={ctx['L']} decode", ("call", "loop"))
  case["dense_ms"], case["dense_loop_ms"] = dense["call"], dense["loop"]
  want = ("xla", "pallas") if plan.smoke else ("cudnn", "xla", "pallas")
  for name in want:
    if name not in case["dense_ms"]:
      case["errors"][f"dense/{name}"] = "failed or skipped (see log)"
  whole = case["split_ms"].get("whole")
  if whole:
    case["ratio_dense_over_sparse"] = {n: t / whole for n, t in case["dense_ms"].items()}
    if case["dense_ms"]:
      case["ratio_best_dense_over_sparse"] = min(case["dense_ms"].values()) / whole
  if case.get("whole_loop_ms") and case.get("dense_loop_ms"):
    case["ratio_best_dense_over_sparse_loop"] = min(case["dense_loop_ms"].values()) / case["whole_loop_ms"]


# ----------------------------------------------------------------------------
# (2) Correctness of a config, config sweep.
# ----------------------------------------------------------------------------
def check_config(plan: Plan, ctx: dict, ref: dict, cfg: ClusteredConfig) -> tuple[dict, Callable]:
  """Compiled (return_stats) vs reference on set 0 -> errors, flips, rows of every set."""
  fn = jax.jit(functools.partial(clustered_decode_attention, scale=ctx["scale"], vote=VOTE,
                                 backend=plan.backend, config=cfg, return_stats=True))
  o, sel, rows = fn(*ctx["whole"][0])
  sel = np.asarray(sel)
  flip = sel != ref["sel"]                                               # [Hkv, C]
  near = np.abs(ctx["scores0"] - ctx["thr"]) <= plan.flip_margin * abs(float(ctx["thr"]))
  nan = bool(np.isnan(np.asarray(o, np.float32)).any())
  err = rel_err(o, ref["o"])
  hard = int(np.sum(flip & ~near))
  rec = {"max_rel_err": err, "nan": nan, "selection_flips": int(flip.sum()),
         "hard_flips": hard, "rows_max_diff": int(np.abs(np.asarray(rows) - ref["rows"]).max()),
         "rows_first_set": np.asarray(rows).astype(int).tolist()}
  rec["status"] = "PASS" if (err <= plan.tol and not nan and hard == 0) else "FAIL"
  return rec, fn


def config_label(cfg: ClusteredConfig) -> str:
  diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
          if getattr(cfg, f.name) != getattr(DEFAULT, f.name)]
  return ",".join(diff) or "default"


def sweep_configs(plan: Plan) -> list[ClusteredConfig]:
  """Default, one field off, two fields off, a few combinations (priority order)."""
  c = functools.partial(dataclasses.replace, DEFAULT)
  one = [c(reduce_stats_first=True), c(block_k=32), c(block_k=128), c(num_warps=8),
         c(num_stages=1), c(num_stages=2), c(num_stages=4), c(sub_clusters=64), c(sub_clusters=256),
         c(target_programs=768), c(target_programs=3072), c(block_c=64), c(block_c=256), c(block_c=512),
         c(score_warps=8)]
  two = [c(block_k=128, num_warps=8), c(block_k=32, num_stages=4), c(num_warps=8, num_stages=2),
         c(sub_clusters=64, block_k=32), c(sub_clusters=256, target_programs=768),
         c(reduce_stats_first=True, target_programs=3072), c(block_k=128, num_stages=1),
         c(reduce_stats_first=True, num_warps=8)]
  combos = [c(reduce_stats_first=True, block_k=32, target_programs=3072),
            c(reduce_stats_first=True, block_k=128, num_warps=8, sub_clusters=64),
            c(reduce_stats_first=True, sub_clusters=64, block_k=32, target_programs=3072,
              block_c=512, score_warps=8)]
  cfgs = [DEFAULT] + one + two + combos
  if not plan.sweep:
    return cfgs[:1]
  return cfgs[:plan.max_configs] if plan.max_configs else cfgs


def _plan_info(plan: Plan, ctx: dict, cfg: ClusteredConfig) -> dict:
  p = clat._make_plan(plan.hq, plan.hkv, ctx["L"], ctx["C"], ctx["S"], plan.d, VOTE, cfg)
  return {"programs_attn": plan.hkv * p.n_prog, "cluster_programs_per_kv": p.n_cb,
          "clusters_per_program": p.bc, "sub_clusters": p.bcs, "score_programs": plan.hkv * p.n_a}


def run_config(plan: Plan, case: dict, ctx: dict, ref: dict, cfg: ClusteredConfig, log) -> dict:
  """One sweep entry: check (return_stats variant), then time the plain call."""
  rec: dict[str, Any] = {"label": config_label(cfg), "config": dataclasses.asdict(cfg)}
  t0 = time.perf_counter()
  try:
    rec.update(_plan_info(plan, ctx, cfg))
    chk, _ = check_config(plan, ctx, ref, cfg)
    chk.pop("rows_first_set")
    rec.update(chk)
  except Exception as e:  # noqa: BLE001 - e.g. a tiling Triton cannot compile
    rec.update(status="ERROR", error=short_error(e))
  if rec["status"] != "ERROR":
    try:
      fn = jax.jit(functools.partial(clustered_decode_attention, scale=ctx["scale"], vote=VOTE,
                                     backend=plan.backend, config=cfg))
      rec["ms"] = time_ms(fn, ctx["whole"], reps=plan.reps, inner=plan.inner)
    except Exception as e:  # noqa: BLE001
      rec.update(status="ERROR", error=short_error(e))
  rec["seconds"] = round(time.perf_counter() - t0, 2)
  base = case["split_ms"].get("whole")
  if rec.get("ms") and base:
    rec["speedup_vs_default"] = base / rec["ms"]
  log(f"[sweep] L={ctx['L']} {rec['status']:5s} {rec['label']:60s} "
      f"{rec.get('ms', float('nan')):.4f} ms  err {rec.get('max_rel_err', float('nan')):.2g} "
      f"flips {rec.get('selection_flips')}/{rec.get('hard_flips')}  ({rec['seconds']}s) "
      f"{rec.get('error', '')}")
  return rec


def run_sweep(plan: Plan, case: dict, ctx: dict, ref: dict, deadline: float, log) -> None:
  """Configs after the default (measured in the split) until the deadline."""
  cfgs = sweep_configs(plan)[1:]
  spent = []
  for i, cfg in enumerate(cfgs):
    est = statistics.median(spent) if spent else 0.0
    if time.perf_counter() + est > deadline:
      case["sweep_stopped"] = (f"time budget spent: {i} of {len(cfgs)} non-default configs "
                               f"run (--budget-s {plan.budget_s:g})")
      log(f"[sweep] L={ctx['L']}: {case['sweep_stopped']}")
      return
    t0 = time.perf_counter()
    case["sweep"].append(run_config(plan, case, ctx, ref, cfg, log))
    spent.append(time.perf_counter() - t0)


# ----------------------------------------------------------------------------
# (3) Bytes.
# ----------------------------------------------------------------------------
def bytes_accounting(plan: Plan, ctx: dict, p, rows_by_set: list, copy_tb: float | None,
                     split_ms: dict) -> dict:
  """Bytes each piece moves (mean over sets) and the achieved TB/s."""
  hq, hkv, d, num_s = plan.hq, plan.hkv, plan.d, ctx["S"]
  el = 2                                                                  # bf16
  n_valid_c = int(np.sum(np.asarray(ctx["counts"]) > 0))
  rows = float(np.mean([np.sum(r) for r in rows_by_set]))               # summed over KV heads
  cen = n_valid_c * d * el
  offs = hkv * (ctx["C"] + 1) * 4
  q_b = hq * d * el
  logits = hkv * p.g * ctx["C"] * 4                                      # x, one way
  stats = 2 * hkv * p.g * p.n_a * 4                                      # (m_b, l_b), one way
  partials = hkv * p.n_prog * p.g * (p.dp + 2) * 4                       # (o, m, l), one way
  kv_rows = rows * 2 * d * el
  kv_new = hkv * num_s * 2 * d * el
  out = hq * d * el
  pieces = {"score": cen + offs + q_b + logits + stats,
            "attend": kv_rows + kv_new + offs + q_b + logits + stats + partials,
            "merge": partials + out}
  pieces["whole"] = sum(pieces.values())
  res = {"centroid_bytes": float(cen), "kv_rows_bytes": kv_rows, "kv_new_bytes": float(kv_new),
         "logits_bytes_each_way": float(logits), "block_stats_bytes_each_way": float(stats),
         "partials_bytes_each_way": float(partials), "offsets_bytes": float(offs),
         "rows_attended_mean": rows, "retrieved_frac": rows / (hkv * ctx["L"]),
         "bytes": {k: float(v) for k, v in pieces.items()}, "tb_per_s": {}, "frac_of_copy": {}}
  for k, b in pieces.items():
    if split_ms.get(k):
      tb = b / (split_ms[k] * 1e-3) / 1e12
      res["tb_per_s"][k] = tb
      if copy_tb:
        res["frac_of_copy"][k] = tb / copy_tb
  return res


# ----------------------------------------------------------------------------
# One length.
# ----------------------------------------------------------------------------
def profile_length(plan: Plan, num_l: int, copy_tb, log) -> tuple[dict, dict | None]:
  """(1) + (3) + the default check for one L; -> (case, ctx for the sweep or None)."""
  case: dict[str, Any] = {"L": num_l, "Hq": plan.hq, "Hkv": plan.hkv, "d": plan.d,
                          "S": plan.n_new, "dtype": "bfloat16", "sparsity": plan.sparsity,
                          "split_ms": {}, "dense_ms": {}, "sweep": [], "errors": {}}
  try:
    ctx = make_inputs(plan, num_l, log)
    ctx["ref"] = reference(ctx)
  except Exception as e:  # noqa: BLE001 - e.g. out of memory: the other lengths still run
    case["errors"]["inputs"] = short_error(e)
    traceback.print_exc(file=sys.stderr)
    return case, None
  case.update(C=ctx["C"], threshold=float(ctx["thr"]), layout=ctx["layout"]["size_stats"],
              n_exact=ctx["layout"]["n_exact"], plan_info=_plan_info(plan, ctx, DEFAULT))
  p = time_split(plan, case, ctx, log)
  try:
    dense_baselines(plan, case, ctx, log)
  except Exception as e:  # noqa: BLE001
    case["errors"]["dense"] = short_error(e)
    traceback.print_exc(file=sys.stderr)
  try:
    chk, sfn = check_config(plan, ctx, ctx["ref"], DEFAULT)
    rows = [np.asarray(chk["rows_first_set"])] + [np.asarray(sfn(*a)[2]) for a in ctx["whole"][1:]]
    case["check"] = {k: v for k, v in chk.items() if k != "rows_first_set"}
    case["rows_per_kv_head_first_set"] = chk["rows_first_set"]
    case["bytes"] = bytes_accounting(plan, ctx, p, rows, copy_tb, case["split_ms"])
    log(f"[check] L={num_l} default {chk['status']} err {chk['max_rel_err']:.2g} flips "
        f"{chk['selection_flips']} (hard {chk['hard_flips']}); retrieved "
        f"{case['bytes']['retrieved_frac']:.3f} of L")
  except Exception as e:  # noqa: BLE001
    case["errors"]["check"] = short_error(e)
    traceback.print_exc(file=sys.stderr)
  case["sweep"].append({"label": "default", "config": dataclasses.asdict(DEFAULT),
                        **case["plan_info"], **case.get("check", {"status": "ERROR"}),
                        **({"ms": case["split_ms"]["whole"], "speedup_vs_default": 1.0}
                           if "whole" in case["split_ms"] else {})})
  return case, ctx


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------
def _f(x, nd=3, suffix=""):
  return "—" if x is None else (f"{x:.{nd}f}{suffix}" if isinstance(x, float) else str(x))


def _gb(x):
  """bytes -> '12.3 MB' (kB / MB / GB)."""
  if x is None:
    return "—"
  for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if x >= div:
      return f"{x / div:.1f} {unit}"
  return f"{x:.0f} B"


def _md_split(res: dict) -> list[str]:
  lines = ["## Split timing (ms, median; default ClusteredConfig)", "",
           "| L | C | score | attend | merge | sum | whole | glue | cuDNN | XLA | Pallas dense "
           "| best dense / whole | whole, device loop | best dense, device loop | ratio, device loop |",
           "|---" * 15 + "|"]
  for c in res["cases"]:
    s, dn = c["split_ms"], c["dense_ms"]
    cells = [c["L"], c.get("C", "—")] + [_f(s.get(k), 4) for k in ("score", "attend", "merge",
                                                                "sum_of_pieces", "whole", "glue")]
    cells += [_f(dn.get(k)) for k in ("cudnn", "xla", "pallas")]
    cells.append(_f(c.get("ratio_best_dense_over_sparse"), 2, "×"))
    dl = c.get("dense_loop_ms") or {}
    cells += [_f(c.get("whole_loop_ms"), 4), _f(min(dl.values()) if dl else None),
              _f(c.get("ratio_best_dense_over_sparse_loop"), 2, "×")]
    lines.append("| " + " | ".join(str(x) for x in cells) + " |")
  lines += ["", "Pieces are separate jits, so each carries its own host dispatch (their sum exceeds the whole); "
            f"\"device loop\" = {res.get('plan', {}).get('loop_iters', '—')} calls in one jitted loop "
            "(`benchmarks._meta.time_ms_looped`), dense timed the same way."]
  return lines


def _md_bytes(res: dict) -> list[str]:
  lines = ["## Bytes and bandwidth (per call, mean over input sets)", "",
           "| L | rows / L | centroids | K/V rows (+new) | logits ×2 | partials ×2 | whole bytes "
           "| whole TB/s (of copy) | attend TB/s (of copy) | score TB/s | check err (flips/hard) |",
           "|---" * 11 + "|"]
  for c in res["cases"]:
    b = c.get("bytes")
    if not b:
      lines.append(f"| {c['L']} |" + " — |" * 10)
      continue
    tb, fr, chk = b["tb_per_s"], b["frac_of_copy"], c.get("check") or {}

    def tbf(k):
      return _f(tb.get(k)) + (f" ({fr[k]:.0%})" if k in fr else "")
    cells = [c["L"], _f(b["retrieved_frac"]), _gb(b["centroid_bytes"]),
             _gb(b["kv_rows_bytes"] + b["kv_new_bytes"]), _gb(2 * b["logits_bytes_each_way"]),
             _gb(2 * b["partials_bytes_each_way"]), _gb(b["bytes"]["whole"]), tbf("whole"),
             tbf("attend"), tbf("score"),
             f"{_f(chk.get('max_rel_err'), 4)} ({chk.get('selection_flips')}/"
             f"{chk.get('hard_flips')}) {chk.get('status', '')}"]
    lines.append("| " + " | ".join(str(x) for x in cells) + " |")
  return lines


def _md_cell(text: str, n: int = 160) -> str:
  return " ".join(str(text).split()).replace("|", "/")[:n]


def _md_sweep(c: dict) -> list[str]:
  lines = [f"## Config sweep, L={c['L']} (whole call, ms; fastest first)", "",
           "| config | ms | default / config | attn programs | max rel err | flips (hard) | status |",
           "|---|---|---|---|---|---|---|"]
  for r in sorted(c["sweep"], key=lambda r: r.get("ms") or float("inf")):
    status = r["status"] + (f": {_md_cell(r['error'])}" if r.get("error") else "")
    cells = [r["label"], _f(r.get("ms"), 4), _f(r.get("speedup_vs_default"), 2, "×"),
             r.get("programs_attn", "—"), _f(r.get("max_rel_err"), 4),
             f"{r.get('selection_flips', '—')} ({r.get('hard_flips', '—')})", status]
    lines.append("| " + " | ".join(str(x) for x in cells) + " |")
  if c.get("sweep_stopped"):
    lines += ["", f"Sweep stopped — {c['sweep_stopped']}."]
  return lines


def to_markdown(res: dict) -> str:
  sh, bw = res["shapes"], res.get("copy_bandwidth") or {}
  lines = [f"# Clustered decode profile — {res['device']}", "",
           f"jax {res['jax_version']}, commit {res['git_commit']}, {res['dtype']}, backend "
           f"{res['backend']}, Hq={sh['Hq']} Hkv={sh['Hkv']} d={sh['d']}, S={sh['S']} new keys, "
           f"{sh['centroid_frac']:.0%} centroids, sparsity {sh['sparsity']:.0%}, "
           f"{res['wall_s']:.0f} s.  Device copy bandwidth {_f(bw.get('tb_per_s'))} TB/s.", ""]
  lines += _md_split(res) + [""] + _md_bytes(res)
  for c in res["cases"]:
    if len(c["sweep"]) > 1 or c.get("sweep_stopped"):
      lines += [""] + _md_sweep(c)
  errs = [(c["L"], k, v) for c in res["cases"] for k, v in c["errors"].items()]
  errs += [("-", k, v) for k, v in res["errors"].items()]
  if errs:
    lines += ["", "## Errors", ""] + [f"- L={a} {k}: {_md_cell(v, 600)}" for a, k, v in errs]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="directory for decode_profile.json / .md")
  ap.add_argument("--cpu-smoke", action="store_true",
                  help="tiny shapes on CPU (Pallas interpret mode) to exercise the plumbing")
  ap.add_argument("--lengths", default="", help="comma-separated fixed-context lengths")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="wall-clock budget (s, default 420): no new sweep config after it")
  ap.add_argument("--no-sweep", action="store_true", help="only the default config")
  args = ap.parse_args(argv)
  plan = make_plan(args)
  if not plan.smoke and jax.default_backend() != "gpu":
    print(f"decode_profile: no GPU (jax backend {jax.default_backend()!r}); use --cpu-smoke to "
          "exercise the plumbing on CPU", file=sys.stderr)
    return 2
  t_start = time.perf_counter()
  deadline = t_start + plan.budget_s
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)

  def log(msg):
    print(msg, flush=True)

  meta = metadata()
  res: dict[str, Any] = {
      **meta, "jax_version": meta["jax"], "backend": plan.backend, "dtype": "bfloat16",
      "mode": "cpu-smoke" if plan.smoke else "full", "plan": dataclasses.asdict(plan),
      "shapes": {"Hq": plan.hq, "Hkv": plan.hkv, "d": plan.d, "S": plan.n_new,
                 "lengths": list(plan.lengths), "centroid_frac": plan.centroid_frac,
                 "sparsity": plan.sparsity, "vote": VOTE},
      "copy_bandwidth": None, "cases": [], "errors": {}}
  log(f"device {res['device']}, jax {res['jax_version']}, commit {res['git_commit']}")
  try:
    res["copy_bandwidth"] = copy_bandwidth(plan)
    log(f"[bw] device copy {res['copy_bandwidth']['tb_per_s']:.3f} TB/s")
  except Exception as e:  # noqa: BLE001
    res["errors"]["copy_bandwidth"] = short_error(e)
  copy_tb = (res["copy_bandwidth"] or {}).get("tb_per_s")
  ctxs = []                           # (case, inputs | None)
  for num_l in plan.lengths:          # (1) + (3) for every length first: the sweep is extra
    if time.perf_counter() > deadline:
      res["cases"].append({"L": num_l, "split_ms": {}, "dense_ms": {}, "sweep": [],
                           "errors": {"all": "skipped: time budget spent"}})
      continue
    case, ctx = profile_length(plan, num_l, copy_tb, log)
    res["cases"].append(case)
    ctxs.append((case, ctx))
  live = [(c, x) for c, x in ctxs if x is not None and "ref" in x]
  for i, (case, ctx) in enumerate(live):   # (2): the remaining budget shared by the lengths
    now = time.perf_counter()
    share = now + max(0.0, deadline - now) / (len(live) - i)
    try:
      run_sweep(plan, case, ctx, ctx["ref"], share, log)
    except Exception as e:  # noqa: BLE001
      case["errors"]["sweep"] = short_error(e)
      traceback.print_exc(file=sys.stderr)
    ctx.clear()                       # this length's arrays go before the next sweep
  res["sweep_budget_exhausted"] = any(c.get("sweep_stopped") for c in res["cases"])
  res["wall_s"] = time.perf_counter() - t_start
  write_json(out_dir / "decode_profile.json", res)
  md = to_markdown(res)
  write_text_atomic(out_dir / "decode_profile.md", md)
  print()
  print(md)
  ok = all("whole" in c["split_ms"] and (c.get("check") or {}).get("status") == "PASS"
           for c in res["cases"])
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
