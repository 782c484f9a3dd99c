#!/usr/bin/env python
"""decode_linear's block configs timed the way the engine runs them: every layer of a stack in turn.

One jitted program calls `stacked_linear(x, w, layer)` for each of the L layers of a [L, K, N] stack (the layer
an int32 operand, as in the engine's decode step, LoRA r=16 fused), `--repeats` times over, each call tied to
the previous one's output by an optimization barrier; ms per call = wall time / (L * repeats). The program
takes five arrays, so host dispatch is amortized over hundreds of kernels (bench/timing.device_ms passes K
copies of every argument, whose dispatch dominated small shapes). Beside it: XLA on per-layer weights (the
engine's "copy"/"merged" layout, LoRA as XLA ops), the same chain.

Prints one JSON line per (shape, M, config): name "decode_linear_chain", model, proj, M, K, N, L, impl
("xla_layers", "pallas_default", "pallas"), config, us_per_call, weight_tbs (one layer's bytes per call time);
then a "best" line per shape. Shapes run in the order given, under a total time budget.

  python bench/decode_linear_chain.py --models qwen2-1.5b --m 16 --budget-s 200
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.timing import emit  # noqa: E402
from pallas_kernels.decode_linear import (DecodeConfig, pick_config, resolve_config, rows_bucket,  # noqa: E402
                                          stacked_linear)

SHAPES = [  # (model, projection, K, N, layers)
    ("qwen2-1.5b", "gate_up", 1536, 8960, 28),
    ("qwen2-1.5b", "down", 8960, 1536, 28),
    ("qwen2-1.5b", "q_o", 1536, 1536, 28),
    ("qwen2-1.5b", "k_v", 1536, 256, 28),
    ("llama-3-8b", "gate_up", 4096, 14336, 32),
    ("llama-3-8b", "down", 14336, 4096, 32),
    ("llama-3-8b", "q_o", 4096, 4096, 32),
    ("llama-3-8b", "k_v", 4096, 1024, 32),
]
RANK = 16
SCALE = 2.0
DTYPE = jnp.bfloat16
INTERPRET = False  # the CPU smoke test (tests/test_bench_data.py-style checks) sets it


def _inputs(m, k, n, L, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (m, k), DTYPE)
    w = (jax.random.normal(ks[1], (L, k, n), jnp.float32) / k ** 0.5).astype(DTYPE)
    a = (jax.random.normal(ks[2], (L, k, RANK), jnp.float32) / k ** 0.5).astype(DTYPE)
    b = (0.01 * jax.random.normal(ks[3], (L, RANK, n), jnp.float32)).astype(DTYPE)
    return x, w, a, b


def _chain(call, L, repeats):
    """fn(x, w, a, b) running call(x, w, a, b, i) for i over the layers, `repeats` times, chained; every call's
    output is returned, so none can be dropped as dead code (a first version summed one element per repeat and
    timed a 27.5 MB read at 2.4 us, faster than HBM allows: calls had been removed)."""
    def fn(x, w, a, b):
        prev, outs = None, []
        for _ in range(repeats):
            for i in range(L):
                if prev is not None:
                    x, _ = jax.lax.optimization_barrier((x, prev))
                prev = call(x, w, a, b, i)
                outs.append(prev)
        return outs
    return jax.jit(fn)


def _time_us(fn, args, calls, runs=7):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] / calls * 1e6


def _candidates(m, k, n):
    """Configs worth timing: block_n x block_k x splits x warps with about 100-1,100 programs and >= 2 K steps
    per split (the default rule's config comes first, as None)."""
    out = [None]
    for bn, bk, s, nw in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8, 16), (4, 8)):
        if bn > max(32, n) or bk > max(64, k):
            continue
        steps = -(-k // bk)
        programs = -(-n // bn) * s * -(-m // 128)
        if not 64 <= programs <= 1100 or steps // s < 2:
            continue
        out.append(DecodeConfig(block_m=16, block_n=bn, block_k=bk, splits=s, num_warps=nw, num_stages=4))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen2-1.5b,llama-3-8b")
    p.add_argument("--proj", default="")
    p.add_argument("--m", default="16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--write-best", metavar="FILE", help="write each shape's best config as JSON (generate_bench.py "
                   "--decode-configs reads it)")
    args = p.parse_args(argv)
    best_by_shape = {}
    models, projs = set(args.models.split(",")), set(filter(None, args.proj.split(",")))
    t_end = time.time() + args.budget_s
    for (model, proj, k, n, L), m in itertools.product(SHAPES, [int(v) for v in args.m.split(",")]):
        if model not in models or (projs and proj not in projs):
            continue
        if time.time() > t_end:
            emit(name="decode_linear_chain", note="time budget reached; later shapes not timed")
            return
        x, w, a, b = _inputs(m, k, n, L)
        calls = L * args.repeats
        base = dict(name="decode_linear_chain", model=model, proj=proj, M=m, K=k, N=n, L=L, r=RANK)
        layers = tuple(jnp.array(w[i], copy=True) for i in range(L))   # the engine's per-layer layout

        def xla_call(x, layers_, a, b, i):
            y = jnp.dot(x, layers_[i], preferred_element_type=jnp.float32)
            y = y + SCALE * jnp.dot(jnp.dot(x, a[i]), b[i], preferred_element_type=jnp.float32)
            return y.astype(x.dtype)

        us = _time_us(_chain(xla_call, L, args.repeats), (x, layers, a, b), calls)
        emit(**base, impl="xla_layers", us_per_call=round(us, 2), weight_tbs=round(k * n * 2 / us / 1e6, 3))
        del layers
        best = None
        seen = set()
        for cand in _candidates(m, k, n):
            if time.time() > t_end:
                break
            cfg = resolve_config(cand or pick_config(m, k, n, DTYPE, RANK), m, k, n, DTYPE, RANK,
                                 auto_shrink=cand is None)
            if cfg in seen:
                continue
            seen.add(cfg)

            def call(x, w_, a, b, i, cfg=cfg):
                return stacked_linear(x, w_, jnp.int32(i), lora_a=a[i], lora_b=b[i], lora_scale=SCALE, config=cfg,
                                      interpret=INTERPRET)
            try:
                us = _time_us(_chain(call, L, args.repeats), (x, w, a, b), calls)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report and go on
                emit(**base, impl="pallas", config=dataclasses.asdict(cfg), error=f"{type(e).__name__}: {e}"[:200])
                continue
            impl = "pallas_default" if cand is None else "pallas"
            emit(**base, impl=impl, config=dataclasses.asdict(cfg), us_per_call=round(us, 2),
                 weight_tbs=round(k * n * 2 / us / 1e6, 3))
            if best is None or us < best[0]:
                best = (us, cfg)
        if best is not None:
            emit(**base, impl="pallas_best", config=dataclasses.asdict(best[1]), us_per_call=round(best[0], 2),
                 weight_tbs=round(k * n * 2 / best[0] / 1e6, 3))
            best_by_shape[f"{rows_bucket(m)},{k},{n}"] = dataclasses.asdict(best[1])
            if args.write_best:
                with open(args.write_best, "w") as f:
                    json.dump(best_by_shape, f, indent=1)


if __name__ == "__main__":
    main()
