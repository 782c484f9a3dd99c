"""Shared pytest fixtures: fresh random seeds (printed, so a failure can be replayed), GPU gating, a fixed umask."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    """Skip @pytest.mark.gpu tests when no GPU is present."""
    if _has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def fresh_seed(what: str = "test") -> int:
    """A fresh random seed, or UNSLOTH_JAX_TEST_SEED when set (to replay one); printed so failures show it."""
    value = int(os.environ.get("UNSLOTH_JAX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"{what} seed = {value}  (replay with UNSLOTH_JAX_TEST_SEED={value})")
    return value


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (see fresh_seed)."""
    return fresh_seed()


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """numpy Generator seeded from the fresh per-test seed."""
    return np.random.default_rng(seed)


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request) -> int:
    """The process umask set to 0o022, then 0o077, for one test (restored afterwards)."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)
