"""Time the fused GLU + e4m3 row quantization kernel (pallas_kernels.glu_fp8) against XLA's fusion of the same
math (reference.swiglu, then pallas_kernels.fp8's row quantization), at Llama-3-8B's MLP shape.

    python bench/glu_fp8_bench.py            # M=4096 tokens, F=14336, D=4096, bf16 (about 1 minute on an H200)
    python bench/glu_fp8_bench.py --sweep    # + the kernel's block configs (one pass vs two passes)
    python bench/glu_fp8_bench.py --tiny     # tiny shapes, runs anywhere (CPU interpret mode)

One JSON line per measurement: name, impl ("pallas" | "xla"), shape [M, F, D], dtype, ms, gbps, config,
jax_version, device. Names:
- quantize: gate, up -> hq, sx (with_h=false: down_proj without LoRA) or hq, sx, h (with_h=true: the LoRA case);
  gbps counts the logical bytes (gate and up read once, the outputs written once);
- down_fwd: gate, up -> the FP8 down_proj output (+ h for with_h): the kernel and fp8_matmul_quantized, vs
  fp8_matmul(swiglu(gate, up)), where XLA may fuse the GLU into the quantization;
- down_fwdbwd: y and d gate, d up of sum(y * ct) through the down projection and a LoRA use of h (h @ b),
  the model's shape of the op in a step (the GLU backward as the model runs it by default: XLA).
The in-step A/B that decides the op's default is bench/gpu_session.sh's speed stage (see BENCHMARKS.md).
Off the GPU the kernel runs in interpret mode (interpret=None), so --tiny only checks that the script runs.
Timing: bench/timing.py (K calls on K distinct input copies inside one jitted program, median / K).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import device_ms  # noqa: E402
from pallas_kernels import fp8, reference  # noqa: E402
from pallas_kernels.glu_fp8 import GluFp8Config, config, glu_fp8_matmul, glu_quantize  # noqa: E402

DEVICE = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"
SWEEP = [GluFp8Config(1, 16384, 16), GluFp8Config(1, 16384, 32), GluFp8Config(2, 16384, 32),
         GluFp8Config(1, 8192, 16), GluFp8Config(1, 4096, 8), GluFp8Config(2, 4096, 16),
         GluFp8Config(1, 2048, 4), GluFp8Config(4, 2048, 16)]


def _xla_quantize(with_h):
    def run(g, u):
        h = reference.swiglu(g, u)
        hq, sx = fp8.quantize_rows(h, fp8.E4M3)
        return (hq, sx, h) if with_h else (hq, sx)
    return run


def _pallas_quantize(with_h, cfg):
    def run(g, u):
        hq, sx, h = glu_quantize(g, u, with_h=with_h, interpret=None, cfg=cfg)
        return (hq, sx, h) if with_h else (hq, sx)
    return run


def _down(impl, with_h, cfg):
    def run(g, u, w, b):
        if impl == "pallas":
            out = glu_fp8_matmul(g, u, w, with_h=with_h, interpret=None, cfg=cfg)
            y, h = out if with_h else (out, None)
        else:
            h = reference.swiglu(g, u)
            y = fp8.fp8_matmul(h, w)
        return y + (h @ b.astype(h.dtype)) if with_h else y
    return run


def _fwdbwd(fn):
    def run(g, u, w, b, ct):
        y, vjp = jax.vjp(lambda g_, u_: fn(g_, u_, w, b), g, u)
        return y, vjp(ct.astype(y.dtype))
    return run


def _emit(name, impl, shape, dtype, ms, nbytes, cfg, with_h):
    print(json.dumps({"name": name, "impl": impl, "with_h": with_h, "shape": list(shape),
                      "dtype": jnp.dtype(dtype).name, "ms": round(ms, 4),
                      "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1) if nbytes else None,
                      "config": None if cfg is None else cfg._asdict(), "jax_version": jax.__version__,
                      "device": DEVICE}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, interpret mode)")
    p.add_argument("--sweep", action="store_true", help="also time every config in SWEEP (quantize only)")
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--f", type=int, default=14336)
    p.add_argument("--d", type=int, default=4096)
    args = p.parse_args(argv)
    m, f, d = (64, 200, 32) if args.tiny else (args.m, args.f, args.d)
    timing = dict(runs=2, max_copies=2, min_bytes=0) if args.tiny else {}
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal((m, f)) * 2, dtype)
    u = jnp.asarray(rng.standard_normal((m, f)), dtype)
    w = fp8.quantize_fp8_weight(jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(f), jnp.float32))
    b = jnp.asarray(rng.standard_normal((f, 16)) * 0.01, jnp.float32) @ jnp.asarray(
        rng.standard_normal((16, d)), jnp.float32)  # a rank-16 LoRA's combined factor stand-in, [F, D]
    ct = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    shape = (m, f, d)
    default = config(m, f)
    cfgs = [default] + ([c for c in SWEEP if c != default] if args.sweep and not args.tiny else [])

    for with_h in (False, True):
        nbytes = m * f * (2 + 2 + 1 + (2 if with_h else 0)) + m * 4
        ms = device_ms(_xla_quantize(with_h), g, u, **timing)
        _emit("quantize", "xla", shape, dtype, ms, nbytes, None, with_h)
        for cfg in cfgs:
            ms = device_ms(_pallas_quantize(with_h, cfg), g, u, **timing)
            _emit("quantize", "pallas", shape, dtype, ms, nbytes, cfg, with_h)
    for with_h in (False, True):
        for impl in ("xla", "pallas"):
            cfg = default if impl == "pallas" else None
            ms = device_ms(_down(impl, with_h, default), g, u, w, b, **timing)
            _emit("down_fwd", impl, shape, dtype, ms, None, cfg, with_h)
    for impl in ("xla", "pallas"):
        cfg = default if impl == "pallas" else None
        ms = device_ms(_fwdbwd(_down(impl, True, default)), g, u, w, b, ct, **timing)
        _emit("down_fwdbwd", impl, shape, dtype, ms, None, cfg, True)


if __name__ == "__main__":
    main()
