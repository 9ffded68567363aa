"""How much int8 (or fp8) lookup operands move Eq. 1 and the selection, on captured SmolLM2 keys (CPU).

Keys/queries from `python -m benchmarks.capture_keys` (8 KV heads x 4096 keys, 32 query heads x 1024 tokens),
5% spherical k-means centroids, blocks of 1024 and 256 query tokens; the threshold keeps 10% of the keys on the
reference scores. Per variant: kept fraction (reference -> rounded), the reference S mass of the rounded
selection over the reference's, selected clusters that flip / selected, the logits' error (natural-log units).
Variants name the scale groups of q / centroids ("row" = per token and head, "head" = per head, "col" = per
centroid). With the argument f32 the reference is f32 inputs (else bf16). Output: precision_cpu.txt.

    python benchmarks/results/gpu_h100_int8_lookup/precision_cpu.py f32
"""
import numpy as np, jax, jax.numpy as jnp
from sqjax.kmeans import KMeansConfig, spherical_kmeans
z = np.load('.scratch/captured/smollm2_qkv.npz')
k = jnp.asarray(z['k'], jnp.float32); q = jnp.asarray(z['q'], jnp.float32)
hkv, L, d = k.shape; hq, T, _ = q.shape; g = hq // hkv
km = spherical_kmeans(k[None], KMeansConfig(L // 20, 10, seed=0))
C = km.centroids[0].astype(jnp.bfloat16).astype(jnp.float32); N = km.counts[0]
qb = q.astype(jnp.bfloat16).astype(jnp.float32)
import sys
if 'f32' in sys.argv: qb = q; C = km.centroids[0]
scale = d ** -0.5
def q8(x, axes, mode):
    if mode == 'fp8':
        s = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / 224.0
        return (x / s).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s
    if mode == 'int8row':
        s = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
        return jnp.round(x / s) * s
    if mode == 'int8':
        s = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / 127.0
        return jnp.round(x / s) * s
    if mode == 'f32':
        return x
    return x
def S(qq, cc):
    lg = scale * jnp.einsum('kgtd,kcd->kgtc', qq.reshape(hkv, g, T, d), cc)
    lg = jnp.where(N[:, None, None, :] > 0, lg, -jnp.inf)
    m = jnp.max(lg, -1, keepdims=True); e = jnp.exp(lg - m)
    den = jnp.sum(e * N[:, None, None, :], -1, keepdims=True)
    return lg, (e / den).mean(axis=(1, 2))   # [Hkv, C]
lg0, s0 = S(qb, C)
from sqjax.calibration import weighted_threshold
for block in (1024, 256):
  for mode, mm, qa, ca in [('int8 row/row', 'int8row', -1, -1), ('int8 row/head', 'int8', -1, (1, 2)), ('int8 head/head', 'int8', (1,2), (1, 2)), ('int8 row/col', 'int8', -1, (0,1)), ('int8 tok/head', 'int8', (0,2), (1,2)),('bf16 vs f32', 'f32', 0, 0)]:
    res = []
    for t0 in range(0, T, block):
        qs = qb[:, t0:t0+block]
        TT = qs.shape[1]
        def SS(qq, cc):
            lg = scale * jnp.einsum('kgtd,kcd->kgtc', qq.reshape(hkv, g, TT, d), cc)
            m = jnp.max(lg, -1, keepdims=True); e = jnp.exp(lg - m)
            den = jnp.sum(e * N[:, None, None, :], -1, keepdims=True)
            return lg, (e / den).mean(axis=(1, 2))
        lgA, sA = SS(qs, C)
        lgB, sB = (SS(q8(qs, qa, mm), q8(C, ca, mm)) if mm != 'f32' else SS(qs.astype(jnp.bfloat16).astype(jnp.float32), C.astype(jnp.bfloat16).astype(jnp.float32)))
        t = weighted_threshold(sA, N, 0.9)
        selA = sA > t; selB = sB > t
        keptA = float((N * selA).sum() / N.sum()); keptB = float((N * selB).sum() / N.sum())
        # mass of true S (times counts) captured
        massA = float((sA * N * selA).sum()); massB = float((sA * N * selB).sum())
        flip = float((selA != selB).sum() / selA.sum())
        err = lgB - lgA
        res.append((keptA, keptB, massB / massA, flip, float(jnp.std(err)), float(jnp.max(jnp.abs(err))), float(jnp.max(jnp.abs(sB - sA) / (sA + 1e-12) * (sA > t)))))
    r = np.array(res).mean(0)
    print(f"{mode:14s} block {block}: kept {r[0]:.4f} -> {r[1]:.4f}, true mass kept {r[2]:.5f}, flipped/selected {r[3]:.4f}, logit err std {r[4]:.4f} max {r[5]:.3f}, max rel S err (selected) {r[6]:.3f}")
print('logit std', float(jnp.std(lg0[jnp.isfinite(lg0)])))
