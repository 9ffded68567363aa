"""Shared test fixtures: fresh random draws every run, reproducible on demand.

Each run draws a run seed (or takes ``SQJAX_TEST_SEED``); a test's generator is seeded with
the run seed mixed with the test's id, and the seed is printed (shown on failure). To replay a
failure: ``SQJAX_TEST_SEED=<run seed> ./scripts/test -k <test>``.
"""

import os
import random
import shutil
import tempfile
import zlib

import numpy as np
import pytest

RUN_SEED = int(os.environ.get("SQJAX_TEST_SEED", random.randrange(2**31)))
os.environ["SQJAX_TEST_SEED"] = str(RUN_SEED)   # pytest-xdist workers (started later) share this run seed

# LLVM's optimisations of XLA:CPU code cost more compile time than they save here: the suite
# compiles thousands of small programs (interpret-mode kernels above all) and runs each once or
# twice. Level 0 took the Pallas clustered-attention tests from 164 s to 112 s; HLO passes are
# unchanged. Set before jax starts (no test module has imported it yet); a caller's own level stays.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


# `sqjax`'s CLI keeps XLA's compiled programs in ~/.cache/sqjax/xla; the tests that call it in-process
# would read and fill the user's cache, so a run gives it a fresh directory of its own, made by the
# controller before the xdist workers start (they inherit it) and removed at the end. One cache for
# every program of the run (JAX_COMPILATION_CACHE_DIR, subprocesses too) did not pay: 92 programs
# loaded, ~2 min of compiling saved, and the run took 42.8 min against 36.1
# (benchmarks/results/cpu_compile_probes/).
if "SQJAX_TEST_OWN_CACHE" not in os.environ:
    os.environ["SQJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="sqjax-test-xla-")
    os.environ["SQJAX_TEST_OWN_CACHE"] = str(os.getpid())


def pytest_unconfigure(config):
    if os.environ.get("SQJAX_TEST_OWN_CACHE") == str(os.getpid()):
        shutil.rmtree(os.environ["SQJAX_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def rng(request):
    seed = (zlib.crc32(request.node.nodeid.encode()) + RUN_SEED) % 2**32
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (SQJAX_TEST_SEED={RUN_SEED})")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends.

    Each XLA:CPU executable keeps its JIT-compiled code in memory mappings of this process, and the
    suite compiles thousands of programs (Pallas interpret-mode kernels above all). Kept until exit,
    they hit Linux's per-process limit of 65,530 mappings (`vm.max_map_count`). At that limit the
    next compilation segfaults; this happened at ~80% of the suite. Modules share few programs, so
    recompiling them costs little.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


# CPU smoke runs of the GPU benchmark scripts (`@pytest.mark.bench_smoke`): each runs a script end to
# end at tiny shapes, compiling every variant it times (1-5 min each, ~9 min of the suite's wall time
# together). They check a script's plumbing before device time is spent on it, not the library, so
# they are opt-in: `./scripts/test-benchmarks` (SQJAX_BENCH_SMOKES=1) runs them; the suite deselects
# them and says so in its summary.
BENCH_SMOKES = os.environ.get("SQJAX_BENCH_SMOKES") == "1"


def pytest_configure(config):
    # deselect by marker expression unless the caller chose one (xdist workers run this hook too)
    if not BENCH_SMOKES and not config.option.markexpr:
        config.option.markexpr = "not bench_smoke"
        config._sqjax_deselects_smokes = True


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "_sqjax_deselects_smokes", False):
        terminalreporter.write_line("the GPU benchmark scripts' CPU smoke runs (bench_smoke) were deselected: "
                                    "./scripts/test-benchmarks runs them")
