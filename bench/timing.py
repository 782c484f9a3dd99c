"""One timing method for every benchmark in bench/.

`device_ms(fn, *args)` is the median time of one call of `fn(*args)` as the GPU sees it inside a program:
K calls of fn on K distinct copies of the arguments are traced into ONE jitted program, and its wall time
(after compile and warm-up, `jax.block_until_ready`) is divided by K. This

- takes Python dispatch and the per-executable launch cost out of short kernels (tens of microseconds,
  where a host loop over jitted calls measures the host, not the kernel);
- rotates among K buffers, so an input that fits in the H200's 60 MB L2 is not served from the cache on
  the second call (K copies together are at least `min_bytes` when memory allows);
- leaves the launch gaps between kernels inside one program in, as they are inside a train step.

K is chosen so one execution takes about `target_ms` (5 ms, up to 64 copies, so the host's dispatch of the
program is a small share of a 30 us kernel's time). XLA would fuse the K independent copies of a cheap
reference into one kernel (horizontal fusion) unless kept apart; each call's arguments are therefore tied to
the previous call's output by an optimization barrier (no runtime cost), so every copy is timed as it would
run alone.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def _nbytes(tree) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(tree))


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, tree)


def _wall_ms(f: Callable, args, runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _chained_calls(fn: Callable, sets_):
    """fn on each argument set in turn; set i+1 is tied to call i's output by an optimization barrier, so XLA
    cannot merge the K independent copies of a cheap function into one kernel (horizontal fusion), which
    would time K calls as one and favour XLA over a Pallas custom call, which it never merges."""
    outs, prev = [], None
    for s in sets_:
        if prev is not None:
            s, _ = jax.lax.optimization_barrier((s, prev))
        prev = fn(*s)
        outs.append(prev)
    return outs


def device_ms(fn: Callable, *args: Any, runs: int = 20, target_ms: float = 5.0, max_copies: int = 64,
              min_bytes: int = 256 << 20, max_bytes: int = 16 << 30) -> float:
    """Median milliseconds of one `fn(*args)` call inside a jitted program (see the module docstring)."""
    single = jax.jit(fn)
    jax.block_until_ready(single(*args))  # compile
    t1 = _wall_ms(single, args, 3)
    size = max(1, _nbytes(args))
    k = max(math.ceil(target_ms / max(t1, 1e-3)), math.ceil(min_bytes / size))
    k = int(max(1, min(k, max_copies, max(1, max_bytes // size))))
    sets = [args] + [_copy(args) for _ in range(k - 1)]
    multi = jax.jit(lambda sets_: _chained_calls(fn, sets_))
    jax.block_until_ready(multi(sets))  # compile
    jax.block_until_ready(multi(sets))  # warm-up
    return _wall_ms(multi, (sets,), runs) / k


def _memory_analysis(fn: Callable, args) -> Any:
    """XLA's memory analysis of the compiled single-call program, or None where the backend has none."""
    try:
        return jax.jit(fn).lower(*args).compile().memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def peak_bytes(fn: Callable, *args: Any) -> int | None:
    """Arguments + outputs + temporaries of the compiled single-call program (XLA's memory analysis)."""
    m = _memory_analysis(fn, args)
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - getattr(m, "alias_size_in_bytes", 0))


def temp_bytes(fn: Callable, *args: Any) -> int | None:
    """Temporary bytes of the compiled single-call program (XLA's memory analysis)."""
    m = _memory_analysis(fn, args)
    return None if m is None else int(m.temp_size_in_bytes)


def emit(**record) -> None:
    """Print one benchmark measurement as a JSON line, with the jax version and the device kind."""
    dev = jax.devices()[0]
    record.setdefault("jax_version", jax.__version__)
    record.setdefault("device", getattr(dev, "device_kind", str(dev)))
    print(json.dumps(record), flush=True)
