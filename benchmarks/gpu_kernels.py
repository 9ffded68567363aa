"""GPU checks and timings of the ``pallas_kernels`` ops (Squeezed Attention and peers).

    python -m benchmarks.gpu_kernels --out DIR [--quick] [--cpu-smoke]
        [--lengths 131072,524288] [--skip-checks] [--no-sweep] [--budget-s 450]

(a) Correctness: every op compiled (backend="pallas") against its plain-jnp
    reference in bf16 at a few shapes (ragged sizes, an empty head, GQA 4:1, both
    vote modes, poisoned rows that must never be read); PASS/FAIL + max rel error.
(b) Speed at the Llama-3-8B attention shape (Hq=32, Hkv=8, d=128, bf16), fixed
    context L in {128K, 512K}: decode (1 token, 1K-token user input so far) and
    prefill (1K and 4K query tokens) at 90% sparsity with 5% centroids.  Per case:
    centroid lookup, sparse attention (in-kernel gather; a few tile configs, best
    reported), the whole pipeline in one jit (lookup -> clusters_to_indices ->
    sparse attention), for prefill also gather-then-cuDNN, and the dense baseline
    ``jax.nn.dot_product_attention(implementation="cudnn")`` over all L + S keys,
    measured in the same run; ratio = dense / pipeline.
(c) Bytes moved and achieved TB/s of the sparse decode kernel and the decode
    lookup vs a measured device-to-device copy bandwidth.
(d) Clustered pipeline (``pallas_kernels.clustered_attention``): the fixed context
    reordered once by cluster (synthetic labels with lognormal cluster sizes, 4 sink
    + 100 exact-tail rows), then decode = ``clustered_decode_attention`` end to end
    (scoring kernel + attention kernel over contiguous cluster ranges + merge; a few
    tile configs, best reported) with retrieved rows, bytes and TB/s and a full-size
    compiled-vs-reference check; prefill = ``clustered_prefill_attention`` (lookup +
    range expansion + gather + cuDNN).  Its compiled-vs-reference checks at small
    shapes join the (a) list on the GPU (not in --cpu-smoke).

Timing: every function is compiled and warmed up on each of 3 input sets (query,
centroids, indices, new part rotate so L2 does not flatter; the big K/V are
shared, they never fit in L2); then the median over repetitions of the mean time
of back-to-back calls cycling over the 3 sets, each repetition ending in
``jax.block_until_ready``.  Failures are caught per case.  Writes
``DIR/gpu_kernels.json`` and ``DIR/gpu_kernels.md`` and prints the markdown last.

``--cpu-smoke`` runs the same plumbing on CPU at tiny shapes (kernels in Pallas
interpret mode, XLA dense attention) -- used by the tests; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (AttentionConfig, centroid_lookup_decode,
                            centroid_lookup_prefill, centroid_lookup_reference,
                            clusters_to_indices, dense_attention_reference, dense_decode_attention,
                            dense_prefill_attention, gather_then_dense_attention,
                            hierarchical_lookup_decode, hierarchical_lookup_prefill,
                            hierarchical_lookup_reference, hierarchical_scores, quest_decode_attention,
                            quest_decode_attention_reference, quest_page_minmax,
                            quest_page_scores, quest_page_scores_reference, quest_select,
                            saap_attention, saap_attention_reference, sparse_attention,
                            sparse_attention_reference)
from pallas_kernels import clustered_attention as clat
from pallas_kernels.centroid_lookup import DEFAULT_PREFILL, mosaic_applies, quantized_inputs
from sqjax.index_io import write_text_atomic
from pallas_kernels.sparse_attention import (GATHER_ZERO, _compact, gather_live_rows,
                                             gather_live_rows_reference)
from pallas_kernels.clustered_attention import (ClusteredConfig, cluster_sort_layout,
                                                clustered_decode_hierarchical,
                                                clustered_decode_hierarchical_reference,
                                                clustered_decode_attention,
                                                clustered_decode_attention_reference,
                                                clustered_decode_selected,
                                                clustered_decode_selected_reference,
                                                clustered_prefill_attention,
                                                clustered_prefill_attention_reference,
                                                clustered_prefill_hierarchical,
                                                clustered_prefill_hierarchical_reference)

BF16 = jnp.bfloat16


@dataclasses.dataclass
class Plan:
  backend: str                       # kernels: "pallas" (GPU) or "interpret" (CPU smoke)
  dense_impl: str                    # "cudnn" or "xla"
  hq: int = 32
  hkv: int = 8
  d: int = 128
  lengths: tuple[int, ...] = (131072, 524288)
  phases: tuple[tuple[str, int, int], ...] = (("decode", 1, 1024), ("prefill_1k", 1024, 1024),
                                              ("prefill_4k", 4096, 4096))
  sparsity: float = 0.9
  centroid_frac: float = 0.05
  reps: int = 7
  inner_decode: int = 20
  inner_prefill: int = 2
  n_sets: int = 3
  sweep: bool = True
  copy_bytes: int = 1 << 30
  checks: str = "full"               # "full" | "quick" | "smoke" | "none"
  check_scale: str = "gpu"           # "gpu" | "tiny"
  budget_s: float = 450.0


def make_plan(args) -> Plan:
  if args.cpu_smoke:
    plan = Plan(backend="interpret", dense_impl="xla", hq=4, hkv=2, d=32, lengths=(512,),
                phases=(("decode", 1, 16), ("prefill_16", 16, 16)), reps=1, inner_decode=1,
                inner_prefill=1, n_sets=2, sweep=False, copy_bytes=1 << 20, checks="smoke",
                check_scale="tiny", budget_s=600.0)
  elif args.quick:
    plan = Plan(backend="pallas", dense_impl="cudnn", lengths=(131072,),
                phases=(("decode", 1, 1024), ("prefill_1k", 1024, 1024)), reps=3,
                inner_decode=10, inner_prefill=1, sweep=False, checks="quick",
                budget_s=150.0)
  else:
    plan = Plan(backend="pallas", dense_impl="cudnn")
  if args.lengths:
    plan.lengths = tuple(int(x) for x in args.lengths.split(","))
  if args.skip_checks:
    plan.checks = "none"
  if args.no_sweep:
    plan.sweep = False
  if args.budget_s:
    plan.budget_s = float(args.budget_s)
  return plan


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------
def short_error(e: BaseException) -> str:
  msg = f"{type(e).__name__}: {e}"
  return msg if len(msg) < 600 else msg[:600] + " ..."


def time_fn(fn: Callable, sets: list[tuple], *, reps: int, inner: int) -> float:
  """Median over reps of the mean per-call time (ms) of `inner` back-to-back calls (benchmarks._meta)."""
  from benchmarks._meta import time_ms
  return time_ms(fn, sets, reps=reps, inner=inner)


def rel_err(a, b) -> float:
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  fin = np.isfinite(b)
  if not np.isfinite(a[fin]).all():
    return float("inf")
  denom = max(float(np.max(np.abs(b[fin]))) if fin.any() else 0.0, 1e-30)
  return float(np.max(np.abs(a[fin] - b[fin]))) / denom if fin.any() else 0.0


def git_commit() -> tuple[str, bool]:
  if os.environ.get("SQJAX_GIT_COMMIT"):  # set when the tree travels without .git
    return os.environ["SQJAX_GIT_COMMIT"], False
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                         timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, timeout=10).stdout.strip()
  except Exception:  # noqa: BLE001 - no git is fine
    return "uncommitted", True
  if not sha:
    return "uncommitted", True
  return (sha if not dirty else "uncommitted"), bool(dirty)


def device_name() -> str:
  dev = jax.devices()[0]
  return f"{dev.platform}:{getattr(dev, 'device_kind', str(dev))}"


# ----------------------------------------------------------------------------
# Synthetic inputs.
# ----------------------------------------------------------------------------
def synth_clusters(key, hkv, num_l, num_c):
  """Random cluster labels -> (counts [Hkv, C], offsets [Hkv, C + 1], keys [Hkv, L])."""
  labels = jax.random.randint(key, (hkv, num_l), 0, num_c)
  keys = jnp.argsort(labels, axis=1, stable=True).astype(jnp.int32)
  counts = jax.vmap(lambda x: jnp.bincount(x, length=num_c))(labels).astype(jnp.int32)
  offs = jnp.concatenate([jnp.zeros((hkv, 1), jnp.int32), jnp.cumsum(counts, axis=1)], axis=1)
  return counts, offs.astype(jnp.int32), keys


def synth_retrieval(key, hs, num_l, keep):
  """Per-head counts around keep*L (+-50%), sorted random positions; static cap."""
  cap = int(math.ceil(keep * 1.5 * num_l / 256) * 256)
  cap = min(cap, num_l) if num_l >= 256 else num_l
  k1, k2 = jax.random.split(key)
  u = jax.random.uniform(k1, (hs,), minval=-1.0, maxval=1.0)
  counts = jnp.clip(jnp.round(keep * num_l * (1 + 0.5 * u)), 0, cap).astype(jnp.int32)
  idx = jnp.sort(jax.random.randint(k2, (hs, cap), 0, num_l), axis=1).astype(jnp.int32)
  return idx, counts, cap


def calibrate_threshold(scores, counts_for_rows, keep):
  """Global threshold so that about `keep` of all keys fall in selected clusters."""
  s = np.asarray(scores, np.float64).reshape(-1)
  n = np.asarray(counts_for_rows, np.float64).reshape(-1)
  order = np.argsort(-s)
  cum = np.cumsum(n[order])
  i = int(np.searchsorted(cum, keep * n.sum()))
  i = min(i, len(order) - 1)
  return np.float32(s[order[i]])


# ----------------------------------------------------------------------------
# (a) Correctness checks.
# ----------------------------------------------------------------------------
def _check_inputs(rng, hq, hkv, d, num_l, num_c, seq_len, num_s, cap, hs, *, poison, causal_new=False):
  """Random check inputs; the new part's slots 20% empty, query i seeing slots 0..i. ``causal_new``:
  instead the layout a block's own keys have (no empty slot among them; T > S: the last S queries are
  the slots), which the dense prefill paths run under cuDNN's causal mask; "left": that layout with
  its first 5 queries and slots padding (``new_part="causal_left_padded"``); "prefix": a conversation's
  follow-up (``new_part="prefix_causal_left_padded"``): slots of its earlier turns, then the block with
  its first 5 queries and slots padding, then a fifth of the rest empty (num_s > seq_len + 5)."""
  q = rng.normal(size=(hq, seq_len, d))
  k = rng.normal(size=(hkv, num_l, d))
  v = rng.normal(size=(hkv, num_l, d))
  cent = rng.normal(size=(hkv, num_c, d))
  ccnt = rng.integers(1, 40, size=(hkv, num_c))
  ccnt[rng.random((hkv, num_c)) < 0.2] = 0
  ccnt[-1] = 0                                                  # a KV head with no cluster
  counts = rng.integers(cap // 3, cap + 1, size=(hs,))
  counts[0] = 0                                                 # a head with nothing
  idx = np.stack([np.sort(rng.choice(num_l, size=cap, replace=False)) for _ in range(hs)])
  idx = np.where(np.arange(cap)[None] < counts[:, None], idx, -7)
  if poison:                                                    # never-read rows are NaN
    used = np.zeros((hkv, num_l), bool)
    for s in range(hs):
      used[s // (hs // hkv), idx[s, :counts[s]]] = True
    k[~used] = np.nan
    v[~used] = np.nan
  kn = rng.normal(size=(hkv, num_s, d))
  vn = rng.normal(size=(hkv, num_s, d))
  kvp = num_l + np.arange(num_s)
  kvp[rng.random(num_s) < 0.2] = -1
  qp = num_l + max(num_s - seq_len, 0) + np.arange(seq_len)
  if causal_new:
    kvp = num_l + np.where(np.arange(num_s) < seq_len, np.arange(num_s), -1 - num_l)
    qp = num_l + min(num_s - seq_len, 0) + np.arange(seq_len)
  if causal_new == "prefix":
    n_prefix = (num_s - seq_len) * 4 // 5
    qp = np.where(np.arange(seq_len) < 5, -1, num_l + n_prefix + np.arange(seq_len) - 5)
    kvp = np.full(num_s, -1)
    kvp[:n_prefix] = num_l + np.arange(n_prefix)
    kvp[n_prefix:n_prefix + seq_len] = qp
  elif causal_new == "left":   # and the causal square's first 5 rows and slots padding (a left-padded question)
    off = seq_len - min(seq_len, num_s)
    qp[off:off + 5] = -1
    kvp[:5] = -1
  b = lambda x: jnp.asarray(x, BF16)
  i = lambda x: jnp.asarray(x, jnp.int32)
  return dict(q=b(q), k=b(k), v=b(v), cent=b(cent), ccnt=i(ccnt), idx=i(idx), counts=i(counts),
              kn=b(kn), vn=b(vn), qp=i(qp), kvp=i(kvp))


def _run_check(log, results: list, name: str, fn, tol: float) -> None:
  """Runs one compiled-vs-reference check ``fn() -> (max_rel_err, extra)``; records and logs it."""
  t0 = time.perf_counter()
  rec = {"name": name, "tol": tol}
  try:
    with jax.default_matmul_precision("highest"):
      err, extra = fn()
    rec.update(status="PASS" if err <= tol else "FAIL", max_rel_err=err, **extra)
  except Exception as e:  # noqa: BLE001 - report and continue
    rec.update(status="ERROR", error=short_error(e))
    traceback.print_exc(file=sys.stderr)
  rec["seconds"] = round(time.perf_counter() - t0, 2)
  log(f"[check] {rec['status']:5s} {name:44s} max_rel_err={rec.get('max_rel_err', float('nan')):.3g}"
      f" (tol {tol}) {rec.get('error', '')}")
  results.append(rec)


def run_checks(plan: Plan, log) -> list[dict]:
  if plan.checks == "none":
    return []
  be = plan.backend
  if plan.check_scale == "gpu":
    hq, hkv, d, num_l, num_c, seq_len, num_s, cap = 32, 8, 128, 3001, 150, 100, 77, 700
  else:
    hq, hkv, d, num_l, num_c, seq_len, num_s, cap = 4, 2, 32, 97, 21, 9, 7, 30
  rng = np.random.default_rng(1234)
  scale = d ** -0.5
  results = []

  check = functools.partial(_run_check, log, results)

  def padding(pad):  # a left-padded block's q_valid keyword: the first `pad` tokens are padding
    return {} if pad is None else {"q_valid": jnp.arange(seq_len) >= min(pad, seq_len - 1)}

  def lookup_case(vote, prefill, config=None, pad=None):
    x = _check_inputs(rng, hq, hkv, d, num_l, num_c, seq_len, num_s, cap, hkv, poison=False)
    q = x["q"] if prefill else x["q"][:, 0]
    kw = padding(pad)
    qr, cr = quantized_inputs(q, x["cent"]) if config is not None and config.prefill_int8 else (q, x["cent"])
    _, ref = centroid_lookup_reference(qr, cr, x["ccnt"], 0.0, scale=scale, vote=vote, **kw)
    thr = np.float32(np.quantile(np.asarray(ref)[np.asarray(ref) > 0], 0.8))
    f = centroid_lookup_prefill if prefill else centroid_lookup_decode
    sel, sc = f(q, x["cent"], x["ccnt"], thr, scale=scale, vote=vote, backend=be, config=config, **kw)
    far = np.abs(np.asarray(ref) - thr) > 1e-3 * float(np.max(ref))
    flips = int(np.sum((np.asarray(sel) != (np.asarray(ref) > thr)) & far))
    err = rel_err(sc, ref)
    return (err if flips == 0 else float("inf")), {"selection_flips": flips}

  def attn_case(seq_len_, hs, poison, fn=sparse_attention, causal_new=False, **kw):
    x = _check_inputs(rng, hq, hkv, d, num_l, num_c, seq_len_, num_s, cap, hs, poison=poison, causal_new=causal_new)
    args = (x["q"], x["k"], x["v"], x["idx"], x["counts"], x["kn"], x["vn"], x["qp"], x["kvp"])
    out, lse = fn(*args, scale=scale, return_lse=True, backend=be, **kw)
    ref, rlse = sparse_attention_reference(*args, scale=scale, return_lse=True)
    nan = bool(np.isnan(np.asarray(out, np.float32)).any())
    return (float("inf") if nan else rel_err(out, ref)), {"lse_err": rel_err(lse, rlse)}

  def gather_case(hs, splits=1):
    """The live-row gather: bit-exact copies of the reference's rows up to count + GATHER_ZERO (in
    each of ``splits`` round-robin chunks)."""
    from pallas_kernels.sparse_attention import interleaved_rows
    x = _check_inputs(rng, hq, hkv, d, num_l, num_c, 1, num_s, cap, hs, poison=False)
    comp, n = _compact(x["idx"], x["counts"], num_l)
    ko, vo = gather_live_rows(x["k"], x["v"], comp, n, backend=be, splits=splits)
    kr, vr = gather_live_rows_reference(x["k"], x["v"], comp, n, splits)
    chunk = ko.shape[1] // splits
    lens = np.asarray(interleaved_rows(n, ko.shape[1], splits)[1])
    err = 0.0
    for a, b in ((ko, kr), (vo, vr)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      for s_ in range(hs):
        for c in range(splits):
          part = slice(c * chunk, c * chunk + min(chunk, int(lens[s_, c]) + GATHER_ZERO))
          err = max(err, float(np.abs(a[s_, part] - b[s_, part]).max(initial=0.0)))
    return err, {"rows_live": int(np.asarray(n).sum()), "cap_p": int(ko.shape[1])}

  def hier_case(vote, prefill, parent_major, config=None, pad=None):
    x = _check_inputs(rng, hq, hkv, d, num_l, num_c, seq_len, num_s, cap, hkv, poison=False)
    c1n = max(2, num_c // 5)
    parent = rng.integers(0, c1n, size=(hkv, num_c))
    parent = jnp.asarray(np.sort(parent, axis=1) if parent_major else parent, jnp.int32)
    c1 = jnp.asarray(rng.normal(size=(hkv, c1n, d)), BF16)
    n1 = jax.vmap(lambda p, n: jnp.zeros(c1n, jnp.int32).at[p].add(n))(parent, x["ccnt"])
    q = x["q"] if prefill else x["q"][:, 0]
    t1 = np.float32(0.5 / c1n)
    args = (q, c1, n1, x["cent"], x["ccnt"], parent, t1, np.float32(1.0 / num_c))
    f = hierarchical_lookup_prefill if prefill else hierarchical_lookup_decode
    kw = padding(pad)
    sel, sc, nt = f(*args, scale=scale, vote=vote, backend=be, config=config, **kw)
    if config is not None and config.prefill_int8:   # the reference over the kernels' int8 inputs
      qr, c1r, c2r = quantized_inputs(q, c1, x["cent"])
      args = (qr, c1r, n1, c2r, *args[4:])
    rsel, rsc, rnt = hierarchical_lookup_reference(*args, scale=scale, vote=vote, **kw)
    touched_diff = int(np.abs(np.asarray(nt) - np.asarray(rnt)).max())
    return rel_err(sc, rsc), {"n_touched_max_diff": touched_diff}

  def quest_case():
    x = _check_inputs(rng, hq, hkv, d, num_l, num_c, 1, num_s, cap, hkv, poison=False)
    q = x["q"][:, 0]
    mn, mx = quest_page_minmax(x["k"], 16)
    sc = quest_page_scores(q, mn, mx, vote="kv", backend=be)
    e1 = rel_err(sc, quest_page_scores_reference(q, mn, mx, vote="kv"))
    pages = quest_select(sc, max(1, cap // 16), force_page=mn.shape[1] - 1)
    args = (q, x["k"], x["v"], pages, x["kn"], x["vn"], x["qp"], x["kvp"])
    out = quest_decode_attention(*args, scale=scale, backend=be)
    e2 = rel_err(out, quest_decode_attention_reference(*args, scale=scale))
    return max(e1, e2), {"scores_err": e1, "attn_err": e2}

  def saap_case():
    x = _check_inputs(rng, hq, hkv, d, num_l, num_c, 1, num_s, cap, hkv, poison=False)
    nb = 16
    counts_b, offs, keys = synth_clusters(jax.random.PRNGKey(3), hkv, num_l, nb)
    bidx = jnp.asarray(np.stack([rng.choice(nb, size=5) for _ in range(hkv)]), jnp.int32)
    args = (x["q"][:, 0], x["k"], x["v"], offs, keys, bidx, x["kn"], x["vn"], x["qp"], x["kvp"])
    kw = dict(scale=scale, n_sink=1, n_recent=min(63, num_l // 4))
    out = saap_attention(*args, **kw, backend=be)
    return rel_err(out, saap_attention_reference(*args, **kw)), {}

  def dense_case(seq_len_, fn=dense_decode_attention, causal_new=False, num_s_=num_s, **kw):
    x = _check_inputs(rng, hq, hkv, d, num_l, num_c, seq_len_, num_s_, cap, hkv, poison=False, causal_new=causal_new)
    args = (x["q"], x["k"], x["v"], x["kn"], x["vn"], x["qp"], x["kvp"])
    out, lse = fn(*args, scale=scale, return_lse=True, backend=be, **kw)
    ref, rlse = dense_attention_reference(*args, scale=scale, return_lse=True)
    extra = {"lse_err": rel_err(lse, rlse)}
    if causal_new:   # the layout the check is for takes the causal (and prefix) route, not the position mask
      from pallas_kernels.sparse_attention import causal_alignment
      mode = kw.get("new_part", "causal")
      extra["aligned"] = bool(causal_alignment(x["qp"], x["kvp"], mode != "causal", mode.startswith("prefix"))[2])
      if not extra["aligned"]:
        return float("inf"), extra
    return rel_err(out, ref), extra

  tl, ta = 1e-2, 2e-2
  check("dense split-KV decode (Pallas dense baseline)", lambda: dense_case(1), ta)
  check("dense split-KV prefill block", lambda: dense_case(seq_len), ta)
  check("dense flash prefill block (cuDNN over the fixed K/V in place)",
        lambda: dense_case(seq_len, dense_prefill_attention), 3e-2)
  check("dense flash prefill block, the block's own keys (causal mask)",
        lambda: dense_case(seq_len, dense_prefill_attention, causal_new=True), 3e-2)
  check("dense flash prefill block, a left-padded block's own keys (rolled causal mask)",
        lambda: dense_case(seq_len, dense_prefill_attention, causal_new="left", new_part="causal_left_padded"), 3e-2)
  check("dense flash prefill block, a follow-up after its turns (prefix in key splits + rolled causal mask)",
        lambda: dense_case(seq_len, dense_prefill_attention, causal_new="prefix", num_s_=24 * seq_len,
                           new_part="prefix_causal_left_padded"), 3e-2)

  def flash_splits_case():
    # the prefill fast paths' fixed part in key chunks with per-head key counts (one head with no
    # key, one with all): 16 tokens x 4 query heads per KV head over 16K keys -> 8 chunks
    from pallas_kernels.sparse_attention import dense_reference, fixed_plus_new
    big = plan.check_scale == "gpu"
    lk, t_ = (16384, 16) if big else (64, 3)
    g_ = hq // hkv
    qq = jnp.asarray(rng.normal(size=(hq, t_, d)), BF16)
    kk, vv = (jnp.asarray(rng.normal(size=(hkv, lk, 1, d)), BF16) for _ in range(2))
    n = jnp.asarray(rng.integers(1, lk, size=hkv), jnp.int32).at[0].set(0).at[1].set(lk)
    none = jnp.zeros((hkv, 0, d), BF16)
    splits = 8 if big else 4
    o, lse = fixed_plus_new(qq, kk, vv, n, none, none, jnp.zeros((t_,), jnp.int32), jnp.zeros((0,), jnp.int32),
                            scale=scale, implementation="cudnn" if be == "pallas" else "xla", return_lse=True,
                            kv_splits=splits)
    mask = jnp.broadcast_to((jnp.arange(lk)[None, :] < n[:, None])[:, None], (hkv, t_, lk))
    ro, rl = dense_reference(qq.reshape(hkv, g_, t_, d), kk[:, :, 0], vv[:, :, 0], mask, scale=scale)
    ro = ro.reshape(hq, t_, d)
    live = np.repeat(np.asarray(n) > 0, g_)
    assert np.all(np.isneginf(np.asarray(lse)[~live])), "a head with no key must have lse -inf"
    return rel_err(o[live], ro[live]), {"lse_err": rel_err(lse[live], rl.reshape(hq, t_)[live]), "splits": splits}

  check("flash fixed part in key splits, per-head key counts", flash_splits_case, 3e-2)
  check("centroid_lookup_prefill vote=kv", lambda: lookup_case("kv", True), tl)
  check("centroid_lookup_decode vote=kv", lambda: lookup_case("kv", False), tl)
  check("sparse_attention decode Hs=Hkv poisoned", lambda: attn_case(1, hkv, True), ta)
  check("sparse_attention prefill Hs=Hkv poisoned", lambda: attn_case(seq_len, hkv, True), ta)
  check("gather_then_dense prefill Hs=Hkv", lambda: attn_case(
      seq_len, hkv, True, fn=gather_then_dense_attention), 3e-2)
  check("gather_then_dense prefill Hs=Hkv, the block's own keys (causal mask)", lambda: attn_case(
      seq_len, hkv, True, fn=gather_then_dense_attention, causal_new=True), 3e-2)
  check("gather_live_rows Hs=Hq (exact copy)", lambda: gather_case(hq), 0.0)
  check("gather_live_rows Hs=Hkv, 4 round-robin splits (exact copy)", lambda: gather_case(hkv, 4), 0.0)
  if plan.checks == "full":
    check("centroid_lookup_prefill vote=q", lambda: lookup_case("q", True), tl)
    check("centroid_lookup_decode vote=q", lambda: lookup_case("q", False), tl)
    check("sparse_attention decode Hs=Hq", lambda: attn_case(1, hq, False), ta)
    check("sparse_attention prefill Hs=Hq", lambda: attn_case(seq_len, hq, False), ta)
    # a left-padded question block: the mean over its real tokens only (q_valid)
    check("centroid_lookup_prefill vote=kv, left-padded block", lambda: lookup_case("kv", True, pad=seq_len // 3), tl)
    check("hierarchical_lookup_prefill vote=kv, left-padded block",
          lambda: hier_case("kv", True, False, pad=seq_len // 3), tl)
  if plan.checks == "full" and mosaic_applies(BF16, d, be):
    # the opt-in Mosaic GPU prefill passes (CentroidLookupConfig(prefill_engine="mosaic"))
    mos = dataclasses.replace(DEFAULT_PREFILL, prefill_engine="mosaic")
    check("centroid_lookup_prefill vote=kv, Mosaic GPU passes", lambda: lookup_case("kv", True, mos), tl)
    check("hierarchical_lookup_prefill vote=kv, Mosaic GPU passes",
          lambda: hier_case("kv", True, True, mos), tl)
  if plan.checks == "full":
    # the opt-in int8 logits of the prefill passes (CentroidLookupConfig(prefill_int8=...)), against the
    # reference over the same int8-quantized inputs
    for mode in ("cvt", "magic"):
      i8 = dataclasses.replace(DEFAULT_PREFILL, prefill_int8=mode)
      check(f"centroid_lookup_prefill vote=kv, int8 logits ({mode})", lambda i8=i8: lookup_case("kv", True, i8), tl)
      check(f"hierarchical_lookup_prefill vote=q, int8 logits ({mode})", lambda i8=i8: hier_case("q", True, False, i8), tl)
  if plan.checks in ("full", "smoke"):
    check("hierarchical_lookup_prefill vote=kv parent-major", lambda: hier_case("kv", True, True), tl)
    check("hierarchical_lookup_prefill vote=q", lambda: hier_case("q", True, False), tl)
    check("hierarchical_lookup_decode vote=q", lambda: hier_case("q", False, False), tl)
    check("hierarchical_lookup_decode vote=kv parent-major", lambda: hier_case("kv", False, True), tl)
    check("quest scores + page-sparse decode", quest_case, ta)
    check("saap_attention decode", saap_case, ta)
  if plan.checks in ("full", "quick"):
    # (not in --cpu-smoke, whose check count the plumbing test pins; the tests run
    # run_clustered_checks directly at tiny shapes)
    results += run_clustered_checks(plan, log)
  return results


def synth_labels(key, hkv, n, num_c, sigma=1.0):
  """Cluster labels [Hkv, n] with k-means-like size variation: cluster weights are
  lognormal(0, sigma) (sizes from 0 to ~10x the mean), inverse-CDF sampling."""
  kw, ku = jax.random.split(key)
  w = jnp.exp(sigma * jax.random.normal(kw, (hkv, num_c)))
  cdf = jnp.cumsum(w, axis=1) / jnp.sum(w, axis=1, keepdims=True)
  u = jax.random.uniform(ku, (hkv, n))
  lab = jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))(cdf, u)
  return jnp.minimum(lab, num_c - 1).astype(jnp.int32)


def gap_threshold(scores, valid, lo_q=0.7, hi_q=0.9):
  """A threshold inside the widest relative gap between consecutive valid scores in
  the [lo_q, hi_q] quantile window: no score sits near it, so a few ulps between a
  compiled kernel and the reference never flip a selection."""
  s = np.sort(np.asarray(scores, np.float64)[np.asarray(valid)].reshape(-1))
  if s.size < 2:
    return np.float32(0.5 * (s[0] if s.size else 1.0))
  a, b = int(lo_q * (s.size - 1)), max(int(hi_q * (s.size - 1)), int(lo_q * (s.size - 1)) + 1)
  lo, hi = s[a:b], s[a + 1:b + 1]
  i = int(np.argmax((hi - lo) / np.maximum(np.abs(hi), 1e-30)))
  return np.float32(0.5 * (lo[i] + hi[i]))


def run_clustered_checks(plan: Plan, log) -> list[dict]:
  """Clustered (cluster-contiguous layout) decode/prefill: compiled vs reference, bf16."""
  be = plan.backend
  if plan.check_scale == "gpu":
    hq, hkv, d, num_l, num_c, seq_len, num_s, n_sink, n_tail = 32, 8, 128, 3001, 150, 100, 77, 4, 100
  else:
    hq, hkv, d, num_l, num_c, seq_len, num_s, n_sink, n_tail = 4, 2, 32, 157, 21, 9, 7, 2, 11
  rng = np.random.default_rng(4321)
  scale = d ** -0.5
  results = []
  b = lambda x: jnp.asarray(x, BF16)
  i32 = lambda x: jnp.asarray(x, jnp.int32)

  def inputs(vote, prefill, poison=True, q_valid=None):
    k = rng.normal(size=(hkv, num_l, d))
    v = rng.normal(size=(hkv, num_l, d))
    lab = np.asarray(synth_labels(jax.random.PRNGKey(int(rng.integers(1 << 30))), hkv,
                                  num_l - n_sink - n_tail, num_c, sigma=1.5))
    ks, vs, offs, _ = cluster_sort_layout(b(k), b(v), i32(lab), n_sink, n_tail,
                                          num_clusters=num_c)
    cnt = np.diff(np.asarray(offs), axis=1)
    cent = rng.normal(size=(hkv, num_c, d))
    cent[cnt == 0] = np.nan                                     # never read
    t = seq_len if prefill else 1
    q = b(rng.normal(size=(hq, t, d)))
    kn = rng.normal(size=(hkv, num_s, d))
    vn = rng.normal(size=(hkv, num_s, d))
    kvp = num_l + np.arange(num_s)
    kvp[rng.random(num_s) < 0.2] = -1
    kn[:, kvp < 0] = np.nan                                     # padding slots: never read
    vn[:, kvp < 0] = np.nan
    qp = num_l + max(num_s - t, 0) + np.arange(t)
    if q_valid is not None:                                     # a left-padded block: padding at position -1
      qp = np.where(np.asarray(q_valid), qp, -1)
    _, sc = centroid_lookup_reference(q if prefill else q[:, 0], b(cent), i32(cnt), 0.0,
                                      scale=scale, vote=vote, q_valid=q_valid)
    g_s = sc.shape[0] // hkv
    thr = gap_threshold(sc, np.repeat(cnt > 0, g_s, axis=0))
    args = [q if prefill else q[:, 0], ks, vs, b(cent), offs, jnp.float32(thr), b(kn), b(vn),
            i32(qp[-1:] if not prefill else qp), i32(kvp)]
    if not poison:
      return args
    # poison the rows no selection head of the group retrieves
    sel = np.asarray(sc) > thr
    used = np.zeros((hkv, num_l), bool)
    o = np.asarray(offs)
    for s in range(sel.shape[0]):
      h = s // g_s
      used[h, o[h, -1]:] = True
      for c in np.nonzero(sel[s] & (cnt[h] > 0))[0]:
        used[h, o[h, c]:o[h, c + 1]] = True
    args[1] = jnp.where(jnp.asarray(used)[..., None], ks, jnp.nan).astype(BF16)
    args[2] = jnp.where(jnp.asarray(used)[..., None], vs, jnp.nan).astype(BF16)
    return args

  def case(vote, prefill, padded=False):
    """``padded``: a left-padded block (the question route: q_valid, no capacity, the causal square
    rolled past the padding)."""
    qv = jnp.arange(seq_len) >= 3 if padded else None
    args = inputs(vote, prefill, q_valid=qv)
    if prefill:
      kw = dict(capacity=None, q_valid=qv, new_part="causal_left_padded") if padded else dict(capacity=num_l // 2)
      out, sel, rows = clustered_prefill_attention(*args, scale=scale, vote=vote, return_stats=True, backend=be,
                                                   **kw)
      ref, rsel, rrows = clustered_prefill_attention_reference(*args, scale=scale, vote=vote,
                                                               return_stats=True, q_valid=qv)
    else:
      out, sel, rows = clustered_decode_attention(*args, scale=scale, vote=vote,
                                                  return_stats=True, backend=be)
      ref, rsel, rrows = clustered_decode_attention_reference(*args, scale=scale, vote=vote,
                                                              return_stats=True)
    flips = int(np.sum(np.asarray(sel) != np.asarray(rsel)))
    rows_diff = int(np.abs(np.asarray(rows) - np.asarray(rrows)).max())
    nan = bool(np.isnan(np.asarray(out, np.float32)).any())
    err = rel_err(out, ref)
    bad = nan or flips or rows_diff
    return (float("inf") if bad else err), {"selection_flips": flips, "rows_max_diff": rows_diff,
                                            "nan": nan}

  def selected_case(vote):
    """The attention kernel over a given selection (what hierarchical decode feeds it): the
    reference's own selection, unselected rows poisoned."""
    args = inputs(vote, False)
    _, rsel, _ = clustered_decode_attention_reference(*args, scale=scale, vote=vote, return_stats=True)
    sargs = (*args[:3], args[4], rsel, *args[6:])
    out = clustered_decode_selected(*sargs, scale=scale, vote=vote, backend=be)
    ref = clustered_decode_selected_reference(*sargs, scale=scale)
    nan = bool(np.isnan(np.asarray(out, np.float32)).any())
    return (float("inf") if nan else rel_err(out, ref)), {"nan": nan}

  def hier_decode_case(vote, prefill=False):
    """Hierarchical decode (level-2 logits handed to the attention kernel; ``prefill``: a block's
    hierarchical lookup kernels, then the gather + cuDNN route) vs the reference
    (hierarchical lookup, then attention over its selection): a random level-1 tree over the
    layout's clusters, T1 / T2 in gaps of the reference scores, the rows the hierarchical selection
    leaves out poisoned (in clean K/V: the 1-level poisoning of ``inputs`` would also hide rows
    that only the hierarchy selects)."""
    args = inputs(vote, prefill, poison=False)
    q, offs = args[0], args[4]
    cnt = np.diff(np.asarray(offs), axis=1)
    c2 = b(np.nan_to_num(np.asarray(args[3], np.float32)))
    num_c1 = max(2, num_c // 5)
    parent = rng.integers(0, num_c1, size=(hkv, num_c))
    c2f = np.asarray(c2, np.float32)
    c1 = np.stack([np.stack([c2f[h, parent[h] == p].mean(0) if (parent[h] == p).any() else np.zeros(d)
                             for p in range(num_c1)]) for h in range(hkv)])
    n1 = np.stack([[cnt[h, parent[h] == p].sum() for p in range(num_c1)] for h in range(hkv)])
    tree = (b(c1), i32(n1), c2, i32(cnt), i32(parent))
    hs = hq if vote == "q" else hkv
    _, s1, _, _ = hierarchical_scores(q, *tree, jnp.float32(0.0), scale=scale, vote=vote, backend="reference")
    t1 = gap_threshold(np.asarray(s1), np.repeat(n1 > 0, hs // hkv, axis=0), 0.3, 0.6)
    s2, _, cand, _ = hierarchical_scores(q, *tree, jnp.float32(t1), scale=scale, vote=vote, backend="reference")
    t2 = gap_threshold(np.asarray(s2), np.asarray(cand), 0.5, 0.9)
    sel = np.asarray(cand) & (np.asarray(s2) > t2)
    used = np.zeros((hkv, num_l), bool)
    o = np.asarray(offs)
    for sh in range(hs):
      h = sh // (hs // hkv)
      used[h, o[h, -1]:] = True
      for c in np.nonzero(sel[sh])[0]:
        used[h, o[h, c]:o[h, c + 1]] = True
    ks = jnp.where(jnp.asarray(used)[..., None], args[1], jnp.nan).astype(BF16)
    vs = jnp.where(jnp.asarray(used)[..., None], args[2], jnp.nan).astype(BF16)
    hargs = (q, ks, vs, b(c1), i32(n1), c2, offs, i32(parent), jnp.float32(t1), jnp.float32(t2), *args[6:])
    if prefill:
      out = clustered_prefill_hierarchical(*hargs, scale=scale, vote=vote, backend=be)
      ref = clustered_prefill_hierarchical_reference(*hargs, scale=scale, vote=vote)
    else:
      out = clustered_decode_hierarchical(*hargs, scale=scale, vote=vote, backend=be)
      ref = clustered_decode_hierarchical_reference(*hargs, scale=scale, vote=vote)
    nan = bool(np.isnan(np.asarray(out, np.float32)).any())
    return (float("inf") if nan else rel_err(out, ref)), {"nan": nan, "selected": int(sel.sum()),
                                                          "candidates": int(np.asarray(cand).sum())}

  check = functools.partial(_run_check, log, results)

  check("clustered_decode vote=kv poisoned", lambda: case("kv", False), 2e-2)
  check("clustered_decode_hierarchical vote=kv poisoned", lambda: hier_decode_case("kv"), 2e-2)
  check("clustered_prefill vote=kv poisoned", lambda: case("kv", True), 3e-2)
  check("clustered_prefill vote=kv left-padded, no capacity", lambda: case("kv", True, padded=True), 3e-2)
  check("clustered_prefill_hierarchical vote=kv poisoned", lambda: hier_decode_case("kv", prefill=True), 3e-2)
  if plan.check_scale == "gpu":          # tiny (CPU test of the plumbing): the five above
    check("clustered_decode vote=q poisoned", lambda: case("q", False), 2e-2)
    check("clustered_decode_hierarchical vote=q poisoned", lambda: hier_decode_case("q"), 2e-2)
    check("clustered_decode_selected vote=kv poisoned", lambda: selected_case("kv"), 2e-2)
    if plan.checks == "full":
      check("clustered_prefill vote=q poisoned", lambda: case("q", True), 3e-2)
  return results


# ----------------------------------------------------------------------------
# (b) + (c) Timings.
# ----------------------------------------------------------------------------
def attention_configs(plan: Plan, seq_len: int) -> list[AttentionConfig | None]:
  if not plan.sweep:
    return [None]
  if seq_len == 1:
    return [None, AttentionConfig(block_rows=16, block_k=128, num_warps=4),
            AttentionConfig(block_rows=16, block_k=32, num_warps=2)]
  return [None, AttentionConfig(block_rows=64, block_k=64, num_warps=4),
          AttentionConfig(block_rows=128, block_k=32, num_warps=4)]


def copy_bandwidth(plan: Plan) -> dict:
  n = plan.copy_bytes // 2
  x = [jnp.full((n,), i, BF16) for i in range(2)]
  f = jax.jit(lambda a: a + 1)
  ms = time_fn(f, [(a,) for a in x], reps=max(3, plan.reps), inner=5)
  return {"bytes": 2 * n * 2, "ms": ms, "tb_per_s": 2 * n * 2 / (ms * 1e-3) / 1e12}


def run_length(plan: Plan, num_l: int, log, deadline: float) -> list[dict]:
  hq, hkv, d = plan.hq, plan.hkv, plan.d
  hs = hkv
  scale = d ** -0.5
  keep = 1.0 - plan.sparsity
  num_c = max(1, round(plan.centroid_frac * num_l))
  be = plan.backend
  key = jax.random.PRNGKey(num_l)
  kk, kv_, kc, kr = jax.random.split(key, 4)
  k = jax.random.normal(kk, (hkv, num_l, d), BF16)
  v = jax.random.normal(kv_, (hkv, num_l, d), BF16)
  ccounts, coffs, ckeys = synth_clusters(kc, hkv, num_l, num_c)
  # Cluster-contiguous layout for the clustered pipeline, built once (offline step).
  layout, layout_err, layout_s = None, None, 0.0
  try:
    t0 = time.perf_counter()
    layout = build_clustered_layout(plan, k, v, num_c, jax.random.fold_in(key, 7))
    layout_s = time.perf_counter() - t0
    log(f"[time] L={num_l} clustered layout built in {layout_s:.1f}s "
        f"(C={num_c}, exact rows {layout['n_exact']})")
  except Exception as e:  # noqa: BLE001 - the other rows still run
    layout_err = short_error(e)
    log(f"[time] L={num_l} clustered layout: ERROR {layout_err}")
    traceback.print_exc(file=sys.stderr)
  out_cases = []
  for phase, seq_len, num_s in plan.phases:
    case: dict[str, Any] = {"L": num_l, "phase": phase, "T": seq_len, "S": num_s,
                            "C": num_c, "Hq": hq, "Hkv": hkv, "d": d, "dtype": "bfloat16",
                            "sparsity": plan.sparsity, "errors": {}}
    out_cases.append(case)
    if time.perf_counter() > deadline:
      case["errors"]["all"] = "skipped: time budget exhausted"
      log(f"[time] L={num_l} {phase}: skipped (time budget)")
      continue
    inner = plan.inner_decode if seq_len == 1 else plan.inner_prefill
    sets = []
    for i in range(plan.n_sets):
      ks = jax.random.split(jax.random.fold_in(kr, 1000 * seq_len + i), 5)
      q = jax.random.normal(ks[0], (hq, seq_len, d), BF16)
      cent = jax.random.normal(ks[1], (hkv, num_c, d), BF16)
      idx, counts, cap = synth_retrieval(ks[2], hs, num_l, keep)
      kn = jax.random.normal(ks[3], (hkv, num_s, d), BF16)
      vn = jax.random.normal(ks[4], (hkv, num_s, d), BF16)
      kvp = (num_l + jnp.arange(num_s)).astype(jnp.int32)
      qp = (num_l + num_s - seq_len + jnp.arange(seq_len)).astype(jnp.int32)
      sets.append(dict(q=q, cent=cent, idx=idx, counts=counts, kn=kn, vn=vn, kvp=kvp, qp=qp))
    case["cap"] = cap
    case["retrieved_frac_synthetic"] = float(np.mean([np.asarray(s["counts"]).mean() / num_l
                                                     for s in sets]))
    case["counts_synthetic_first_set"] = np.asarray(sets[0]["counts"]).tolist()

    def attempt(name, fn):
      if time.perf_counter() > deadline:
        case["errors"][name] = "skipped: time budget exhausted"
        return None
      t0 = time.perf_counter()
      try:
        val = fn()
        log(f"[time] L={num_l} {phase:11s} {name:22s} {val if not isinstance(val, float) else f'{val:.4f} ms'}"
            f"   ({time.perf_counter() - t0:.1f}s incl. compile)")
        return val
      except Exception as e:  # noqa: BLE001
        case["errors"][name] = short_error(e)
        log(f"[time] L={num_l} {phase} {name}: ERROR {short_error(e)}")
        traceback.print_exc(file=sys.stderr)
        return None

    # Threshold giving ~keep of the keys (calibrated once, outside the timings).
    def calib():
      s0 = sets[0]
      if seq_len == 1:
        _, sc = centroid_lookup_decode(s0["q"][:, 0], s0["cent"], ccounts, 0.0, scale=scale,
                                       backend=be)
      else:
        _, sc = centroid_lookup_prefill(s0["q"], s0["cent"], ccounts, 0.0, scale=scale,
                                        backend=be)
      return calibrate_threshold(sc, ccounts, keep)
    thr = attempt("calibrate", calib)
    thr = np.float32(0.0) if thr is None else thr
    case["threshold"] = float(thr)

    # Big shared arrays are passed as arguments (never closed over: no HLO constants).
    if seq_len == 1:
      lookup = jax.jit(lambda q, c, n: centroid_lookup_decode(q[:, 0], c, n, thr, scale=scale,
                                                              backend=be))
    else:
      lookup = jax.jit(lambda q, c, n: centroid_lookup_prefill(q, c, n, thr, scale=scale,
                                                               backend=be))
    lk_sets = [(s["q"], s["cent"], ccounts) for s in sets]
    case["lookup_ms"] = attempt("lookup", lambda: time_fn(lookup, lk_sets, reps=plan.reps,
                                                          inner=inner))

    at_sets = [(s["q"], k, v, s["idx"], s["counts"], s["kn"], s["vn"], s["qp"], s["kvp"])
               for s in sets]
    case["attn_ms_by_config"] = {}
    for cfg in attention_configs(plan, seq_len):
      label = "default" if cfg is None else (f"rows{cfg.block_rows}_bk{cfg.block_k}"
                                             f"_w{cfg.num_warps}")
      fn = jax.jit(functools.partial(sparse_attention, scale=scale, backend=be, config=cfg))
      ms = attempt(f"attn[{label}]", lambda: time_fn(fn, at_sets, reps=plan.reps, inner=inner))
      if ms is not None:
        case["attn_ms_by_config"][label] = ms
    if case["attn_ms_by_config"]:
      best = min(case["attn_ms_by_config"], key=case["attn_ms_by_config"].get)
      case["attn_ms"], case["attn_best_config"] = case["attn_ms_by_config"][best], best

    if seq_len > 1:
      gbe = "pallas" if be == "pallas" else "interpret"
      gfn = jax.jit(functools.partial(gather_then_dense_attention, scale=scale, backend=gbe))
      case["gather_dense_ms"] = attempt("gather+cuDNN", lambda: time_fn(
          gfn, at_sets, reps=plan.reps, inner=inner))

    # Whole pipeline: lookup -> cluster key lists (clusters_to_indices) -> sparse attention,
    # one jit; capacity 2x the target so per-head variation does not overflow.
    cap_pipe = min(num_l, int(math.ceil(2 * keep * num_l / 256) * 256)) if num_l >= 256 else num_l

    def index_sets():
      return [(lookup(*a)[0], coffs, ckeys) for a in lk_sets]
    ifn = jax.jit(functools.partial(clusters_to_indices, cap=cap_pipe))
    case["index_ms"] = attempt("index_build", lambda: time_fn(ifn, index_sets(), reps=plan.reps,
                                                              inner=inner))

    def pipeline(q, c, n, offs, keys, k, v, kn, vn, qp, kvp):
      if seq_len == 1:
        sel, _ = centroid_lookup_decode(q[:, 0], c, n, thr, scale=scale, backend=be)
      else:
        sel, _ = centroid_lookup_prefill(q, c, n, thr, scale=scale, backend=be)
      idx, cnt, wanted = clusters_to_indices(sel, offs, keys, cap=cap_pipe)
      out = sparse_attention(q, k, v, idx, cnt, kn, vn, qp, kvp, scale=scale, backend=be)
      return out, cnt, wanted
    pfn = jax.jit(pipeline)
    pp_sets = [(s["q"], s["cent"], ccounts, coffs, ckeys, k, v, s["kn"], s["vn"], s["qp"],
                s["kvp"]) for s in sets]
    case["pipeline_cap"] = cap_pipe
    case["pipeline_ms"] = attempt("pipeline", lambda: time_fn(pfn, pp_sets, reps=plan.reps,
                                                              inner=inner))

    def pipe_stats():
      _, cnt, wanted = pfn(*pp_sets[0])
      cnt, wanted = np.asarray(cnt), np.asarray(wanted)
      case["pipeline_counts"] = cnt.tolist()
      case["pipeline_overflow_heads"] = int(np.sum(wanted > cap_pipe))
      case["pipeline_retrieved_frac"] = float(cnt.mean() / num_l)
      return f"retrieved {cnt.mean() / num_l:.3f} of L, overflow heads {int(np.sum(wanted > cap_pipe))}"
    if case.get("pipeline_ms") is not None:
      attempt("pipeline_stats", pipe_stats)

    # Dense baseline over all L + S keys (non-causal: <1% more work than causal).
    kfull = jnp.concatenate([k, sets[0]["kn"]], axis=1).transpose(1, 0, 2)[None]
    vfull = jnp.concatenate([v, sets[0]["vn"]], axis=1).transpose(1, 0, 2)[None]
    dn_sets = [(s["q"].transpose(1, 0, 2)[None], kfull, vfull) for s in sets]
    dfn = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=scale,
                                    implementation=plan.dense_impl))
    case["dense_ms"] = attempt("dense", lambda: time_fn(dfn, dn_sets, reps=plan.reps,
                                                        inner=inner))
    del kfull, vfull, dn_sets

    parts = [case.get("lookup_ms"), case.get("index_ms"), case.get("attn_ms")]
    case["total_ms"] = sum(parts) if all(p is not None for p in parts) else None
    total = case.get("pipeline_ms") or case.get("total_ms")
    case["ratio"] = (case["dense_ms"] / total) if (case.get("dense_ms") and total) else None

    if seq_len == 1 and case.get("attn_ms"):
      byts = []
      for s in sets:
        n = float(np.asarray(s["counts"]).sum())
        byts.append(n * 2 * d * 2 + n * 4 + hs * num_s * 2 * d * 2)
      b = float(np.mean(byts))
      case["attn_bytes"] = b
      case["attn_tb_per_s"] = b / (case["attn_ms"] * 1e-3) / 1e12
      lb = hkv * num_c * (d * 2 + 4) + 2 * hq * num_c * 4
      case["lookup_bytes"] = float(lb)
      if case.get("lookup_ms"):
        case["lookup_tb_per_s"] = lb / (case["lookup_ms"] * 1e-3) / 1e12
      db = hkv * (num_l + num_s) * 2 * d * 2
      case["dense_bytes"] = float(db)
      if case.get("dense_ms"):
        case["dense_tb_per_s"] = db / (case["dense_ms"] * 1e-3) / 1e12
    if layout is None:
      case["errors"]["clustered_layout"] = layout_err
    else:
      case["clustered_layout_s"] = layout_s
      try:
        run_clustered(plan, case, sets, layout, attempt, seq_len=seq_len, num_s=num_s,
                      inner=inner)
      except Exception as e:  # noqa: BLE001 - never stops the other cases
        case["errors"]["clustered"] = short_error(e)
        traceback.print_exc(file=sys.stderr)
    del sets, at_sets, pp_sets, lk_sets
  return out_cases


def build_clustered_layout(plan: Plan, k, v, num_c: int, key) -> dict:
  """Synthetic labels (lognormal cluster sizes) -> sorted K/V + offsets; sink 4 rows,
  exact tail 100 rows (DESIGN 3.1 n_obs), scaled down for tiny smoke shapes."""
  hkv, num_l, _ = k.shape
  n_sink, n_tail = (4, 100) if num_l >= 4096 else (2, 11)
  labels = synth_labels(key, hkv, num_l - n_sink - n_tail, num_c)
  ks, vs, offs, _ = cluster_sort_layout(k, v, labels, n_sink, n_tail, num_clusters=num_c)
  jax.block_until_ready((ks, vs, offs))
  cnt = jnp.diff(offs, axis=1).astype(jnp.int32)
  sizes = np.asarray(cnt)
  return {"k": ks, "v": vs, "offs": offs, "counts": cnt, "n_exact": n_sink + n_tail,
          "n_sink": n_sink, "n_tail": n_tail,
          "size_stats": {"mean": float(sizes.mean()), "max": int(sizes.max()),
                         "empty_frac": float((sizes == 0).mean()),
                         "p99": float(np.percentile(sizes, 99))}}


def clustered_configs(plan: Plan) -> list[ClusteredConfig | None]:
  if not plan.sweep:
    return [None]
  return [None,
          ClusteredConfig(block_clusters=128, sub_clusters=128),
          ClusteredConfig(block_clusters=256, sub_clusters=256),
          ClusteredConfig(block_clusters=256, sub_clusters=64, block_k=32, num_stages=3),
          ClusteredConfig(block_clusters=512, sub_clusters=128, block_k=64, num_warps=8),
          ClusteredConfig(target_programs=2048, block_k=32)]


def _cfg_label(cfg: ClusteredConfig | None) -> str:
  if cfg is None:
    return "default"
  bc = "auto" if cfg.block_clusters is None else cfg.block_clusters
  return (f"bc{bc}_sub{cfg.sub_clusters}_bk{cfg.block_k}_w{cfg.num_warps}_s{cfg.num_stages}"
          + (f"_t{cfg.target_programs}" if cfg.target_programs != 768 else ""))


def run_clustered(plan: Plan, case: dict, sets: list[dict], layout: dict, attempt, *,
                  seq_len: int, num_s: int, inner: int) -> None:
  """Clustered pipeline rows (cluster-contiguous layout): decode = scoring kernel +
  attention kernel + merge; prefill = lookup + range expansion + gather + cuDNN."""
  hq, hkv, d = plan.hq, plan.hkv, plan.d
  num_l = case["L"]
  num_c = case["C"]
  scale = d ** -0.5
  keep = 1.0 - plan.sparsity
  be = plan.backend
  ks, vs, offs, cnt = layout["k"], layout["v"], layout["offs"], layout["counts"]
  cl: dict[str, Any] = {"size_stats": layout["size_stats"], "n_exact": layout["n_exact"],
                        "ms_by_config": {}}
  case["clustered"] = cl

  def calib():
    s0 = sets[0]
    if seq_len == 1:
      _, sc = centroid_lookup_decode(s0["q"][:, 0], s0["cent"], cnt, 0.0, scale=scale,
                                     backend=be)
    else:
      _, sc = centroid_lookup_prefill(s0["q"], s0["cent"], cnt, 0.0, scale=scale, backend=be)
    return calibrate_threshold(sc, cnt, keep)
  thr = attempt("clustered_calibrate", calib)
  thr = jnp.float32(0.0 if thr is None else thr)
  cl["threshold"] = float(thr)

  if seq_len == 1:
    c_sets = [(s["q"][:, 0], ks, vs, s["cent"], offs, thr, s["kn"], s["vn"], s["qp"], s["kvp"])
              for s in sets]
    for cfg in clustered_configs(plan):
      label = _cfg_label(cfg)
      fn = jax.jit(functools.partial(clustered_decode_attention, scale=scale, backend=be,
                                     config=cfg))
      ms = attempt(f"clustered[{label}]", lambda: time_fn(fn, c_sets, reps=plan.reps,
                                                          inner=inner))
      if ms is not None:
        cl["ms_by_config"][label] = ms
    if cl["ms_by_config"]:
      best = min(cl["ms_by_config"], key=cl["ms_by_config"].get)
      cl["ms"], cl["best_config"] = cl["ms_by_config"][best], best

    def stats_and_check():
      sfn = jax.jit(functools.partial(clustered_decode_attention, scale=scale, backend=be,
                                      return_stats=True))
      rows = [np.asarray(sfn(*a)[2], np.float64) for a in c_sets]
      p = clat._make_plan(hq, hkv, num_l, num_c, num_s, d, "kv", ClusteredConfig())
      byts = []
      for r in rows:
        kv_bytes = r.sum() * 2 * d * 2 + hkv * num_s * 2 * d * 2
        other = (hkv * num_c * d * 2                  # centroids
                 + 2 * hkv * (num_c + 1) * 4          # offsets (kernels A and B)
                 + 2 * hq * num_c * 4                 # logits written by A, read by B
                 + 2 * hkv * p.n_prog * p.g * (d + 2) * 4)   # partials written + merged
        byts.append(kv_bytes + other)
      cl["rows_per_head_first_set"] = rows[0].astype(int).tolist()
      cl["retrieved_frac"] = float(np.mean([r.mean() for r in rows]) / num_l)
      cl["bytes"] = float(np.mean(byts))
      cl["kv_bytes_frac"] = float(np.mean([r.sum() for r in rows]) / (hkv * num_l))
      cl["n_programs_attn"] = hkv * p.n_prog
      if cl.get("ms"):
        cl["tb_per_s"] = cl["bytes"] / (cl["ms"] * 1e-3) / 1e12
      # correctness at this shape: compiled vs reference (bf16)
      out, sel, _ = sfn(*c_sets[0])
      with jax.default_matmul_precision("highest"):
        ref, rsel, _ = clustered_decode_attention_reference(*c_sets[0], scale=scale,
                                                            return_stats=True)
      cl["check_rel_err"] = rel_err(out, ref)
      cl["check_selection_flips"] = int(np.sum(np.asarray(sel) != np.asarray(rsel)))
      cl["check_nan"] = bool(np.isnan(np.asarray(out, np.float32)).any())
      return (f"retrieved {cl['retrieved_frac']:.3f} of L, check rel err "
              f"{cl['check_rel_err']:.2g}, flips {cl['check_selection_flips']}")
    attempt("clustered_stats", stats_and_check)
  else:
    cap = min(num_l, int(math.ceil((2 * keep * num_l + layout["n_exact"]) / 256) * 256))
    cl["capacity"] = cap
    p_sets = [(s["q"], ks, vs, s["cent"], offs, thr, s["kn"], s["vn"], s["qp"], s["kvp"])
              for s in sets]
    # return_stats only hands back arrays the pipeline computes anyway: time that variant
    fn = jax.jit(functools.partial(clustered_prefill_attention, scale=scale, capacity=cap,
                                   backend=be, return_stats=True))
    ms = attempt("clustered_prefill", lambda: time_fn(fn, p_sets, reps=plan.reps, inner=inner))
    if ms is not None:
      cl["ms_by_config"]["default"] = ms
      cl["ms"], cl["best_config"] = ms, "default"

    def pstats():
      rows = np.asarray(fn(*p_sets[0])[2])
      cl["rows_per_head_first_set"] = rows.astype(int).tolist()
      cl["retrieved_frac"] = float(rows.mean() / num_l)
      cl["overflow_heads"] = int(np.sum(rows > cap))
      return f"retrieved {cl['retrieved_frac']:.3f} of L, overflow heads {cl['overflow_heads']}"
    attempt("clustered_prefill_stats", pstats)
  if cl.get("ms") and case.get("dense_ms"):
    cl["ratio"] = case["dense_ms"] / cl["ms"]


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------
def fmt(x, nd=3):
  if x is None:
    return "—"
  if isinstance(x, float):
    return f"{x:.{nd}f}"
  return str(x)


def to_markdown(res: dict) -> str:
  lines = [f"# pallas_kernels GPU run — {res['device']}", "",
           f"jax {res['jax_version']}, commit {res['git_commit']}, dtype {res['dtype']}, "
           f"backend {res['backend']}, dense baseline `{res['dense_impl']}`, "
           f"{res['seconds']:.0f} s total.", ""]
  if res["checks"]:
    lines += ["## Correctness (compiled kernel vs reference, bf16)", "",
              "| check | status | max rel err | tol |", "|---|---|---|---|"]
    for c in res["checks"]:
      lines.append(f"| {c['name']} | {c['status']} | {fmt(c.get('max_rel_err'), 4)} | {c['tol']} |"
                   + (f" {c['error']}" if c.get("error") else ""))
    lines.append("")
  bw = res.get("copy_bandwidth") or {}
  lines += ["## Bandwidth (decode)", "",
            f"device-to-device copy: {fmt(bw.get('tb_per_s'))} TB/s", "",
            "| L | sparse attn bytes | sparse attn TB/s | lookup bytes | lookup TB/s | dense TB/s |",
            "|---|---|---|---|---|---|"]
  for c in res["cases"]:
    if c["T"] == 1:
      lines.append(f"| {c['L']} | {fmt(c.get('attn_bytes'), 0)} | {fmt(c.get('attn_tb_per_s'))} | "
                   f"{fmt(c.get('lookup_bytes'), 0)} | {fmt(c.get('lookup_tb_per_s'))} | "
                   f"{fmt(c.get('dense_tb_per_s'))} |")
  lines += ["", "## Timings (ms, median)", "",
            "| L | phase | T | lookup | index build | sparse attn (best cfg) | sum | pipeline | "
            "gather+cuDNN | dense cuDNN | dense / pipeline |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for c in res["cases"]:
    att = fmt(c.get("attn_ms"))
    if c.get("attn_best_config"):
      att += f" ({c['attn_best_config']})"
    ratio = fmt(c.get("ratio"), 2) + ("×" if c.get("ratio") else "")
    lines.append(f"| {c['L']} | {c['phase']} | {c['T']} | {fmt(c.get('lookup_ms'))} | "
                 f"{fmt(c.get('index_ms'))} | {att} | "
                 f"{fmt(c.get('total_ms'))} | {fmt(c.get('pipeline_ms'))} | "
                 f"{fmt(c.get('gather_dense_ms'))} | {fmt(c.get('dense_ms'))} | {ratio} |")
  if any(c.get("clustered") for c in res["cases"]):
    lines += ["", "## Clustered pipeline (cluster-contiguous layout, no index build)", "",
              "decode: scoring kernel + attention kernel + merge, one jit; prefill: lookup + "
              "range expansion + gather + cuDNN.  bytes = retrieved K/V rows (exact part and "
              "new part included) + centroids + logits/offsets/partials traffic.", "",
              "| L | phase | T | clustered ms (best cfg) | rows / L | bytes | TB/s | "
              "dense cuDNN | dense / clustered | check rel err (flips) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
      cl = c.get("clustered")
      if not cl:
        continue
      ms = fmt(cl.get("ms")) + (f" ({cl['best_config']})" if cl.get("best_config") else "")
      ratio = fmt(cl.get("ratio"), 2) + ("×" if cl.get("ratio") else "")
      chk = (f"{fmt(cl.get('check_rel_err'), 4)} ({cl.get('check_selection_flips')})"
             if "check_rel_err" in cl else "—")
      lines.append(f"| {c['L']} | {c['phase']} | {c['T']} | {ms} | "
                   f"{fmt(cl.get('retrieved_frac'))} | {fmt(cl.get('bytes'), 0)} | "
                   f"{fmt(cl.get('tb_per_s'))} | {fmt(c.get('dense_ms'))} | {ratio} | {chk} |")
    sweep = [(c["L"], c["phase"], cl) for c in res["cases"] if (cl := c.get("clustered"))
             and len(cl.get("ms_by_config", {})) > 1]
    if sweep:
      lines += ["", "Clustered decode configs (ms): " + "; ".join(
          f"L={a}: " + ", ".join(f"{k} {v:.4f}" for k, v in cl["ms_by_config"].items())
          for a, _, cl in sweep)]
  errs = [(c["L"], c["phase"], k, v) for c in res["cases"] for k, v in c["errors"].items()]
  if errs:
    lines += ["", "## Errors", ""] + [f"- L={a} {b} {k}: {v}" for a, b, k, v in errs]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True, help="directory for gpu_kernels.json / .md")
  ap.add_argument("--quick", action="store_true", help="short smoke run on the GPU")
  ap.add_argument("--cpu-smoke", action="store_true",
                  help="tiny shapes on CPU (Pallas interpret mode) to exercise the plumbing")
  ap.add_argument("--lengths", default="", help="comma-separated fixed-context lengths")
  ap.add_argument("--skip-checks", action="store_true")
  ap.add_argument("--checks-only", action="store_true", help="only the compiled-vs-reference checks")
  ap.add_argument("--no-sweep", action="store_true", help="only the default kernel configs")
  ap.add_argument("--budget-s", type=float, default=0.0,
                  help="stop starting new timing cases after this many seconds")
  args = ap.parse_args(argv)
  plan = make_plan(args)
  if args.checks_only:
    plan.lengths = ()
  if plan.backend == "pallas" and jax.default_backend() != "gpu":
    print(f"error: no GPU (jax backend {jax.default_backend()!r}); use --cpu-smoke",
          file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  t_start = time.perf_counter()
  deadline = t_start + plan.budget_s

  def log(msg):
    print(msg, flush=True)

  sha, dirty = git_commit()
  res: dict[str, Any] = {
      "device": device_name(), "jax_version": jax.__version__, "python": platform.python_version(),
      "git_commit": sha, "git_dirty": dirty, "dtype": "bfloat16", "backend": plan.backend,
      "dense_impl": plan.dense_impl, "mode": "cpu-smoke" if args.cpu_smoke else (
          "quick" if args.quick else "full"),
      "plan": dataclasses.asdict(plan), "checks": [], "cases": [], "copy_bandwidth": None,
      "errors": {},
  }
  log(f"device {res['device']}, jax {res['jax_version']}, commit {sha}")
  try:
    res["checks"] = run_checks(plan, log)
  except Exception as e:  # noqa: BLE001
    res["errors"]["checks"] = short_error(e)
  try:
    if plan.lengths:
      res["copy_bandwidth"] = copy_bandwidth(plan)
      log(f"[bw] device copy {res['copy_bandwidth']['tb_per_s']:.3f} TB/s")
  except Exception as e:  # noqa: BLE001
    res["errors"]["copy_bandwidth"] = short_error(e)
  for num_l in plan.lengths:
    try:
      res["cases"] += run_length(plan, num_l, log, deadline)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory while building inputs
      res["errors"][f"L={num_l}"] = short_error(e)
      traceback.print_exc(file=sys.stderr)
  res["seconds"] = time.perf_counter() - t_start
  write_text_atomic(os.path.join(args.out, "gpu_kernels.json"),
                    json.dumps(res, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
  md = to_markdown(res)
  write_text_atomic(os.path.join(args.out, "gpu_kernels.md"), md)
  print()
  print(md)
  n_bad = sum(c["status"] != "PASS" for c in res["checks"])
  return 1 if n_bad else 0


if __name__ == "__main__":
  sys.exit(main())
