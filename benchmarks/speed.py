"""GPU speed suite (`sqjax bench`): the library path against dense attention, side by side.

    python -m benchmarks.speed --out DIR [--quick] [--cpu-smoke] [--keys FILE.npz]

What it measures, in one process on one GPU (median of repeated runs after warm-up,
`block_until_ready`, input sets rotated so caches do not flatter):

1. Offline cost: clustering + calibration of a 128K-token fixed context for a 32-layer,
   8-KV-head model (Llama-3-8B attention shape), 1-level and hierarchical.
2. Kernels through the library path (`Squeezed.select` → `sqjax.dispatch` → Pallas), for
   fixed contexts of 32K/128K/512K, decode (1 token) and prefill (1K, 4K tokens), sparsity
   70/80/90% with 5% centroids, 1-level and hierarchical (level 1 = 1%, pruning ~50%):
   lookup time, lookup + retrieval + sparse attention total, against dense attention in the
   same run (cuDNN through `jax.nn.dot_product_attention`, XLA, and for decode the Pallas
   split-KV dense kernel); bytes moved and TB/s. For decode, QUEST and SAAP (nearest-centroid
   buckets) on their Pallas kernels at the budget Squeezed kept at each sparsity. Shapes:
   Llama-3-8B attention (32/8 heads) over the full sweep, Llama-2-7B (32/32) over a reduced one.
3. End to end: decode ms/token and time to first token of a Llama-3-8B-shaped model (random
   bf16 weights) over a 128K fixed context, Squeezed Attention vs full attention.
4. A plot like the paper's Fig. 4: latency normalised to dense per sparsity.

Keys: with --keys, keys/values/queries captured from the real model (SmolLM2, two 64-d heads
concatenated to d=128; `python -m benchmarks.capture_keys` writes the default file on the CPU)
are tiled to the context length with a little noise, so per-head sparsity is realistic;
otherwise Gaussian.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import (dispatch_ms, hbm_peak_tbps, metadata, time_ms, time_ms_looped, time_ms_steady,
                              time_ms_unrolled, write_json)
from benchmarks._profile import device_activity, kernel_time_per_call, loop_trace
from sqjax.index_io import write_figure_atomic, write_text_atomic

BF16 = jnp.bfloat16


@dataclasses.dataclass
class Plan:
    lengths: tuple = (32768, 131072, 524288)
    sparsities: tuple = (0.7, 0.8, 0.9)
    prefill: tuple = (1024, 4096)
    hq: int = 32  # the (Hq, Hkv) of the offline and end-to-end sections (Llama-3-8B)
    hkv: int = 8
    d: int = 128
    shapes: tuple = ((32, 8), (32, 32))  # kernel sweep (Hq, Hkv): Llama-3-8B, Llama-2-7B attention
    other_shape_lengths: tuple = (32768, 131072)  # shapes after the first: a reduced sweep (time)
    other_shape_sparsities: tuple = (0.9,)
    hier_sparsities: tuple = (0.9,)  # the hierarchical (2-level) rows: only these sparsities (time; --hier-sparsities)
    # keys ruled out at level 1 on calibration (the kernel rows' hierarchical method): 0.5 is the
    # paper's accuracy setting (Sec. 5) and the issue's; its kernel Table 9 assumes 0.9
    level1_prune: float = 0.5
    # the Squeezed rows' block lookups from int8 q and centroids (`Squeezed.lookup_int8`; decode unchanged)
    lookup_int8: bool = False
    offline_layers: int = 32
    offline_length: int = 131072
    e2e_length: int = 131072
    e2e_layers: int = 32
    e2e_hidden: int = 4096
    e2e_inter: int = 14336
    e2e_vocab: int = 128256
    e2e_steps: int = 16
    e2e_batches: tuple = (4, 8)   # `ask_many` batch sizes timed in the end-to-end section
    # longer questions' time to first token in the end-to-end section (tokens; also what a follow-up
    # with that many tokens of earlier turns costs: `ask(history=...)` prefills them again)
    e2e_question_tokens: tuple = (512, 2048)
    # a follow-up's time to first token after earlier turns of about these many tokens: a `Conversation`
    # (the turns' K/V kept) against `ask(history=...)` (prefilled again); none by default
    e2e_follow_up_tokens: tuple = ()
    e2e_ask_only: bool = False    # end-to-end section: only `ask` / `ask_many` (no decode-loop variants)
    e2e_method: str = "squeezed"  # end-to-end section's sparse method: "squeezed" or "hierarchical" (2-level)
    reps: int = 10
    # decode calls per device loop (time_ms_looped): 300, so that the program's own dispatch and final
    # sync, paid once per loop, fall out; at 30 the same kernels came out 6-12 us slower per call on an
    # H200 (512K / 128K sparse 0.106 / 0.050 vs 0.094 / 0.044 ms, gpu_h200_decode_stages/loop300_6e7eea1),
    # an absolute cost that weighs most on the faster side
    loop_iters: int = 300
    unroll_calls: int = 16     # decode calls unrolled in one program (time_ms_unrolled)
    # prefill calls per device loop: 16, so the program's first dispatch (0.8-1.3 ms of host time for the
    # hierarchical 4K prefill's ~60 kernels on an H200) is spread over 16 calls rather than 4
    prefill_loop_iters: int = 16
    deadline_s: float = 520.0
    cpu: bool = False
    phases: tuple = ("decode", "prefill")
    offline_hierarchical: bool = True  # also time the 2-level offline build
    offline_token: bool = True  # also time the builds with decode thresholds (decode_calibration="token")
    backend: str = "auto"  # sqjax.dispatch backend ("interpret" in the CPU smoke run: kernel plumbing)


def cpu_plan() -> Plan:
    return Plan(lengths=(1024,), sparsities=(0.8, 0.9), prefill=(32,), hq=4, hkv=2, d=16, shapes=((4, 2), (4, 4)),
                other_shape_lengths=(1024,), offline_layers=2,
                offline_length=1024, e2e_length=1024, e2e_layers=2, e2e_hidden=64, e2e_inter=128, e2e_vocab=256,
                e2e_steps=3, e2e_batches=(2,), e2e_question_tokens=(40,), e2e_follow_up_tokens=(48,), reps=2, loop_iters=2, unroll_calls=2, prefill_loop_iters=2, deadline_s=600, cpu=True, backend="interpret")


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

class KeySource:
    """Keys/values/queries [H, L, d]: captured from a real model and tiled, or Gaussian."""

    def __init__(self, path: str | None, plan: Plan):
        self.plan = plan
        self.cap = None
        if path and Path(path).is_file():
            z = np.load(path, allow_pickle=False)
            if z["k"].shape[0] >= plan.hkv and z["k"].shape[-1] == plan.d and z["q"].shape[0] >= plan.hq:
                self.cap = {n: jnp.asarray(z[n][: (plan.hq if n == "q" else plan.hkv)], jnp.float32) for n in ("k", "v", "q")}
        self.kind = "captured SmolLM2 keys, tiled" if self.cap is not None else "gaussian"

    def kv(self, length: int, seed: int, n_heads: int | None = None):
        h = n_heads or self.plan.hkv
        key = jax.random.key(seed)
        k1, k2 = jax.random.split(key)
        if self.cap is None:
            return (jax.random.normal(k1, (h, length, self.plan.d), BF16),
                    jax.random.normal(k2, (h, length, self.plan.d), BF16))

        def tile(x):
            x = x[jnp.arange(h) % x.shape[0]]
            reps = -(-length // x.shape[1])
            y = jnp.tile(x, (1, reps, 1))[:, :length]
            noise = 0.05 * jnp.std(x) * jax.random.normal(k1, y.shape, jnp.float32)
            return (y + noise).astype(BF16)

        return tile(self.cap["k"]), tile(self.cap["v"])

    def queries(self, t: int, seed: int, n_heads: int | None = None):
        h = n_heads or self.plan.hq
        key = jax.random.key(10_000 + seed)
        if self.cap is None:
            return jax.random.normal(key, (h, t, self.plan.d), BF16)
        q = self.cap["q"][jnp.arange(h) % self.cap["q"].shape[0]]
        idx = jax.random.randint(key, (t,), 0, q.shape[1])
        return (q[:, idx] + 0.05 * jnp.std(q) * jax.random.normal(key, (h, t, self.plan.d))).astype(BF16)


def _err(e: BaseException) -> str:
    """One line for a failed row.  Out of device memory: the device's allocator figures are added,
    because the executable the error names is the next one to run, not always the one that asked
    (k-means' 29 GiB temporary was reported in `jit_take_along_axis`, `jit__take` and
    `jit_centroid_lookup_prefill`: benchmarks/results/gpu_h100_llama2_bb4b1ba)."""
    msg = f"{type(e).__name__}: {e}"[:500]
    if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
        try:
            st = jax.devices()[0].memory_stats() or {}
        except Exception:  # noqa: BLE001
            st = {}
        if st:
            gib = {k: st.get(k, 0) / 2**30 for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}
            msg += (f" [device memory: {gib['bytes_in_use']:.1f} GiB in use, peak {gib['peak_bytes_in_use']:.1f}, "
                    f"limit {gib['bytes_limit']:.1f}; the named executable may only be the next to run]")
    return msg


# ---------------------------------------------------------------------------------------------
# 1. offline cost
# ---------------------------------------------------------------------------------------------

def offline_cost(plan: Plan, src: KeySource, log, deadline: float | None = None, on_build=None) -> dict:
    """Time each index build of a 128K x 32-layer context, first (compiling) and again compiled.
    ``deadline`` (perf_counter): builds not started by then are listed under ``not_run``;
    ``on_build(out)`` after each build (the caller saves: a killed run keeps the builds it finished)."""
    from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed

    out = {"layers": plan.offline_layers, "Hkv": plan.hkv, "Hq": plan.hq, "L": plan.offline_length, "d": plan.d}
    ks, vs = zip(*[src.kv(plan.offline_length, seed=layer) for layer in range(plan.offline_layers)])
    k = jnp.stack(ks)
    v = jnp.stack(vs)
    q_obs = jnp.stack([src.queries(100, seed=layer) for layer in range(plan.offline_layers)])
    jax.block_until_ready((k, v, q_obs))
    data = ContextData(k, v, q_obs, scale=1.0 / math.sqrt(plan.d))
    methods = [("squeezed", Squeezed(sparsity=0.9, n_sink=1))]
    if plan.offline_hierarchical:
        methods.append(("hsqueezed", HierarchicalSqueezed(sparsity=0.9, n_sink=1)))
    if plan.offline_token:
        methods += [(f"{name}_token", dataclasses.replace(m, decode_calibration="token")) for name, m in methods]
    for name, m in methods:
        from sqjax import dispatch

        if deadline is not None and time.perf_counter() > deadline:
            out.setdefault("not_run", []).append(name)
            log(f"[offline] {name}: not run (deadline)")
            continue
        t0 = time.perf_counter()
        with dispatch.using(plan.backend):
            index, info = m.build(data)
        jax.block_until_ready(index)
        out[f"{name}_seconds"] = time.perf_counter() - t0  # includes compilation (first build)
        out[f"{name}_capacity"] = info["capacity"]
        out[f"{name}_threshold"] = float(info["threshold"])
        # retrieved fraction of the clustered keys on the calibration queries themselves (App. C's
        # block of 100; with decode thresholds also each query alone at those)
        out[f"{name}_calibrated_kept"] = float(np.mean(np.asarray(info["calibrated_retrieved_fraction"])))
        if "threshold_decode" in info:
            out[f"{name}_threshold_decode"] = float(info["threshold_decode"])
            out[f"{name}_decode_kept"] = float(np.mean(np.asarray(info["decode_retrieved_fraction"])))
            out[f"{name}_decode_kept_app_c"] = float(np.mean(np.asarray(info["decode_retrieved_fraction_app_c"])))
            out[f"{name}_decode_queries"] = int(info["decode_calibration_queries"])
        # the same build again, compiled: what each further document of this shape costs
        t0 = time.perf_counter()
        with dispatch.using(plan.backend):
            jax.block_until_ready(dataclasses.replace(m, seed=1).build(data)[0])
        out[f"{name}_seconds_warm"] = time.perf_counter() - t0
        log(f"[offline] {name}: {out[f'{name}_seconds']:.1f}s cold, {out[f'{name}_seconds_warm']:.1f}s compiled, for {plan.offline_layers} layers x {plan.hkv} heads x {plan.offline_length} keys")
        out[f"{name}_index"] = (m, index, info)
        if on_build is not None:
            on_build(out)
    out["data"] = data
    return out


# ---------------------------------------------------------------------------------------------
# 2. kernels through the library path
# ---------------------------------------------------------------------------------------------

def _dense_fns(plan: Plan):
    scale = 1.0 / math.sqrt(plan.d)
    impls = {"cudnn": "cudnn", "xla": "xla"} if not plan.cpu else {"xla": "xla"}
    out = {}
    for name, impl in impls.items():
        def f(q, k, v, kn, vn, impl=impl):
            kk = jnp.concatenate([k, kn], axis=1).swapaxes(0, 1)[None]
            vv = jnp.concatenate([v, vn], axis=1).swapaxes(0, 1)[None]
            return jax.nn.dot_product_attention(q.swapaxes(0, 1)[None], kk, vv, scale=scale, implementation=impl)
        out[name] = jax.jit(f)
    return out


def _dense_fns_nocat(plan: Plan):
    """Dense over K/V already holding the new part (no concatenation inside the timing)."""
    scale = 1.0 / math.sqrt(plan.d)
    impls = ("cudnn", "xla") if not plan.cpu else ("xla",)
    return {impl: jax.jit(lambda q, kk, vv, impl=impl: jax.nn.dot_product_attention(
        q, kk, vv, scale=scale, implementation=impl)) for impl in impls}


def _sweep(plan: Plan, i: int) -> tuple[tuple, tuple]:
    """(lengths, sparsities) of shape i: the first shape the full sweep, the others the reduced one."""
    if i == 0:
        return plan.lengths, plan.sparsities
    sps = tuple(s for s in plan.sparsities if s in plan.other_shape_sparsities) or plan.sparsities[-1:]
    return tuple(n for n in plan.lengths if n in plan.other_shape_lengths), sps


@functools.partial(jax.jit, static_argnames=("method", "backend", "lookup_only"))
def _kernel_path(method, index, layout, q, k, v, kn, vn, qp, kp, *, backend, lookup_only=False):
    """A method's lookup alone (`lookup_only`), or its decode (or Squeezed's block prefill) on its own Pallas kernels.

    Squeezed: centroid-lookup kernel (Eq. 1) / fused clustered decode over `layout` (cluster-
    sorted K, V, offsets); hierarchical: the hierarchical lookup kernels (Eq. 2-3) / their
    selection attended by the same clustered attention kernel. A block (prefill): the lookup kernels,
    then the selected clusters' rows of `layout` gathered and attended by cuDNN (`dispatch.clustered_prefill`). QUEST: page-score kernel + top-K pages / + page-sparse decode kernel.
    SAAP: nearest-centroid top-ℓ buckets (q taken as de-roped) / + bucket attention kernel.
    Arrays are arguments, never closure constants (those would be baked into the program).
    """
    import pallas_kernels as pk
    from sqjax import dispatch, saap, squeezed

    scale = 1.0 / math.sqrt(q.shape[-1])
    length = k.shape[1]
    with dispatch.using(backend):
        if method.name == "quest":
            s = pk.quest_page_scores(q[:, 0], index["kmin"][0], index["kmax"][0], vote=method.vote, backend=backend)
            sel = pk.quest_select(s, method.n_pages(length), force_page=s.shape[-1] - 1, backend=backend)
            if lookup_only:
                return sel
            return pk.quest_decode_attention(q[:, 0], k, v, sel, kn, vn, qp, kp, scale=scale, page_size=method.page,
                                             backend=backend)[:, None]
        if method.name == "saap":
            sel = jax.lax.top_k(saap.nearest_centroid_scores(q, index["unit"][0])[:, 0], method.probes)[1]
            if lookup_only:
                return sel
            return pk.saap_attention(q[:, 0], k, v, index["off"][0], index["lst"][0], sel.astype(jnp.int32), kn, vn,
                                     qp, kp, scale=scale, n_sink=method.n_sink, n_recent=method.sizes(length)[1],
                                     backend=backend)[:, None]
        li = index.layer(0)
        if lookup_only:
            return squeezed.layer_scores(li, q, index.threshold1, scale, method.vote, int8=method.lookup_int8)[0]
        ks, vs, off = layout
        level1 = (li.centroids1, li.counts1, li.parent) if li.centroids1.shape[-2] else None
        if q.shape[1] > 1:   # a block: the route FixedContext's question prefill takes on a GPU
            t, t1 = index.thresholds(q.shape[1])
            return dispatch.clustered_prefill(q, ks, vs, li.centroids, off, t, kn, vn, qp, kp, scale, method.vote,
                                              level1=level1, threshold1=t1, int8=method.lookup_int8)
        return dispatch.clustered_decode(q, ks, vs, li.centroids, off, index.threshold, kn, vn, qp, kp, scale,
                                         method.vote, level1=level1, threshold1=index.threshold1)


@functools.partial(jax.jit, static_argnames=("method", "backend"))
def _library_path(method, index, q, k, v, kn, vn, qp, kp, *, backend):
    """The library path: `method.select` (layer 0; q doubles as the de-roped query, for SAAP)
    → `sqjax.dispatch.attention`, with what the selection reads: K/V rows, metadata rows, overflow."""
    from sqjax import dispatch

    with dispatch.using(backend):
        sel = method.select(index, 0, q, q, k)
        o = dispatch.attention(q, k, v, sel, kn, vn, qp, kp, 1.0 / math.sqrt(q.shape[-1]))
    return o, sel.kv_rows, sel.meta_rows, sel.overflow


_PATHS = {"quest": "Pallas page scores + top-K pages + page-sparse decode kernel",
          "saap": "nearest-centroid top-ℓ + Pallas bucket attention (synthetic K/q taken as de-roped)"}


def _method_row(row, plan, log, method, index, qs, ctx, layout=None, best_dense=None, best_dense_loop=None,
                best_dense_unrolled=None, best_dense_kernels=None, best_dense_steady=None) -> dict:
    """Time one method (Squeezed, QUEST, SAAP alike) into `row`: lookup ms; total ms of its own
    Pallas decode path where it has one (the library path then goes to generic_total_ms), else of
    the library path; kept fraction and bytes (K+V rows + metadata rows) its selection reads."""
    kernel = method.name in _PATHS or layout is not None
    lib = functools.partial(_library_path, method, backend=plan.backend)
    kern = functools.partial(_kernel_path, method, backend=plan.backend)
    # the (static) capacity only bounds the library path's retrieval: one compilation of the
    # lookup and the fused kernel path serves every sparsity
    kidx = dataclasses.replace(index, capacity=0) if hasattr(index, "capacity") else index
    sets = [(qq, *ctx) for qq in qs]
    length, t = ctx[0].shape[1], qs[0].shape[1]
    t0 = time.perf_counter()
    try:
        row["lookup_ms"] = time_ms(functools.partial(kern, lookup_only=True), [(kidx, layout, *s) for s in sets],
                                   reps=plan.reps)
        row["generic_total_ms" if kernel else "total_ms"] = time_ms(lib, [(index, *s) for s in sets], reps=plan.reps)
        if kernel:
            row["total_ms"] = time_ms(kern, [(kidx, layout, *s) for s in sets], reps=plan.reps)
        # device time per call, host dispatch amortised as in a model step (one program, many layers)
        if kernel:
            timed, fixed = (lambda q, ki, lay, *c: kern(ki, lay, q, *c)), (kidx, layout, *ctx)
        else:
            timed, fixed = (lambda q, ix, *c: lib(ix, q, *c)), (index, *ctx)
        row["total_loop_ms"] = time_ms_looped(timed, qs, fixed=fixed, n_iter=_loop_iters(plan, t), reps=plan.reps)
        if best_dense_loop:
            row["speedup_vs_best_dense_loop"] = best_dense_loop / row["total_loop_ms"]
        if t > 1:   # where the loop's time goes (GPU only): kernels, copies and gaps per call inside the loop
            row["prefill_loop_trace"] = lt = loop_trace(timed, qs, fixed=fixed, n_iter=_loop_iters(plan, t))
            if lt:
                log(f"[loop trace] {method.name} L={length} T={t}: {_loop_trace_str(lt)}")
        if t == 1:
            row["total_unrolled_ms"] = time_ms_unrolled(timed, qs, fixed=fixed, n_calls=plan.unroll_calls,
                                                        reps=plan.reps)
            if best_dense_unrolled:
                row["speedup_vs_best_dense_unrolled"] = best_dense_unrolled / row["total_unrolled_ms"]
            # the lookup's kernel time per call (hierarchical vs 1-level), from a profiler trace (GPU only)
            ksets = [(kidx, layout, *s) for s in sets]
            tr = kernel_time_per_call(functools.partial(kern, lookup_only=True), ksets, top=6)
            if tr:
                row["lookup_kernel_busy_ms"] = tr["busy_ms_per_call"]
                row["lookup_kernels"] = tr["kernels"]
            if kernel:  # kernel time per call and the largest kernels, from a profiler trace (GPU only)
                tr = kernel_time_per_call(kern, ksets, top=6)
                if tr:
                    row["kernel_busy_ms"] = tr["busy_ms_per_call"]
                    row["kernels"] = tr["kernels"]
        else:  # prefill: where the time goes, from a profiler trace (GPU only)
            tr = kernel_time_per_call(functools.partial(kern, lookup_only=True), [(kidx, layout, *s) for s in sets],
                                      n=3, top=8)
            if tr:
                row["prefill_lookup_busy_ms"] = tr["busy_ms_per_call"]
                row["prefill_lookup_kernels"] = tr["kernels"]
            tr = kernel_time_per_call(kern if kernel else lib, [((kidx, layout) if kernel else (index,)) + s
                                                                for s in sets], n=3, top=24)
            if tr:
                row["prefill_busy_ms"] = tr["busy_ms_per_call"]
                row["prefill_span_ms"] = tr["span_ms_per_call"]  # busy + idle between kernels (+ between calls)
                row["prefill_kernels_per_call"] = tr["kernels_per_call"]
                row["prefill_gaps"] = tr["gaps"][:6]
                if best_dense_kernels:  # device time against device time: no host dispatch on either side
                    row["speedup_vs_best_dense_span"] = best_dense_kernels / tr["span_ms_per_call"]
                row["prefill_kernels"] = tr["kernels"]
            psets = [((kidx, layout) if kernel else (index,)) + s for s in sets]
            row["dispatch_ms"] = dispatch_ms(kern if kernel else lib, psets)
            # per call without the first call's dispatch and the final sync (dense timed the same way)
            row["total_steady_ms"] = time_ms_steady(kern if kernel else lib, psets)
            if best_dense_steady:
                row["speedup_vs_best_dense_steady"] = best_dense_steady / row["total_steady_ms"]
        fused_name = ("hierarchical lookup kernels + clustered attention kernel" if method.name == "hsqueezed"
                      else "fused clustered decode kernel") if t == 1 else (
            ("hierarchical" if method.name == "hsqueezed" else "centroid") + " lookup kernels + the selected "
            "clusters' rows gathered + cuDNN")
        row["path"] = _PATHS.get(method.name) or (fused_name if kernel else "lookup + retrieve + "
                                                  + ("sparse attention" if t == 1 else "gather + cuDNN"))
        o, rows_, meta_, over = lib(index, *sets[0])
        if kernel:  # the timed kernel path computes what the library path does (same selection)
            o2 = kern(kidx, layout, *sets[0]).astype(jnp.float32)
            row["rel_diff_vs_library"] = float(jnp.linalg.norm(o2 - o) / jnp.maximum(jnp.linalg.norm(o), 1e-30))
        rows_ = np.asarray(rows_, np.float64).mean(-1)  # per selection head, mean over its key sets
        meta_ = np.asarray(meta_, np.float64).mean(-1)
        row.update(retrieved_frac=float(rows_.mean() / length), meta_rows=float(meta_.mean()),
                   overflow_heads=int(np.asarray(over).sum()),
                   bytes=float((rows_.sum() * 2 + meta_.sum()) * row["d"] * 2))  # bf16 K+V rows + metadata rows
        row["tb_per_s"] = row["bytes"] / (row["total_ms"] * 1e-3) / 1e12
        if best_dense:
            row["speedup_vs_best_dense"] = best_dense / row["total_ms"]
        row["wall_s"] = time.perf_counter() - t0  # compilation included: what the row costs the run
        log(f"[{method.name}] L={length} {row['Hq']}/{row['Hkv']} {row['phase']} {row['budget']}: lookup "
            f"{row['lookup_ms']:.3f} ms, total {row['total_ms']:.3f} ms, kept {row['retrieved_frac']:.3f}, "
            f"x{row.get('speedup_vs_best_dense', float('nan')):.2f} vs dense ({row['wall_s']:.1f}s)")
    except Exception as e:  # noqa: BLE001
        row["error"] = _err(e)
        log(f"[{method.name}] L={length} {row['Hq']}/{row['Hkv']} {row['phase']} {row['budget']}: ERROR {row['error']}")
        traceback.print_exc()
    return row


def _saap_probes(method, index, qs, length: int, frac: float) -> int:
    """SAAP's ℓ whose visited fraction on these queries is closest to `frac` (buckets in
    nearest-centroid order, their sizes summed, plus the dense part)."""
    from sqjax import saap

    sizes = jnp.diff(index["off"][0], axis=-1)  # [Hkv, C]
    cum = np.mean([np.asarray(jnp.cumsum(jnp.take_along_axis(
        sizes, jnp.argsort(-saap.nearest_centroid_scores(qq, index["unit"][0])[:, 0], axis=-1), axis=-1), axis=-1))
        .mean(0) for qq in qs], axis=0)
    dense = method.n_sink + method.sizes(length)[1]
    return int(np.argmin(np.abs((cum + dense) / length - frac))) + 1


_DENSE_MODES = {"call": "", "loop": " loop", "unrolled": " unrolled", "kernels": " kernels", "steady": " steady"}


def _loop_iters(plan: Plan, t: int) -> int:
    return plan.loop_iters if t == 1 else plan.prefill_loop_iters


def _loop_trace_str(lt: dict) -> str:
    """One line of a `loop_trace`: per call busy / span ms, kernels, the largest kernels and the longest gaps."""
    return (f"busy {lt['busy_ms_per_call']:.3f} ms, span {lt['span_ms_per_call']:.3f} ms, "
            f"{lt['kernels_per_call']:.1f} kernels per call; largest "
            + ", ".join(f"{k['name'][:28]} {k['ms_per_call']:.3f}" for k in lt["largest"][:5])
            + "; gaps " + ", ".join(f"{g['ms']:.3f} {g['after'][:20]}>{g['before'][:20]}" for g in lt["gaps"][:3]))


def _dense_times(plan: Plan, log, qs, ctx, tag: str, modes=("call",)) -> dict:
    """Dense baselines, new part appended outside the timing: cuDNN, XLA (where its T x L scores
    fit), for decode the Pallas split-KV dense kernel (`pallas_kernels.dense_decode_attention`), for
    blocks "cudnn_split", the library's own (`pallas_kernels.dense_prefill_attention`: cuDNN over the
    fixed K/V in place and over the new part under its causal mask, merged by log-sum-exp).

    {mode: {baseline: ms}} for each of `modes`: "call" (`time_ms`), the device time per call
    "loop" (`time_ms_looped`) or "unrolled" (`time_ms_unrolled`), or "kernels", the kernel busy
    time per call from a profiler trace (GPU only; empty elsewhere): the same jitted functions on
    the same prepared queries, K/V concatenated once and passed as arguments every way."""
    import pallas_kernels

    k, v, kn, vn = ctx[:4]
    t, length = qs[0].shape[1], k.shape[1]
    kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
    vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
    # name -> (jitted fn(q, *fixed), its queries, fixed)
    cases = {name: (fn, [qq.swapaxes(0, 1)[None] for qq in qs], (kk, vv)) for name, fn in _dense_fns_nocat(plan).items()
             if not (name == "xla" and qs[0].shape[0] * t * length * 4 > 16 << 30)}  # XLA's f32 Hq x T x L scores: OOM
    if t > 1:  # the library's full-attention prefill: cuDNN over the fixed K/V in place + the new part, causal
        fn = functools.partial(pallas_kernels.dense_prefill_attention, scale=1.0 / math.sqrt(plan.d),
                               backend=plan.backend)
        cases["cudnn_split"] = (fn, list(qs), tuple(ctx))
    if t == 1 and hasattr(pallas_kernels, "dense_decode_attention"):
        fn = functools.partial(pallas_kernels.dense_decode_attention, scale=1.0 / math.sqrt(plan.d),
                               backend=plan.backend)
        cases["pallas"] = (fn, list(qs), tuple(ctx))
    out = {}
    for mode in modes:
        times = out[mode] = {}
        for name, (fn, queries, fixed) in cases.items():
            try:
                if mode == "kernels":
                    tr = kernel_time_per_call(fn, [(qq, *fixed) for qq in queries])
                    if tr:
                        times[name] = tr["busy_ms_per_call"]
                elif mode == "unrolled":
                    times[name] = time_ms_unrolled(fn, queries, fixed=fixed, n_calls=plan.unroll_calls, reps=plan.reps)
                elif mode == "loop":
                    times[name] = time_ms_looped(fn, queries, fixed=fixed, n_iter=_loop_iters(plan, t), reps=plan.reps)
                    if t > 1:   # the loop's own trace (GPU only), as for the sparse rows
                        lt = out.setdefault("loop_trace", {})[name] = loop_trace(fn, queries, fixed=fixed,
                                                                                 n_iter=_loop_iters(plan, t))
                        if lt:
                            log(f"[loop trace] {tag} {name}: {_loop_trace_str(lt)}")
                elif mode == "steady":
                    times[name] = time_ms_steady(fn, [(qq, *fixed) for qq in queries])
                else:
                    times[name] = time_ms(fn, [(qq, *fixed) for qq in queries], reps=plan.reps)
            except Exception as e:  # noqa: BLE001
                log(f"[dense{_DENSE_MODES[mode]}] {tag} {name}: ERROR {_err(e)}")
        log(f"[dense{_DENSE_MODES[mode]}] {tag}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items()))
    return out


_ROW_LATE = "not run: the run's deadline came first"  # a row cut (a whole length cut: "not run: deadline")


def _length_rows(plan: Plan, src: KeySource, log, deadline: float, length: int, i: int) -> list[dict]:
    """Every row of one (shape, fixed-context length): its arrays die when this returns."""
    from pallas_kernels import cluster_sort_layout
    from sqjax import dispatch
    from sqjax.methods import ContextData, HierarchicalSqueezed, Quest, Saap, Squeezed

    from benchmarks.quality import matched_fraction
    from benchmarks.quality_engine import ClusterMemo

    hq, hkv = plan.shapes[i]
    sps = _sweep(plan, i)[1]
    level_sps = {"squeezed": sps, "hsqueezed": tuple(s for s in sps if s in plan.hier_sparsities)}
    scale = 1.0 / math.sqrt(plan.d)
    k, v = src.kv(length, seed=length, n_heads=hkv)
    q_obs = src.queries(100, seed=length, n_heads=hq)[None]
    k1 = k[None]  # one copy serves as both (4 GiB at 32 KV heads x 512K)
    data = ContextData(k1, v[None], q_obs, k_pre=k1, scale=scale)  # SAAP: keys taken as de-roped
    built = {}
    for m in (Squeezed(sparsity=0.9, n_sink=1, lookup_int8=plan.lookup_int8),
              HierarchicalSqueezed(sparsity=0.9, n_sink=1, level1_prune=plan.level1_prune, lookup_int8=plan.lookup_int8),
              Quest(dense_layers=0), Saap(dense_layers=0)):
        t0 = time.perf_counter()
        try:
            with dispatch.using(plan.backend), ClusterMemo():
                if isinstance(m, Squeezed):  # one clustering, calibrated per sparsity (threshold, capacity)
                    index = {sp: dataclasses.replace(m, sparsity=sp).build(data)[0] for sp in level_sps[m.name]}
                else:
                    index = m.build(data)[0]
                if m.name == "quest":  # min/max of bf16 keys are exact in bf16: what the page kernel reads
                    index = jax.tree.map(lambda a: a.astype(k.dtype), index)
            jax.block_until_ready(index)
            built[m.name] = (m, index)
            log(f"[index] L={length} {hq}/{hkv} {m.name} built in {time.perf_counter() - t0:.1f}s")
        except Exception as e:  # noqa: BLE001
            log(f"[index] L={length} {hq}/{hkv} {m.name}: ERROR {_err(e)}")
            traceback.print_exc()
    layouts = {}  # the cluster-contiguous layout the fused decode kernel reads (1- and 2-level)
    for name in ("squeezed", "hsqueezed"):
        if name in built:
            idx0 = next(iter(built[name][1].values()))
            layouts[name] = cluster_sort_layout(k, v, idx0.layers.labels[0], idx0.n_sink, idx0.n_tail,
                                                num_clusters=idx0.layers.counts.shape[-1])[:3]
    phases = [("decode", 1)] + [(f"prefill_{t // 1024}k" if t >= 1024 else f"prefill_{t}", t) for t in plan.prefill]
    phases = [p for p in phases if p[0].split("_")[0] in plan.phases]
    n_new = 1024 if not plan.cpu else 16
    kn, vn = src.kv(n_new, seed=7, n_heads=hkv)
    kv_pos = (length + jnp.arange(n_new)).astype(jnp.int32)
    rows = []

    def late(phase: str, t: int, method: str, sp: float) -> bool:
        """Past the deadline: the row is listed as not run (never silently missing)."""
        if time.perf_counter() <= deadline:
            return False
        log(f"[{method}] L={length} {hq}/{hkv} {phase} sparsity {sp}: not run (deadline)")
        rows.append({"L": length, "Hq": hq, "Hkv": hkv, "phase": phase, "T": t, "method": method, "sparsity": sp,
                     "budget": f"sparsity {sp}", "error": _ROW_LATE})
        return True

    # the targets first, so that a deadline cuts only the extra rows: the longest prefill before the
    # shorter one, the highest sparsity first; the rows are put back in reading order at the end
    for phase, t in sorted(phases, key=lambda p: (p[1] != 1, -p[1])):  # decode, then prefill 4K, 1K
        if any([late(phase, t, "every method", sp) for sp in sorted(sps, reverse=True)]):
            continue
        qs = [src.queries(t, seed=100 * t + j, n_heads=hq) for j in range(3)]
        ctx = (k, v, kn, vn, (length + n_new - t + jnp.arange(t)).astype(jnp.int32), kv_pos)
        dense = _dense_times(plan, log, qs, ctx, f"L={length} {hq}/{hkv} {phase}",
                             ("call", "loop", "unrolled", "kernels") if t == 1 else ("call", "loop", "kernels", "steady"))
        dense_ms, dense_loop, dense_unr, dense_kern = (dense.get(m, {}) for m in ("call", "loop", "unrolled", "kernels"))
        best_steady = min(dense.get("steady", {}).values(), default=None)
        best, best_loop, best_unr, best_kern = (min(x.values(), default=None)
                                                for x in (dense_ms, dense_loop, dense_unr, dense_kern))
        base = {"L": length, "phase": phase, "T": t, "Hq": hq, "Hkv": hkv, "d": plan.d, "dtype": "bfloat16",
                "dense_ms": dense_ms, "dense_loop_ms": dense_loop, "dense_unrolled_ms": dense_unr,
                "dense_kernel_busy_ms": dense_kern, "dense_steady_ms": dense.get("steady", {})}
        first_row = len(rows)
        for sp in sorted(sps, reverse=True):
            frac = None
            for name in ("squeezed", "hsqueezed"):
                if name in built and sp in built[name][1] and not late(phase, t, name, sp):
                    m, idx = built[name]
                    fused = layouts.get(name)
                    r = _method_row({**base, "method": name, "sparsity": sp, "hierarchical": name == "hsqueezed",
                                     "budget": f"sparsity {sp}, {2 if name == 'hsqueezed' else 1}-level",
                                     "C": int(idx[sp].layers.centroids.shape[2])},
                                    plan, log, m, idx[sp], qs, ctx, fused, best, best_loop, best_unr, best_kern,
                                    best_steady)
                    rows.append(r)
                    frac = frac or r.get("retrieved_frac")
            # the target rows again at their phase's own threshold: 1-level decode on single queries,
            # hierarchical prefill on blocks of t queries (two draws apart from the timed ones)
            name = "squeezed" if t == 1 else "hsqueezed"
            if name in built and sp in built[name][1] and not late(phase, t, f"{name} (phase T)", sp):
                blocks = (decode_blocks(q_obs) if t == 1 else
                          [src.queries(t, seed=7_000_000 + 100 * t + j, n_heads=hq) for j in range(2)])
                rows.append(_phase_calibrated_row(base, plan, log, name, built[name], sp, blocks, qs, ctx,
                                                  layouts.get(name), best, best_loop, best_unr, best_kern,
                                                  best_steady))
            if t != 1 or frac is None:  # QUEST and SAAP: decode, at the budget Squeezed kept at this sparsity
                continue
            for name in ("quest", "saap"):
                if name not in built or late(phase, t, name, sp):
                    continue
                m, idx = built[name]
                if name == "quest":
                    m = dataclasses.replace(m, budget=matched_fraction("quest", frac, length))
                    label = f"{m.n_pages(length)} pages of {m.page} (matched sparsity {sp})"
                else:
                    try:
                        m = dataclasses.replace(m, probes=_saap_probes(m, idx, qs, length, frac))
                    except Exception as e:  # noqa: BLE001
                        rows.append({**base, "method": name, "sparsity": sp, "budget": "matched ℓ", "error": _err(e)})
                        log(f"[saap] L={length} {hq}/{hkv} probes: ERROR {_err(e)}")
                        continue
                    label = f"ℓ={m.probes} of {m.sizes(length)[0]} buckets (matched sparsity {sp})"
                rows.append(_method_row({**base, "method": name, "sparsity": sp, "budget": label, "matched_frac": frac},
                                        plan, log, m, idx, qs, ctx, None, best, best_loop, best_unr))
        if len(rows) > first_row:  # the dense loop's trace once per phase (the same for every row of it)
            rows[first_row]["dense_loop_trace"] = dense.get("loop_trace", {})
    order = {p: i for i, (p, _) in enumerate(phases)}
    return sorted(rows, key=lambda r: (order[r["phase"]], r["sparsity"]))  # stable: methods keep their order


def phase_thresholds(index, q_blocks, scale: float, vote: str, sparsity: float, backend: str,
                     level1_prune: float | None = None, int8: bool = False) -> tuple[float, float]:
    """(T, T1) calibrated App. C's way but on blocks of the phase's size: each block's S averaged over
    its own tokens (layer 0), the quantile taken over all keys of all blocks (`weighted_threshold`).

    App. C (the library's calibration) averages S over the 100-token observation window. A single
    decode query's S is peakier and a 4K-token prefill block's flatter, so at that one threshold a
    decode step keeps fewer keys than nominal and a 4K prefill more (the paper notes both, App. E),
    by how much depending on the keys. Blocks of one query give a decode threshold, blocks of T
    queries a prefill one: at these, a row reads about 1 - sparsity of the keys. Hierarchical:
    T1 first (`level1_prune` of the keys ruled out by their parent's score), then T2.  `int8`: the
    blocks' scores from int8 inputs, as `Squeezed.lookup_int8` computes them."""
    from sqjax import dispatch, squeezed
    from sqjax.calibration import weighted_threshold

    li = index.layer(0)
    t1 = float(index.threshold1)
    # the layer's arrays are arguments, not closure constants (those would be baked into the program)
    with dispatch.using(backend):
        if li.centroids1.shape[-2]:
            par = squeezed.per_selection_head(li.parent, squeezed.selection_heads(q_blocks[0].shape[0],
                                                                                  li.parent.shape[0], vote))
            s1 = jax.jit(lambda c1, n1, q: squeezed.cluster_scores(q, c1, n1, scale, vote, int8=int8))   # [Hs, C1]
            child = [np.asarray(jnp.take_along_axis(s1(li.centroids1, li.counts1, qb), par, axis=-1))
                     for qb in q_blocks]                                                    # a child's parent score
            t1 = weighted_threshold(np.stack(child), li.counts, level1_prune)
        score = jax.jit(lambda li, q, t: squeezed.layer_scores(li, q, t, scale, vote, int8=int8)[0])
        s = np.stack([np.asarray(score(li, qb, jnp.float32(t1))) for qb in q_blocks])
    return weighted_threshold(s, li.counts, sparsity), t1


def decode_blocks(q_obs, n_queries: int = 32) -> list:
    """The first `n_queries` observation queries, each alone ([Hq, 1, d]): blocks of a decode step."""
    return [q_obs[0, :, j:j + 1] for j in range(min(n_queries, q_obs.shape[2]))]


def decode_threshold(index, q_obs, scale: float, vote: str, sparsity: float, backend: str, n_queries: int = 32) -> float:
    """`phase_thresholds` on single queries (`decode_blocks`), one level: the threshold at which a
    decode row keeps about 1 - sparsity of the keys."""
    return phase_thresholds(index, decode_blocks(q_obs, n_queries), scale, vote, sparsity, backend)[0]


def _recalibrated(r: dict) -> bool:
    """A row timed again at its phase's own threshold (`phase_thresholds`)."""
    return bool(r.get("decode_calibrated") or r.get("prefill_calibrated"))


def _phase_calibrated_row(base, plan, log, name, built, sp, q_blocks, qs, ctx, layout, *best) -> dict:
    """A Squeezed row again at the thresholds `phase_thresholds` gives on `q_blocks` (same clusters)."""
    m, idx = built
    t = base["T"]
    hier = name == "hsqueezed"
    row = {**base, "method": name, "sparsity": sp, "hierarchical": hier,
           ("decode_calibrated" if t == 1 else "prefill_calibrated"): True,
           "budget": f"sparsity {sp}, {2 if hier else 1}-level, T calibrated on "
                     + ("single queries" if t == 1 else f"{t}-token blocks"),
           "C": int(idx[sp].layers.centroids.shape[2]), "threshold_app_c": float(idx[sp].threshold),
           "threshold1_app_c": float(idx[sp].threshold1)}
    try:
        row["threshold"], row["threshold1"] = phase_thresholds(
            idx[sp], q_blocks, 1.0 / math.sqrt(plan.d), m.vote, sp, plan.backend,
            getattr(m, "level1_prune", None), m.lookup_int8)
    except Exception as e:  # noqa: BLE001
        row["error"] = _err(e)
        log(f"[{name}] L={base['L']} {base['phase']} phase-calibrated threshold: ERROR {row['error']}")
        return row
    index = dataclasses.replace(idx[sp], threshold=jnp.float32(row["threshold"]),
                                threshold1=jnp.float32(row["threshold1"]))
    return _method_row(row, plan, log, m, index, qs, ctx, layout, *best)


def kernel_cases(plan: Plan, src: KeySource, log, deadline: float, offline: dict | None,
                 on_rows=None) -> list[dict]:
    """Every (shape, length), shortest first (a deadline cuts the longest), decode before prefill;
    `on_rows(rows)` after each, so a run cut short still has written what it measured."""
    rows = []
    jobs = sorted((length, i) for i in range(len(plan.shapes)) for length in _sweep(plan, i)[0])
    for length, i in jobs:
        hq, hkv = plan.shapes[i]
        if time.perf_counter() > deadline:
            log(f"[kernels] L={length} {hq}/{hkv}: not run (deadline)")
            rows.append({"L": length, "Hq": hq, "Hkv": hkv, "phase": "", "method": "", "budget": "",
                         "error": "not run: deadline"})
            continue
        try:
            rows += _length_rows(plan, src, log, deadline, length, i)
        except Exception as e:  # noqa: BLE001
            log(f"[kernels] L={length} {hq}/{hkv}: ERROR {_err(e)}")
            traceback.print_exc()
        if on_rows:
            on_rows(rows)
    return rows


# ---------------------------------------------------------------------------------------------
# 3. end to end
# ---------------------------------------------------------------------------------------------

class _ByteTokenizer:
    """Text -> ids for a random-weight model, which has no tokenizer of its own: one id per
    UTF-8 byte of text below U+0100 (folded into the vocabulary), no stop id (an answer runs to
    max_new_tokens). `decode` writes each id as its own character above U+00FF (surrogates
    skipped), which `encode` reads back as that id: an answer encodes back to the tokens it was
    generated as, as a real tokenizer's mostly do (a `Conversation` then reuses all of it)."""

    eos_ids: tuple = ()
    _BASE, _GAP = 0x100, 0x800          # id i <-> chr(0x100 + i), past the surrogates U+D800..U+DFFF

    def __init__(self, vocab_size: int):
        self.n = vocab_size - 3

    def encode(self, text: str, add_bos=None, *, special: bool = True) -> list[int]:
        ids = []
        for c in text:
            o = ord(c)
            if o < self._BASE:
                ids += [3 + b % self.n for b in c.encode()]
            else:
                ids.append(o - self._BASE - (self._GAP if o >= 0xD800 + self._GAP else 0))
        return ids

    def has_special_text(self, text: str) -> bool:   # it has no special tokens
        return False

    def decode(self, ids) -> str:
        cps = (self._BASE + int(i) for i in ids)
        return "".join(chr(cp + self._GAP if cp >= 0xD800 else cp) for cp in cps)

    @staticmethod
    def apply_chat_template(messages, add_generation_prompt: bool = True) -> str:
        """A plain chat template (marks as text: this tokenizer has no special tokens), so the
        random model can hold a `Conversation` (`_CHAT_SUFFIX`: the text after the document)."""
        text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


# `_ByteTokenizer`'s template after its first user turn's document, which ends with "\n\n" as a built
# context's does (`FixedContext._split_template`): a follow-up's prompt then starts with the first question
_CHAT_SUFFIX = "{question}<|end|>\n<|assistant|>\n"


def _question_prefill_s(ctx, question: str, n_new: int = 16) -> dict:
    """Where `ask`'s time to first token goes: the question's forward alone (median of 3, synced),
    on a new cache made inside its program as `ask` makes it (`_run_new_cache`), with the captures
    `ask` takes (every token's queries) and without, last logits only; then `ask`'s first-token
    path stage by stage, each synced (median of 3): the forward with captures, the first token's
    sampling and its read on the host."""
    from sqjax.fixed_context import _first_token, _left_pad

    padded = _left_pad([ctx._question_ids(question)])[0]
    n_cache = len(padded) + n_new
    out = {}
    for label, capture in (("with_captures", None), ("without_captures", False)):
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            lg, _, _ = ctx._run_new_cache(padded, ctx.n_tokens, n_cache, capture=capture, logits="last")
            jax.block_until_ready(lg)
            times.append(time.perf_counter() - t0)
        out[label] = float(np.median(times[1:]))
    stages = []
    for _ in range(4):
        t1 = time.perf_counter()
        lg, cache, caps = jax.block_until_ready(ctx._run_new_cache(padded, ctx.n_tokens, n_cache, capture=None,
                                                                   logits="last"))
        t2 = time.perf_counter()
        int(_first_token(lg, jax.random.key(0), jnp.float32(0.0), jnp.float32(1.0), greedy=True, use_top_p=False)[0])
        stages.append((t2 - t1, time.perf_counter() - t2))
        del cache, caps
    med = np.median(np.asarray(stages[1:]), axis=0)
    out["ask_stages"] = {"forward_with_captures": float(med[0]), "first_token": float(med[1])}
    if jax.default_backend() == "gpu":  # where the question's prefill spends its device time
        def run():
            jax.block_until_ready(ctx._run_new_cache(padded, ctx.n_tokens, n_cache, capture=False, logits="last")[0])

        planes = device_activity(run, top=12)
        if planes:
            prof = next(iter(planes.values()))
            out["profile"] = {"busy_ms": prof["busy_ms"], "span_ms": prof["span_ms"],
                              "n_kernels": prof["n_kernels"], "by_name": prof["by_name"]}
    return out


_ASK_TIMED_CALLS = 5   # `ask` calls timed after the first (which compiles; the next builds its CUDA graph); rows take medians


# the parts of an `ask` call after its last token that `_timed_asks` times: the accounting's lookups
# (re-run for the KV-budget stats, its few arrays read back together) and the host's budget arithmetic per answer
_AFTER_LAST_TOKEN = {"accounting_s": "_lookup_counts", "stats_s": "_stats"}


def _timed_asks(call, n: int) -> list[dict]:
    """call(on_token) n times (an `ask` or `ask_many` call that streams to on_token) -> per call {"result",
    "call_s": the whole call, "after_last_token_s": its part after the last token reached the host, and
    for each key of `_AFTER_LAST_TOKEN` the time in that `FixedContext` method}."""
    from sqjax.fixed_context import FixedContext

    saved = {key: getattr(FixedContext, name) for key, name in _AFTER_LAST_TOKEN.items()}
    spent, last = {}, [0.0]

    def timed(key, f):
        def g(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return f(self, *a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        return g

    def on_token(*_):
        last[0] = time.perf_counter()

    out = []
    for key, f in saved.items():
        setattr(FixedContext, _AFTER_LAST_TOKEN[key], timed(key, f))
    try:
        for _ in range(n):
            spent.clear()
            t0 = time.perf_counter()
            res = call(on_token)
            t1 = time.perf_counter()
            out.append({"result": res, "call_s": t1 - t0, "after_last_token_s": t1 - last[0],
                        **{key: spent.get(key, 0.0) for key in saved}})
    finally:
        for key, f in saved.items():
            setattr(FixedContext, _AFTER_LAST_TOKEN[key], f)
    return out


def _call_parts(timed: list[dict]) -> dict:
    """The medians of `_timed_asks`' parts after the last token, over the timed calls."""
    return {key: float(np.median([c[key] for c in timed])) for key in ("after_last_token_s", *_AFTER_LAST_TOKEN)}


def _ask_many_row(ctx, question: str, n_rows: int, n_new: int) -> dict:
    """`FixedContext.ask_many` with `n_rows` questions (the question with a different number appended
    to each): the step time (each call's median step), time to first token and the whole call, each
    the median over `_ASK_TIMED_CALLS` calls after the first (which compiles); tokens/s counts every
    row's tokens (n_rows per step)."""
    questions = [f"{question} ({i + 1})" for i in range(n_rows)]
    calls = _timed_asks(lambda on_token: ctx.ask_many(questions, max_new_tokens=n_new, on_token=on_token),
                        1 + _ASK_TIMED_CALLS)
    timed = calls[1:]
    step = [c["result"][0].stats.time_per_output_token_s for c in timed]
    return {"rows": n_rows, "n_new_tokens": timed[-1]["result"][0].stats.n_new_tokens,
            "ms_per_step": 1e3 * float(np.median(step)), "tokens_per_s": n_rows / float(np.median(step)),
            "ttft_s": float(np.median([c["result"][0].stats.time_to_first_token_s for c in timed])),
            "ask_many_s": float(np.median([c["call_s"] for c in timed])), **_call_parts(timed),
            "kv_budget_rows": [a.stats.kv_budget for a in timed[-1]["result"]], "first_call_s": calls[0]["call_s"],
            "ms_per_step_calls": [1e3 * x for x in step]}


def _repeated(text: str, n: int) -> str:
    """`text` repeated to n characters (at least 1): n tokens of the byte tokenizer."""
    return (text * (max(1, n) // max(1, len(text)) + 1))[: max(1, n)]


def _ttft_by_question_tokens(ctx, question: str, lengths, log, name: str) -> dict:
    """`ask`'s time to first token for questions of each length in `lengths` (tokens of the byte
    tokenizer, the question repeated to fill them): median of `_ASK_TIMED_CALLS` calls after the
    first, which compiles. A follow-up with that many tokens of earlier turns costs the same."""
    out = {}
    for n in lengths:
        text = _repeated(question, n - 2)   # + the template's "\n\n"
        try:
            ttft, n_tok = [], 0
            for _ in range(1 + _ASK_TIMED_CALLS):
                st = ctx.ask(text, max_new_tokens=2).stats
                ttft.append(st.time_to_first_token_s)
                n_tok = st.n_prompt_tokens
            out[str(n)] = {"n_prompt_tokens": n_tok, "ttft_s": float(np.median(ttft[1:])), "ttft_s_calls": ttft[1:],
                           "first_call_s": ttft[0]}
            log(f"[e2e] ask, {name}, {n_tok}-token question: TTFT {1e3 * out[str(n)]['ttft_s']:.1f} ms")
        except Exception as e:  # noqa: BLE001
            out[str(n)] = {"error": _err(e)}
            log(f"[e2e] ask, {name}, {n}-token question: ERROR {_err(e)}")
    return out


def _ttft_follow_up(ctx, question: str, lengths, n_new: int, log, name: str) -> dict:
    """A follow-up's time to first token after a first turn of about n tokens (question and an
    n_new-token answer), for each n in `lengths`: `Conversation.ask`, which keeps the turns' K/V and
    prefills only what is new, against `ask(history=...)`, which prefills the whole conversation
    again. Each timed follow-up is undone, and the next one is numbered differently at its start, so
    each prefills its whole question; medians of `_ASK_TIMED_CALLS` calls after two (which compile:
    the first grows the kept cache, the second's question block is shorter; later ones run on the
    kept K/V buffers in place). Each timed follow-up prefills its own turn from its number on: the
    earlier follow-up's prompt, kept, holds everything before it."""
    out = {}
    for n in lengths:
        first = _repeated(question, n - n_new - 30)   # + the answer and the template's marks
        try:
            conv = ctx.conversation()
            conv.ask(first, max_new_tokens=n_new)
            kept, again, agree = [], [], []
            for i in range(2 + _ASK_TIMED_CALLS):
                q = f"({i}) {question}"
                a = conv.ask(q, max_new_tokens=2)
                conv.undo()
                b = ctx.ask(q, max_new_tokens=2, history=conv.history)
                kept.append(a.stats)
                again.append(b.stats)
                agree.append(a.token_ids == b.token_ids)
            med = lambda sts: float(np.median([s.time_to_first_token_s for s in sts[2:]]))   # noqa: E731
            r = out[str(n)] = {
                "n_prompt_tokens": kept[-1].n_prompt_tokens, "n_reused_tokens": kept[-1].n_reused_tokens,
                "ttft_kept_s": med(kept), "ttft_again_s": med(again),
                "ttft_kept_s_calls": [s.time_to_first_token_s for s in kept[2:]],
                "ttft_again_s_calls": [s.time_to_first_token_s for s in again[2:]],
                "first_calls_kept_s": [s.time_to_first_token_s for s in kept[:2]],
                "first_calls_again_s": [s.time_to_first_token_s for s in again[:2]],
                "n_reused_tokens_calls": [s.n_reused_tokens for s in kept],
                "answers_agree": agree}   # kept vs prefilled again: the same two tokens (exact only in exact arithmetic)
            r["kept_speedup"] = r["ttft_again_s"] / r["ttft_kept_s"]
            log(f"[e2e] follow-up, {name}, {r['n_prompt_tokens']}-token conversation ({r['n_reused_tokens']} kept): "
                f"TTFT {1e3 * r['ttft_kept_s']:.1f} ms kept, {1e3 * r['ttft_again_s']:.1f} ms prefilled again; the same "
                f"answer in {sum(agree)} of {len(agree)} calls")
            del conv
        except Exception as e:  # noqa: BLE001
            out[str(n)] = {"error": _err(e)}
            log(f"[e2e] follow-up, {name}, {n}-token conversation: ERROR {_err(e)}")
    return out


def _after_last_token(row: dict) -> str:
    """A log line's account of an `ask` row's time after its last token."""
    return (f"after the last token {1e3 * row['after_last_token_s']:.1f} ms: the stats' lookups "
            f"{1e3 * row['accounting_s']:.1f} ms, their arithmetic {1e3 * row['stats_s']:.1f} ms")


def _call_ms(row: dict, key: str) -> str:
    """A row's whole `ask` / `ask_many` call in ms, with its part after the last token and the stats'
    lookups in it, where recorded."""
    parts = [row.get(k) for k in ("after_last_token_s", "accounting_s")]
    return f"{1e3 * row[key]:.1f}" + ("" if None in parts else f" ({1e3 * parts[0]:.1f} / {1e3 * parts[1]:.1f})")


def _rows_by_length(ask: dict, key: str, time_key: str):
    """The end-to-end `ask` rows' per-length results under `key`: [(method, length, row)], and
    vs_full(method, length, row) -> full attention's `time_key` over the row's (None for full
    attention itself, for an error, or where full attention has no time)."""
    rows = [(name, n, t) for name, r in ask.items() if isinstance(r, dict) and name != "batch_speedup"
            for n, t in r.get(key, {}).items()]
    full = {n: t.get(time_key) for name, n, t in rows if name == "full"}

    def vs_full(name, n, t):
        return full[n] / t[time_key] if name != "full" and full.get(n) and time_key in t else None

    return rows, vs_full


def _by_length_md(rows, n_cols: int, cells) -> list[str]:
    """Markdown rows of `_rows_by_length`'s (method, length, row): | method | cells(method, length, row)... |,
    or an error row padded to n_cols columns."""
    out = []
    for name, n, t in rows:
        if "error" in t:
            out.append(f"| {name} | {n} | error: {t['error'][:80]} |" + " |" * (n_cols - 3))
        else:
            out.append("| " + " | ".join(str(c) for c in (name, *cells(name, n, t))) + " |")
    return out


def _ask_rows(model, methods, data: LayerKV, length: int, n_prompt: int, n_new: int, log, batches=(),
              question_tokens=(), follow_up_tokens=()) -> dict:
    """`FixedContext.ask` -- the library's question loop (question prefill, pipelined decode on
    carried buffers, per-token accounting after the loop) -- on the end-to-end model and fixed
    context, for each (name, method, index): time to first token, time per output token (each
    call's median) and the whole call, each the median over `_ASK_TIMED_CALLS` calls after the
    first (which compiles; every call's values are kept), and the KV budget. Then `ask_many` for
    each batch size in `batches` (`_ask_many_row`): several questions over the one fixed context,
    full attention's rows folded into one pass over it (`sqjax.dispatch.dense_attention_batched`),
    Squeezed's through `clustered_decode_batched` (one level). Then the time to first token of
    longer questions (`question_tokens`, `_ttft_by_question_tokens`)."""
    from sqjax.fixed_context import FixedContext

    question = ("Which of the measurements in the document above was taken on the largest input, and by how "
                "much did it beat the baseline?")[: max(1, n_prompt - 2)]
    rows = {}
    for name, method, idx in methods:
        ctx = None  # the previous method's context (its clustered copy of the K/V) goes first
        try:
            ctx = FixedContext(model, method, np.zeros(length, np.int32), data, idx, {}, last_logits=None, chat=False,
                               suffix_template="\n\n{question}", doc_sha256="random")
            calls = _timed_asks(lambda on_token: ctx.ask(question, max_new_tokens=n_new, on_token=on_token),
                                1 + _ASK_TIMED_CALLS)
            timed = calls[1:]                                   # the first call compiles
            st = timed[-1]["result"].stats
            ttft = [c["result"].stats.time_to_first_token_s for c in timed]
            per_tok = [c["result"].stats.time_per_output_token_s for c in timed]
            rows[name] = {"n_prompt_tokens": st.n_prompt_tokens, "n_new_tokens": st.n_new_tokens,
                          "ttft_s": float(np.median(ttft)), "ms_per_token": 1e3 * float(np.median(per_tok)),
                          "tokens_per_s": 1.0 / float(np.median(per_tok)),
                          "ask_s": float(np.median([c["call_s"] for c in timed])), **_call_parts(timed),
                          "kv_budget": st.kv_budget,
                          "ttft_s_calls": ttft, "ms_per_token_calls": [1e3 * x for x in per_tok],
                          "question_prefill_s": _question_prefill_s(ctx, question, n_new)}
            log(f"[e2e] ask, {name}: question prefill alone "
                f"{1e3 * rows[name]['question_prefill_s']['with_captures']:.1f} ms with captures, "
                f"{1e3 * rows[name]['question_prefill_s']['without_captures']:.1f} ms without")
            log(f"[e2e] ask, {name}: stages of the first token (synced) "
                + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in rows[name]["question_prefill_s"]["ask_stages"].items()))
            prof = rows[name]["question_prefill_s"].get("profile")
            if prof:
                log(f"[e2e] ask, {name}: question prefill device busy {prof['busy_ms']:.2f} ms, span "
                    f"{prof['span_ms']:.2f} ms, {prof['n_kernels']} kernels; largest: "
                    + "; ".join(f"{k['name'][:60]} {k['total_ms']:.3f} ms x{k['count']}" for k in prof["by_name"][:8]))
            log(f"[e2e] ask, {name}: TTFT {1e3 * rows[name]['ttft_s']:.1f} ms (calls: "
                + ", ".join(f"{1e3 * x:.1f}" for x in ttft) + "), "
                f"{rows[name]['ms_per_token']:.2f} ms/token ({st.n_new_tokens} tokens), whole call "
                f"{1e3 * rows[name]['ask_s']:.1f} ms ({_after_last_token(rows[name])}), "
                f"KV budget {st.kv_budget:.3f}")
            for n_rows in batches:
                try:
                    r = rows[name].setdefault("batches", {})[str(n_rows)] = _ask_many_row(ctx, question, n_rows, n_new)
                    log(f"[e2e] ask_many, {name}, {n_rows} questions: {r['ms_per_step']:.2f} ms/step, "
                        f"{r['tokens_per_s']:.1f} tokens/s, TTFT {1e3 * r['ttft_s']:.1f} ms, whole call {1e3 * r['ask_many_s']:.1f} ms "
                        f"({_after_last_token(r)}; first call, compiling: "
                        f"{r['first_call_s']:.1f} s)")
                except Exception as e:  # noqa: BLE001
                    rows[name].setdefault("batches", {})[str(n_rows)] = {"error": _err(e)}
                    log(f"[e2e] ask_many, {name}, {n_rows} questions: ERROR {_err(e)}")
            if question_tokens:
                rows[name]["ttft_by_question_tokens"] = _ttft_by_question_tokens(ctx, question, question_tokens, log,
                                                                                 name)
            if follow_up_tokens:
                ctx = None   # the same context with the chat template (one clustered copy at a time)
                ctx = FixedContext(model, method, np.zeros(length, np.int32), data, idx, {}, last_logits=None,
                                   chat=True, suffix_template=_CHAT_SUFFIX, doc_sha256="random")
                rows[name]["ttft_follow_up"] = _ttft_follow_up(ctx, question, follow_up_tokens, n_new, log, name)
            del ctx
        except Exception as e:  # noqa: BLE001
            rows[name] = {"error": _err(e)}
            log(f"[e2e] ask, {name}: ERROR {_err(e)}")
            traceback.print_exc()
    if all("tokens_per_s" in rows.get(n, {}) for n in ("squeezed", "full")):
        rows["speedup"] = rows["squeezed"]["tokens_per_s"] / rows["full"]["tokens_per_s"]
        rows["ttft_speedup"] = rows["full"]["ttft_s"] / rows["squeezed"]["ttft_s"]
    for n_rows in batches:
        a, b = (rows.get(n, {}).get("batches", {}).get(str(n_rows), {}) for n in ("squeezed", "full"))
        if "tokens_per_s" in a and "tokens_per_s" in b:
            rows.setdefault("batch_speedup", {})[str(n_rows)] = a["tokens_per_s"] / b["tokens_per_s"]
    return rows


@dataclasses.dataclass(frozen=True)
class _NoAttention:
    """An attn_fn that returns zeros: times everything in a decode step but attention."""

    def __call__(self, layer, q, cache_k, cache_v, q_pos, kv_pos, state):
        return jnp.zeros_like(q)


def _fused_decode_by_layer(plan: Plan, data, index, length: int, q_layers, layers=(0, 1, 15, 31)) -> list:
    """The fused decode kernel alone on a few layers of the end-to-end index, for the model's
    decode query q_layers [layers, Hq, d]: time, the fraction of rows it reads and the largest
    cluster (work balance), to locate per-step costs. (Alone, the same rows are read call after
    call and may sit in L2; inside a step every layer reads its own.)"""
    from pallas_kernels import cluster_sort_layout, clustered_decode_attention

    kn = jnp.zeros((plan.hkv, 32, plan.d), BF16)
    kp = jnp.where(jnp.arange(32) < 8, length + jnp.arange(32), -1).astype(jnp.int32)
    qp = jnp.full((1,), length + 8, jnp.int32)
    rows = []
    for layer in (x for x in layers if x < data.k.shape[0]):
        q = q_layers[layer].astype(BF16)
        li = index.layer(layer)
        ks, vs, off, _ = cluster_sort_layout(data.k[layer], data.v[layer], li.labels, index.n_sink, index.n_tail,
                                             num_clusters=li.counts.shape[-1])
        cent = li.centroids.astype(BF16)
        f = jax.jit(lambda q, ks, vs, off: clustered_decode_attention(
            q, ks, vs, cent, off, index.threshold, kn, kn, qp, kp, scale=1.0 / math.sqrt(plan.d)))
        _, _, n_rows = jax.jit(lambda q, ks, vs, off: clustered_decode_attention(
            q, ks, vs, cent, off, index.threshold, kn, kn, qp, kp, scale=1.0 / math.sqrt(plan.d),
            return_stats=True))(q, ks, vs, off)
        sizes = np.diff(np.asarray(off), axis=-1)
        rows.append({"layer": layer, "kernel_ms": time_ms(f, [(q, ks, vs, off)], reps=plan.reps),
                     "kept": float(np.asarray(n_rows).mean() / length), "max_cluster": int(sizes.max()),
                     "mean_cluster": float(sizes.mean())})
        del ks, vs
    return rows


def _stable_step(graphdef, state, tok, pos, cache, attn_state, *, attn_fn):
    """One greedy decode step whose token, position and cache are donated and come back as
    outputs of the same shapes: XLA aliases them, so every step runs on the same addresses.
    tok, pos int32 [1, 1] -> (next token [1, 1], pos + 1, cache)."""
    from models.forward import forward

    lg, cache, _ = forward(graphdef, state, tok, pos, cache, attn_fn=attn_fn, attn_state=attn_state,
                           logits="last")
    return jnp.argmax(lg[:, -1], axis=-1).astype(jnp.int32)[:, None], pos + 1, cache


_stable_step_jit = jax.jit(_stable_step, static_argnames=("attn_fn",), donate_argnames=("tok", "pos", "cache"))


def end_to_end(plan: Plan, src: KeySource, log, offline: dict | None) -> dict:
    from flax import nnx

    from models import KVCache, LlamaConfig
    from models.forward import forward_jit
    from models.llama import Llama
    from models.rope import config_frequencies
    from sqjax.fixed_context import LayerKV, SparseAttentionHook, attention_state
    from sqjax.methods import ContextData, Full, HierarchicalSqueezed, Squeezed

    cfg = LlamaConfig(vocab_size=plan.e2e_vocab, hidden_size=plan.e2e_hidden, intermediate_size=plan.e2e_inter,
                      num_layers=plan.e2e_layers, num_heads=plan.hq, num_kv_heads=plan.hkv, head_dim=plan.d,
                      rope_theta=500000.0, max_position_embeddings=plan.e2e_length + 16384, name="llama3-8b-shaped")
    t0 = time.perf_counter()
    model = Llama(cfg, dtype=BF16, param_dtype=BF16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    jax.block_until_ready(state)
    out = {"config": dataclasses.asdict(cfg), "init_s": time.perf_counter() - t0, "L": plan.e2e_length}
    log(f"[e2e] model init {out['init_s']:.1f}s")
    length = plan.e2e_length
    inv = tuple(float(x) for x in config_frequencies(cfg))
    full_hook = SparseAttentionHook(Full(), inv, backend=plan.backend)
    # per-layer K/V (full_state's) are what the hooks and FixedContext keep; the stacked copy
    # (k_fix, v_fix) exists for the index build (an 80 GB H100 ran out of memory holding a third copy)
    if offline and offline.get("data") is not None and offline["data"].k.shape[2] == length:
        k_fix, v_fix = offline["data"].k, offline["data"].v
        full_state = attention_state(k_fix, v_fix, None)
    else:
        ks, vs = zip(*[src.kv(length, seed=layer) for layer in range(plan.e2e_layers)])
        k_fix, v_fix = jnp.stack(ks), jnp.stack(vs)
        full_state = attention_state(ks, vs, None)

    def model_queries(hook, st, toks, start):
        """The model's own roped queries [layers, Hq, T, d] for tokens [1, T] at start.. (attending
        the fixed context through `hook`)."""
        T = toks.shape[1]
        _, _, caps = forward_jit(graphdef, state, toks, jnp.arange(start, start + T, dtype=jnp.int32)[None],
                                 KVCache.init(cfg, 1, T, BF16), attn_fn=hook, attn_state=st, capture_last=None,
                                 logits="none")
        return jnp.stack([jnp.swapaxes(c["q"][0], 0, 1) for c in caps])

    # the threshold is calibrated on queries of THIS model (random weights), as the library
    # calibrates on the document's own last queries: queries of another model (the captured
    # SmolLM2 ones) put its score distribution elsewhere and the in-situ selection kept ~all rows
    n_obs = 100 if not plan.cpu else 8
    obs_tokens = jax.random.randint(jax.random.key(7), (1, n_obs), 0, cfg.vocab_size)
    q_obs = model_queries(full_hook, full_state, obs_tokens, length - n_obs)
    data = ContextData(k_fix, v_fix, q_obs.astype(BF16), scale=1.0 / math.sqrt(plan.d))
    kv = LayerKV(full_state["k"], full_state["v"], data.q_obs, data.scale)  # what the `ask` rows share
    from sqjax import dispatch

    # a shorter clustering (8 Lloyd iterations instead of 25) keeps this section short;
    # section 1 times the full one
    cls = HierarchicalSqueezed if plan.e2e_method == "hierarchical" else Squeezed
    method = cls(sparsity=0.9, n_sink=1, kmeans_iters=8, n_obs=n_obs)
    out["method"] = plan.e2e_method
    t0 = time.perf_counter()
    with dispatch.using(plan.backend):
        index, info = method.build(data)
    jax.block_until_ready(index)
    out["index_build_s"] = time.perf_counter() - t0
    out["index_kmeans"] = f"k-means++, 8 Lloyd iterations; threshold calibrated on {n_obs} queries of the model itself"
    log(f"[e2e] index built in {out['index_build_s']:.1f}s")
    n_prompt, n_steps = (128 if not plan.cpu else 8), plan.e2e_steps
    tokens = jax.random.randint(jax.random.key(1), (1, n_prompt), 0, cfg.vocab_size)

    if plan.e2e_ask_only:
        del full_state, data, k_fix, v_fix
        return _e2e_ask_section(plan, out, graphdef, state, cfg, method, index, kv, length, n_prompt, n_steps, log)
    # the model's decode queries (one token after the question, full attention upstream)
    q_dec = model_queries(full_hook, full_state, tokens[:, :1], length + n_prompt)
    del full_state
    with dispatch.using(plan.backend):  # fraction of the fixed context Squeezed selects for them
        out["kept_in_situ_per_layer"] = [
            float(jnp.mean(method.select(index, layer, q_dec[layer], None, data.k[layer]).kv_rows) / length)
            for layer in range(plan.e2e_layers)]
    out["kept_in_situ"] = float(np.mean(out["kept_in_situ_per_layer"]))
    # the same with the threshold calibrated on the captured SmolLM2 queries (how this section
    # calibrated before): those queries do not come from this model
    from sqjax.calibration import key_threshold
    from sqjax.squeezed import layer_scores

    q_cap = jnp.stack([src.queries(100, seed=layer) for layer in range(plan.e2e_layers)])
    per_cluster = [layer_scores(index.layer(i), q_cap[i], 0.0, data.scale, method.vote)[0] for i in range(plan.e2e_layers)]
    t_cap = key_threshold(per_cluster, [index.layer(i).counts for i in range(plan.e2e_layers)], method.sparsity)
    idx_cap = dataclasses.replace(index, threshold=jnp.float32(t_cap))
    with dispatch.using(plan.backend):
        out["kept_in_situ_captured_threshold"] = float(np.mean([
            float(jnp.mean(method.select(idx_cap, layer, q_dec[layer], None, data.k[layer]).kv_rows) / length)
            for layer in range(plan.e2e_layers)]))
    del q_cap, per_cluster, idx_cap
    log(f"[e2e] squeezed keeps {out['kept_in_situ']:.3f} of the fixed context for the model's decode queries "
        f"(layers {min(out['kept_in_situ_per_layer']):.3f}..{max(out['kept_in_situ_per_layer']):.3f}); "
        f"{out['kept_in_situ_captured_threshold']:.3f} with the threshold calibrated on the captured queries")

    def attn_layer_ms(hook, state_tree, layer=1):
        """One layer's attention call alone (jitted), decode shape: where the step's time goes."""
        q = q_dec[layer][:, 0][None, None].astype(BF16)  # [1, 1, Hq, d]: the model's decode query
        ck = jnp.zeros((1, plan.hkv, 32, plan.d), BF16)
        qp = jnp.full((1, 1), length + 8, jnp.int32)
        kp = jnp.where(jnp.arange(32) < 8, length + jnp.arange(32), -1).astype(jnp.int32)[None]
        f = jax.jit(lambda q, st: hook(layer, q, ck, ck, qp, kp, st))
        return time_ms(f, [(q, state_tree)], reps=plan.reps)

    n_pipe = n_steps  # steps dispatched back to back (no host sync in between), as generate() runs
    capacity = n_prompt + 2 * n_steps + 2 * n_pipe + 16

    def run(hook, state_tree) -> dict:
        def step(tok, p, c):
            lg, c, _ = forward_jit(graphdef, state, tok.reshape(1, 1), jnp.full((1, 1), p, jnp.int32), c,
                                   attn_fn=hook, attn_state=state_tree, logits="last")
            return jnp.argmax(lg[0, -1]).astype(jnp.int32), c

        pos = jnp.arange(length, length + n_prompt, dtype=jnp.int32)[None]
        # compile both shapes first
        lg, c2, _ = forward_jit(graphdef, state, tokens, pos, KVCache.init(cfg, 1, capacity, BF16),
                                attn_fn=hook, attn_state=state_tree, logits="last")
        jax.block_until_ready(step(jnp.argmax(lg[0, -1]).astype(jnp.int32), length + n_prompt, c2))
        ttfts = []
        for _ in range(3):
            cache = KVCache.init(cfg, 1, capacity, BF16)
            t0 = time.perf_counter()
            lg, cache, _ = forward_jit(graphdef, state, tokens, pos, cache, attn_fn=hook, attn_state=state_tree, logits="last")
            nxt = jnp.argmax(lg[0, -1]).astype(jnp.int32)
            jax.block_until_ready(nxt)
            ttfts.append(time.perf_counter() - t0)
        times, host = [], []
        p = length + n_prompt
        for i in range(n_steps):  # synced: the host waits for each token before dispatching the next
            t0 = time.perf_counter()
            lg, cache, _ = forward_jit(graphdef, state, nxt.reshape(1, 1), jnp.full((1, 1), p, jnp.int32), cache,
                                       attn_fn=hook, attn_state=state_tree, logits="last")
            host.append(time.perf_counter() - t0)  # the call returns once the step is dispatched
            nxt = jnp.argmax(lg[0, -1]).astype(jnp.int32)
            jax.block_until_ready(nxt)
            times.append(time.perf_counter() - t0)
            p += 1
        # pipelined: the next step is dispatched before the previous token reaches the host
        t0 = time.perf_counter()
        for i in range(n_pipe):
            nxt, cache = step(nxt, p, cache)
            p += 1
        jax.block_until_ready(nxt)
        pipelined = (time.perf_counter() - t0) / n_pipe
        # pipelined on stable buffers: token and position stay on the device, donated each step
        # (the pipelined loop above hands every step a new token and a new position buffer)
        tok_d, pos_d = nxt.reshape(1, 1), jnp.full((1, 1), p, jnp.int32)
        tok_d, pos_d, cache = _stable_step_jit(graphdef, state, tok_d, pos_d, cache, state_tree, attn_fn=hook)
        jax.block_until_ready(tok_d)  # compiled; one step taken
        host_stable = []
        t0 = time.perf_counter()
        for i in range(n_pipe):
            th = time.perf_counter()
            tok_d, pos_d, cache = _stable_step_jit(graphdef, state, tok_d, pos_d, cache, state_tree, attn_fn=hook)
            host_stable.append(time.perf_counter() - th)
        jax.block_until_ready(tok_d)
        pipelined_stable = (time.perf_counter() - t0) / n_pipe
        nxt, p = tok_d.reshape(()), p + n_pipe + 1
        res = {"ttft_s": float(np.median(ttfts)), "ms_per_token": 1e3 * float(np.median(times)),
               "host_dispatch_ms": 1e3 * float(np.median(host)), "ms_per_token_pipelined": 1e3 * pipelined,
               "ms_per_token_pipelined_stable": 1e3 * pipelined_stable,
               "host_dispatch_stable_ms": 1e3 * float(np.median(host_stable))}
        # where the device time goes: a trace of n_prof pipelined steps
        n_prof = 4
        box = {"nxt": nxt, "cache": cache, "p": p}

        def traced():
            for _ in range(n_prof):
                box["nxt"], box["cache"] = step(box["nxt"], box["p"], box["cache"])
                box["p"] += 1
            jax.block_until_ready(box["nxt"])

        try:
            planes = device_activity(traced, top=15)
        except Exception as e:  # noqa: BLE001 - the profile is diagnostics; the timings stand without it
            planes = {"error": _err(e)}
        if planes and "error" not in planes:
            name, act = next(iter(planes.items()))
            res["profile"] = {"plane": name, "steps": n_prof, "busy_ms_per_token": act["busy_ms"] / n_prof,
                              "span_ms_per_token": act["span_ms"] / n_prof,
                              "kernels_per_token": act["n_kernels"] / n_prof,
                              "by_name": act["by_name"], "by_hlo_op": act["by_hlo_op"]}
        elif planes:
            res["profile"] = planes
        return res

    out["per_layer"] = _fused_decode_by_layer(plan, data, index, length, q_dec[:, :, 0])
    log("[e2e] per layer (fused kernel alone): " + ", ".join(
        f"L{r['layer']} {r['kernel_ms']:.3f} ms kept {r['kept']:.3f} max cluster {r['max_cluster']}"
        for r in out["per_layer"]))
    variants = [("squeezed", SparseAttentionHook(method, inv, backend=plan.backend), index),
                ("full", full_hook, None),
                # full attention through the jnp reference (what "full" ran before the dense kernel)
                ("full-xla", SparseAttentionHook(Full(), inv, backend="reference"), None),
                # no attention at all: the floor set by the weights and the per-step overhead
                ("no-attention", _NoAttention(), None)]
    for name, hook, idx in variants:
        try:
            st = attention_state(data.k, data.v, idx, clustered_layout=name == "squeezed")
            r = out[name] = run(hook, st)
            r["tokens_per_s"] = 1e3 / r["ms_per_token"]
            r["tokens_per_s_pipelined"] = 1e3 / r["ms_per_token_pipelined"]
            r["tokens_per_s_pipelined_stable"] = 1e3 / r["ms_per_token_pipelined_stable"]
            if name != "no-attention":
                r["attention_ms_per_layer"] = attn_layer_ms(hook, st)

            prof = r.get("profile", {})
            log(f"[e2e] {name}: TTFT {r['ttft_s'] * 1e3:.1f} ms ({n_prompt} tokens), {r['ms_per_token']:.2f} ms/token "
                f"synced, {r['ms_per_token_pipelined']:.2f} pipelined, {r['ms_per_token_pipelined_stable']:.2f} pipelined on "
                f"stable buffers (dispatch {r['host_dispatch_stable_ms']:.2f} ms), dispatch {r['host_dispatch_ms']:.2f} ms, "
                f"device busy {prof.get('busy_ms_per_token', float('nan')):.2f} ms/token "
                f"({prof.get('kernels_per_token', float('nan')):.0f} kernels), "
                f"one layer's attention {r.get('attention_ms_per_layer', 0):.3f} ms")
            for k in prof.get("by_name", [])[:8]:
                log(f"[e2e]    {k['total_ms'] / prof['steps']:.3f} ms/token x{k['count'] // prof['steps']} {k['name'][:90]}")
            del st
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": _err(e)}
            log(f"[e2e] {name}: ERROR {_err(e)}")
            traceback.print_exc()
    if "tokens_per_s" in out.get("squeezed", {}) and "tokens_per_s" in out.get("full", {}):
        out["decode_speedup"] = out["squeezed"]["tokens_per_s"] / out["full"]["tokens_per_s"]
        out["decode_speedup_pipelined"] = out["squeezed"]["tokens_per_s_pipelined"] / out["full"]["tokens_per_s_pipelined"]
        out["decode_speedup_pipelined_stable"] = (out["squeezed"]["tokens_per_s_pipelined_stable"]
                                                  / out["full"]["tokens_per_s_pipelined_stable"])
        out["ttft_speedup"] = out["full"]["ttft_s"] / out["squeezed"]["ttft_s"]
    base = out.get("no-attention", {}).get("profile", {}).get("busy_ms_per_token")
    for name in ("squeezed", "full", "full-xla"):
        prof = out.get(name, {}).get("profile", {})
        if base is not None and "busy_ms_per_token" in prof:  # attention's share of the step's device time
            out[name]["attention_busy_ms_per_token"] = prof["busy_ms_per_token"] - base
    if all("attention_busy_ms_per_token" in out.get(n, {}) for n in ("squeezed", "full")):
        out["attention_busy_speedup"] = (out["full"]["attention_busy_ms_per_token"]
                                         / out["squeezed"]["attention_busy_ms_per_token"])
    return _e2e_ask_section(plan, out, graphdef, state, cfg, method, index, kv, length, n_prompt, n_steps, log)


def _e2e_ask_section(plan, out, graphdef, state, cfg, method, index, fixed, length, n_prompt, n_steps,
                     log) -> dict:
    """The end-to-end section's `ask` / `ask_many` rows and the byte bound.  fixed: the context's
    per-layer K/V (`LayerKV`), shared by both contexts."""
    from models.registry import LoadedModel
    from sqjax.methods import Full

    model = LoadedModel(graphdef, state, cfg, _ByteTokenizer(cfg.vocab_size), source="random", dtype=BF16)
    out["ask"] = _ask_rows(model, (("squeezed", method, index), ("full", Full(), None)), fixed,
                           length, n_prompt, n_steps, log, batches=plan.e2e_batches,
                           question_tokens=plan.e2e_question_tokens, follow_up_tokens=plan.e2e_follow_up_tokens)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    kv = sum(x.size * x.dtype.itemsize for x in fixed.k + fixed.v)
    out["bytes_weights"] = float(weights)
    out["bytes_fixed_kv"] = float(kv)
    out["decode_speedup_bound_bytes"] = (weights + kv) / (weights + 0.1 * kv + 0.025 * kv)
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

_SHAPE_NAMES = {(32, 8): "Llama-3-8B", (32, 32): "Llama-2-7B"}


def _f(x, nd: int = 3, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.{nd}f}{suffix}"


def _tb(tbps: float | None, peak: float | None) -> str:
    """TB/s and, where the device's datasheet bandwidth is known, its fraction ("2.26 (47%)")."""
    return "—" if tbps is None else f"{tbps:.2f}" + (f" ({tbps / peak:.0%})" if peak else "")


def to_markdown(res: dict) -> str:
    p = res["plan"]
    shapes = [tuple(s) for s in p.get("shapes", [(p["hq"], p["hkv"])])]
    md = [f"# sqjax speed suite — {res['meta']['device']}", "",
          f"jax {res['meta']['jax']}, commit {res['meta']['git_commit']}, keys: {res['keys']}, bf16, d={p['d']}, "
          f"(Hq, Hkv) = {', '.join(map(str, shapes))}, 5% centroids, n_sink=1, n_obs=100"
          + (", Squeezed block lookups from int8 q and centroids (`lookup_int8`)" if p.get("lookup_int8") else "")
          + (f", level 1 ruling out {p['level1_prune']:g} of the keys" if p.get("level1_prune", 0.5) != 0.5 else "")
          + ".", ""]
    off = res.get("offline")
    if off:
        def secs(key):
            return f"{off[key]:.1f} s" if key in off else "—"

        md += ["## Offline: clustering + calibration (k-means++, ≤ 25 Lloyd iterations)", "",
               "| fixed context | layers × KV heads | 1-level, first build (compiles) | 1-level, compiled | "
               "hierarchical, first | hierarchical, compiled |", "|---|---|---|---|---|---|",
               f"| {off['L']} | {off['layers']} × {off['Hkv']} | {secs('squeezed_seconds')} | "
               f"{secs('squeezed_seconds_warm')} | {secs('hsqueezed_seconds')} | {secs('hsqueezed_seconds_warm')} |", ""]
        if "squeezed_token_seconds" in off:
            md += ["With decode thresholds (`decode_calibration=\"token\"`: each calibration query alone also "
                   "sets T, T1 for decode steps). Kept: mean retrieved fraction of the clustered keys by each "
                   "calibration query alone (a decode step), at App. C's pair and at the decode pair.", "",
                   "| build | first build | compiled | App. C T | decode T | single query kept at App. C's T "
                   "| at the decode T |", "|---|---|---|---|---|---|---|"]
            for name in ("squeezed_token", "hsqueezed_token"):
                if f"{name}_seconds" in off:
                    md.append(f"| {name.replace('_token', '')} | {secs(name + '_seconds')} | "
                              f"{secs(name + '_seconds_warm')} | {off[name + '_threshold']:.3g} | "
                              f"{off[name + '_threshold_decode']:.3g} | {off[name + '_decode_kept_app_c']:.4f} | "
                              f"{off[name + '_decode_kept']:.4f} |")
            md.append("")
        if off.get("not_run"):
            md += [f"Not run (the run's deadline came first): {', '.join(off['not_run'])}.", ""]
    rows = [r for r in res.get("kernels", []) if "method" in r]
    for shape in sorted({(r["Hq"], r["Hkv"]) for r in rows}, key=lambda s: (s not in shapes, s)):
        name = _SHAPE_NAMES.get(shape)
        md += [f"## Hq={shape[0]}, Hkv={shape[1]}, d={p['d']}{f' ({name} attention)' if name else ''}: "
               "lookup + retrieval + sparse attention vs dense (ms, median)", "",
               "| L | phase | method | level / budget | kept | lookup ms | total ms | path | cuDNN | XLA | Pallas dense "
               "| speedup vs best dense | TB/s |", "|---" * 13 + "|"]
        for r in (r for r in rows if (r["Hq"], r["Hkv"]) == shape):
            dn = r.get("dense_ms", {})
            path = f"ERROR: {r['error'][:120]}" if "error" in r else r.get("path", "")
            if "generic_total_ms" in r:
                path += f" (library path {r['generic_total_ms']:.3f} ms)"
            if r.get("overflow_heads"):
                path += f"; {r['overflow_heads']} heads over the index capacity (library path capped)"
            md.append(f"| {r['L']} | {r['phase']} | {r['method']} | {r['budget']} | {_f(r.get('retrieved_frac'))} | "
                      f"{_f(r.get('lookup_ms'))} | {_f(r.get('total_ms'))} | {path} | {_f(dn.get('cudnn'))} | "
                      f"{_f(dn.get('xla'))} | {_f(dn.get('pallas'))} | {_f(r.get('speedup_vs_best_dense'), 2, '×')} | "
                      f"{_f(r.get('tb_per_s'), 2)} |")
        md.append("")
    loop_rows = [r for r in rows if "total_loop_ms" in r and r["phase"] == "decode"]
    if loop_rows:
        p = res.get("plan", {})
        md += [f"## Decode, device time per call (same run, same inputs, dense timed the same ways)", "",
               f"Loop = {p.get('loop_iters', 30)} calls in one jitted `fori_loop` (host dispatch paid once; the loop "
               f"body's kernels are launched iteration by iteration; runs before 2026-11-23 looped 30 calls, where the "
               "same kernels came out 6-12 us slower per call). Unrolled = "
               f"{p.get('unroll_calls', 16)} calls written out in one jitted program (its dispatch and sync weigh "
               "1/16 each), which XLA can capture whole in a command buffer (a CUDA graph; "
               "the end-to-end trace shows the model step captured so), as a model step runs its layers; each call's query depends on the previous output, so they run in order and "
               "none is merged with another. Both reuse one layer's K/V call after call: at 128K part of the sparse "
               "working set (~75 MB) can stay in the 50 MB L2, which a model's next layer would not find there.", "",
               "| Hq/Hkv | L | method | level / budget | kept | loop ms | cuDNN loop | Pallas dense loop | speedup "
               "(loop) | unrolled ms | cuDNN unrolled | Pallas dense unrolled | speedup (unrolled) | per-call wall ms "
               "| speedup (per call) |", "|---" * 15 + "|"]
        for r in loop_rows:
            dl, du = r.get("dense_loop_ms", {}), r.get("dense_unrolled_ms", {})
            md.append(f"| {r['Hq']}/{r['Hkv']} | {r['L']} | {r['method']} | {r['budget']} | "
                      f"{_f(r.get('retrieved_frac'))} | {_f(r['total_loop_ms'])} | {_f(dl.get('cudnn'))} | "
                      f"{_f(dl.get('pallas'))} | {_f(r.get('speedup_vs_best_dense_loop'), 2, '×')} | "
                      f"{_f(r.get('total_unrolled_ms'))} | {_f(du.get('cudnn'))} | {_f(du.get('pallas'))} | "
                      f"{_f(r.get('speedup_vs_best_dense_unrolled'), 2, '×')} | {_f(r.get('total_ms'))} | "
                      f"{_f(r.get('speedup_vs_best_dense'), 2, '×')} |")
        md.append("")
    traced = [r for r in rows if "kernel_busy_ms" in r or "lookup_kernel_busy_ms" in r]
    if traced:
        peak = hbm_peak_tbps(res.get("meta", {}).get("device", ""))
        md += ["## Decode, kernel time per call (profiler trace of 10 calls; busy = union of kernel intervals)", "",
               "TB/s = bytes read / kernel busy time (sparse: the row's K+V rows and metadata rows; dense: all "
               "fixed-context K and V); of floor = the bytes' time at the datasheet HBM bandwidth "
               f"({_f(peak, 2)} TB/s for {res.get('meta', {}).get('device', '?')}) / the busy time.", "",
               "| Hq/Hkv | L | method | kept | lookup kernels ms | kernel busy ms (whole decode) | dense kernel busy ms "
               "(cuDNN / Pallas) | ratio vs best dense | TB/s (of floor) | best dense TB/s (of floor) "
               "| largest kernels (ms per call) |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in traced:
            dk = r.get("dense_kernel_busy_ms") or {}
            best = min(dk.values(), default=None)
            busy = r.get("kernel_busy_ms")
            tbps = r["bytes"] / (busy * 1e-3) / 1e12 if busy and r.get("bytes") else None
            dense_bytes = 2 * r["L"] * r["Hkv"] * r.get("d", 128) * 2  # bf16 K and V of the fixed context
            dense_tbps = dense_bytes / (best * 1e-3) / 1e12 if best else None
            md.append(f"| {r['Hq']}/{r['Hkv']} | {r['L']} | {r['method']}{' (T on single queries)' if r.get('decode_calibrated') else ''} | "
                      f"{_f(r.get('retrieved_frac'))} | "
                      f"{_f(r.get('lookup_kernel_busy_ms'), 4)} | "
                      f"{_f(busy, 4)} | {_f(dk.get('cudnn'), 4)} / {_f(dk.get('pallas'), 4)} | "
                      f"{_f(best / busy if best and busy else None, 2, '×')} | "
                      f"{_tb(tbps, peak)} | {_tb(dense_tbps, peak)} | "
                      + "; ".join(f"`{k['name'][:28]}` {k['ms_per_call']:.4f}" for k in r.get("kernels", [])[:4]) + " |")
        md.append("")
    pre_loop = [r for r in rows if "total_loop_ms" in r and r["phase"] != "decode"]
    if pre_loop:
        p = res.get("plan", {})
        md += ["## Prefill, device time per call (same run, same inputs, dense timed the same ways)", "",
               f"Loop = {p.get('prefill_loop_iters', 4)} calls in one jitted `fori_loop`, as a model's prefill runs "
               "its layers in one program (runs before 2026-11-23 looped 4, spreading the program's "
               "first dispatch over 4 calls); per call = back-to-back jitted calls, each synced every 5 calls; "
               "steady = (T(8 calls) - T(4 calls)) / 4, T ending in one sync: what each further call adds, "
               "without the first call's host dispatch and the final sync.", "",
               "| Hq/Hkv | L | phase | method | level / budget | kept | loop ms | cuDNN loop | speedup (loop) | "
               "per-call wall ms | cuDNN per call | speedup (per call) | steady per call ms | cuDNN steady | "
               "speedup (steady) |", "|---" * 15 + "|"]
        for r in pre_loop:
            md.append(f"| {r['Hq']}/{r['Hkv']} | {r['L']} | {r['phase']} | {r['method']} | {r['budget']} | "
                      f"{_f(r.get('retrieved_frac'))} | {_f(r['total_loop_ms'])} | "
                      f"{_f(r.get('dense_loop_ms', {}).get('cudnn'))} | {_f(r.get('speedup_vs_best_dense_loop'), 2, '×')} | "
                      f"{_f(r.get('total_ms'))} | {_f(r.get('dense_ms', {}).get('cudnn'))} | "
                      f"{_f(r.get('speedup_vs_best_dense'), 2, '×')} | {_f(r.get('total_steady_ms'))} | "
                      f"{_f(r.get('dense_steady_ms', {}).get('cudnn'))} | "
                      f"{_f(r.get('speedup_vs_best_dense_steady'), 2, '×')} |")
        md.append("")
    pre = [r for r in rows if "prefill_busy_ms" in r]
    if pre:
        md += ["## Prefill, kernel time per call (profiler trace of 3 calls; dense: 10 calls)", "",
               "Span = first kernel's start to last kernel's end, per call (busy + idle gaps); host = time until "
               "a call returns (it launches every kernel), the device idle.", "",
               "| Hq/Hkv | L | phase | method | lookup kernels ms | whole path kernels ms | span ms | kernels "
               "per call | host ms per call | dense cuDNN kernels ms | dense / span | largest kernels of the "
               "whole path (ms per call) | largest lookup kernels |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pre:
            md.append(f"| {r['Hq']}/{r['Hkv']} | {r['L']} | {r['phase']} | {r['method']}"
                      f"{' (T on blocks)' if r.get('prefill_calibrated') else ''} | "
                      f"{_f(r.get('prefill_lookup_busy_ms'))} | {_f(r['prefill_busy_ms'])} | "
                      f"{_f(r.get('prefill_span_ms'))} | {_f(r.get('prefill_kernels_per_call'), 0)} | "
                      f"{_f(r.get('dispatch_ms'))} | {_f(r.get('dense_kernel_busy_ms', {}).get('cudnn'))} | "
                      f"{_f(r.get('speedup_vs_best_dense_span'), 2, '×')} | "
                      + "; ".join(f"`{k['name'][:28]}` {k['ms_per_call']:.3f}" for k in r["prefill_kernels"][:6]) + " | "
                      + "; ".join(f"`{k['name'][:28]}` {k['ms_per_call']:.3f}"
                                  for k in r.get("prefill_lookup_kernels", [])[:6]) + " |")
        md.append("")
        md += [f"- longest idle gaps, {r['L']} {r['phase']} {r['method']}: "
               + "; ".join(f"{g['ms']:.3f} ms `{g['after'][:24]}` → `{g['before'][:24]}`" for g in r["prefill_gaps"][:4])
               for r in pre if r.get("prefill_gaps")] + [""]
    pairs = [(a, b) for a in traced for b in traced if a["method"] == "squeezed" and b["method"] == "hsqueezed"
             and not _recalibrated(a)
             and (a["Hq"], a["Hkv"], a["L"], a["sparsity"]) == (b["Hq"], b["Hkv"], b["L"], b["sparsity"])
             and a.get("lookup_kernel_busy_ms") and b.get("lookup_kernel_busy_ms")]
    if pairs:
        md += ["## Decode lookup: hierarchical vs 1-level, kernel time per call (same trace method)", "",
               "| Hq/Hkv | L | sparsity | 1-level ms | hierarchical ms | ratio | centroid rows read (1-level / "
               "hierarchical) | hierarchical lookup kernels (ms per call) |", "|---|---|---|---|---|---|---|---|"]
        for a, b in pairs:
            md.append(f"| {a['Hq']}/{a['Hkv']} | {a['L']} | {a['sparsity']} | {a['lookup_kernel_busy_ms']:.4f} | "
                      f"{b['lookup_kernel_busy_ms']:.4f} | {b['lookup_kernel_busy_ms'] / a['lookup_kernel_busy_ms']:.2f}× | "
                      f"{_f(a.get('meta_rows'), 0)} / {_f(b.get('meta_rows'), 0)} | "
                      + "; ".join(f"`{k['name'][:28]}` {k['ms_per_call']:.4f}" for k in b.get("lookup_kernels", [])[:5])
                      + " |")
        md.append("")
    if rows:
        md += ["QUEST and SAAP (decode): budget matched to the kept fraction of the 1-level Squeezed row at that "
               "sparsity (QUEST: that fraction of L rounded up to 16-token pages; SAAP, nearest-centroid buckets: the "
               "ℓ whose visited fraction on the timed queries is closest). SAAP reads the synthetic keys and queries as "
               "already de-roped. Total = the method's own Pallas kernels; \"library path\" = `method.select` → "
               "`sqjax.dispatch.attention`. Kept = fixed-context keys read / L; bytes = K+V rows read + metadata rows "
               "(centroids, page bounds, bucket centroids), bf16. Speedup vs the fastest dense baseline of the same "
               "run.", ""]
    e2e = res.get("e2e")
    if e2e and ("squeezed" in e2e or "ask" in e2e):
        md += ["## End to end: Llama-3-8B-shaped model (random bf16 weights), batch 1", "",
               f"Fixed context {e2e.get('L')} tokens; sparse method: "
               f"{'two-level (hierarchical) ' if e2e.get('method') == 'hierarchical' else ''}Squeezed, 90%; "
               f"index: {e2e.get('index_kmeans', 'the offline section’s')}. "
               "Synced = the host waits for each token before dispatching the next step; pipelined = "
               "each step is dispatched while the previous one runs (the next token stays on the device), "
               "as `models.generate` does; \"dispatch\" = time until the jitted step returns (the host "
               "enqueues every kernel); device busy = union of kernel time per token in a profiler trace of "
               "4 pipelined steps; \"one layer\" = one layer's attention call alone, jitted; \"stable\" = pipelined "
               "with the token and position carried on the device and donated, so every step runs on the same "
               "buffer addresses (\"stable dispatch\" = its time until the step returns).", "",
               "| variant | TTFT (128-token question) | ms / token synced | ms / token pipelined | tokens/s pipelined "
               "| ms / token stable | tokens/s stable | stable dispatch ms "
               "| dispatch ms | device busy ms / token | kernels / token | one layer's attention ms |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in ("squeezed", "full", "full-xla", "no-attention"):
            r = e2e.get(name)
            if r is None:
                continue
            if "ms_per_token" in r:
                prof = r.get("profile", {})
                md.append(f"| {name} | {1e3 * r['ttft_s']:.1f} ms | {r['ms_per_token']:.2f} | "
                          f"{r.get('ms_per_token_pipelined', float('nan')):.2f} | "
                          f"{r.get('tokens_per_s_pipelined', float('nan')):.1f} | "
                          f"{r.get('ms_per_token_pipelined_stable', float('nan')):.2f} | "
                          f"{r.get('tokens_per_s_pipelined_stable', float('nan')):.1f} | "
                          f"{r.get('host_dispatch_stable_ms', float('nan')):.2f} | "
                          f"{r.get('host_dispatch_ms', float('nan')):.2f} | "
                          f"{prof.get('busy_ms_per_token', float('nan')):.2f} | "
                          f"{prof.get('kernels_per_token', float('nan')):.0f} | "
                          f"{r.get('attention_ms_per_layer', 0.0):.3f} |")
            else:
                md.append(f"| {name} | error: {r.get('error', '?')[:80]} | | | | | | | | | | |")
        md += ["", "full = the split-KV Pallas dense kernel (the dispatch default for dense attention on GPU); "
               "full-xla = the jnp reference; no-attention = every layer's attention replaced by zeros (weights, "
               "norms, MLPs, logits and per-step overhead only)."]
        for name in ("squeezed", "full"):
            prof = (e2e.get(name) or {}).get("profile", {})
            if prof.get("by_name"):
                md += ["", f"Largest kernels per token, {name} ({prof['plane']}):", "",
                       "| kernel | ms / token | launches / token |", "|---|---|---|"]
                md += [f"| `{k['name'][:80]}` | {k['total_ms'] / prof['steps']:.3f} | {k['count'] / prof['steps']:.0f} |"
                       for k in prof["by_name"][:10]]
        if "kept_in_situ" in e2e:
            md += ["", f"Squeezed keeps {e2e['kept_in_situ']:.3f} of the fixed context for the model's own decode "
                   f"queries (per layer {min(e2e['kept_in_situ_per_layer']):.3f}–"
                   f"{max(e2e['kept_in_situ_per_layer']):.3f}); with the threshold calibrated on the captured "
                   f"SmolLM2 queries instead (this section before 2026-11-22) it would keep "
                   f"{e2e.get('kept_in_situ_captured_threshold', float('nan')):.3f}."]
        if e2e.get("per_layer"):
            md += ["", "| layer | fused decode kernel alone (ms) | rows read / L | largest cluster | mean cluster |",
                   "|---|---|---|---|---|"]
            md += [f"| {r['layer']} | {r['kernel_ms']:.3f} | {r['kept']:.3f} | {r['max_cluster']} | {r['mean_cluster']:.1f} |"
                   for r in e2e["per_layer"]]
        if "decode_speedup" in e2e:
            if "decode_speedup_pipelined" in e2e:
                md.append(f"\nDecode speedup pipelined {e2e['decode_speedup_pipelined']:.2f}×.")
            if "decode_speedup_pipelined_stable" in e2e:
                md.append(f"\nDecode speedup pipelined on stable buffers {e2e['decode_speedup_pipelined_stable']:.2f}×.")
            if "attention_busy_speedup" in e2e:
                md.append(f"\nAttention's device time per token (busy time minus the no-attention variant's): "
                          f"squeezed {e2e['squeezed']['attention_busy_ms_per_token']:.2f} ms, full "
                          f"{e2e['full']['attention_busy_ms_per_token']:.2f} ms → {e2e['attention_busy_speedup']:.2f}×.")
            md.append(f"\nDecode speedup {e2e['decode_speedup']:.2f}× synced (byte bound with these weights: "
                      f"{e2e['decode_speedup_bound_bytes']:.2f}×), TTFT speedup {e2e['ttft_speedup']:.2f}×.")
        ask = e2e.get("ask", {})
        if any(isinstance(r, dict) for r in ask.values()):
            md += ["", "`FixedContext.ask` on the same model and fixed context (medians over the calls after the "
                   "first, which compiles; TTFT of each call in brackets):", "",
                   "| method | question tokens | new tokens | TTFT ms | ms / token | tokens/s | whole call ms (after the "
                   "last token / of it the stats' lookups) | KV budget |", "|---|---|---|---|---|---|---|---|"]
            for name, r in ask.items():
                if not isinstance(r, dict) or name == "batch_speedup":
                    continue
                if "error" in r:
                    md.append(f"| {name} | error: {r['error'][:80]} | | | | | | |")
                    continue
                calls = ", ".join(f"{1e3 * x:.1f}" for x in r.get("ttft_s_calls", []))
                md.append(f"| {name} | {r['n_prompt_tokens']} | {r['n_new_tokens']} | {1e3 * r['ttft_s']:.1f}"
                          f"{f' ({calls})' if calls else ''} | {r['ms_per_token']:.3f} | {r['tokens_per_s']:.1f} | "
                          f"{_call_ms(r, 'ask_s')} | {r['kv_budget']:.3f} |")
            if "speedup" in ask:
                md.append(f"\n`ask` decode speedup {ask['speedup']:.2f}×, TTFT speedup {ask['ttft_speedup']:.2f}×.")
            batched = [(name, n, b) for name, r in ask.items() if isinstance(r, dict) and name != "batch_speedup"
                       for n, b in r.get("batches", {}).items()]
            if batched:
                md += ["", "`FixedContext.ask_many`: several questions in one batch over the same fixed context "
                       "(tokens/s counts every row's tokens; full attention reads the context once per step for "
                       "all rows):", "", "| method | questions | ms / step | tokens/s | TTFT ms | whole call ms (after the last token / of it the "
                       "stats' lookups) | "
                       "speed-up vs full |", "|---|---|---|---|---|---|---|"]
                for name, n, b in batched:
                    if "error" in b:
                        md.append(f"| {name} | {n} | error: {b['error'][:80]} | | | | |")
                        continue
                    sp = ask.get("batch_speedup", {}).get(n) if name == "squeezed" else None
                    md.append(f"| {name} | {n} | {b['ms_per_step']:.3f} | {b['tokens_per_s']:.1f} | "
                              f"{1e3 * b['ttft_s']:.1f} | {_call_ms(b, 'ask_many_s')} | {_f(sp, 2, '×')} |")
            longer, vs_full = _rows_by_length(ask, "ttft_by_question_tokens", "ttft_s")
            if longer:
                md += ["", "Time to first token by question length (a follow-up with that many tokens of earlier "
                       "turns costs the same: `ask(history=...)` prefills them again):", "",
                       "| method | question tokens | TTFT ms | speed-up vs full |", "|---|---|---|---|"]
                md += _by_length_md(longer, 4, lambda name, n, t: (
                    t['n_prompt_tokens'], f"{1e3 * t['ttft_s']:.1f}", _f(vs_full(name, n, t), 2, '×')))
            follow, vs_full = _rows_by_length(ask, "ttft_follow_up", "ttft_kept_s")
            if follow:
                md += ["", "A follow-up's time to first token: `Conversation.ask` keeps the turns' K/V and prefills "
                       "only the new turn, against `ask(history=...)`, which prefills the whole conversation "
                       "again:", "",
                       "| method | conversation tokens | kept | TTFT kept ms | TTFT prefilled again ms | kept vs again | "
                       "kept vs full kept |", "|---|---|---|---|---|---|---|"]
                md += _by_length_md(follow, 7, lambda name, n, t: (
                    t['n_prompt_tokens'], t['n_reused_tokens'], f"{1e3 * t['ttft_kept_s']:.1f}",
                    f"{1e3 * t['ttft_again_s']:.1f}", f"{t['kept_speedup']:.2f}×", _f(vs_full(name, n, t), 2, '×')))
        md.append("")
    if res.get("errors"):
        md += ["## Errors", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(md)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape = list(res["plan"].get("shapes", [[res["plan"]["hq"], res["plan"]["hkv"]]])[0])
    rows = [r for r in res.get("kernels", []) if "total_ms" in r and r.get("dense_ms") and r.get("method") == "squeezed"
            and [r["Hq"], r["Hkv"]] == shape and not _recalibrated(r)]
    if not rows:
        return
    length = max(r["L"] for r in rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for phase in sorted({r["phase"] for r in rows}):
        rr = sorted([r for r in rows if r["phase"] == phase and r["L"] == length], key=lambda r: r["sparsity"])
        if rr:
            ax.plot([r["sparsity"] for r in rr], [r["total_ms"] / min(r["dense_ms"].values()) for r in rr], "o-", label=phase)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_xlabel("sparsity (fraction of fixed-context keys pruned)")
    ax.set_ylabel("latency / best dense latency")
    ax.set_title(f"Squeezed Attention, L={length}, Hq/Hkv={shape[0]}/{shape[1]}, {res['meta']['device']}")
    ax.legend()
    fig.tight_layout()
    write_figure_atomic(fig, path, dpi=120)


# plan settings that change what a row measures: runs that differ in one are not one result
_MERGE_SAME = ("lookup_int8", "level1_prune", "d")


def merge_runs(runs: list[dict], names: list[str]) -> dict:
    """One result from several runs of the suite on the same commit (a run split by section, phase
    or length to fit a machine's time limit): kernel rows and errors concatenated, the offline and
    end-to-end sections from the run that has them, the plan's lengths, sparsities, phases and
    shapes united, seconds summed, each run's plan and seconds kept under `merged_from`. Every row
    keeps the dense baselines of its own run. A length one run did not reach ("not run: deadline")
    and another measured is not listed as not run; runs measured with different settings
    (`_MERGE_SAME`: the int8 lookup, level-1 pruning, d) or on different commits are refused."""
    if not runs:
        raise ValueError("nothing to merge: give at least one run directory")
    commits = {n: r.get("meta", {}).get("git_commit") for n, r in zip(names, runs)}
    if len(set(commits.values())) != 1:
        raise ValueError(f"runs of different commits cannot be merged: {commits}")
    out = {k: v for k, v in runs[0].items() if k not in ("offline", "e2e")}
    for section in ("offline", "e2e"):
        have = [(n, r[section]) for n, r in zip(names, runs) if section in r]
        if len(have) > 1:
            raise ValueError(f"the {section} section is in more than one run ({', '.join(n for n, _ in have)}): "
                             "keep one")
        if have:
            out[section] = have[0][1]
    for key in _MERGE_SAME:
        vals = {n: r["plan"].get(key) for n, r in zip(names, runs)}
        if len({json.dumps(v) for v in vals.values()}) != 1:
            raise ValueError(f"runs measured with different {key} cannot be merged: {vals}")
    rows = [row for r in runs for row in r.get("kernels", [])]
    measured = {(row["L"], row["Hq"], row["Hkv"]) for row in rows if row.get("method")}
    # a length one run left to its deadline and another measured: the measured rows stand for it
    out["kernels"] = [row for row in rows if not (row.get("error") == "not run: deadline"
                                                   and (row["L"], row["Hq"], row["Hkv"]) in measured)]
    out["errors"] = [e for r in runs for e in r.get("errors", [])]
    out["seconds"] = sum(r.get("seconds", 0.0) for r in runs)
    plan = dict(runs[0]["plan"])
    sweeps = [r for r in runs if r.get("kernels")] or runs  # the kernel axes of the runs that swept kernels
    for key in ("lengths", "sparsities", "phases", "hier_sparsities"):
        plan[key] = sorted({x for r in sweeps for x in r["plan"].get(key, [])})
    shapes = [list(s) for r in runs for s in r["plan"].get("shapes", [])]
    plan["shapes"] = [s for i, s in enumerate(shapes) if s not in shapes[:i]]   # first run's first shape stays first
    out["plan"] = plan
    out["merged_from"] = {n: {"seconds": r.get("seconds"), "plan": r["plan"]} for n, r in zip(names, runs)}
    return out


def _write_merged(dirs: list[str], out_dir: Path) -> dict:
    runs = []
    for d in dirs:
        f = Path(d) / "speed.json"
        if not f.is_file():
            raise SystemExit(f"--merge: {f} does not exist (give directories written by --out)")
        runs.append(json.loads(f.read_text()))
    res = merge_runs(runs, [str(d) for d in dirs])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "speed.json", res)
    write_text_atomic(out_dir / "speed.md", to_markdown(res))
    plot(res, out_dir / "fig4_latency_vs_sparsity.png")
    return res


def main(argv_or_args=None) -> int:
    if isinstance(argv_or_args, argparse.Namespace):
        a = argv_or_args
        argv = ["--out", a.out] + (["--quick"] if a.quick else [])
        if a.contexts:
            argv += ["--lengths", ",".join(str(x) for x in a.contexts)]
        if a.sparsities:
            argv += ["--sparsities", ",".join(str(x) for x in a.sparsities)]
        argv_or_args = argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--keys", default=".scratch/captured/smollm2_qkv.npz",
                    help="captured keys (python -m benchmarks.capture_keys); Gaussian if the file is missing")
    ap.add_argument("--lengths", default="")
    ap.add_argument("--sparsities", default="")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: offline,kernels,e2e")
    ap.add_argument("--no-offline-hierarchical", action="store_true", help="time only the 1-level offline build")
    ap.add_argument("--only-kernels", action="store_true", help="= --skip offline,e2e")
    ap.add_argument("--shapes", default="", help="kernel sweep (Hq, Hkv) shapes, e.g. 32x8,32x32")
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--level1-prune", type=float, default=None,
                    help="fraction of keys level 1 rules out for the hierarchical kernel rows (default 0.5)")
    ap.add_argument("--lookup-int8", action="store_true",
                    help="the Squeezed kernel rows' block (prefill) lookups from int8 q and centroids (Squeezed.lookup_int8)")
    ap.add_argument("--phases", default="", help="decode,prefill (default both)")
    ap.add_argument("--hier-sparsities", default="",
                    help="sparsities of the hierarchical (2-level) kernel rows (default 0.9)")
    ap.add_argument("--e2e-batches", default="", help="comma list of ask_many batch sizes (default 4,8; 0 = none)")
    ap.add_argument("--e2e-method", choices=("squeezed", "hierarchical"), default="squeezed",
                    help="the end-to-end section's sparse method (hierarchical: the 2-level index)")
    ap.add_argument("--e2e-question-tokens", default="",
                    help="comma list of longer questions' lengths whose TTFT the end-to-end section times "
                         "(default 512,2048; 0 = none)")
    ap.add_argument("--e2e-follow-up-tokens", default="",
                    help="comma list of conversation lengths after which the end-to-end section times a follow-up's "
                         "TTFT, the turns' K/V kept (Conversation) against prefilled again (default none)")
    ap.add_argument("--e2e-ask-only", action="store_true",
                    help="end-to-end section: only ask / ask_many (skip the decode-loop variants and probes)")
    ap.add_argument("--merge", default="", help="comma list of --out directories of runs on one commit: write their "
                    "merged speed.json / speed.md / plot to --out (no GPU needed, nothing is measured)")
    args = ap.parse_args(argv_or_args)
    if args.merge:
        res = _write_merged(args.merge.split(","), Path(args.out))
        print(f"merged {len(res['merged_from'])} runs: {len(res['kernels'])} kernel rows -> {args.out}")
        return 0
    plan = cpu_plan() if args.cpu_smoke else Plan()
    if args.quick:
        plan = dataclasses.replace(plan, lengths=(131072,), sparsities=(0.9,), offline_layers=4, e2e_layers=4, reps=5)
    if args.lengths:
        plan = dataclasses.replace(plan, lengths=tuple(int(x) for x in args.lengths.split(",")))
    if args.sparsities:
        plan = dataclasses.replace(plan, sparsities=tuple(float(x) for x in args.sparsities.split(",")))
    if args.hier_sparsities:
        plan = dataclasses.replace(plan, hier_sparsities=tuple(float(x) for x in args.hier_sparsities.split(",")))
    if args.no_offline_hierarchical:
        plan = dataclasses.replace(plan, offline_hierarchical=False)
    if args.phases:
        plan = dataclasses.replace(plan, phases=tuple(args.phases.split(",")))
    if args.budget_s:
        plan = dataclasses.replace(plan, deadline_s=args.budget_s)
    if args.level1_prune is not None:
        plan = dataclasses.replace(plan, level1_prune=args.level1_prune)
    if args.lookup_int8:
        plan = dataclasses.replace(plan, lookup_int8=True)
    if args.e2e_question_tokens:
        plan = dataclasses.replace(plan, e2e_question_tokens=tuple(
            int(x) for x in args.e2e_question_tokens.split(",") if int(x) > 0))
    if args.e2e_follow_up_tokens:
        plan = dataclasses.replace(plan, e2e_follow_up_tokens=tuple(
            int(x) for x in args.e2e_follow_up_tokens.split(",") if int(x) > 0))
    if args.e2e_batches:
        plan = dataclasses.replace(plan, e2e_batches=tuple(int(x) for x in args.e2e_batches.split(",") if int(x) > 0))
    if args.e2e_ask_only:
        plan = dataclasses.replace(plan, e2e_ask_only=True)
    plan = dataclasses.replace(plan, e2e_method=args.e2e_method)
    if args.shapes:
        plan = dataclasses.replace(plan, shapes=tuple(tuple(map(int, s.split("x"))) for s in args.shapes.split(",")))
    if not args.cpu_smoke and jax.default_backend() != "gpu":
        print("sqjax bench needs a GPU (use --cpu-smoke to check the plumbing)", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(","))) | ({"offline", "e2e"} if args.only_kernels else set())
    t_start = time.perf_counter()
    deadline = t_start + plan.deadline_s
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    errors = []

    def log(msg):
        print(msg, flush=True)
        if "ERROR" in msg:
            errors.append(msg)

    src = KeySource(args.keys, plan)
    res = {"meta": metadata(), "plan": dataclasses.asdict(plan), "keys": src.kind, "errors": errors}

    def save():  # after every section (and every kernel length): a run cut short keeps what it measured
        res["seconds"] = time.perf_counter() - t_start
        write_json(out_dir / "speed.json", res)
        write_text_atomic(out_dir / "speed.md", to_markdown(res))

    offline = None
    if "offline" not in skip:
        try:
            def numbers(o):  # the section's numbers, not the indexes or the data
                return {k: v for k, v in o.items() if not k.endswith("_index") and k != "data"}

            offline = offline_cost(plan, src, log, deadline,   # saved after every build
                                   on_build=lambda o: (res.__setitem__("offline", numbers(o)), save()))
            res["offline"] = numbers(offline)
        except Exception as e:  # noqa: BLE001
            log(f"[offline] ERROR {_err(e)}")
            traceback.print_exc()
        save()
    if "e2e" not in skip:
        try:
            res["e2e"] = end_to_end(plan, src, log, offline)
        except Exception as e:  # noqa: BLE001
            log(f"[e2e] ERROR {_err(e)}")
            traceback.print_exc()
        save()
    offline = None  # free the 128K x 32-layer context before the kernel sweep
    if "kernels" not in skip:
        res["kernels"] = kernel_cases(plan, src, log, deadline, offline,
                                      on_rows=lambda rows: (res.__setitem__("kernels", rows), save()))
    save()
    md = to_markdown(res)
    try:
        plot(res, out_dir / "fig4_latency_vs_sparsity.png")
    except Exception as e:  # noqa: BLE001
        log(f"[plot] ERROR {_err(e)}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
