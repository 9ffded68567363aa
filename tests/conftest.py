"""Shared test fixtures: fresh random draws every run (the seed is printed on failure)."""

import os

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)
