"""Capture real keys, values and queries for the GPU kernel benchmarks (CPU, a few seconds).

The GPU benchmarks (`benchmarks.speed --keys`, the A/B scripts under `benchmarks/results/`) run at
the Llama-3-8B attention shape (8 KV heads, 32 query heads, d = 128), but the model files that
travel to the GPU are small.  This script runs the embedded SmolLM2-135M (30 layers, 3 KV heads,
9 query heads, d = 64) over the committed benchmark excerpts on the CPU and writes, per benchmark
head, two of its 64-d heads from two adjacent layers concatenated to d = 128:

    KV head i (0..7):       [k(layer a_i, kv c_i) | k(layer a_i + 1, kv c_i)]      a_i = 2 + 3 i,
                            c_i = i mod 3 (values the same way)
    query head 4 i + t:     [q(a_i, 3 c_i + t mod 3) | q(a_i + 1, 3 c_i + u_t)]     u = (0, 1, 2, 1)

so that query head ``h`` belongs to KV head ``h // 4`` as in the benchmark's grouping, and
``q . k`` is the sum of two real layers' attention logits: per-head sparsity comes from the
model, not from Gaussian noise.  Keys are roped (as attention sees them).

Output (float16, `np.savez_compressed`: ~7% fewer bytes to carry to the GPU; written atomically):
``k, v [8, T, 128]``, ``q [32, Tq, 128]`` (the last ``Tq`` tokens' queries).  ``KeySource`` in
`benchmarks.speed` tiles them to any context length with a little noise.

    python -m benchmarks.capture_keys --out .scratch/captured/smollm2_qkv.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

DATA = Path(__file__).resolve().parent / "data"
HKV, HQ, GROUP = 8, 32, 4
Q_SECOND = (0, 1, 2, 1)   # second-layer query head offset for t = 0..3


def head_plan(n_layers: int, n_kv: int, group_src: int) -> list[tuple[int, int]]:
    """(first layer a_i, source KV head c_i) for the 8 benchmark KV heads."""
    plan = [(2 + 3 * i, i % n_kv) for i in range(HKV)]
    if plan[-1][0] + 1 >= n_layers:
        raise ValueError(f"the model has {n_layers} layers; capture needs at least {plan[-1][0] + 2}")
    if group_src < 3:
        raise ValueError(f"the capture pairs 3 query heads per KV head; the model has {group_src}")
    return plan


def assemble(k_layers, v_layers, q_layers, group_src: int):
    """k_layers, v_layers [nL, Hkv_src, T, d]; q_layers [nL, Hq_src, Tq, d] -> (k, v [8, T, 2d],
    q [32, Tq, 2d]) by the pairing in the module docstring."""
    n_layers, n_kv = k_layers.shape[:2]
    plan = head_plan(n_layers, n_kv, group_src)
    cat = lambda a, b: np.concatenate([a, b], axis=-1)   # noqa: E731
    k = np.stack([cat(k_layers[a, c], k_layers[a + 1, c]) for a, c in plan])
    v = np.stack([cat(v_layers[a, c], v_layers[a + 1, c]) for a, c in plan])
    q = np.stack([cat(q_layers[a, group_src * c + t % 3], q_layers[a + 1, group_src * c + Q_SECOND[t]])
                  for a, c in plan for t in range(GROUP)])
    return k, v, q


def capture(model_name: str = "smollm2-135m", n_tokens: int = 4096, n_queries: int = 1024):
    """Run the model over the benchmark excerpts; returns (k, v, q) as float16 numpy arrays."""
    from models import load_model

    if n_queries > n_tokens:
        raise ValueError(f"n_queries ({n_queries}) must not exceed n_tokens ({n_tokens})")
    m = load_model(model_name)
    if m.tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer")
    text = "\n\n".join(p.read_text() for p in sorted(DATA.glob("*.txt")))
    ids = m.tokenizer.encode(text)
    if len(ids) < n_tokens:
        raise ValueError(f"the excerpts hold {len(ids)} tokens, fewer than --tokens {n_tokens}")
    ids = np.asarray(ids[:n_tokens], np.int32)
    cache = m.new_cache(1, n_tokens)
    pos = jnp.arange(n_tokens, dtype=jnp.int32)[None]
    _, cache, caps = m.forward(jnp.asarray(ids[None]), pos, cache, capture_last=n_queries, logits="none")
    k_layers, v_layers = (np.asarray(x[:, 0], np.float32) for x in cache.stacked())  # [nL, Hkv, T, d]
    q_layers = np.stack([np.asarray(c["q"][0], np.float32).transpose(1, 0, 2) for c in caps])  # [nL, Hq, Tq, d]
    group_src = m.config.num_heads // m.config.num_kv_heads
    k, v, q = assemble(k_layers, v_layers, q_layers, group_src)
    return k.astype(np.float16), v.astype(np.float16), q.astype(np.float16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".scratch/captured/smollm2_qkv.npz")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=1024)
    a = ap.parse_args(argv)
    from sqjax.index_io import write_atomic

    k, v, q = capture(a.model, a.tokens, a.queries)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez_compressed(f, k=k, v=v, q=q)

    write_atomic(out, write)
    print(f"wrote {out}: k, v {k.shape}, q {q.shape} float16", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
