"""Where a profiled train step's GPU time goes: sums the device kernel events of a jax profiler trace.

    python bench/trace_summary.py LOG_DIR [--steps N] [--top K]

LOG_DIR is what `jax.profiler.start_trace(LOG_DIR)` wrote (the newest `plugins/profile/*/*.trace.json.gz`).
Events of the processes named like a GPU device ("/device:GPU:0") are grouped by kernel name and by a coarse
category (matmul, attention, our Pallas kernels, copies, XLA fusions, other); times are divided by --steps, so
they read as milliseconds per step; the busiest stream's idle gaps are grouped by the kernels around them.
Prints one JSON object. Names only: categories are guesses from kernel
names (cuBLAS/cuDNN/XLA naming), listed with their regular expressions in CATEGORIES.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
from pathlib import Path

# (category, regex on the kernel name), first match wins. Pallas kernels keep their Python function names
# (pallas_kernels/*: _fwd_kernel, _dkdv_kernel, _dequant_kernel, ...); cuBLAS GEMMs on Hopper are nvjet_* or
# sm90_xmma_*; XLA's own Triton GEMM fusions are named after the fusion (gemm_fusion / triton_gemm).
# Caveat: _fwd_kernel is also the forward of the RMSNorm, GLU, LoRA, cross-entropy and NF4 kernels, so
# attention_pallas counts those too when they run; top_kernels shows the names to tell them apart.
CATEGORIES = (
    ("copy", r"memcpy|memset|Memcpy|Memset"),
    ("attention_cudnn", r"cudnn|sdpa|fmha|flash_fprop|flash_bprop"),
    ("attention_pallas", r"^_(fwd|dkdv|dq)_kernel$"),
    ("pallas_other", r"^_[a-z0-9_]*kernel$"),
    ("matmul", r"nvjet|gemm|xmma|cutlass|cublas|sm90_|wgmma|dot"),
    ("xla_fusion", r"fusion|reduce|transpose|convert|copy|concatenate|slice|scatter|gather|select|broadcast"),
)


def newest_trace(log_dir: Path) -> Path:
    traces = sorted(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"{log_dir}: no plugins/profile/*/*.trace.json.gz (did the trace stop?)")
    return traces[-1]


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def busiest_stream_idle(kernels: list, stream_of, steps: int, min_us: float = 300.0, top: int = 8) -> dict:
    """Idle time of the busiest stream (the compute stream) between consecutive kernels, in gaps of at least
    `min_us`: total ms per step and the largest groups by (kernel before, kernel after) name, each with the
    events of other streams that ended last within its gaps (name, HLO op, duration; the three most common).
    A gap that repeats once per layer marks the compute stream waiting on something else (e.g. a host copy's
    end)."""
    if not kernels:
        return {}
    busy = collections.Counter()
    for e in kernels:
        busy[stream_of(e)] += e["dur"]
    stream = busy.most_common(1)[0][0]
    ordered = sorted((e for e in kernels if stream_of(e) == stream), key=lambda e: e["ts"])
    # what ended on the other streams during each gap, the latest first: the likely thing waited for
    others = sorted((e for e in kernels if stream_of(e) != stream), key=lambda e: e["ts"] + e["dur"])
    other_ends = [e["ts"] + e["dur"] for e in others]
    groups: dict[tuple, list] = collections.defaultdict(lambda: [0.0, 0, collections.Counter()])
    for before, after in zip(ordered, ordered[1:]):
        start = before["ts"] + before["dur"]
        gap = after["ts"] - start
        if gap >= min_us:
            entry = groups[(before["name"][:60], after["name"][:60])]
            entry[0] += gap
            entry[1] += 1
            i = bisect.bisect_right(other_ends, after["ts"] + 20.0) - 1  # 20 us: the launch after an event
            if i >= 0 and other_ends[i] >= start:
                last = others[i]
                op = (last.get("args") or {}).get("hlo_op") or ""
                entry[2][" ".join(filter(None, (last["name"][:40], op[:60], f"({last['dur'] / 1e3:.2f} ms)")))] += 1
            else:
                entry[2]["nothing"] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"stream": stream, "min_gap_us": min_us,
            "idle_ms_per_step": round(sum(us for us, _, _ in groups.values()) / 1e3 / steps, 2),
            "largest": [{"before": b, "after": a, "ms_per_step": round(us / 1e3 / steps, 2),
                         "gaps_per_step": n / steps, "ended_last_elsewhere": dict(ended.most_common(3))}
                        for (b, a), (us, n, ended) in ranked[:top]]}


def summarize(trace_file: Path, steps: int = 1, top: int = 40) -> dict:
    """Per-step milliseconds by category and by kernel name for the GPU processes of `trace_file`."""
    with gzip.open(trace_file, "rt") as fp:
        events = json.load(fp)["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in process.items() if "GPU" in name or "gpu" in name}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, None])  # name -> [us, calls, hlo op]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    def stream_of(e):
        return threads.get((e["pid"], e.get("tid")), str(e.get("tid")))

    by_stream: dict[str, float] = collections.defaultdict(float)
    for e in kernels:
        by_stream[stream_of(e)] += e["dur"]
        entry = by_name[e["name"]]
        entry[0] += e["dur"]
        entry[1] += 1
        args = e.get("args") or {}
        entry[2] = entry[2] or args.get("hlo_op") or args.get("long_name")
    by_cat: dict[str, float] = collections.defaultdict(float)
    for name, (us, _, _) in by_name.items():
        by_cat[category(name)] += us
    busy_us = sum(by_cat.values())
    span_us = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {
        "trace": str(trace_file), "steps": steps, "gpu_processes": sorted(process[p] for p in gpu_pids),
        "kernel_events": len(kernels),
        "busy_ms_per_step": round(busy_us / 1e3 / steps, 2),
        "span_ms_per_step": round(span_us / 1e3 / steps, 2),
        # streams run concurrently (copies beside compute), so busy_ms can exceed the step time
        "ms_per_step_by_stream": {k: round(t / 1e3 / steps, 2) for k, t in sorted(by_stream.items(), key=lambda x: -x[1])},
        "ms_per_step_by_category": {c: round(t / 1e3 / steps, 2) for c, t in sorted(by_cat.items(), key=lambda x: -x[1])},
        "busiest_stream_idle": busiest_stream_idle(kernels, stream_of, steps),
        "top_kernels": [{"name": n[:120], "ms_per_step": round(t / 1e3 / steps, 3), "calls_per_step": c / steps,
                         "category": category(n), "hlo_op": (op or "")[:80]} for n, (t, c, op) in ranked[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log_dir")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    print(json.dumps(summarize(newest_trace(Path(a.log_dir)), a.steps, a.top)))


if __name__ == "__main__":
    main()
