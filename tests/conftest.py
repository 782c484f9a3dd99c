"""Shared pytest fixtures: fresh random seeds (printed, so a failure can be replayed), GPU gating, a fixed umask.

Seeds: every test that takes `seed` or `rng` draws a fresh seed per run; UNSLOTH_JAX_TEST_SEED=<n> replays one, and
UNSLOTH_JAX_SEED_SWEEP=<count> runs each such test once per seed for `count` consecutive seeds from there (how the
statistical bounds were set: `UNSLOTH_JAX_SEED_SWEEP=100 pytest tests/test_optim.py -k adam_8bit`)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.helpers import quick_codegen

# Directories this process made for the test run (the controller; xdist workers inherit the variables and make
# none): removed when pytest ends (pytest_unconfigure), so runs do not fill /tmp (each is ~0.1-0.5 GB).
_MADE_HERE: list[str] = []


def _share_compiled_programs() -> None:
    """One on-disk XLA compile cache for the test run's pytest processes (the controller makes a new directory
    and its xdist workers inherit the variable, so no run starts warm): many tests compile the same programs
    (the tiny model's forward and train steps) under fresh jit wrappers or in the other worker, and a program
    compiled once is then loaded. The JAX_* variables carry it into the processes tests start (the CLI, notebook
    kernels, the 8-device cases of tests/multidevice_cases.py), except the two-process jax.distributed run,
    which hung at its shutdown barrier sharing it (test_distributed drops the variables for it).
    UNSLOTH_JAX_TEST_COMPILE_CACHE=0 turns it off."""
    if os.environ.get("UNSLOTH_JAX_TEST_COMPILE_CACHE", "1") == "0":
        return
    path = os.environ.get("UNSLOTH_JAX_TEST_COMPILE_CACHE_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="unsloth-jax-test-xla-")
        _MADE_HERE.append(path)
        os.environ["UNSLOTH_JAX_TEST_COMPILE_CACHE_DIR"] = path
    settings = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)
        jax.config.update(name, value)


def _quick_cpu_codegen() -> None:
    """On a machine without an NVIDIA GPU, this process's XLA CPU backend compiles quickly (tests.helpers.
    quick_codegen(): LLVM at -O0, fusion emitters off where jaxlib has that switch): the tests' tiny programs
    spend most of their time compiling.
    HLO-level passes are unchanged, but the code may round float32 differently in the last bits, so a test that
    asks two programs for bit-identical results pins its compiler_options (as test_fp8_model's fused-GLU test
    does). XLA_FLAGS is read when the backend starts, so it is set, the CPU backend started, and the variable
    restored: the processes tests start (the CLI's training runs, notebook kernels), which mostly execute, compile
    with the defaults. UNSLOTH_JAX_TEST_QUICK_CODEGEN=0 keeps the defaults; the GPU suite is untouched."""
    if os.environ.get("UNSLOTH_JAX_TEST_QUICK_CODEGEN", "1") == "0" or os.path.exists("/dev/nvidiactl"):
        return
    flags = os.environ.get("XLA_FLAGS")
    if flags and "xla_backend_optimization_level" in flags:
        return
    os.environ["XLA_FLAGS"] = ((flags or "") + " " + quick_codegen()).strip()
    try:
        jax.devices()
    finally:
        if flags is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = flags


def _run_directory() -> None:
    """UNSLOTH_JAX_TEST_RUN_DIR: a directory for this test run, shared by its pytest processes (made here, in the
    controller, and inherited by its xdist workers, as the compile cache is), for files that several tests need
    and one process makes (tests.helpers.made_once). Set from outside, it is kept."""
    if not os.environ.get("UNSLOTH_JAX_TEST_RUN_DIR"):
        os.environ["UNSLOTH_JAX_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="unsloth-jax-test-run-")
        _MADE_HERE.append(os.environ["UNSLOTH_JAX_TEST_RUN_DIR"])


_quick_cpu_codegen()
_share_compiled_programs()
_run_directory()


def pytest_unconfigure(config):
    """Removes the run's shared directories (compile cache, made_once files) in the process that made them."""
    for path in _MADE_HERE:
        shutil.rmtree(path, ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def _gpu_peak_bytes() -> int | None:
    """jax's peak device memory of this process (GPU only), or None."""
    if not _has_gpu():
        return None
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """On a GPU: a test that raised its process's peak device memory records the new peak (GiB) in its report's
    user_properties; pytest_terminal_summary lists the largest (what bench/gpu_tests.py's per-worker share has to
    hold; the peak counts what earlier tests of the process still hold)."""
    before = _gpu_peak_bytes()
    yield
    after = _gpu_peak_bytes() if before is not None else None
    if after is not None and after > before:
        item.user_properties.append(("gpu_peak_gib", round(after / 2**30, 2)))


def pytest_terminal_summary(terminalreporter):
    """The 15 largest gpu_peak_gib of the run (GPU runs only; xdist carries user_properties to the controller)."""
    peaks = [(value, rep.nodeid) for key in ("passed", "failed", "error")
             for rep in terminalreporter.stats.get(key, []) if getattr(rep, "when", None) == "call"
             for name, value in getattr(rep, "user_properties", ()) if name == "gpu_peak_gib"]
    if peaks:
        terminalreporter.write_sep("=", "GPU memory: the tests that raised their process's peak most (GiB)")
        for value, nodeid in sorted(peaks, reverse=True)[:15]:
            terminalreporter.write_line(f"{value:8.2f}  {nodeid}")


# Files whose tests run longest on a 2-core CPU (a minute or so each: subprocesses, notebooks, the real
# SmolLM2 model): they start first, so pytest-xdist's workers do not end on them one at a time.
_LONG_FIRST = ("test_grpo_notebook.py", "test_cli.py", "test_distributed.py", "test_notebooks.py", "test_fp8_model.py",
               "test_readme.py", "test_gguf_loading.py", "test_trainer_base.py", "test_grpo.py", "test_long_context.py",
               "test_vision_lora.py", "test_vision_sft.py", "test_vision_export.py", "test_engine.py",
               "test_vision_sample.py", "test_vision_qlora.py", "test_vision_qwen2_5_vl.py")


# Test files of code with GPU paths that run on the CPU (no gpu marker: the engine, the vision-language models, long
# context): collected with the `gpu_suite` marker, so the GPU suite (bench/gpu_tests.py, -m "gpu or gpu_suite") runs
# them on the GPU backend too, with float32 matmuls at full precision there (_float32_matmuls_at_full_precision).
_GPU_SUITE_FILES = ("test_engine.py", "test_long_context.py")
_GPU_SUITE_PREFIXES = ("test_vision_",)


def in_gpu_suite(path) -> bool:
    """True for a test file the GPU suite runs beside the gpu-marked tests (_GPU_SUITE_FILES, test_vision_*)."""
    name = Path(path).name
    return name in _GPU_SUITE_FILES or name.startswith(_GPU_SUITE_PREFIXES)


def pytest_itemcollected(item):
    """The gpu_suite marker on the tests of in_gpu_suite files (before -m selects)."""
    if in_gpu_suite(item.path):
        item.add_marker(pytest.mark.gpu_suite)


@pytest.fixture(autouse=True, scope="module")
def _float32_matmuls_at_full_precision(request):
    """On a GPU, an in_gpu_suite module runs under jax.default_matmul_precision("highest"): its float32 results are
    compared with torch / transformers (float32 at full precision) or with another program of ours at tolerances
    set on the CPU, whose float32 matmuls are full precision, while the GPU's default float32 matmul is TF32 (10-bit
    mantissa products: relative errors around 1e-3; four vision tests failed at 2e-5..4e-3). bf16 matmuls are
    unchanged. Module scope, so the module's fixtures (models, reference outputs) are computed under it too. The
    CPU is left as it is (full precision already)."""
    if not (in_gpu_suite(request.path) and _has_gpu()):
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


def _one_case_per_test(items: list) -> list:
    """UNSLOTH_JAX_ONE_CASE_PER_TEST=1: the first parametrization of each test function only (.ci/run's second
    stage, which checks that every kernel test runs on another jax version; the main stage runs every case)."""
    seen, kept = set(), []
    for item in items:
        key = (item.path, getattr(item, "originalname", item.name))
        if key not in seen:
            seen.add(key)
            kept.append(item)
    return kept


def pytest_collection_modifyitems(config, items):
    """Long-running files first; UNSLOTH_JAX_ONE_CASE_PER_TEST; skip @pytest.mark.gpu tests without a GPU."""
    if os.environ.get("UNSLOTH_JAX_ONE_CASE_PER_TEST") == "1":
        kept = _one_case_per_test(items)
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    items.sort(key=lambda item: item.path.name not in _LONG_FIRST)  # stable: the order within each group stays
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
