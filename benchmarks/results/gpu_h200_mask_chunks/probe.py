"""QUEST's question-block route on a GPU at 128K, one layer (Llama-3-8B heads: 32/8, d = 128, bf16 K/V).

A question block of T tokens with QUEST (or SAAP, or the oracle) selects per token, so it reaches
`sqjax.attention.fixed_context_attention` with a [Hs, T, L] mask. Before key chunks, that took
every key at once: [Hq, T, L] f32 scores. This times the whole route (`Quest.select` for the block,
then `dispatch.attention`) with the keys all at once (`SCORE_BYTES` above every call's scores: the
code before) against key chunks at several score budgets (the shipped default 512 MiB among them).
Beside it: cuDNN's full attention of the same block over the same 128K keys
(`jax.nn.dot_product_attention`, what `Full` runs). Medians of repeated calls after warm-up, three
rotated input sets; a setting that runs out of memory is reported as such. Outputs of every chunked
setting are compared with the all-at-once output where that one ran.

    python benchmarks/results/gpu_h200_mask_chunks/probe.py --out DIR
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sqjax.attention as att  # noqa: E402
from benchmarks._meta import metadata, report, time_ms  # noqa: E402
from sqjax import dispatch  # noqa: E402
from sqjax.methods import ContextData, Quest  # noqa: E402

L, HQ, HKV, D = 131072, 32, 8, 128
BF16 = jnp.bfloat16
ALL_AT_ONCE = 1 << 62


def _normal(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(BF16)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory for probe.json / probe.md")
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--budgets-mib", default="0,128,512,2048,8192", help="score budgets; 0 = all keys at once")
    ap.add_argument("--budget", type=float, default=0.15, help="QUEST's budget (fraction of the tokens)")
    ap.add_argument("--length", type=int, default=L, help="fixed-context tokens (a CPU smoke run: fewer)")
    ap.add_argument("--backend", default="pallas", help="dispatch backend (a CPU smoke run: reference)")
    args = ap.parse_args()
    length = args.length
    scale = 1.0 / math.sqrt(D)
    keys = jax.random.split(jax.random.key(0), 8)
    k, v = _normal(keys[0], (1, HKV, length, D)), _normal(keys[1], (1, HKV, length, D))
    data = ContextData(k, v, _normal(keys[2], (1, HQ, 4, D)), scale=scale)
    method = Quest(budget=args.budget, dense_layers=0)
    index, _ = method.build(data)
    k0, v0 = k[0], v[0]
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        sets = []
        for j in range(3):
            kk = jax.random.split(keys[3 + j], 3)
            # the fixed context's arrays are arguments, never closure constants (those would be baked
            # into the program, and XLA then compiles for minutes)
            sets.append((_normal(kk[0], (HQ, t, D)), _normal(kk[1], (HKV, t, D)), _normal(kk[2], (HKV, t, D)),
                         k0, v0, index))
        pos = length + jnp.arange(t, dtype=jnp.int32)

        def full(q, kn, vn, kc, vc, _index):   # cuDNN over the fixed context + the block's own causal keys
            kf = jnp.concatenate([kc, kn], axis=1)
            vf = jnp.concatenate([vc, vn], axis=1)
            o = jax.nn.dot_product_attention(q.transpose(1, 0, 2)[None], kf.transpose(1, 0, 2)[None],
                                             vf.transpose(1, 0, 2)[None], scale=scale, is_causal=False,
                                             implementation="cudnn",
                                             mask=(jnp.arange(length + t)[None, :] <= (length + jnp.arange(t))[:, None])[None, None])
            return o[0].transpose(1, 0, 2)

        try:
            f = jax.jit(full)
            full_ms = time_ms(f, sets, reps=7, inner=3)
        except Exception as e:  # noqa: BLE001
            full_ms = None
            print(f"T={t} cuDNN full: {type(e).__name__}: {str(e)[:200]}", flush=True)
        ref = None
        for mib in (int(x) for x in args.budgets_mib.split(",")):
            att.SCORE_BYTES = ALL_AT_ONCE if mib == 0 else mib << 20   # read when the route is traced

            def quest_block(q, kn, vn, kc, vc, idx):
                with dispatch.using(args.backend):
                    sel = method.select(idx, 0, q, None, kc)
                    return dispatch.attention(q, kc, vc, sel, kn, vn, pos, pos, scale)

            chunk = att.key_chunk(HQ * t, length)
            row = {"T": t, "score_budget_mib": mib or None, "keys_per_chunk": chunk, "chunks": -(-length // chunk),
                   "full_cudnn_ms": full_ms}
            try:
                g = jax.jit(quest_block)
                mem = g.lower(*sets[0]).compile().memory_analysis()
                row["temp_gb"] = mem.temp_size_in_bytes / 1e9 if mem is not None else None
                t0 = time.perf_counter()
                out = np.asarray(jax.block_until_ready(g(*sets[0])).astype(jnp.float32))
                row["first_call_s"] = time.perf_counter() - t0
                row["ms"] = time_ms(g, sets, reps=7, inner=3)
                if mib == 0:
                    ref = out
                elif ref is not None:
                    row["max_abs_diff_vs_all_at_once"] = float(np.max(np.abs(out - ref)))
                if full_ms:
                    row["vs_full"] = row["ms"] / full_ms
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print({k2: (round(x, 4) if isinstance(x, float) else x) for k2, x in row.items()}, flush=True)
            rows.append(row)
    md = ["# QUEST's question-block route at 128K: keys all at once vs key chunks", "",
          f"{metadata()['device']}, jax {jax.__version__}; Hq={HQ}, Hkv={HKV}, d={D}, L={length}, bf16 K/V, QUEST budget "
          f"{args.budget}; `Quest.select` + `dispatch.attention` (one layer), medians; cuDNN full attention beside.", "",
          "| T | score budget | keys per chunk | chunks | temporaries GB | ms | cuDNN full ms | vs full | max abs diff | error |",
          "|---|---|---|---|---|---|---|---|---|---|"]

    def f3(x):
        return "—" if x is None else f"{x:.3f}"

    for r in rows:
        md.append(f"| {r['T']} | {'all at once' if r['score_budget_mib'] is None else str(r['score_budget_mib']) + ' MiB'} "
                  f"| {r['keys_per_chunk']} | {r['chunks']} | {f3(r.get('temp_gb'))} | {f3(r.get('ms'))} "
                  f"| {f3(r['full_cudnn_ms'])} | {f3(r.get('vs_full'))} | {r.get('max_abs_diff_vs_all_at_once', '—')} "
                  f"| {r.get('error', '')[:80]} |")
    report({"meta": metadata(), "shapes": {"L": length, "Hq": HQ, "Hkv": HKV, "d": D, "dtype": "bfloat16"},
            "quest_budget": args.budget, "rows": rows}, "\n".join(md) + "\n",
           str(Path(args.out) / "probe.json") if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
