"""bench/gpu_tests.py (the GPU suite's runner, issue 47): workers and memory shares from the card, the tests retried
alone, the summary counts; and the gpu_suite selection tests/conftest.py makes."""
from __future__ import annotations

from bench import gpu_tests
from tests.conftest import in_gpu_suite


def test_plan_fits_the_card():
    for free, total in ((79.2, 79.6), (139.5, 140.4)):  # H100 80GB, H200 141GB
        workers, fraction = gpu_tests.plan(free, total, cpus=16, gib_per_worker=12)
        assert workers == int(free // 12)
        # the shares and the processes' CUDA contexts fit the free memory together
        assert workers * (fraction * total + gpu_tests.CONTEXT_GIB) <= free
        assert fraction * total >= 10
    assert gpu_tests.plan(79.2, 79.6, cpus=4, gib_per_worker=12)[0] == 4  # at most the CPU count
    assert gpu_tests.plan(5.0, 79.6, cpus=16, gib_per_worker=12)[0] == 1  # at least one
    assert gpu_tests.plan(79.2, 79.6, cpus=16, gib_per_worker=12, workers=12)[0] == 12  # asked for


def test_retry_ids_and_counts():
    out = """
FAILED tests/kernels/test_cross_entropy.py::test_gpu_fp32 - jaxlib._jax.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of
FAILED tests/test_moe.py::test_grouped_experts_on_gpu[qwen3-bf16] - Failed: Timeout >150.0s
FAILED tests/test_engine.py::test_x - AssertionError: 3 != 4
ERROR tests/test_vision_lora.py::test_y - RuntimeError: CUDA_ERROR_OUT_OF_MEMORY: out of memory
===== 3 failed, 250 passed, 6 skipped, 776 deselected, 1 error in 401.22s (0:06:41) =====
"""
    assert gpu_tests.retry_ids(out) == ["tests/kernels/test_cross_entropy.py::test_gpu_fp32",
                                        "tests/test_moe.py::test_grouped_experts_on_gpu[qwen3-bf16]",
                                        "tests/test_vision_lora.py::test_y"]
    assert gpu_tests.counts(out) == {"failed": 3, "passed": 250, "skipped": 6, "deselected": 776, "error": 1}


def test_gpu_suite_files():
    assert in_gpu_suite("tests/test_engine.py") and in_gpu_suite("tests/test_long_context.py")
    assert in_gpu_suite("tests/test_vision_qwen2_5_vl.py") and not in_gpu_suite("tests/test_lora_train.py")


def test_counts_of_a_run_stopped_early():
    out = """[gw0] [  1%] PASSED tests/kernels/test_nf4.py::test_a
[gw1] [  2%] FAILED tests/kernels/test_nf4.py::test_b
[gw1] [  3%] SKIPPED tests/kernels/test_nf4.py::test_c
"""
    assert gpu_tests.counts(out) == {"passed": 1, "failed": 1, "skipped": 1, "stopped": 1}


def test_shards_split_the_files_whole_and_evenly():
    """--shard K/N: the N parts hold every file once, and their test counts differ by at most the largest file's."""
    per_file = {f"tests/test_{i}.py": c for i, c in enumerate([40, 3, 17, 25, 9, 9, 30, 1, 12, 22])}
    for n in (1, 2, 3, 4):
        parts = gpu_tests.assign_shards(per_file, n)
        files = [f for part in parts for f in part]
        assert sorted(files) == sorted(per_file) and len(parts) == n, parts
        loads = [sum(per_file[f] for f in part) for part in parts]
        assert max(loads) - min(loads) <= max(per_file.values()), (n, loads)
    assert gpu_tests.assign_shards(per_file, 3) == gpu_tests.assign_shards(dict(reversed(per_file.items())), 3)
