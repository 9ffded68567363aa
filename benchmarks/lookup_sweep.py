"""Tiling sweep of the prefill centroid lookup (Eq. 1 averaged over a block of T tokens).

    python -m benchmarks.lookup_sweep --out DIR [--length 524288] [--tokens 4096] [--cpu-smoke]

For each `CentroidLookupConfig` (block_t x block_c x num_warps x num_stages) the two-pass
lookup kernels (`centroid_lookup_prefill`: statistics pass + scoring pass) are checked against
`centroid_lookup_reference` on the first `check_tokens` tokens (same centroids), then timed on
all T tokens (median of repeated calls after warm-up). Shapes: Llama-3-8B attention (32 query
heads, 8 KV heads, d = 128), bf16, 5% centroids. Prints a table, writes lookup_sweep.json/.md
with the default and the fastest passing config, TFLOP/s (two passes of 2*T*Hq*C*d).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata, time_ms, write_json


@dataclasses.dataclass(frozen=True)
class Plan:
    length: int = 524288
    tokens: int = 4096
    hq: int = 32
    hkv: int = 8
    d: int = 128
    centroid_frac: float = 0.05
    check_tokens: int = 128
    reps: int = 5
    inner: int = 2
    backend: str = "pallas"
    budget_s: float = 400.0
    # statistics pass x scoring pass tilings (the scoring pass accumulating tiles: 1.3x in the
    # previous sweep, gpu_h200_lookup_sweep/tile_acc)
    grid: tuple = (("block_t", (64, 128)), ("block_c", (128,)), ("num_warps", (4,)), ("num_stages", (2,)),
                   ("tile_acc", (True,)), ("score_block_t", (64, 128)), ("score_block_c", (64, 128)),
                   ("score_warps", (4, 8)))


def cpu_plan() -> Plan:
    return Plan(length=2048, tokens=48, hq=4, hkv=2, d=32, check_tokens=16, reps=1, inner=1,
                backend="interpret", grid=(("block_t", (16, 32)), ("block_c", (32,)), ("num_warps", (4,)),
                                           ("num_stages", (2,)), ("tile_acc", (False, True)),
                                           ("score_block_t", (None, 16)), ("score_block_c", (None,)),
                                           ("score_warps", (None,))))


def configs(plan: Plan):
    from pallas_kernels.centroid_lookup import CentroidLookupConfig

    names = [n for n, _ in plan.grid]
    for values in itertools.product(*(v for _, v in plan.grid)):
        yield CentroidLookupConfig(**dict(zip(names, values)))


def run(plan: Plan, log=print) -> dict:
    from pallas_kernels.centroid_lookup import (DEFAULT_PREFILL, centroid_lookup_prefill,
                                                centroid_lookup_reference)

    t_start = time.perf_counter()
    num_c = int(plan.length * plan.centroid_frac)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (plan.hq, plan.tokens, plan.d), jnp.bfloat16)
    cent = (2.0 * jax.random.normal(keys[1], (plan.hkv, num_c, plan.d), jnp.float32)).astype(jnp.bfloat16)
    counts = jax.random.randint(keys[2], (plan.hkv, num_c), 0, 41, jnp.int32)  # some empty clusters
    scale = 1.0 / float(np.sqrt(plan.d))
    thr = jnp.float32(1.0 / num_c)
    qc = q[:, :plan.check_tokens]
    _, ref = centroid_lookup_reference(qc, cent, counts, thr, scale=scale)
    ref = np.asarray(ref)
    flops = 2 * 2 * plan.tokens * plan.hq * num_c * plan.d
    rows, default = [], DEFAULT_PREFILL
    cfgs = list(configs(plan))
    if default not in cfgs:
        cfgs.insert(0, default)
    for cfg in cfgs:
        row = {"config": dataclasses.asdict(cfg), "default": cfg == default}
        if time.perf_counter() - t_start > plan.budget_s:
            row["error"] = "skipped (time budget)"
            rows.append(row)
            continue
        try:
            f = jax.jit(lambda q, c, n, t, cfg=cfg: centroid_lookup_prefill(
                q, c, n, t, scale=scale, backend=plan.backend, config=cfg))
            _, got = f(qc, cent, counts, thr)
            err = float(np.max(np.abs(np.asarray(got) - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
            row["max_rel_err"] = err
            row["pass"] = bool(err < 2e-2)
            row["ms"] = time_ms(f, [(q, cent, counts, thr)], reps=plan.reps, inner=plan.inner)
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            log(f"{_label(cfg)}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s, rel err {err:.1e}"
                f"{' (default)' if row['default'] else ''}")
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{_label(cfg)}: ERROR {row['error']}")
        rows.append(row)
    ok = [r for r in rows if r.get("pass")]
    trace = {}
    for tag, r in (("default", next((r for r in rows if r["default"] and r.get("pass")), None)),
                   ("best", min(ok, key=lambda r: r["ms"]) if ok else None)):
        if r is None or plan.backend == "interpret":
            continue
        from benchmarks._profile import device_activity
        from pallas_kernels.centroid_lookup import CentroidLookupConfig

        cfg = CentroidLookupConfig(**r["config"])
        f = jax.jit(lambda q, c, n, t, cfg=cfg: centroid_lookup_prefill(q, c, n, t, scale=scale,
                                                                      backend=plan.backend, config=cfg))
        planes = device_activity(lambda: jax.block_until_ready([f(q, cent, counts, thr) for _ in range(3)]))
        if planes:  # the two passes' kernel times per call
            act = next(iter(planes.values()))
            trace[tag] = [{"name": k["name"], "ms_per_call": k["total_ms"] / 3} for k in act["by_name"][:4]]
            log(f"trace {tag}: " + ", ".join(f"{k['name']} {k['ms_per_call']:.3f} ms" for k in trace[tag]))
    res = {"meta": metadata(), "plan": dataclasses.asdict(plan), "num_centroids": num_c, "flops_per_call": flops,
           "rows": rows, "trace": trace, "seconds": time.perf_counter() - t_start}
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        res["best"] = best
        dflt = next((r for r in rows if r["default"] and "ms" in r), None)
        if dflt:
            res["default_ms"] = dflt["ms"]
            res["speedup_best_vs_default"] = dflt["ms"] / best["ms"]
    return res


def _label(cfg) -> str:
    return _label_dict(dataclasses.asdict(cfg))


def _label_dict(c: dict) -> str:
    """'block_t x block_c / warps; scoring pass block_t x block_c / warps (tile acc)'."""
    bt, bc, w = c["block_t"], c["block_c"], c["num_warps"]
    sbt, sbc, sw = c.get("score_block_t") or bt, c.get("score_block_c") or bc, c.get("score_warps") or w
    return (f"{bt}×{bc}/{w}w; {sbt}×{sbc}/{sw}w{' tile acc' if c.get('tile_acc') else ''}"
            f"{'' if c.get('num_stages', 2) == 2 else ' stages ' + str(c['num_stages'])}")


def to_markdown(res: dict) -> str:
    p = res["plan"]
    md = [f"# Prefill centroid lookup: tiling sweep — {res['meta']['device']}", "",
          f"jax {res['meta']['jax']}, commit {res['meta']['git_commit']}; L = {p['length']} "
          f"({res['num_centroids']} centroids per KV head), T = {p['tokens']} tokens, Hq/Hkv/d = "
          f"{p['hq']}/{p['hkv']}/{p['d']} bf16; check vs the jnp reference on the first {p['check_tokens']} "
          f"tokens; median of {p['reps']} × {p['inner']} calls.", "",
          "| config (statistics pass; scoring pass) | ms | TFLOP/s | max rel err | |", "|---|---|---|---|---|"]
    for r in sorted(res["rows"], key=lambda r: r.get("ms", float("inf"))):
        tag = "default" if r["default"] else ""
        if "ms" in r:
            md.append(f"| {_label_dict(r['config'])} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                      f"{r['max_rel_err']:.1e}{'' if r['pass'] else ' FAIL'} | {tag} |")
        else:
            md.append(f"| {_label_dict(r['config'])} | — | — | {r.get('error', '')[:60]} | {tag} |")
    if "speedup_best_vs_default" in res:
        md += ["", f"Fastest passing: {_label_dict(res['best']['config'])}, {res['best']['ms']:.3f} ms vs the "
                   f"default's {res['default_ms']:.3f} ms ({res['speedup_best_vs_default']:.2f}×)."]
    for tag, kernels in res.get("trace", {}).items():
        md += ["", f"Kernel time per call ({tag}, profiler trace): "
               + "; ".join(f"`{k['name']}` {k['ms_per_call']:.3f} ms" for k in kernels)]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--length", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=0.0)
    args = ap.parse_args(argv)
    plan = cpu_plan() if args.cpu_smoke else Plan()
    if not args.cpu_smoke and jax.default_backend() != "gpu":
        print("the lookup sweep needs a GPU (use --cpu-smoke to check the plumbing)", file=sys.stderr)
        return 2
    if args.length:
        plan = dataclasses.replace(plan, length=args.length)
    if args.tokens:
        plan = dataclasses.replace(plan, tokens=args.tokens)
    if args.budget_s:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    try:
        res = run(plan, log=lambda m: print(m, flush=True))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    out = Path(args.out)
    write_json(out / "lookup_sweep.json", res)
    md = to_markdown(res)
    (out / "lookup_sweep.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
