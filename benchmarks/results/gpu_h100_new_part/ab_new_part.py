"""Where a prefill block's attention goes: the kept fixed rows against the block's own (causal) keys, and ways to
compute the causal part, 4K query tokens (Llama-3-8B attention: 32 query heads, 8 KV heads, d = 128, bf16) over
~53K kept rows per KV head (the #8 prefill at 90%) and the block's own 4K keys.

    python benchmarks/results/gpu_h100_new_part/ab_new_part.py OUT_DIR [--interpret] [--lens]

--lens: instead, one cuDNN call over the new part with padding lengths (none, T, 1, 0, 64), with the position mask
as a bias or under the causal mask: what the call `_new_part` does not take costs.

Variants, each timed by a profiler trace (kernel busy ms per call) and by wall time (median), two input sets:
  whole (current)     `fixed_plus_new` as the library runs it: the fixed part, then the new part with its
                      [T, S] position mask (cuDNN takes it as a bias), merged by log-sum-exp
  fixed part          the kept rows alone (no mask, per-head key lengths)
  new: mask           the new part as the library computes it now
  new: causal         cuDNN's causal mask (top-left: query i sees slots 0..i), no bias
  new: N chunks       the queries in N chunks as batch entries, each with the key length up to its last visible
                      slot, plus the same mask (exact for any positions)
Outputs are compared with "whole (current)" / "new: mask".
Then the library's new part (`_new_part`, new_part="causal" and "causal_left_padded") against the mask alone on three
layouts: the block's own keys, the last T/4 queries' own keys (the speed suite's prefill rows), and a left-padded block
(which "causal" hands to the mask and "causal_left_padded" rolls into the causal square).
"""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._meta import metadata, time_ms, write_json
from benchmarks._profile import kernel_time_per_call
from pallas_kernels.sparse_attention import _dense_attention, _flash_fixed, fixed_plus_new, flash_kv_splits


