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
   same run (cuDNN through `jax.nn.dot_product_attention`, and XLA); bytes moved and TB/s.
3. End to end: decode ms/token and time to first token of a Llama-3-8B-shaped model (random
   bf16 weights) over a 128K fixed context, Squeezed Attention vs full attention.
4. A plot like the paper's Fig. 4: latency normalised to dense per sparsity.

Keys: with --keys, keys/values/queries captured from the real model (SmolLM2, two 64-d heads
concatenated to d=128) are tiled to the context length with a little noise, so per-head
sparsity is realistic; otherwise Gaussian.
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

from benchmarks._meta import metadata, time_ms, write_json

BF16 = jnp.bfloat16


@dataclasses.dataclass
class Plan:
    lengths: tuple = (32768, 131072, 524288)
    sparsities: tuple = (0.7, 0.8, 0.9)
    prefill: tuple = (1024, 4096)
    hq: int = 32
    hkv: int = 8
    d: int = 128
    offline_layers: int = 32
    offline_length: int = 131072
    e2e_length: int = 131072
    e2e_layers: int = 32
    e2e_hidden: int = 4096
    e2e_inter: int = 14336
    e2e_vocab: int = 128256
    e2e_steps: int = 16
    reps: int = 10
    deadline_s: float = 520.0
    cpu: bool = False
    phases: tuple = ("decode", "prefill")
    backend: str = "auto"  # sqjax.dispatch backend ("interpret" in the CPU smoke run: kernel plumbing)


def cpu_plan() -> Plan:
    return Plan(lengths=(1024,), sparsities=(0.8, 0.9), prefill=(32,), hq=4, hkv=2, d=16, offline_layers=2,
                offline_length=1024, e2e_length=1024, e2e_layers=2, e2e_hidden=64, e2e_inter=128, e2e_vocab=256,
                e2e_steps=3, reps=2, deadline_s=600, cpu=True, backend="interpret")


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
    msg = f"{type(e).__name__}: {e}"
    return msg[:500]


# ---------------------------------------------------------------------------------------------
# 1. offline cost
# ---------------------------------------------------------------------------------------------

def offline_cost(plan: Plan, src: KeySource, log) -> dict:
    from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed

    out = {"layers": plan.offline_layers, "Hkv": plan.hkv, "Hq": plan.hq, "L": plan.offline_length, "d": plan.d}
    ks, vs = zip(*[src.kv(plan.offline_length, seed=layer) for layer in range(plan.offline_layers)])
    k = jnp.stack(ks)
    v = jnp.stack(vs)
    q_obs = jnp.stack([src.queries(100, seed=layer) for layer in range(plan.offline_layers)])
    jax.block_until_ready((k, v, q_obs))
    data = ContextData(k, v, q_obs, scale=1.0 / math.sqrt(plan.d))
    for name, m in (("squeezed", Squeezed(sparsity=0.9, n_sink=1)),
                    ("hsqueezed", HierarchicalSqueezed(sparsity=0.9, n_sink=1))):
        from sqjax import dispatch

        t0 = time.perf_counter()
        with dispatch.using(plan.backend):
            index, info = m.build(data)
        jax.block_until_ready(index)
        out[f"{name}_seconds"] = time.perf_counter() - t0  # includes compilation (first build)
        out[f"{name}_capacity"] = info["capacity"]
        log(f"[offline] {name}: {out[f'{name}_seconds']:.1f}s for {plan.offline_layers} layers x {plan.hkv} heads x {plan.offline_length} keys")
        out[f"{name}_index"] = (m, index, info)
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


