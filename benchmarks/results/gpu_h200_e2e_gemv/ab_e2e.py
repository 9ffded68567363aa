"""A/B of the speed suite's end-to-end section (Llama-3-8B-shaped random bf16 model, 128K fixed
context, Squeezed vs full attention) with the Q/K/V projections as three `nnx.Linear` products
(before) and as one product over the kernels side by side (`models.llama.Attention.project` now),
in one process, before first.

    PYTHONPATH=. python benchmarks/results/gpu_h200_e2e_gemv/ab_e2e.py OUT_DIR [mlp]

With `mlp`: the same A/B for the MLP's gate and up (two `nnx.Linear` products before, one product
over both kernels now, `models.llama.MLP`), the projections as now in both runs.
"""
import json
import sys
from pathlib import Path

import jax

from benchmarks import speed
from benchmarks._meta import metadata
from models.llama import MLP, Attention

fused = Attention.project
fused_mlp = MLP.__call__


def two_linears(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def three_linears(self, x):
    B, T, _ = x.shape
    return (self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim),
            self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim),
            self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim))


def main():
    out = Path(sys.argv[1])
    plan = speed.Plan()
    src = speed.KeySource(".scratch/captured/smollm2_qkv.npz", plan)
    res = {"meta": metadata(), "runs": {}}
    mlp = sys.argv[2:] == ["mlp"]
    runs = ((("two_linears", MLP, "__call__", two_linears), ("fused_gate_up", MLP, "__call__", fused_mlp)) if mlp
            else (("three_linears", Attention, "project", three_linears), ("fused_qkv", Attention, "project", fused)))
    for label, cls, attr, fn in runs:
        setattr(cls, attr, fn)
        jax.clear_caches()
        e = speed.end_to_end(plan, src, lambda m: print(m, flush=True), None)
        res["runs"][label] = e
        keys = ("decode_speedup", "decode_speedup_pipelined", "decode_speedup_pipelined_stable", "ttft_speedup")
        print(label, {k: round(e[k], 3) for k in keys if k in e}, flush=True)
        for n in ("squeezed", "full", "no-attention"):
            r = e.get(n, {})
            print(f"  {n}: {r.get('ms_per_token_pipelined_stable', float('nan')):.3f} ms/token stable pipelined, "
                  f"{r.get('tokens_per_s_pipelined_stable', float('nan')):.1f} tokens/s, "
                  f"busy {r.get('profile', {}).get('busy_ms_per_token', float('nan')):.3f} ms/token, "
                  f"ttft {r.get('ttft_s', float('nan')) * 1e3:.1f} ms", flush=True)
        (out / ("ab_e2e_mlp.json" if mlp else "ab_e2e.json")).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