def main(out: Path, interpret: bool) -> int:
  hq, hkv, d = 32, 8, 128
  t = 256 if interpret else 4096
  cap = 4096 if interpret else 65536
  impl = "xla" if interpret else "cudnn"
  scale = 1.0 / np.sqrt(d)
  rng = np.random.default_rng(0)
  base = 524288

  def inputs(seed):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((hq, t, d)), jnp.bfloat16)
    ks = jnp.asarray(r.standard_normal((hkv, cap, 1, d)), jnp.bfloat16)
    vs = jnp.asarray(r.standard_normal((hkv, cap, 1, d)), jnp.bfloat16)
    kn = jnp.asarray(r.standard_normal((hkv, t, d)), jnp.bfloat16)
    vn = jnp.asarray(r.standard_normal((hkv, t, d)), jnp.bfloat16)
    return q, ks, vs, kn, vn

  n = jnp.asarray(rng.integers(int(cap * 0.7), int(cap * 0.95), hkv), jnp.int32)   # ~53K kept rows per KV head
  qp = jnp.arange(base, base + t, dtype=jnp.int32)
  kp = qp
  sets = [inputs(s) + (n, qp, kp) for s in (1, 2)]

  def whole(q, ks, vs, kn, vn, n, qp, kp):
    return fixed_plus_new(q, ks, vs, n, kn, vn, qp, kp, scale=scale, implementation=impl, return_lse=True)

  def fixed(q, ks, vs, kn, vn, n, qp, kp):
    qs = q.reshape(hkv, (hq // hkv) * t, 1, d)
    return _flash_fixed(qs, ks, vs, n, scale=scale, splits=flash_kv_splits(hkv, qs.shape[1], cap),
                        implementation=impl)

  def new_mask(q, ks, vs, kn, vn, n, qp, kp):
    vis = (kp >= 0)[None, :] & (kp[None, :] <= qp[:, None])
    return _dense_attention(q[None], kn[None], vn[None], mask=vis[None, None], kv_len=None, scale=scale,
                            implementation=impl, layout="BNTH")

  def new_causal(q, ks, vs, kn, vn, n, qp, kp):
    if impl != "cudnn":
      o, lse = jax.nn.dot_product_attention(q[None].swapaxes(1, 2), kn[None].swapaxes(1, 2),
                                            vn[None].swapaxes(1, 2), scale=scale, is_causal=True, return_residual=True)
      return o.swapaxes(1, 2), lse.swapaxes(1, 2).astype(jnp.float32)
    from jax._src.cudnn import fused_attention_stablehlo as fa
    o, lse = fa.dot_product_attention(q[None], kn[None], vn[None], None, None, None, None, scale=scale,
                                      mask_type=fa.MaskType.CAUSAL, qkv_layout="BNTH", return_residual=True)
    return o, lse.astype(jnp.float32)

  def new_chunks(nc):
    def f(q, ks, vs, kn, vn, n, qp, kp):
      m = t // nc
      qc = q.reshape(hq, nc, m, d).swapaxes(0, 1)                         # [nc, Hq, m, d]
      qpc = qp.reshape(nc, m)
      vis = (kp >= 0)[None, None, :] & (kp[None, None, :] <= qpc[:, :, None])   # [nc, m, S]
      slot = jnp.arange(kp.shape[0], dtype=jnp.int32)
      last = jnp.max(jnp.where(jnp.any(vis, axis=1), slot[None, :], -1), axis=1)  # [nc]
      kv_len = jnp.maximum(last + 1, 1).astype(jnp.int32)
      kb = jnp.broadcast_to(kn[None], (nc,) + kn.shape)
      vb = jnp.broadcast_to(vn[None], (nc,) + vn.shape)
      o, lse = _dense_attention(qc, kb, vb, mask=vis[:, None], kv_len=kv_len, scale=scale, implementation=impl,
                                layout="BNTH")
      return o.swapaxes(0, 1).reshape(hq, t, d), lse.swapaxes(0, 1).reshape(hq, t)
    return f

  def lens_call(causal, bias, ql, kl):   # one cuDNN call with padding lengths ql, kl (None: no padding)
    def f(q, ks, vs, kn, vn, n, qp, kp):
      vis = (kp >= 0)[None, :] & (kp[None, :] <= qp[:, None])
      one = jnp.ones((1,), jnp.int32)
      return _dense_attention(q[None], kn[None], vn[None], mask=vis[None, None] if bias else None, causal=causal,
                              q_len=None if ql is None else ql * one, kv_len=None if kl is None else kl * one,
                              scale=scale, implementation=impl, layout="BNTH")
    return f

  def timed(jf, row):   # wall ms (median) and the profiled kernel busy ms per call into row; print it
    row["wall_ms"] = time_ms(jf, sets, reps=10, inner=5)
    prof = None if interpret else kernel_time_per_call(jf, sets, n=10)
    if prof:
      row["busy_ms"] = prof["busy_ms_per_call"]
      row["kernels"] = [(k["name"][:60], round(k["ms_per_call"], 4), k["per_call"]) for k in prof["kernels"][:6]]
    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
    if "kernels" in row:
      print("   ", row["kernels"][:4], flush=True)

  if "--lens" in sys.argv:   # what a call costs with cuDNN's padding lengths (the call `_new_part` does not take)
    variants = {f"{'causal' if c else 'bias'}, lengths {ql}/{kl}": lens_call(c, not c, ql, kl)
                for c, ql, kl in ((False, None, None), (False, t, t), (False, 1, 1), (False, 0, 0), (False, 64, 64),
                                  (True, None, None), (True, t, t), (True, 1, 1), (True, 0, 0))}
    res = {"meta": metadata(), "shapes": {"Hq": hq, "Hkv": hkv, "d": d, "T": t}, "dtype": "bfloat16", "rows": []}
    for name, fn in variants.items():
      jf = jax.jit(fn)
      row = {"variant": name}
      try:
        o = jax.block_until_ready(jf(*sets[0]))
        row["finite_rows"] = int(np.sum(np.isfinite(np.asarray(o[1]))))
        timed(jf, row)
      except Exception as e:  # noqa: BLE001
        row["error"] = str(e)[:300]
        print(json.dumps(row), flush=True)
      res["rows"].append(row)
    write_json(out / "ab_lens.json", res)
    return 0

  variants = {"whole (current)": whole, "fixed part": fixed, "new: mask": new_mask, "new: causal": new_causal,
              "new: 4 chunks": new_chunks(4), "new: 8 chunks": new_chunks(8)}
  res = {"meta": metadata(), "shapes": {"Hq": hq, "Hkv": hkv, "d": d, "T": t, "cap": cap,
                                          "kept_rows": [int(x) for x in n]}, "dtype": "bfloat16", "rows": []}
  ref = {}
  for rnd in range(2):
    for name, fn in variants.items():
      jf = jax.jit(fn)
      o = jax.block_until_ready(jf(*sets[0]))
      row = {"variant": name, "round": rnd}
      if rnd == 0:
        if name in ("whole (current)", "new: mask"):
          ref[name] = o
        if name.startswith("new:"):
          a, b = o[0].reshape(hq, t, d).astype(jnp.float32), ref["new: mask"][0].reshape(hq, t, d).astype(jnp.float32)
          row["max_abs_vs_mask"] = float(jnp.max(jnp.abs(a - b)))
          row["lse_max_abs_vs_mask"] = float(jnp.max(jnp.abs(o[1].reshape(hq, t) - ref["new: mask"][1].reshape(hq, t))))
      timed(jf, row)
      res["rows"].append(row)
  # the library's new part (`_new_part`: the causal call when the positions allow it, else the position mask;
  # both calls made, the one not taken with zero-length padding; "causal_left_padded" rolls a left-padded block's
  # square) on three layouts, against the mask alone
  from pallas_kernels.sparse_attention import _new_part
  s_br = t // 4
  layouts = {
      "own keys (causal)": (qp, kp, slice(None)),
      "the last T/4 queries' own keys, the speed suite's layout (causal)": (qp, qp[-s_br:], slice(0, s_br)),
      "left padding, 64 tokens": (jnp.where(jnp.arange(t) < 64, -1, qp),
                                                  jnp.where(jnp.arange(t) < 64, -1, qp), slice(None)),
  }
  for rnd in range(2):
    for lname, (qpl, kpl, sl) in layouts.items():
      for kind in ("mask", "library", "library, causal_left_padded"):
        def fn(q, ks, vs, kn, vn, n, qp_, kp_, kind=kind, qpl=qpl, kpl=kpl, sl=sl):
          kn, vn = kn[:, sl], vn[:, sl]
          if kind == "mask":
            return new_mask(q, ks, vs, kn, vn, n, qpl, kpl)
          mode = "causal_left_padded" if kind.endswith("padded") else "causal"
          o, lse, has = _new_part(q, kn, vn, qpl, kpl, scale=scale, implementation=impl, new_part=mode)
          return o[None], lse[None], has
        jf = jax.jit(fn)
        o = jax.block_until_ready(jf(*sets[0]))
        row = {"variant": f"{lname}: {kind}", "round": rnd}
        if kind == "mask":
          ref_m = o
        elif rnd == 0:
          has = np.asarray(o[2])[None, :, :, None]
          a = np.where(has, np.asarray(o[0].astype(jnp.float32)), 0)
          b = np.where(has, np.asarray(ref_m[0].astype(jnp.float32)), 0)
          row["max_abs_vs_mask"] = float(np.max(np.abs(a - b)))
          row["lse_max_abs_vs_mask"] = float(np.max(np.where(has[..., 0], np.abs(np.asarray(o[1]) - np.asarray(
              ref_m[1])), 0)))
          row["rows_seeing_a_new_key"] = int(np.sum(np.asarray(o[2])[0]))
        timed(jf, row)
        res["rows"].append(row)
  write_json(out / "ab_new_part.json", res)
  return 0


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1]), "--interpret" in sys.argv))
