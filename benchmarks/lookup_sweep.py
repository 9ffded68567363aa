"""Tiling sweeps of the centroid lookup: prefill (Eq. 1 averaged over a block of T tokens), or
with --decode the one-token lookup, 1-level and hierarchical side by side.

    python -m benchmarks.lookup_sweep --out DIR [--length 524288] [--tokens 4096] [--cpu-smoke]
    python -m benchmarks.lookup_sweep --decode --out DIR [--length 524288] [--cpu-smoke]

For each `CentroidLookupConfig` (block_t x block_c x num_warps x num_stages) the two-pass
lookup kernels (`centroid_lookup_prefill`: statistics pass + scoring pass) are checked against
`centroid_lookup_reference` on the first `check_tokens` tokens (same centroids), then timed on
all T tokens (median of repeated calls after warm-up). Shapes: Llama-3-8B attention (32 query
heads, 8 KV heads, d = 128), bf16, 5% centroids. Prints a table, writes lookup_sweep.json/.md
with the default and the fastest passing config, TFLOP/s (two passes of 2*T*Hq*C*d).

--decode: for each (block_c, num_warps) the 1-level decode lookup over the 5% centroids and the
hierarchical one (1% level-1 centroids, level 2 in random order as k-means leaves it, T1 keeping
`keep_parents` of the level-1 clusters) are checked against their references and timed: kernel
busy time per call from a profiler trace (what the speed suite's hierarchical-vs-1-level table
reports) and wall time per call. Writes lookup_decode_sweep.json/.md.
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
from sqjax.index_io import write_text_atomic


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


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    length: int = 524288
    hq: int = 32
    hkv: int = 8
    d: int = 128
    centroid_frac: float = 0.05
    level1_frac: float = 0.01
    keep_parents: float = 0.3   # fraction of level-1 clusters T1 keeps (on the timed query)
    reps: int = 5
    backend: str = "pallas"
    # (block_c, num_warps, num_stages, level-2 blocks per program, written out); the 1-level
    # lookup is timed for the configs with one block per program
    configs: tuple = ((128, 4, 2, 1, False), (64, 2, 2, 1, False), (64, 4, 2, 1, False), (256, 4, 2, 1, False),
                      (128, 4, 2, 2, False), (128, 4, 2, 4, False), (128, 4, 3, 4, False), (128, 4, 2, 2, True),
                      (128, 4, 2, 4, True), (64, 4, 2, 4, False), (64, 4, 3, 4, False), (64, 4, 2, 4, True),
                      (64, 4, 2, 8, False), (64, 2, 2, 8, True), (256, 8, 2, 2, True))


def decode_cpu_plan() -> DecodePlan:
    return DecodePlan(length=4096, hq=4, hkv=2, d=32, reps=1, backend="interpret",
                      configs=((16, 4, 2, 1, False), (32, 4, 2, 2, True), (16, 4, 2, 3, False)))


def decode_inputs(plan: DecodePlan, seed: int = 0):
    """Random bf16 two-level tree (parents in random order, level-1 centroids = means of their
    children) and a T1 between two adjacent level-1 scores near the `keep_parents` quantile."""
    from pallas_kernels import centroid_lookup_reference

    c2n, c1n = int(plan.length * plan.centroid_frac), int(plan.length * plan.level1_frac)
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (plan.hq, plan.d), jnp.float32).astype(jnp.bfloat16)
    c2 = 2.0 * jax.random.normal(ks[1], (plan.hkv, c2n, plan.d), jnp.float32)
    n2 = jax.random.randint(ks[2], (plan.hkv, c2n), 0, 41, jnp.int32)
    parent = jax.random.randint(ks[3], (plan.hkv, c2n), 0, c1n, jnp.int32)
    seg = jax.vmap(lambda x, p: jax.ops.segment_sum(x, p, c1n))
    c1 = seg(c2 * n2[..., None], parent) / jnp.maximum(seg(n2, parent), 1)[..., None]
    n1 = seg(n2, parent)
    c1, c2 = c1.astype(jnp.bfloat16), c2.astype(jnp.bfloat16)
    scale = 1.0 / float(np.sqrt(plan.d))
    _, s1 = centroid_lookup_reference(q, c1, n1, 0.0, scale=scale)
    v = np.sort(np.asarray(s1).ravel())
    k = int((1.0 - plan.keep_parents) * (len(v) - 1))
    t1 = np.float32((v[k] + v[min(k + 1, len(v) - 1)]) / 2)
    t2 = np.float32(1.0 / c2n)
    return dict(q=q, c1=c1, n1=n1, c2=c2, n2=n2, parent=parent, t1=t1, t2=t2, scale=scale)


def run_decode(plan: DecodePlan, log=print) -> dict:
    from benchmarks._profile import kernel_time_per_call
    from pallas_kernels import (CentroidLookupConfig, centroid_lookup_decode, centroid_lookup_reference,
                                hierarchical_lookup_decode, hierarchical_lookup_reference)

    t_start = time.perf_counter()
    x = decode_inputs(plan)
    h_args = (x["q"], x["c1"], x["n1"], x["c2"], x["n2"], x["parent"], x["t1"], x["t2"])
    o_args = (x["q"], x["c2"], x["n2"], x["t2"])
    _, ref1 = centroid_lookup_reference(*o_args, scale=x["scale"])
    _, refh, ref_touched = hierarchical_lookup_reference(*h_args, scale=x["scale"])
    ref1, refh, ref_touched = np.asarray(ref1), np.asarray(refh), np.asarray(ref_touched)

    def rel(a, b):
        return float(np.max(np.abs(np.asarray(a) - b)) / max(float(np.max(np.abs(b))), 1e-30))

    rows = []
    for bc, w, st, blocks, unroll in plan.configs:
        cfg = CentroidLookupConfig(block_c=bc, num_warps=w, num_stages=st, level2_blocks=blocks,
                                   level2_unroll=unroll)
        row = {"block_c": bc, "num_warps": w, "num_stages": st, "level2_blocks": blocks, "level2_unroll": unroll,
               "default": cfg == CentroidLookupConfig()}
        variants = [("hierarchical", hierarchical_lookup_decode, h_args, refh)]
        if blocks == 1:  # the level-2 settings do not touch the 1-level kernel
            variants.insert(0, ("one_level", centroid_lookup_decode, o_args, ref1))
        for name, fn, args, ref in variants:
            try:
                f = jax.jit(lambda *a, fn=fn, cfg=cfg: fn(*a, scale=x["scale"], backend=plan.backend, config=cfg))
                out = f(*args)
                err = rel(out[1], ref)
                ok = err < 2e-2
                if name == "hierarchical":  # level-1 survivors must agree (T1 sits in a gap)
                    row["touched_max_diff"] = int(np.max(np.abs(np.asarray(out[2]) - ref_touched)))
                    ok = ok and row["touched_max_diff"] <= 0.005 * x["c2"].shape[1]
                row[f"{name}_err"], row[f"{name}_pass"] = err, bool(ok)
                row[f"{name}_ms"] = time_ms(f, [args], reps=plan.reps)
                tr = kernel_time_per_call(f, [args], top=5) if plan.backend == "pallas" else None
                if tr:
                    row[f"{name}_busy_ms"] = tr["busy_ms_per_call"]
                    row[f"{name}_kernels"] = tr["kernels"]
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        key = "busy_ms" if "one_level_busy_ms" in row else "ms"
        if f"hierarchical_{key}" in row and f"one_level_{key}" in row:
            row["ratio"] = row[f"hierarchical_{key}"] / row[f"one_level_{key}"]
        log(f"block_c {bc}, {w} warps, {st} stages, {blocks} level-2 blocks/program{' unrolled' if unroll else ''}: 1-level {row.get('one_level_' + key, float('nan')):.4f} ms, hierarchical "
            f"{row.get('hierarchical_' + key, float('nan')):.4f} ms ({key}), ratio {row.get('ratio', float('nan')):.2f}"
            + "".join(f"; {k}: {v[:80]}" for k, v in row.items() if k.endswith("_error")))
        rows.append(row)
    res = {"meta": metadata(), "plan": dataclasses.asdict(plan), "t1": float(x["t1"]),
           "level2_rows": int(x["c2"].shape[1]), "level1_rows": int(x["c1"].shape[1]),
           "touched_ref_mean": float(ref_touched.mean()), "rows": rows, "seconds": time.perf_counter() - t_start}
    key = "busy_ms" if any("one_level_busy_ms" in r for r in rows) else "ms"
    for name in ("one_level", "hierarchical"):
        ok = [r for r in rows if r.get(f"{name}_pass") and f"{name}_{key}" in r]
        if ok:
            res[f"best_{name}"] = min(ok, key=lambda r: r[f"{name}_{key}"])
    if "best_one_level" in res and "best_hierarchical" in res:
        for r in rows:  # every hierarchical config against the fastest 1-level one
            if f"hierarchical_{key}" in r:
                r["ratio_vs_best_one_level"] = r[f"hierarchical_{key}"] / res["best_one_level"][f"one_level_{key}"]
        res["best_ratio"] = res["best_hierarchical"][f"hierarchical_{key}"] / res["best_one_level"][f"one_level_{key}"]
    res["timing"] = key
    return res


def decode_to_markdown(res: dict) -> str:
    p, key = res["plan"], res["timing"]
    what = "kernel busy ms per call (profiler trace)" if key == "busy_ms" else "wall ms per call"
    md = [f"# Decode centroid lookup, 1-level vs hierarchical: tiling sweep — {res['meta']['device']}", "",
          f"jax {res['meta']['jax']}, commit {res['meta']['git_commit']}; L = {p['length']}: {res['level2_rows']} "
          f"level-2 and {res['level1_rows']} level-1 centroids per KV head, Hq/Hkv/d = {p['hq']}/{p['hkv']}/{p['d']} "
          f"bf16; T1 keeps {p['keep_parents']:.0%} of the level-1 clusters: centroid rows scored "
          f"{res['touched_ref_mean']:.0f} of {res['level2_rows']} (hierarchical / 1-level "
          f"{res['touched_ref_mean'] / res['level2_rows']:.2f}). Times: {what}, median of {p['reps']}.", "",
          "| block_c | warps | stages | level-2 blocks / program | 1-level ms | hierarchical ms | hierarchical / "
          "fastest 1-level | 1-level err | hierarchical err | |", "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in res["rows"]:
        md.append(f"| {r['block_c']} | {r['num_warps']} | {r['num_stages']} | {r['level2_blocks']}"
                  f"{' (unrolled)' if r['level2_unroll'] else ''} | {r.get('one_level_' + key, nan):.4f} | "
                  f"{r.get('hierarchical_' + key, nan):.4f} | {r.get('ratio_vs_best_one_level', nan):.2f} | "
                  f"{r.get('one_level_err', nan):.1e} | {r.get('hierarchical_err', nan):.1e} | "
                  f"{'default' if r['default'] else ''}{' ' + r['hierarchical_error'][:60] if 'hierarchical_error' in r else ''} |")
    if "best_ratio" in res:
        b1, bh = res["best_one_level"], res["best_hierarchical"]
        md += ["", f"Fastest 1-level: block_c {b1['block_c']}, {b1['num_warps']} warps, {b1['one_level_' + key]:.4f} ms; "
                   f"fastest hierarchical: block_c {bh['block_c']}, {bh['num_warps']} warps, {bh['num_stages']} stages, "
                   f"{bh['level2_blocks']} level-2 blocks per program{' (unrolled)' if bh['level2_unroll'] else ''}, "
                   f"{bh['hierarchical_' + key]:.4f} ms → {res['best_ratio']:.2f}× the fastest 1-level."]
        for k in bh.get("hierarchical_kernels", [])[:5]:
            md.append(f"- `{k['name']}` {k['ms_per_call']:.4f} ms per call")
    return "\n".join(md) + "\n"


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
    return (f"{bt}×{bc}/{w}w{' anchored (' + c['stats_anchor'] + ')' if c.get('stats_anchor') else ''}; "
            f"{sbt}×{sbc}/{sw}w{' tile acc' if c.get('tile_acc') else ''}"
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


def parse_grid(text: str, base: tuple) -> tuple:
    """``--grid`` JSON -> the plan's grid: ((field, values), ...), the given fields replacing
    ``base``'s. Unknown fields or empty value lists are errors that name them."""
    import json

    from pallas_kernels.centroid_lookup import CentroidLookupConfig

    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--grid is not JSON ({e}): {text!r}") from None
    fields = {f.name for f in dataclasses.fields(CentroidLookupConfig)}
    if not isinstance(given, dict) or set(given) - fields:
        raise SystemExit(f"--grid must map fields of CentroidLookupConfig ({', '.join(sorted(fields))}) "
                         f"to lists of values; got {text!r}")
    out = dict(base)
    for k, v in given.items():
        v = v if isinstance(v, list) else [v]
        if not v:
            raise SystemExit(f"--grid: no values for {k}")
        out[k] = tuple(v)
    return tuple(out.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--length", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--decode", action="store_true", help="the decode lookup: 1-level vs hierarchical")
    ap.add_argument("--grid", default="", help='prefill tilings instead of the default grid, as JSON: '
                    '{"block_t": [128, 256], "num_warps": [4, 8], ...} (fields of CentroidLookupConfig; '
                    'fields left out keep the default grid\'s values)')
    args = ap.parse_args(argv)
    if args.decode:
        return _main_decode(args)
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
    if args.grid:
        plan = dataclasses.replace(plan, grid=parse_grid(args.grid, plan.grid))
    try:
        res = run(plan, log=lambda m: print(m, flush=True))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    out = Path(args.out)
    write_json(out / "lookup_sweep.json", res)
    md = to_markdown(res)
    write_text_atomic(out / "lookup_sweep.md", md)
    print(md)
    return 0


def _main_decode(args) -> int:
    plan = decode_cpu_plan() if args.cpu_smoke else DecodePlan()
    if not args.cpu_smoke and jax.default_backend() != "gpu":
        print("the lookup sweep needs a GPU (use --cpu-smoke to check the plumbing)", file=sys.stderr)
        return 2
    if args.length:
        plan = dataclasses.replace(plan, length=args.length)
    res = run_decode(plan, log=lambda m: print(m, flush=True))
    out = Path(args.out)
    write_json(out / "lookup_decode_sweep.json", res)
    md = decode_to_markdown(res)
    write_text_atomic(out / "lookup_decode_sweep.md", md)
    print(md)
    return 0 if "best_ratio" in res else 1


if __name__ == "__main__":
    sys.exit(main())
