"""CPU check behind two statements of ../README.md: (1) on a real document k-means leaves no level-2
cluster empty (SmolLM2-135M, the first 6000 tokens of the QUEST excerpt, every layer and KV head,
HierarchicalSqueezed's clustering: 5% level 2, 1% level 1); (2) the level-up before 3800606 (all
children clustered, empty ones as zero rows) left level-1 clusters empty where level 2 had empties,
the masked one does not (2 heads x 2000 children, 26% empty, 400 level-1 clusters).

    python benchmarks/results/gpu_h200_capture_keys/empty_clusters_cpu/check_empty.py   (repo root)
"""
import json, subprocess, sys
from pathlib import Path
import numpy as np, jax.numpy as jnp
sys.path.insert(0, ".")
from models import load_model
from sqjax.kmeans import KMeansConfig, cluster_level_up
from sqjax.squeezed import SqueezedConfig, cluster_fixed_context

out = {}
m = load_model("smollm2-135m")
ids = np.asarray(m.tokenizer.encode(Path("benchmarks/data/quest_excerpt.txt").read_text())[:6000], np.int32)
cache = m.new_cache(1, len(ids))
_, cache, _ = m.forward(jnp.asarray(ids[None]), jnp.arange(len(ids), dtype=jnp.int32)[None], cache, logits="none")
lay = cluster_fixed_context(cache.k[:, 0], SqueezedConfig(sparsity=0.9, n_obs=100, n_sink=1, hierarchical=True))
c2, c1 = np.asarray(lay.counts), np.asarray(lay.counts1)
out["real_document"] = {"tokens": len(ids), "layers": int(c2.shape[0]), "kv_heads": int(c2.shape[1]),
                        "level2_clusters": int(c2.shape[2]), "level1_clusters": int(c1.shape[2]),
                        "level2_empty_fraction": float((c2 == 0).mean()), "level1_empty_fraction": float((c1 == 0).mean())}
old_src = subprocess.run(["git", "show", "71fa566:sqjax/kmeans.py"], capture_output=True, text=True, check=True).stdout
ns = {}
exec(compile(old_src.replace("from __future__ import annotations", ""), "kmeans_71fa566", "exec"), ns)
rng = np.random.default_rng(0)
cent = rng.normal(size=(2, 2000, 32)).astype(np.float32)
cnt = rng.integers(1, 50, size=(2, 2000)).astype(np.int32)
empty = rng.random((2, 2000)) < 0.26
cent[empty], cnt[empty] = 0, 0
for name, f in (("level_up_71fa566", ns["cluster_level_up"]), ("level_up_masked", cluster_level_up)):
  _, _, n1 = f(jnp.asarray(cent), jnp.asarray(cnt), KMeansConfig(400))
  out[name] = {"children": 2000, "empty_children_fraction": float(empty.mean()), "level1_clusters": 400,
               "level1_empty_fraction_per_head": [float((np.asarray(n1[h]) == 0).mean()) for h in range(2)]}
print(json.dumps(out, indent=1))
Path(__file__).with_name("check_empty.json").write_text(json.dumps(out, indent=1))
