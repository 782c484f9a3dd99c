#!/usr/bin/env python
"""Benchmark pallas_kernels.grouped_matmul against jax.lax.ragged_dot (XLA) at the Qwen3-30B-A3B expert shapes.

Prints one JSON line per measurement (keys: name, shape [N, K, M, E], dtype, impl, what, ms, tflops, mfu,
config, jax_version, device). Timing: bench/timing.py's device_ms (median, K copies in one program).

  python bench/grouped_matmul_bench.py            # N in 8192, 65536; gate_up and down; fwd, fwd_dx, fwd_dx_dw
  python bench/grouped_matmul_bench.py --sweep    # also: block configs of the fwd and dX kernels at N=65536
  python bench/grouped_matmul_bench.py --tiny     # toy shapes, interpret mode: checks the script on the CPU

what: "fwd" = y; "fwd_dx" = y and dX (frozen w: the MoE LoRA case); "fwd_dx_dw" = y, dX and dW. tflops counts
the useful work, 2*N*K*M per product (1, 2 or 3 products); mfu is tflops over the H200's 989 dense bf16
TFLOP/s. Group sizes: multinomial over E equally likely experts (8192 tokens x top-8 routing at N = 65536).
impl "xla_ragged_dot" is jax.lax.ragged_dot (XLA's dense GPU rewrite); a failure (out of memory) is printed
as an "error" line, and the run goes on. Sweep lines are named "grouped_matmul_sweep.<kernel>", the best of
each shape and kernel "grouped_matmul_sweep_best.<kernel>".
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.kernels_matmul import emit  # noqa: E402  (one JSON line, with jax version and device)
from bench.timing import device_ms  # noqa: E402
import pallas_kernels.reference as reference  # noqa: E402
from pallas_kernels.grouped_matmul import GmmConfig, grouped_matmul  # noqa: E402

PEAK_FLOPS = 989e12
E = 128
PROJECTIONS = [("gate_up", 2048, 1536), ("down", 768, 2048)]   # (name, K, M) of Qwen3-30B-A3B's experts
ROWS = (8192, 65536)
TINY = dict(rows=(256,), projections=[("tiny", 64, 48)], experts=8)
N_PRODUCTS = {"fwd": 1, "fwd_dx": 2, "fwd_dx_dw": 3}


def _sweep_configs(tiny: bool):
    if tiny:
        return [GmmConfig(block_m=16, block_n=16, block_k=16, num_warps=4), GmmConfig(block_m=32, block_n=16,
                                                                                      block_k=16)]
    out = [GmmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=3)
           for bm, bn, bk, nw in itertools.product((64, 128), (128, 256), (32, 64), (4, 8))]
    out.append(GmmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3))
    out += [GmmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=s) for s in (2, 4)]
    return out


def _inputs(n, k, m, e, dtype, seed):
    rng = np.random.default_rng(seed)
    gs = jnp.asarray(rng.multinomial(n, np.full(e, 1.0 / e)), jnp.int32)
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(ks[0], (n, k), dtype)
    w = (jax.random.normal(ks[1], (e, k, m), jnp.float32) / k ** 0.5).astype(dtype)
    dy = jax.random.normal(ks[2], (n, m), dtype)
    return x, w, gs, dy


def _fns(impl: str, config: GmmConfig | None, interpret):
    """(what -> fn(x, w, gs, dy)) for one implementation."""
    if impl == "pallas":
        def mm(x, w, gs):
            return grouped_matmul(x, w, gs, config=config, interpret=interpret)
    else:
        mm = reference.grouped_matmul

    def fwd(x, w, gs, dy):
        return mm(x, w, gs)

    def fwd_dx(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x_: mm(x_, w, gs), x)
        return y, vjp(dy)[0]

    def fwd_dx_dw(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x_, w_: mm(x_, w_, gs), x, w)
        return y, *vjp(dy)

    return {"fwd": fwd, "fwd_dx": fwd_dx, "fwd_dx_dw": fwd_dx_dw}


def _record(name, impl, what, shape, dtype, ms, config=None):
    n, k, m, _ = shape
    flops = 2.0 * n * k * m * N_PRODUCTS.get(what, 1)
    tflops = flops / (ms * 1e-3) / 1e12
    emit(name=name, shape=list(shape), dtype=jnp.dtype(dtype).name, impl=impl, what=what, ms=round(ms, 4),
         tflops=round(tflops, 2), mfu=round(tflops * 1e12 / PEAK_FLOPS, 4),
         config=None if config is None else dataclasses.asdict(config))


def _time(fn, args, timing):
    return device_ms(fn, *args, **timing)


def bench(rows, projections, e, dtype, timing, interpret, whats, skip_xla):
    for n, (proj, k, m) in itertools.product(rows, projections):
        args = _inputs(n, k, m, e, dtype, seed=0)
        shape = (n, k, m, e)
        for impl in (("pallas",) if skip_xla else ("pallas", "xla_ragged_dot")):
            fns = _fns(impl, None, interpret)
            for what in whats:
                name = f"grouped_matmul.{proj}"
                try:
                    _record(name, impl, what, shape, dtype, _time(fns[what], args, timing))
                except Exception as exc:  # noqa: BLE001 - XLA's dense rewrite can run out of memory
                    emit(name=name, shape=list(shape), dtype=jnp.dtype(dtype).name, impl=impl, what=what,
                         error=f"{type(exc).__name__}: {str(exc)[:300]}")
        del args


def sweep(rows, projections, e, dtype, timing, interpret, configs):
    """Times the fwd kernel (x @ w[e]) and the dX kernel (dy @ w[e]^T, transpose_rhs) for each config."""
    for n, (proj, k, m) in itertools.product(rows, projections):
        x, w, gs, dy = _inputs(n, k, m, e, dtype, seed=0)
        shape = (n, k, m, e)
        for kernel, args, flops_shape in (("fwd", (x, w, gs), shape), ("dx", (dy, w, gs), shape)):
            best = None
            for cfg in configs:
                def fn(a, b, g, cfg=cfg, t=kernel == "dx"):
                    return grouped_matmul(a, b, g, transpose_rhs=t, config=cfg, interpret=interpret)
                name = f"grouped_matmul_sweep.{kernel}.{proj}"
                try:
                    ms = _time(fn, args, timing)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit shared memory, etc.
                    emit(name=name, shape=list(shape), config=dataclasses.asdict(cfg),
                         error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    continue
                _record(name, "pallas", kernel, flops_shape, dtype, ms, cfg)
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            if best is not None:
                _record(f"grouped_matmul_sweep_best.{kernel}.{proj}", "pallas", kernel, flops_shape, dtype, *best)
        del x, w, gs, dy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy shapes in interpret mode (CPU check of the script)")
    ap.add_argument("--sweep", action="store_true", help="also sweep block configs at the largest N")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep")
    ap.add_argument("--skip-xla", action="store_true", help="do not time jax.lax.ragged_dot")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per measurement (median)")
    a = ap.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    if a.tiny:
        rows, projections, e = TINY["rows"], TINY["projections"], TINY["experts"]
        timing = dict(runs=2, max_copies=2)
        interpret = True
    else:
        rows, projections, e = ROWS, PROJECTIONS, E
        timing = dict(runs=a.runs)
        interpret = None
    if not a.sweep_only:
        bench(rows, projections, e, dtype, timing, interpret, list(N_PRODUCTS), a.skip_xla)
    if a.sweep or a.sweep_only:
        sweep_timing = dict(timing, runs=min(timing["runs"], 10))
        sweep(rows[-1:], projections, e, dtype, sweep_timing, interpret, _sweep_configs(a.tiny))


if __name__ == "__main__":
    main()
