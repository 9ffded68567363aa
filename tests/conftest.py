"""Shared test fixtures: fresh random draws every run, reproducible on demand.

Each run draws a run seed (or takes ``SQJAX_TEST_SEED``); a test's generator is seeded with
the run seed mixed with the test's id, and the seed is printed (shown on failure). To replay a
failure: ``SQJAX_TEST_SEED=<run seed> ./scripts/test -k <test>``.
"""

import os
import random
import zlib

import numpy as np
import pytest

RUN_SEED = int(os.environ.get("SQJAX_TEST_SEED", random.randrange(2**31)))


@pytest.fixture
def rng(request):
    seed = (zlib.crc32(request.node.nodeid.encode()) + RUN_SEED) % 2**32
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (SQJAX_TEST_SEED={RUN_SEED})")
    return np.random.default_rng(seed)
