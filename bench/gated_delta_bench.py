#!/usr/bin/env python
"""Benchmark the gated delta rule (Qwen3.5's linear attention), forward + backward, at Qwen3.5's shape: the Pallas
path (pallas_kernels.gated_delta_state: chunk-local terms in XLA, the state pass over the chunks in Pallas), the
chunked XLA form (pallas_kernels.gated_delta_chunked, ops' default) and the token-by-token scan
(pallas_kernels.reference).

Prints one JSON line per implementation (keys: name, impl, shape [B, T, Hk, Hv, Dk, Dv], dtype, what, ms,
peak_bytes, jax_version, device). Each implementation runs in its own process with
XLA_PYTHON_CLIENT_PREALLOCATE=false, so peak_bytes (memory_stats()["peak_bytes_in_use"] after one call, before the
timing makes copies of the inputs) is that implementation's alone; null where the backend reports none (CPU).
Timing: bench/timing.py's device_ms (median). A failure (out of memory, say) is printed as an "error" line.

  python bench/gated_delta_bench.py             # B=4, T=2048, Hk=16, Hv=32, Dk=Dv=128, bf16 inputs
  python bench/gated_delta_bench.py --tiny      # toy shape, interpret mode: checks the script on the CPU
  python bench/gated_delta_bench.py --impl xla_chunked  # one implementation in this process (what the runs above spawn)
  python bench/gated_delta_bench.py --sweep     # also the Pallas path's (chunk, block_v, num_warps), gated_delta_sweep
  python bench/gated_delta_bench.py --parts     # also the Pallas path's two parts alone, name gated_delta_part:
                                                # part "chunk_terms" (XLA) and "state_pass" (the kernels)

what: "fwd_bwd" = o and the gradients of q, k, v, g and beta for a random cotangent of o (no initial state, the
final state unused: a training step's call).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402

IMPLS = ("pallas", "xla_chunked", "xla_token_scan")
# the Pallas path's (chunk, block_v, num_warps); (64, 128) is at the edge of an H100's shared memory
SWEEP = ((64, 64, 8), (64, 64, 4), (64, 32, 8), (64, 32, 4), (64, 128, 8), (32, 128, 8), (32, 64, 8), (32, 32, 4))
SHAPE = dict(b=4, t=2048, hk=16, hv=32, dk=128, dv=128)
TINY = dict(b=1, t=40, hk=1, hv=2, dk=16, dv=16)


def _inputs(shape, dtype):
    import jax
    import jax.numpy as jnp

    b, t, hk, hv, dk, dv = (shape[n] for n in ("b", "t", "hk", "hv", "dk", "dv"))
    ks = jax.random.split(jax.random.PRNGKey(0), 6)

    def unit(key, s):
        x = jax.random.normal(key, s, jnp.float32)
        return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

    q, k = unit(ks[0], (b, t, hk, dk)), unit(ks[1], (b, t, hk, dk))
    v = jax.random.normal(ks[2], (b, t, hv, dv), jnp.float32).astype(dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, hv), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, hv), jnp.float32))
    do = jax.random.normal(ks[5], (b, t, hv, dv), jnp.float32).astype(dtype)
    return q, k, v, g, beta, do


def _fn(impl: str, scale: float, interpret, chunk=None, block_v=None, num_warps=None):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import reference
    from pallas_kernels.gated_delta_state import gated_delta_rule as kernel
    from pallas_kernels.gated_delta_chunked import chunked_gated_delta_rule

    rule = {"pallas": lambda *a: kernel(*a, scale=scale, chunk=chunk, block_v=block_v, num_warps=num_warps,
                                        interpret=interpret),
            "xla_chunked": lambda *a: chunked_gated_delta_rule(*a, scale=scale),
            "xla_token_scan": lambda *a: reference.gated_delta_rule(*a, scale=scale)}[impl]

    def fwd_bwd(q, k, v, g, beta, do):
        (o, final), vjp = jax.vjp(rule, q, k, v, g, beta)
        return o, vjp((do, jnp.zeros_like(final)))

    return fwd_bwd


def _parts(shape, dtype, args, chunk: int, block_v: int, interpret):
    """{part: fwd_bwd fn, its arguments} for the Pallas path's two parts at the default tiles: chunk_terms (XLA; a
    cotangent of ones for each term) and state_pass (the kernels, on precomputed terms; o's cotangent do)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels.gated_delta_chunked import chunk_terms
    from pallas_kernels.gated_delta_state import state_pass

    q, k, v, g, beta, do = args
    prec = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    terms_fn = jax.jit(lambda *a: chunk_terms(*a, scale=shape["dk"] ** -0.5, chunk=chunk, precision=prec))

    def terms_fwd_bwd(*a):
        terms, vjp = jax.vjp(terms_fn, *a)
        return terms, vjp(jax.tree.map(jnp.ones_like, terms))

    terms = terms_fn(q, k, v, g, beta)
    b, hv, n = terms[0].shape[:3]
    s0 = jnp.zeros((b, hv, shape["dk"], shape["dv"]), jnp.float32)
    do = jnp.pad(do, ((0, 0), (0, n * chunk - do.shape[1]), (0, 0), (0, 0)))

    def pass_fwd_bwd(*a):
        rule = lambda *x: state_pass(*x, out_dtype=dtype, block_v=block_v, interpret=interpret)  # noqa: E731
        (o, final), vjp = jax.vjp(rule, *a[:-1])
        return o, vjp((a[-1], jnp.zeros_like(final)))

    return {"chunk_terms": (terms_fwd_bwd, (q, k, v, g, beta)), "state_pass": (pass_fwd_bwd, (*terms, s0, do))}


def run_one(impl: str, tiny: bool, dtype_name: str, runs: int, sweep: bool, parts: bool = False) -> None:
    import jax
    import jax.numpy as jnp

    from bench.timing import device_ms, emit

    shape = TINY if tiny else SHAPE
    dtype = jnp.dtype(dtype_name)
    record = dict(name="gated_delta", impl=impl, shape=[shape[n] for n in ("b", "t", "hk", "hv", "dk", "dv")],
                  dtype=dtype.name, what="fwd_bwd")
    if impl == "pallas":  # the default tiles this shape gets
        from pallas_kernels._common import next_pow2
        from pallas_kernels.gated_delta_state import default_tiles

        pad = lambda d: max(16, next_pow2(d))  # noqa: E731
        chunk, block_v = default_tiles(shape["t"], pad(shape["dk"]), pad(shape["dv"]), dtype == jnp.float32)
        record["config"] = dict(chunk=chunk, block_v=block_v)
    try:
        args = _inputs(shape, dtype)
        fn = _fn(impl, shape["dk"] ** -0.5, True if tiny else None)
        jax.block_until_ready(jax.jit(fn)(*args))
        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        timing = dict(runs=2, max_copies=1) if tiny else dict(runs=runs)
        ms = device_ms(fn, *args, **timing)
    except Exception as exc:  # noqa: BLE001 - out of memory, a compile failure: report it and go on
        emit(**record, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return
    emit(**record, ms=round(ms, 4), peak_bytes=peak)
    if parts and impl == "pallas":
        try:
            for part, (fn, part_args) in _parts(shape, dtype, args, record["config"]["chunk"],
                                                record["config"]["block_v"], True if tiny else None).items():
                emit(**dict(record, name="gated_delta_part", part=part), ms=round(device_ms(fn, *part_args, **timing), 4))
        except Exception as exc:  # noqa: BLE001 - report it and go on to the sweep
            emit(**dict(record, name="gated_delta_part"), error=f"{type(exc).__name__}: {str(exc)[:300]}")
    if not (sweep and impl == "pallas"):
        return
    for chunk, block_v, num_warps in ((16, 16, 4), (32, 16, 4)) if tiny else SWEEP:
        config = dict(chunk=chunk, block_v=block_v, num_warps=num_warps)
        try:
            ms = device_ms(_fn(impl, shape["dk"] ** -0.5, True if tiny else None, chunk, block_v, num_warps), *args,
                           **timing)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile: report it and go on
            emit(**dict(record, name="gated_delta_sweep", config=config),
                 error=f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        emit(**dict(record, name="gated_delta_sweep", config=config), ms=round(ms, 4))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy shape in interpret mode (CPU check of the script)")
    ap.add_argument("--impl", choices=IMPLS, help="run this implementation here (default: each in its own process)")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of q, k, v (g and beta are float32)")
    ap.add_argument("--runs", type=int, default=10, help="timed runs per measurement (median)")
    ap.add_argument("--sweep", action="store_true", help="also time the Pallas path's (chunk, block_v, num_warps)")
    ap.add_argument("--parts", action="store_true", help="also time the Pallas path's chunk_terms and state_pass")
    a = ap.parse_args(argv)
    if a.impl:
        run_one(a.impl, a.tiny, a.dtype, a.runs, a.sweep, a.parts)
        return
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for impl in IMPLS:
        cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--dtype", a.dtype, "--runs", str(a.runs)]
        cmd += [flag for flag, on in (("--tiny", a.tiny), ("--sweep", a.sweep), ("--parts", a.parts)) if on]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        if run.returncode != 0 or not lines:
            print(json.dumps(dict(name="gated_delta", impl=impl, error=f"exit {run.returncode}: "
                                  f"{run.stderr.strip()[-300:]}")), flush=True)
        for line in lines:
            print(line, flush=True)


if __name__ == "__main__":
    main()
