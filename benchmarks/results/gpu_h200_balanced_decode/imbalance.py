"""Per-program selected rows of the clustered decode (bc clusters per program) on the speed suite's
captured-and-tiled keys: is the attention kernel's time set by its heaviest program?"""
import math, sys, time
import jax, jax.numpy as jnp, numpy as np
from benchmarks.speed import KeySource, Plan
from sqjax.methods import ContextData, Squeezed
from sqjax import dispatch, squeezed
from pallas_kernels.clustered_attention import cluster_sort_layout, clustered_decode_attention_reference
L = int(sys.argv[1]); hkv = int(sys.argv[2]); hq = 4 * hkv
plan = Plan()
src = KeySource(".scratch/captured/smollm2_qkv.npz", plan)
k, v = src.kv(L, seed=L, n_heads=hkv)
q_obs = src.queries(100, seed=L, n_heads=hq)[None]
data = ContextData(k[None], v[None], q_obs, k_pre=k[None], scale=1 / math.sqrt(128))
t0 = time.time()
m = Squeezed(sparsity=0.9, n_sink=1)
with dispatch.using("reference"):
    index = m.build(data)[0]
print("built", time.time() - t0, flush=True)
li = index.layers
ks, vs, offs, perm = cluster_sort_layout(k, v, li.labels[0], index.n_sink, index.n_tail, num_clusters=li.counts.shape[-1])
C = li.counts.shape[-1]
np.savez(f"/tmp/imb_{L}_{hkv}.npz", offs=np.asarray(offs), cent=np.asarray(li.centroids[0], np.float32),
         thr=np.asarray(index.threshold))
for j in range(3):
    q = src.queries(1, seed=100 + j, n_heads=hq)[:, 0]
    s = np.asarray(squeezed.cluster_scores(q[:, None], li.centroids[0], li.counts[0], 1 / math.sqrt(128), "kv"))
    sel = (s > float(index.threshold)) & (np.asarray(li.counts[0]) > 0)
    sizes = np.diff(np.asarray(offs), axis=1)
    rows = np.where(sel, sizes, 0)                          # [Hkv, C]
    for bc in (128, 256):
        nb = -(-C // bc)
        pr = np.pad(rows, ((0, 0), (0, nb * bc - C))).reshape(hkv, nb, bc).sum(-1)
        tiles = np.ceil(pr / 64)
        print(f"q{j} bc={bc}: kept {rows.sum() / (hkv * L):.3f}, rows/program mean {pr.mean():.0f} max {pr.max()} "
              f"p99 {np.percentile(pr, 99):.0f}; tiles mean {tiles.mean():.1f} max {tiles.max():.0f}; "
              f"selected clusters/program max {np.pad(sel, ((0,0),(0,nb*bc-C))).reshape(hkv,nb,bc).sum(-1).max()}", flush=True)
