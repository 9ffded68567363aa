"""The Mosaic GPU prefill lookup passes (``lookup_mosaic``): GPU interpret mode on the CPU against
the Eq. 1 reference (``mosaic_interpret_cases.py``, run in a subprocess with a time limit), their
dispatch through ``CentroidLookupConfig.prefill_engine``, and their lowering to Mosaic GPU for a
Hopper target (no GPU needed)."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from conftest import RUN_SEED
from pallas_kernels import centroid_lookup as cl
from pallas_kernels import lookup_mosaic as lm
from pallas_kernels.centroid_lookup import CentroidLookupConfig, lookup_prefill_scores
from test_kernels_centroid_lookup import make_inputs

TESTS = Path(__file__).resolve().parent
N_INTERPRET_CASES = 4     # mosaic_interpret_cases.py: three pass cases + the engine through the lookups
INTERPRET_LIMIT_S = 420   # ~30 s when it runs; a stall becomes a failure instead of a stuck suite
POOL_THREADS = 16         # XLA CPU pool threads (NPROC) in that process: >= the warpgroups that block at once


def test_interpret_cases(tmp_path):
  """``mosaic_interpret_cases.py`` (the passes vs the f64 reference: GQA 4:1, MHA 1:1, vote-q groups,
  ragged T and C, bounded calls with a group bounded at 0, a KV head with no cluster, splits, a
  ring that wraps; the engine through the public and hierarchical lookups) in a fresh process.

  The GPU interpreter runs each warpgroup (3 in pass 1) as a host thread that executes its own
  XLA computation; that computation's barrier waits are io_callbacks which XLA runs on the CPU
  client's thread pool, sized to the CPU count. On a 2-CPU machine two warpgroups blocked in
  their waits can hold the whole pool while the warpgroup that would release them waits for a
  pool thread: a deadlock. It stalled two fresh-clone CI runs (2 CPUs); with ``NPROC=1`` (XLA's
  override of the pool size) it stalls every time, the blocked wait on the pool's only thread
  and the other two warpgroups inside their computations. ``NPROC=16`` gives every warpgroup a
  pool thread. A stall still fails this test (time limit) with every thread's Python stack."""
  stacks = tmp_path / "stacks.txt"
  code = ("import faulthandler, sys; "
          f"faulthandler.dump_traceback_later({INTERPRET_LIMIT_S - 30}, file=open({str(stacks)!r}, 'w')); "
          "import pytest; "
          "sys.exit(pytest.main(['-o', 'addopts=', '-q', '-p', 'no:cacheprovider', '-p', 'no:warnings', "
          f"{str(TESTS / 'mosaic_interpret_cases.py')!r}]))")
  env = dict(os.environ, SQJAX_TEST_SEED=str(RUN_SEED), JAX_PLATFORMS="cpu", NPROC=str(POOL_THREADS))
  try:
    r = subprocess.run([sys.executable, "-c", code], cwd=TESTS.parent, env=env, capture_output=True,
                       text=True, timeout=INTERPRET_LIMIT_S)
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    dump = stacks.read_text()[-6000:] if stacks.exists() else "(none written)"
    pytest.fail(f"the Mosaic GPU interpret cases did not finish in {INTERPRET_LIMIT_S} s "
                f"(SQJAX_TEST_SEED={RUN_SEED}); output so far:\n{out[-3000:]}\nthread stacks:\n{dump}")
  assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
  assert f"{N_INTERPRET_CASES} passed" in r.stdout, r.stdout[-3000:]


def test_engine_choice_and_errors(rng, monkeypatch):
  q, cent, counts = make_inputs(rng, 4, 2, 8, 30, 64, jnp.float32)
  with pytest.raises(ValueError, match="prefill_engine must be one of"):
    CentroidLookupConfig(prefill_engine="cuda")
  with pytest.raises(ValueError, match="multiple of 64"):
    lm.MosaicLookupConfig(score_block_c=96)
  mos = CentroidLookupConfig(prefill_engine="mosaic")
  with pytest.raises(ValueError, match="bf16/f16 q and centroids .* got q float32"):
    lookup_prefill_scores(q, cent, counts, scale=0.125, groups=2, cfg=mos, backend="interpret")
  qb, cb = q.astype(jnp.bfloat16), cent.astype(jnp.bfloat16)
  monkeypatch.setattr(cl, "is_hopper", lambda: False)
  with pytest.raises(ValueError, match="needs a Hopper GPU"):
    cl._mosaic_engine(mos, qb, cb, "pallas")
  auto = CentroidLookupConfig(prefill_engine="auto")
  assert not cl._mosaic_engine(auto, qb, cb, "pallas")          # not Hopper: Triton
  assert not cl._mosaic_engine(auto, qb, cb, "interpret")       # interpret: Triton
  monkeypatch.setattr(cl, "is_hopper", lambda: True)
  assert cl._mosaic_engine(auto, qb, cb, "pallas")
  assert not cl._mosaic_engine(auto, q, cent, "pallas")         # f32: Triton
  assert not cl._mosaic_engine(cl.DEFAULT_PREFILL, qb, cb, "pallas")   # the default stays Triton


@pytest.mark.parametrize("bounded", [False, True])
def test_mosaic_lowers_for_hopper(bounded):
  """The Pallas -> Mosaic GPU lowering (layouts, TMA, wgmma, barriers) at the benchmark's
  Llama-3-8B shapes, exported for CUDA on the CPU."""
  hq, hkv, seq_len, num_c, d = 32, 8, 4096, 26214, 128
  sds = jax.ShapeDtypeStruct
  args = [sds((hq, seq_len, d), jnp.bfloat16), sds((hkv, num_c, d), jnp.bfloat16),
          sds((hkv, num_c), jnp.int32)] + ([sds((hkv,), jnp.int32)] if bounded else [])
  fn = jax.jit(lambda *a: lm.lookup_prefill_scores_mosaic(*a, scale=d ** -0.5, groups=hkv,
                                                           cfg=lm.DEFAULT_MOSAIC))
  text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
  assert text.count("mosaic_gpu") >= 2
