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


def test_trace_summary_sums_gpu_kernels_per_step(tmp_path):
    """bench/trace_summary.py counts only the GPU processes' kernel events, by name and category, per step."""
    import gzip
    import json

    from bench.trace_summary import newest_trace, summarize

    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(MemcpyD2H)"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5000, "name": "PjitFunction(step)"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 300, "name": "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT",
         "args": {"hlo_op": "dot.3"}},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 400, "dur": 100, "name": "_dkdv_kernel"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 600, "dur": 60, "name": "_fwd_kernel"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 700, "dur": 40, "name": "loop_multiply_fusion_2"},
        {"ph": "X", "pid": 2, "tid": 8, "ts": 100, "dur": 200, "name": "MemcpyD2H"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 900, "dur": 300, "name": "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT"},
    ]
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as fp:
        json.dump({"traceEvents": events}, fp)
    s = summarize(newest_trace(tmp_path), steps=2)
    assert s["gpu_processes"] == ["/device:GPU:0"] and s["kernel_events"] == 6
    assert s["busy_ms_per_step"] == 0.5 and s["span_ms_per_step"] == 0.6
    assert s["ms_per_step_by_stream"] == {"Stream #7(Compute)": 0.4, "Stream #8(MemcpyD2H)": 0.1}
    assert s["ms_per_step_by_category"] == {"matmul": 0.3, "copy": 0.1, "attention_pallas": 0.08, "xla_fusion": 0.02}
    top = s["top_kernels"][0]
    assert top["calls_per_step"] == 1 and top["ms_per_step"] == 0.3 and top["hlo_op"] == "dot.3"
    idle = s["busiest_stream_idle"]  # stream 7's gaps: 100, 100, 40, 160 us; >= 300 us: none
    assert idle["stream"] == "Stream #7(Compute)" and idle["idle_ms_per_step"] == 0 and idle["largest"] == []


def test_trace_summary_groups_the_compute_streams_idle_gaps():
    """The busiest stream's gaps of at least 0.3 ms, grouped by the kernels before and after them."""
    from bench.trace_summary import busiest_stream_idle

    kernels = [{"ts": t, "dur": 100, "name": n, "s": 7} for t, n in
               ((0, "a"), (600, "b"), (700, "a"), (1300, "b"), (1400, "c"), (2000, "d"))]
    kernels.append({"ts": 0, "dur": 2000, "name": "MemcpyD2H", "s": 8})
    idle = busiest_stream_idle(kernels, lambda e: e["s"], steps=2)
    assert idle["stream"] == 8  # the copy stream is busier here: 2000 vs 600 us
    idle = busiest_stream_idle(kernels[:-1], lambda e: e["s"], steps=2)
    assert idle["idle_ms_per_step"] == 0.75  # gaps 500 + 500 + 500 us over 2 steps
    assert idle["largest"][0] == {"before": "a", "after": "b", "ms_per_step": 0.5, "gaps_per_step": 1.0,
                                  "ended_last_elsewhere": {"nothing": 2}}
    assert idle["largest"][1] == {"before": "c", "after": "d", "ms_per_step": 0.25, "gaps_per_step": 0.5,
                                  "ended_last_elsewhere": {"nothing": 1}}
    # copies on stream 9 ending inside the gaps (the second one just before "b" at 1300): what was waited for
    copies = [{"ts": 500, "dur": 90, "name": "MemcpyH2D", "s": 9, "args": {"hlo_op": "dynamic-slice-fusion.2"}},
              {"ts": 100, "dur": 50, "name": "MemcpyD2D", "s": 9},
              {"ts": 1200, "dur": 95, "name": "MemcpyH2D", "s": 9, "args": {"hlo_op": "dynamic-slice-fusion.2"}},
              {"ts": 1450, "dur": 100, "name": "MemcpyD2D", "s": 9}]
    idle = busiest_stream_idle(kernels[:-1] + copies, lambda e: e["s"], steps=2)
    assert idle["stream"] == 7 and idle["idle_ms_per_step"] == 0.75
    assert idle["largest"][0]["ended_last_elsewhere"] == {"MemcpyH2D dynamic-slice-fusion.2 (0.09 ms)": 1,
                                                          "MemcpyH2D dynamic-slice-fusion.2 (0.10 ms)": 1}
    assert idle["largest"][1]["ended_last_elsewhere"] == {"MemcpyD2D (0.10 ms)": 1}
