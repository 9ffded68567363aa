"""One call of each prefill lookup engine (1K tokens over a 128K context, 5% centroids,
Llama-3-8B heads, bf16) for Nsight Compute (run_ncu.sh): pipe utilisation of each pass."""
import jax
import jax.numpy as jnp

from pallas_kernels.centroid_lookup import DEFAULT_PREFILL, lookup_prefill_scores
from pallas_kernels.lookup_mosaic import MosaicLookupConfig, lookup_prefill_scores_mosaic

hq, hkv, d, groups, t, num_c = 32, 8, 128, 8, 1024, 6554
kq, kc, kn = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(kq, (hq, t, d), jnp.bfloat16)
c = jax.random.normal(kc, (hkv, num_c, d), jnp.bfloat16) * 0.5
n = jax.random.randint(kn, (hkv, num_c), 0, 40).astype(jnp.int32)
tri = jax.jit(lambda q, c, n: lookup_prefill_scores(q, c, n, scale=d ** -0.5, groups=groups,
                                                     cfg=DEFAULT_PREFILL, backend="pallas"))
mos = jax.jit(lambda q, c, n: lookup_prefill_scores_mosaic(q, c, n, scale=d ** -0.5, groups=groups,
                                                            cfg=MosaicLookupConfig(stats_block_c=256)))
jax.block_until_ready((tri(q, c, n), mos(q, c, n)))     # compile outside the profiled range
jax.block_until_ready(tri(q, c, n))
jax.block_until_ready(mos(q, c, n))
