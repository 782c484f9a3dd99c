"""The shared benchmark timer (bench/timing.py) on the CPU: it must time the function it is given, on copies
that are real separate buffers, and report sane numbers."""
from __future__ import annotations

import math

import jax.numpy as jnp

from bench import timing


def test_device_ms_times_the_function_on_distinct_copies():
    calls = []

    def fn(x, y):
        calls.append(x.shape)  # runs at trace time: once per copy inside the multi-call program
        return x * 2 + y

    x = jnp.arange(1024, dtype=jnp.float32)
    ms = timing.device_ms(fn, x, jnp.float32(1.0), runs=3, target_ms=0.5, max_copies=4, min_bytes=0)
    assert math.isfinite(ms) and ms > 0
    # one trace for the single-call warm-up program, then K traces for the K-copy program (K >= 1)
    assert 2 <= len(calls) <= 1 + 4


def test_copies_are_separate_buffers_with_equal_values():
    x = jnp.ones((8, 8), jnp.bfloat16)
    tree = {"a": x, "n": None, "s": 3}
    c = timing._copy(tree)
    assert c["n"] is None and c["s"] == 3
    assert c["a"] is not x and bool(jnp.all(c["a"] == x))
    assert c["a"].unsafe_buffer_pointer() != x.unsafe_buffer_pointer()


def test_memory_analysis_helpers_return_ints_or_none():
    x = jnp.ones((256, 256), jnp.float32)
    peak = timing.peak_bytes(lambda a: a @ a, x)
    temp = timing.temp_bytes(lambda a: a @ a, x)
    for v in (peak, temp):
        assert v is None or (isinstance(v, int) and v >= 0)
    if peak is not None:
        assert peak >= x.nbytes  # at least the argument
