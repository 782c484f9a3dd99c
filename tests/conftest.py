"""Shared pytest fixtures: fresh random seeds (printed, so a failure can be replayed), GPU gating, a fixed umask.

Seeds: every test that takes `seed` or `rng` draws a fresh seed per run; UNSLOTH_JAX_TEST_SEED=<n> replays one, and
UNSLOTH_JAX_SEED_SWEEP=<count> runs each such test once per seed for `count` consecutive seeds from there (how the
statistical bounds were set: `UNSLOTH_JAX_SEED_SWEEP=100 pytest tests/test_optim.py -k adam_8bit`)."""
from __future__ import annotations

import os
import tempfile

import jax
import numpy as np
import pytest


def _share_compiled_programs() -> None:
    """One on-disk XLA compile cache for the whole test run (its pytest-xdist workers included): many tests
    compile the same programs (the tiny model's forward and train steps) in separate processes or under fresh
    jit wrappers, and a program compiled once is then loaded. The directory is new for each run (the controller
    makes it and the workers inherit the variable), so no run starts warm. UNSLOTH_JAX_TEST_COMPILE_CACHE=0 turns
    it off. The JAX_* variables carry it into the processes tests start (the CLI, notebook kernels, the
    two-process distributed run)."""
    if os.environ.get("UNSLOTH_JAX_TEST_COMPILE_CACHE", "1") == "0":
        return
    path = os.environ.get("UNSLOTH_JAX_TEST_COMPILE_CACHE_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="unsloth-jax-test-xla-")
        os.environ["UNSLOTH_JAX_TEST_COMPILE_CACHE_DIR"] = path
    settings = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)
        jax.config.update(name, value)


def _quick_cpu_codegen() -> None:
    """On a machine without an NVIDIA GPU, XLA's LLVM backend at -O0 (XLA_FLAGS, read when the backend starts,
    after this import; inherited by the processes tests start): the tests' tiny programs spend most of their
    time compiling, and on the CI's 2 cores this cut a sample of training tests from 112 to 79 s. HLO-level
    passes and float semantics are unchanged (no fast math either way). UNSLOTH_JAX_TEST_QUICK_CODEGEN=0 keeps
    the default level. The GPU suite (`pytest -m gpu` on the device machine) compiles as users do."""
    if os.environ.get("UNSLOTH_JAX_TEST_QUICK_CODEGEN", "1") == "0" or os.path.exists("/dev/nvidiactl"):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()


_quick_cpu_codegen()
_share_compiled_programs()


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


def pytest_generate_tests(metafunc):
    """UNSLOTH_JAX_SEED_SWEEP=<count>: parametrize `seed` (and so `rng`) over `count` seeds."""
    count = int(os.environ.get("UNSLOTH_JAX_SEED_SWEEP", "0"))
    if count > 0 and "seed" in metafunc.fixturenames:
        first = fresh_seed("sweep first") if "UNSLOTH_JAX_TEST_SEED" in os.environ else 0
        seeds = [(first + i) % (1 << 32) for i in range(count)]
        metafunc.parametrize("seed", seeds, ids=[f"seed{s}" for s in seeds], indirect=True)


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (see fresh_seed), or the sweep's seed."""
    if hasattr(request, "param"):
        print(f"test seed = {request.param}  (replay with UNSLOTH_JAX_TEST_SEED={request.param})")
        return request.param
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