def kernel_cases(plan: Plan, src: KeySource, log, deadline: float, offline: dict | None) -> list[dict]:
    from sqjax import dispatch, squeezed
    from sqjax.calibration import global_threshold, key_scores
    from sqjax.methods import ContextData, HierarchicalSqueezed, Squeezed

    rows = []
    scale = 1.0 / math.sqrt(plan.d)
    dense = _dense_fns_nocat(plan)
    for length in sorted(plan.lengths, reverse=True):
        if time.perf_counter() > deadline:
            break
        k, v = src.kv(length, seed=length)
        q_obs = src.queries(100, seed=length)[None]
        data = ContextData(k[None], v[None], q_obs, scale=scale)
        built = {}
        for hier in (False, True):
            cls = HierarchicalSqueezed if hier else Squeezed
            t0 = time.perf_counter()
            try:
                m = cls(sparsity=0.9, n_sink=1)
                with dispatch.using(plan.backend):
                    index, info = m.build(data)
                li = index.layer(0)
                # thresholds for every sparsity from the same calibration scores
                with dispatch.using(plan.backend):
                    s, _ = squeezed.layer_scores(li, q_obs[0], index.threshold1, scale, "kv")
                per_key = key_scores(s, li.labels)
                thr = {sp: global_threshold([per_key], sp) for sp in plan.sparsities}
                built[hier] = (m, index, thr)
                log(f"[index] L={length} {'hier' if hier else 'flat'} built in {time.perf_counter() - t0:.1f}s")
            except Exception as e:  # noqa: BLE001
                log(f"[index] L={length} hier={hier}: ERROR {_err(e)}")
                traceback.print_exc()
        clustered = {}
        if False in built:  # 1-level: the cluster-contiguous layout the fused decode kernel reads
            from pallas_kernels import cluster_sort_layout

            _, idx0, _ = built[False]
            ks, vs, off, _ = cluster_sort_layout(k, v, idx0.layers.labels[0], idx0.n_sink, idx0.n_tail,
                                                 num_clusters=idx0.layers.counts.shape[-1])
            clustered[False] = (ks, vs, off)
        phases = [("decode", 1)] + [(f"prefill_{t // 1024}k" if t >= 1024 else f"prefill_{t}", t) for t in plan.prefill]
        phases = [p for p in phases if p[0].split("_")[0] in plan.phases]
        n_new = 1024 if not plan.cpu else 16
        kn, vn = src.kv(n_new, seed=7)
        for phase, t in phases:
            qs = [src.queries(t, seed=100 * t + i) for i in range(3)]
            kv_pos = (length + jnp.arange(n_new)).astype(jnp.int32)
            q_pos = (length + n_new - t + jnp.arange(t)).astype(jnp.int32)
            # dense baselines (the new part already appended outside the timing)
            kk = jnp.concatenate([k, kn], 1).swapaxes(0, 1)[None]
            vv = jnp.concatenate([v, vn], 1).swapaxes(0, 1)[None]
            dense_ms = {}
            for name, fn in dense.items():
                if time.perf_counter() > deadline:
                    break
                if name == "xla" and t * length > (1 << 30):  # XLA materialises T x L scores: OOM
                    continue
                try:
                    dense_ms[name] = time_ms(fn, [(qq.swapaxes(0, 1)[None], kk, vv) for qq in qs], reps=plan.reps)
                except Exception as e:  # noqa: BLE001
                    log(f"[dense] L={length} {phase} {name}: ERROR {_err(e)}")
            del kk, vv
            best_dense = min(dense_ms.values()) if dense_ms else None
            log(f"[dense] L={length} {phase}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in dense_ms.items()))
            for hier, (m, index, thr) in built.items():
                for sp in plan.sparsities:
                    if time.perf_counter() > deadline:
                        break
                    row = {"L": length, "phase": phase, "T": t, "sparsity": sp, "hierarchical": hier,
                           "Hq": plan.hq, "Hkv": plan.hkv, "d": plan.d, "dtype": "bfloat16",
                           "C": int(index.layers.centroids.shape[2]), "dense_ms": dense_ms}
                    idx_sp = dataclasses.replace(index, threshold=jnp.float32(thr[sp]))
                    m_sp = dataclasses.replace(m, sparsity=sp)

                    def lookup_only(q, index=idx_sp, m=m_sp):
                        li = index.layer(0)
                        return squeezed.layer_scores(li, q, index.threshold1, scale, "kv")[0]

                    def full_path(q, k, v, kn, vn, qp, kp, index=idx_sp, m=m_sp):
                        sel = m.select(index, 0, q, None, k)
                        o = dispatch.attention(q, k, v, sel, kn, vn, qp, kp, scale)
                        return o, sel.kv_rows, sel.meta_rows, sel.overflow

                    fused = clustered.get(hier) if t == 1 else None
                    if fused is not None:  # what the model's decode runs on GPU: the fused kernel
                        ks, vs, off = fused

                        def fast(q, k, v, kn, vn, qp, kp, index=idx_sp, ks=ks, vs=vs, off=off):
                            return dispatch.clustered_decode(q, ks, vs, index.layer(0).centroids, off, index.threshold,
                                                             kn, vn, qp, kp, scale, "kv")

                    try:
                        with dispatch.using(plan.backend):
                            lk = jax.jit(lookup_only)
                            fp = jax.jit(full_path)
                            row["lookup_ms"] = time_ms(lk, [(qq,) for qq in qs], reps=plan.reps)
                            sets = [(qq, k, v, kn, vn, q_pos, kv_pos) for qq in qs]
                            if fused is not None:
                                row["generic_total_ms"] = time_ms(fp, sets, reps=plan.reps)
                                row["total_ms"] = time_ms(jax.jit(fast), sets, reps=plan.reps)
                                row["path"] = "fused clustered decode kernel"
                            else:
                                row["total_ms"] = time_ms(fp, sets, reps=plan.reps)
                                row["path"] = "lookup + retrieve + " + ("sparse attention" if t == 1 else "gather + cuDNN")
                            _, rows_, meta_, over = fp(qs[0], k, v, kn, vn, q_pos, kv_pos)
                        rows_ = np.asarray(rows_, np.float64).mean(-1)
                        row["retrieved_frac"] = float(rows_.mean() / length)
                        row["centroids_read"] = float(np.asarray(meta_).mean())
                        row["overflow_heads"] = int(np.asarray(over).sum())
                        by = (rows_.sum() * 2 + np.asarray(meta_, np.float64).mean(-1).sum()) * plan.d * 2
                        row["bytes"] = float(by)
                        row["tb_per_s"] = by / (row["total_ms"] * 1e-3) / 1e12
                        if best_dense:
                            row["speedup_vs_best_dense"] = best_dense / row["total_ms"]
                        log(f"[squeezed] L={length} {phase} sp={sp} {'hier' if hier else 'flat'}: lookup {row['lookup_ms']:.3f} ms, "
                            f"total {row['total_ms']:.3f} ms, kept {row['retrieved_frac']:.3f}, "
                            f"x{row.get('speedup_vs_best_dense', float('nan')):.2f} vs dense")
                    except Exception as e:  # noqa: BLE001
                        row["error"] = _err(e)
                        log(f"[squeezed] L={length} {phase} sp={sp} hier={hier}: ERROR {row['error']}")
                        traceback.print_exc()
                    rows.append(row)
        del k, v, data, built
    return rows


# ---------------------------------------------------------------------------------------------
# 3. end to end
# ---------------------------------------------------------------------------------------------

def end_to_end(plan: Plan, src: KeySource, log, offline: dict | None) -> dict:
    from flax import nnx

    from models import KVCache, LlamaConfig
    from models.forward import forward_jit
    from models.llama import Llama
    from models.rope import config_frequencies
    from sqjax.fixed_context import SparseAttentionHook, attention_state
    from sqjax.methods import ContextData, Full, Squeezed

    cfg = LlamaConfig(vocab_size=plan.e2e_vocab, hidden_size=plan.e2e_hidden, intermediate_size=plan.e2e_inter,
                      num_layers=plan.e2e_layers, num_heads=plan.hq, num_kv_heads=plan.hkv, head_dim=plan.d,
                      rope_theta=500000.0, max_position_embeddings=plan.e2e_length + 4096, name="llama3-8b-shaped")
    t0 = time.perf_counter()
    model = Llama(cfg, dtype=BF16, param_dtype=BF16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    jax.block_until_ready(state)
    out = {"config": dataclasses.asdict(cfg), "init_s": time.perf_counter() - t0, "L": plan.e2e_length}
    log(f"[e2e] model init {out['init_s']:.1f}s")
    length = plan.e2e_length
    if offline and offline.get("data") is not None and offline["data"].k.shape[2] == length:
        data = offline["data"]
        method, index, info = offline["squeezed_index"]
    else:
        ks, vs = zip(*[src.kv(length, seed=layer) for layer in range(plan.e2e_layers)])
        q_obs = jnp.stack([src.queries(100, seed=layer) for layer in range(plan.e2e_layers)])
        data = ContextData(jnp.stack(ks), jnp.stack(vs), q_obs, scale=1.0 / math.sqrt(plan.d))
        from sqjax import dispatch

        # decode speed does not depend on clustering quality: a quick clustering (random init,
        # 3 Lloyd iterations) keeps this section short; section 1 times the real one
        method = Squeezed(sparsity=0.9, n_sink=1, kmeans_iters=3, kmeans_init="random")
        t0 = time.perf_counter()
        with dispatch.using(plan.backend):
            index, info = method.build(data)
        jax.block_until_ready(index)
        out["index_build_s"] = time.perf_counter() - t0
        out["index_kmeans"] = "random init, 3 Lloyd iterations"
        log(f"[e2e] index built in {out['index_build_s']:.1f}s")
    inv = tuple(float(x) for x in config_frequencies(cfg))
    n_prompt, n_steps = (128 if not plan.cpu else 8), plan.e2e_steps
    tokens = jax.random.randint(jax.random.key(1), (1, n_prompt), 0, cfg.vocab_size)

    def run(hook, state_tree):
        cache = KVCache.init(cfg, 1, n_prompt + n_steps + 8, BF16)
        pos = jnp.arange(length, length + n_prompt, dtype=jnp.int32)[None]
        # compile both shapes first
        lg, c2, _ = forward_jit(graphdef, state, tokens, pos, KVCache.init(cfg, 1, n_prompt + n_steps + 8, BF16),
                                attn_fn=hook, attn_state=state_tree, logits="last")
        jax.block_until_ready(lg)
        lg, c2, _ = forward_jit(graphdef, state, tokens[:, :1], pos[:, :1] + n_prompt, c2, attn_fn=hook,
                                attn_state=state_tree, logits="last")
        jax.block_until_ready(lg)
        ttfts = []
        for _ in range(3):
            cache = KVCache.init(cfg, 1, n_prompt + n_steps + 8, BF16)
            t0 = time.perf_counter()
            lg, cache, _ = forward_jit(graphdef, state, tokens, pos, cache, attn_fn=hook, attn_state=state_tree, logits="last")
            nxt = jnp.argmax(lg[0, -1]).astype(jnp.int32)
            jax.block_until_ready(nxt)
            ttfts.append(time.perf_counter() - t0)
        times = []
        p = length + n_prompt
        for i in range(n_steps):
            t0 = time.perf_counter()
            lg, cache, _ = forward_jit(graphdef, state, nxt.reshape(1, 1), jnp.full((1, 1), p + i, jnp.int32), cache,
                                       attn_fn=hook, attn_state=state_tree, logits="last")
            nxt = jnp.argmax(lg[0, -1]).astype(jnp.int32)
            jax.block_until_ready(nxt)
            times.append(time.perf_counter() - t0)
        return float(np.median(ttfts)), float(np.median(times))

    for name, m, idx in (("squeezed", method, index), ("full", Full(), None)):
        try:
            hook = SparseAttentionHook(m, inv, backend=plan.backend)
            ttft, tpot = run(hook, attention_state(data.k, data.v, idx, clustered_layout=name == "squeezed"))
            out[name] = {"ttft_s": ttft, "ms_per_token": 1e3 * tpot, "tokens_per_s": 1.0 / tpot}
            log(f"[e2e] {name}: TTFT {ttft * 1e3:.1f} ms ({n_prompt} tokens), {1e3 * tpot:.2f} ms/token")
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": _err(e)}
            log(f"[e2e] {name}: ERROR {_err(e)}")
            traceback.print_exc()
    if "tokens_per_s" in out.get("squeezed", {}) and "tokens_per_s" in out.get("full", {}):
        out["decode_speedup"] = out["squeezed"]["tokens_per_s"] / out["full"]["tokens_per_s"]
        out["ttft_speedup"] = out["full"]["ttft_s"] / out["squeezed"]["ttft_s"]
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    kv = data.k.size * data.k.dtype.itemsize * 2
    out["bytes_weights"] = float(weights)
    out["bytes_fixed_kv"] = float(kv)
    out["decode_speedup_bound_bytes"] = (weights + kv) / (weights + 0.1 * kv + 0.025 * kv)
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def to_markdown(res: dict) -> str:
    md = [f"# sqjax speed suite — {res['meta']['device']}", "",
          f"jax {res['meta']['jax']}, commit {res['meta']['git_commit']}, keys: {res['keys']}, bf16, "
          f"Hq={res['plan']['hq']}, Hkv={res['plan']['hkv']}, d={res['plan']['d']}, 5% centroids, n_sink=1, n_obs=100.", ""]
    off = res.get("offline")
    if off:
        md += ["## Offline: clustering + calibration", "",
               "| fixed context | layers × KV heads | 1-level | hierarchical |", "|---|---|---|---|",
               f"| {off['L']} | {off['layers']} × {off['Hkv']} | {off.get('squeezed_seconds', float('nan')):.1f} s | "
               f"{off.get('hsqueezed_seconds', float('nan')):.1f} s |", ""]
    rows = [r for r in res.get("kernels", []) if "total_ms" in r]
    if rows:
        md += ["## Lookup + retrieval + sparse attention vs dense (ms, median)", "",
               "| L | phase | sparsity | levels | kept | lookup | total | path | cuDNN dense | XLA dense | speedup vs best dense | TB/s |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            dn = r.get("dense_ms", {})
            md.append(f"| {r['L']} | {r['phase']} | {r['sparsity']} | {2 if r['hierarchical'] else 1} | "
                      f"{r.get('retrieved_frac', float('nan')):.3f} | {r['lookup_ms']:.3f} | {r['total_ms']:.3f} | {r.get('path', '')} | "
                      f"{dn.get('cudnn', float('nan')):.3f} | {dn.get('xla', float('nan')):.3f} | "
                      f"{r.get('speedup_vs_best_dense', float('nan')):.2f}× | {r.get('tb_per_s', float('nan')):.2f} |")
        md.append("")
    e2e = res.get("e2e")
    if e2e and "squeezed" in e2e:
        md += ["## End to end: Llama-3-8B-shaped model (random bf16 weights), batch 1", "",
               "| method | TTFT (128-token question) | ms / token | tokens/s |", "|---|---|---|---|"]
        for name in ("squeezed", "full"):
            r = e2e.get(name, {})
            if "ms_per_token" in r:
                md.append(f"| {name} | {1e3 * r['ttft_s']:.1f} ms | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} |")
            else:
                md.append(f"| {name} | error: {r.get('error', '?')[:80]} | | |")
        if "decode_speedup" in e2e:
            md.append(f"\nDecode speedup {e2e['decode_speedup']:.2f}× (byte bound with these weights: "
                      f"{e2e['decode_speedup_bound_bytes']:.2f}×), TTFT speedup {e2e['ttft_speedup']:.2f}×.")
        md.append("")
    if res.get("errors"):
        md += ["## Errors", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(md)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res.get("kernels", []) if "total_ms" in r and r.get("dense_ms") and not r["hierarchical"]]
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
    ax.set_title(f"Squeezed Attention, L={length}, {res['meta']['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    ap.add_argument("--keys", default=".scratch/captured/smollm2_qkv.npz")
    ap.add_argument("--lengths", default="")
    ap.add_argument("--sparsities", default="")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: offline,kernels,e2e")
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--phases", default="", help="decode,prefill (default both)")
    args = ap.parse_args(argv_or_args)
    plan = cpu_plan() if args.cpu_smoke else Plan()
    if args.quick:
        plan = dataclasses.replace(plan, lengths=(131072,), sparsities=(0.9,), offline_layers=4, e2e_layers=4, reps=5)
    if args.lengths:
        plan = dataclasses.replace(plan, lengths=tuple(int(x) for x in args.lengths.split(",")))
    if args.sparsities:
        plan = dataclasses.replace(plan, sparsities=tuple(float(x) for x in args.sparsities.split(",")))
    if args.phases:
        plan = dataclasses.replace(plan, phases=tuple(args.phases.split(",")))
    if args.budget_s:
        plan = dataclasses.replace(plan, deadline_s=args.budget_s)
    if not args.cpu_smoke and jax.default_backend() != "gpu":
        print("sqjax bench needs a GPU (use --cpu-smoke to check the plumbing)", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
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
    offline = None
    if "offline" not in skip:
        try:
            offline = offline_cost(plan, src, log)
            res["offline"] = {k: v for k, v in offline.items() if not k.endswith("_index") and k != "data"}
        except Exception as e:  # noqa: BLE001
            log(f"[offline] ERROR {_err(e)}")
            traceback.print_exc()
    if "e2e" not in skip:
        try:
            res["e2e"] = end_to_end(plan, src, log, offline)
        except Exception as e:  # noqa: BLE001
            log(f"[e2e] ERROR {_err(e)}")
            traceback.print_exc()
    offline = None  # free the 128K x 32-layer context before the kernel sweep
    if "kernels" not in skip:
        res["kernels"] = kernel_cases(plan, src, log, deadline, offline)
    res["seconds"] = time.perf_counter() - t_start
    write_json(out_dir / "speed.json", res)
    md = to_markdown(res)
    (out_dir / "speed.md").write_text(md)
    try:
        plot(res, out_dir / "fig4_latency_vs_sparsity.png")
    except Exception as e:  # noqa: BLE001
        log(f"[plot] ERROR {_err(e)}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
