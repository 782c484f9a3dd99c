#!/usr/bin/env python
"""Benchmark the matmul-shaped kernels against their jitted XLA twins: lora_linear and fused cross-entropy.

Prints one JSON line per measurement (keys: name, shape, dtype, impl, fwd_ms, fwdbwd_ms, tflops, ...,
jax_version, device). Timing: jax.block_until_ready after warm-up, median of --iters runs (>= 20).

  python bench/kernels_matmul.py            # ANCHORS.md shapes (Qwen2-1.5B M=8192, Llama-3-8B M=4096), r=16
  python bench/kernels_matmul.py --quick    # smoke run: two LoRA shapes, one cross-entropy shape
  python bench/kernels_matmul.py --sweep    # try block-size configs, print the best per shape ("*_best")

lora_linear: fwd = y; fwdbwd = y plus dX, dA, dB (w frozen, as in training). tflops counts the useful work:
  fwd 2MKN + 2MKr + 2MrN, bwd 2MNK + 2MNr + 2MrK (dX) + 2MKr (dA) + 2MNr (dB).
cross_entropy: fwd = loss; fwdbwd = loss + d_hidden (frozen head, the LoRA case); "fwdbwd_head_ms" also
  returns d_lm_head. tflops counts 2TVD per product (fwd 1, fwdbwd 2, with head 3); the kernels recompute the
  logits in the backward, which is not counted. impl "xla" is the chunked twin (reference.cross_entropy),
  "xla_naive" the unfused full-logits version. Memory: temp_bytes from the compiled executable's
  memory_analysis (all impls), and peak_bytes = memory_stats()["peak_bytes_in_use"] measured in a fresh
  subprocess per impl (XLA_PYTHON_CLIENT_PREALLOCATE=false), with peak_over_inputs_bytes = peak minus the
  bytes held by the inputs. The target is pallas < 1/8 of xla_naive at V=151936.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.timing import device_ms, emit, temp_bytes  # noqa: E402
import pallas_kernels.reference as reference  # noqa: E402
from pallas_kernels.cross_entropy import cross_entropy, pick_config as ce_pick_config  # noqa: E402
from pallas_kernels.lora_linear import (lora_linear, pick_config as lora_pick_config,  # noqa: E402
                                        shape_class as lora_shape_class)

LORA_SHAPES = [  # (model, M, K, N)
    ("qwen2-1.5b.q_o", 8192, 1536, 1536),
    ("qwen2-1.5b.k_v", 8192, 1536, 256),
    ("qwen2-1.5b.gate_up", 8192, 1536, 8960),
    ("qwen2-1.5b.down", 8192, 8960, 1536),
    ("llama-3-8b.q_o", 4096, 4096, 4096),
    ("llama-3-8b.k_v", 4096, 4096, 1024),
    ("llama-3-8b.gate_up", 4096, 4096, 14336),
    ("llama-3-8b.down", 4096, 14336, 4096),
]
LORA_QUICK = [LORA_SHAPES[2], LORA_SHAPES[6]]
CE_SHAPES = [  # (model, T, D, V, softcap)
    ("qwen2-1.5b", 8192, 1536, 151936, None),
    ("llama-3-8b", 4096, 4096, 128256, None),
    ("gemma-2-2b", 8192, 2304, 256000, 30.0),
]
CE_QUICK = [CE_SHAPES[0]]




def _tf(flops, ms):
    return None if ms is None else round(flops / (ms * 1e-3) / 1e12, 2)


# ------------------------------------------------------------------------------------------------ lora
def _lora_inputs(m, k, n, r, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (m, k), dtype)
    w = (jax.random.normal(ks[1], (k, n), jnp.float32) / k ** 0.5).astype(dtype)
    a = (jax.random.normal(ks[2], (k, r), jnp.float32) / k ** 0.5).astype(dtype)
    b = (jax.random.normal(ks[3], (r, n), jnp.float32) * 0.01).astype(dtype)
    dy = jax.random.normal(ks[4], (m, n), dtype)
    return x, w, a, b, dy


def _lora_fns(impl, scale, config=None):
    if impl == "pallas":
        def f(x, w, a, b):
            return lora_linear(x, w, a, b, scale, config=config)
    else:
        def f(x, w, a, b):
            return reference.lora_linear(x, w, a, b, scale)

    fwd = jax.jit(f)

    @jax.jit
    def fwdbwd(x, w, a, b, dy):
        y, vjp = jax.vjp(lambda x_, a_, b_: f(x_, w, a_, b_), x, a, b)   # w frozen: no dW
        return y, vjp(dy)
    return fwd, fwdbwd


def _lora_flops(m, k, n, r):
    fwd = 2 * m * k * n + 2 * m * k * r + 2 * m * r * n
    bwd = 2 * m * n * k + 2 * m * n * r + 2 * m * r * k + 2 * m * k * r + 2 * m * r * n
    return fwd, fwd + bwd


def bench_lora(shapes, r, dtype, iters):
    for name, m, k, n in shapes:
        x, w, a, b, dy = _lora_inputs(m, k, n, r, dtype)
        f_fwd, f_all = _lora_flops(m, k, n, r)
        res = {}
        for impl in ("xla", "pallas"):
            fwd, fwdbwd = _lora_fns(impl, 2.0)
            try:
                t_fwd = device_ms(fwd, x, w, a, b, runs=iters)
                t_all = device_ms(fwdbwd, x, w, a, b, dy, runs=iters)
            except Exception as e:  # report and keep going (a failing kernel must not hide the others)
                emit(name=f"lora_linear.{name}", shape=[m, k, n, r], dtype=jnp.dtype(dtype).name, impl=impl,
                     error=f"{type(e).__name__}: {e}"[:500])
                continue
            res[impl] = (t_fwd, t_all)
            extra = {}
            if impl == "pallas" and "xla" in res:
                extra = {"speedup_fwd": round(res["xla"][0] / t_fwd, 3),
                         "speedup_fwdbwd": round(res["xla"][1] / t_all, 3)}
            emit(name=f"lora_linear.{name}", shape=[m, k, n, r], dtype=jnp.dtype(dtype).name, impl=impl,
                 fwd_ms=round(t_fwd, 4), fwdbwd_ms=round(t_all, 4), tflops_fwd=_tf(f_fwd, t_fwd),
                 tflops=_tf(f_all, t_all), **extra)


LORA_FWD_CANDIDATES = [dict(bm=128, bn=128, bk=64, warps=8, stages=3), dict(bm=128, bn=128, bk=64, warps=4, stages=4),
                       dict(bm=128, bn=256, bk=64, warps=8, stages=3), dict(bm=64, bn=128, bk=64, warps=4, stages=4),
                       dict(bm=256, bn=128, bk=64, warps=8, stages=3), dict(bm=128, bn=64, bk=64, warps=4, stages=4)]
# swept in this order on fwd+bwd time, each group starting from the best so far
LORA_BWD_GROUPS = [
    [dict(fuse_xa=True, fuse_g=True), dict(fuse_xa=False, fuse_g=False)],
    [dict(dx_bm=128, dx_bk=128, dx_bn=64, dx_warps=8, dx_stages=3),
     dict(dx_bm=128, dx_bk=128, dx_bn=64, dx_warps=4, dx_stages=4),
     dict(dx_bm=128, dx_bk=256, dx_bn=64, dx_warps=8, dx_stages=3),
     dict(dx_bm=64, dx_bk=128, dx_bn=64, dx_warps=4, dx_stages=4),
     dict(dx_bm=256, dx_bk=128, dx_bn=64, dx_warps=8, dx_stages=3)],
    [dict(red_splits=16, red_bc=128, red_bm=64), dict(red_splits=32, red_bc=64, red_bm=64),
     dict(red_splits=8, red_bc=256, red_bm=32)],
]


def sweep_lora(shapes, r, dtype, iters):
    for name, m, k, n in shapes:
        x, w, a, b, dy = _lora_inputs(m, k, n, r, dtype)
        base = lora_pick_config(m, k, n, r, dtype)

        def run(cfg, what):
            fwd, fwdbwd = _lora_fns("pallas", 2.0, config=cfg)
            try:
                t = (device_ms(fwd, x, w, a, b, runs=iters) if what == "fwd"
                     else device_ms(fwdbwd, x, w, a, b, dy, runs=iters))
            except Exception as e:
                emit(name=f"lora_linear_sweep.{name}", shape=[m, k, n, r], dtype=jnp.dtype(dtype).name,
                     impl="pallas", config=dataclasses.asdict(cfg), error=f"{type(e).__name__}: {e}"[:300])
                return float("inf")
            emit(name=f"lora_linear_sweep.{name}", shape=[m, k, n, r], dtype=jnp.dtype(dtype).name,
                 impl="pallas", config=dataclasses.asdict(cfg), **{f"{what}_ms": round(t, 4)})
            return t

        cands = [dataclasses.replace(base, **c) for c in LORA_FWD_CANDIDATES]
        best = min(((run(c, "fwd"), i) for i, c in enumerate(cands)))[1]
        best = cands[best]
        for group in LORA_BWD_GROUPS:
            cands = [dataclasses.replace(best, **c) for c in group]
            best = cands[min(((run(c, "fwdbwd"), i) for i, c in enumerate(cands)))[1]]
        fwd, fwdbwd = _lora_fns("pallas", 2.0, config=best)
        t_fwd, t_all = device_ms(fwd, x, w, a, b, runs=iters), device_ms(fwdbwd, x, w, a, b, dy, runs=iters)
        xf, xb = _lora_fns("xla", 2.0)
        emit(name=f"lora_linear_best.{name}", shape=[m, k, n, r], dtype=jnp.dtype(dtype).name, impl="pallas",
             key=[lora_shape_class(m, k, n), jnp.dtype(dtype).name, r], config=dataclasses.asdict(best),
             fwd_ms=round(t_fwd, 4), fwdbwd_ms=round(t_all, 4),
             xla_fwd_ms=round(device_ms(xf, x, w, a, b, runs=iters), 4),
             xla_fwdbwd_ms=round(device_ms(xb, x, w, a, b, dy, runs=iters), 4))


# ------------------------------------------------------------------------------------------ cross-entropy
def _ce_inputs(t, d, v, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    h = jax.random.normal(ks[0], (t, d), dtype)
    w = (jax.random.normal(ks[1], (v, d), jnp.float32) * (2.0 / d ** 0.5)).astype(dtype)
    y = jax.random.randint(ks[2], (t,), 0, v, jnp.int32)
    y = jnp.where(jax.random.uniform(ks[2], (t,)) < 0.1, -100, y)   # some ignored tokens
    return h, w, y


def _ce_fn(impl, softcap, config=None):
    if impl == "pallas":
        return lambda h, w, y: cross_entropy(h, w, y, softcap=softcap, config=config)
    if impl == "xla":
        return lambda h, w, y: reference.cross_entropy(h, w, y, softcap=softcap)
    return lambda h, w, y: reference.cross_entropy_naive(h, w, y, softcap=softcap)


def _ce_jits(impl, softcap, config=None):
    f = _ce_fn(impl, softcap, config)
    fwd = jax.jit(f)
    fwdbwd = jax.jit(lambda h, w, y: jax.value_and_grad(lambda h_: f(h_, w, y))(h))
    fwdbwd_head = jax.jit(lambda h, w, y: jax.value_and_grad(f, argnums=(0, 1))(h, w, y))
    return fwd, fwdbwd, fwdbwd_head


def bench_ce(shapes, dtype, iters, impls=("xla", "pallas", "xla_naive"), with_head=True):
    for name, t, d, v, cap in shapes:
        h, w, y = _ce_inputs(t, d, v, dtype)
        res = {}
        for impl in impls:
            fwd, fwdbwd, fwdbwd_head = _ce_jits(impl, cap)
            out = dict(name=f"cross_entropy.{name}", shape=[t, d, v], softcap=cap, dtype=jnp.dtype(dtype).name,
                       impl=impl)
            try:
                out["fwd_ms"] = round(device_ms(fwd, h, w, y, runs=iters), 4)
                out["fwdbwd_ms"] = round(device_ms(fwdbwd, h, w, y, runs=iters), 4)
                out["temp_bytes"] = temp_bytes(fwdbwd, h, w, y)
                if with_head:
                    out["fwdbwd_head_ms"] = round(device_ms(fwdbwd_head, h, w, y, runs=iters), 4)
            except Exception as e:
                out["error"] = f"{type(e).__name__}: {e}"[:500]
                emit(**out)
                continue
            flops = 2 * t * v * d
            out["tflops_fwd"] = _tf(flops, out["fwd_ms"])
            out["tflops"] = _tf(2 * flops, out["fwdbwd_ms"])
            if with_head:
                out["tflops_head"] = _tf(3 * flops, out["fwdbwd_head_ms"])
            res[impl] = out
            if impl == "pallas" and "xla" in res:
                out["speedup_fwd"] = round(res["xla"]["fwd_ms"] / out["fwd_ms"], 3)
                out["speedup_fwdbwd"] = round(res["xla"]["fwdbwd_ms"] / out["fwdbwd_ms"], 3)
                if with_head:
                    out["speedup_fwdbwd_head"] = round(res["xla"]["fwdbwd_head_ms"] / out["fwdbwd_head_ms"], 3)
            emit(**out)


def _memory_child(impl, shape_name, dtype_name):
    """Runs in a fresh process: peak device memory of one fwd+bwd (d_hidden) of one impl."""
    (name, t, d, v, cap), = [s for s in CE_SHAPES if s[0] == shape_name]
    dtype = jnp.dtype(dtype_name)
    h, w, y = _ce_inputs(t, d, v, dtype)
    jax.block_until_ready((h, w, y))
    dev = jax.devices()[0]
    if not dev.memory_stats():
        raise SystemExit(f"memory_stats() unavailable on {dev}")
    base = dev.memory_stats()["peak_bytes_in_use"]
    _, fwdbwd, _ = _ce_jits(impl, cap)
    jax.block_until_ready(fwdbwd(h, w, y))
    peak = dev.memory_stats()["peak_bytes_in_use"]
    emit(name=f"cross_entropy_memory.{name}", shape=[t, d, v], softcap=cap, dtype=dtype_name, impl=impl,
         what="fwd+bwd(d_hidden)", peak_bytes=int(peak), inputs_bytes=int(base),
         peak_over_inputs_bytes=int(peak - base))


def memory_ce(shape_name, dtype_name, impls=("pallas", "xla", "xla_naive")):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = {}
    for impl in impls:
        cmd = [sys.executable, os.path.abspath(__file__), "--_memory-child", impl, shape_name, dtype_name]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not line:
            emit(name=f"cross_entropy_memory.{shape_name}", impl=impl, dtype=dtype_name,
                 error=(p.stderr or p.stdout)[-500:])
            continue
        print(line[-1], flush=True)
        out[impl] = json.loads(line[-1])
    if "pallas" in out and "xla_naive" in out:
        emit(name=f"cross_entropy_memory_ratio.{shape_name}", dtype=dtype_name, impl="pallas",
             pallas_over_naive_peak_increase=round(out["pallas"]["peak_over_inputs_bytes"]
                                                   / max(1, out["xla_naive"]["peak_over_inputs_bytes"]), 4),
             target="< 0.125")


def sweep_ce(shapes, dtype, iters):
    fwd_c = [dict(bt=64, bv=128, bd=64, warps=4, stages=3), dict(bt=128, bv=128, bd=64, warps=8, stages=3),
             dict(bt=64, bv=256, bd=64, warps=8, stages=3), dict(bt=128, bv=64, bd=64, warps=4, stages=4),
             dict(bt=64, bv=128, bd=64, warps=4, stages=3, target_programs=528),
             dict(bt=64, bv=128, bd=64, warps=4, stages=3, target_programs=2112)]
    bwd_c = [dict(bwd_bt=128, bwd_bv=128, bwd_bd=64, bwd_warps=8, bwd_stages=3),
             dict(bwd_bt=128, bwd_bv=256, bwd_bd=64, bwd_warps=8, bwd_stages=3),
             dict(bwd_bt=64, bwd_bv=128, bwd_bd=64, bwd_warps=4, bwd_stages=4),
             dict(bwd_bt=128, bwd_bv=128, bwd_bd=64, bwd_warps=4, bwd_stages=4),
             dict(bwd_bt=128, bwd_bv=128, bwd_bd=64, bwd_warps=8, bwd_stages=3, chunk_bytes=1 << 30)]
    for name, t, d, v, cap in shapes:
        h, w, y = _ce_inputs(t, d, v, dtype)
        base = ce_pick_config(t, d, v, dtype)

        def run(cfg, what):
            fwd, fwdbwd, _ = _ce_jits("pallas", cap, cfg)
            try:
                ms = device_ms(fwd if what == "fwd" else fwdbwd, h, w, y, runs=iters)
            except Exception as e:
                emit(name=f"cross_entropy_sweep.{name}", shape=[t, d, v], dtype=jnp.dtype(dtype).name,
                     impl="pallas", config=dataclasses.asdict(cfg), error=f"{type(e).__name__}: {e}"[:300])
                return float("inf")
            emit(name=f"cross_entropy_sweep.{name}", shape=[t, d, v], dtype=jnp.dtype(dtype).name,
                 impl="pallas", config=dataclasses.asdict(cfg), **{f"{what}_ms": round(ms, 4)})
            return ms

        cands = [dataclasses.replace(base, **c) for c in fwd_c]
        best = cands[min(((run(c, "fwd"), i) for i, c in enumerate(cands)))[1]]
        cands = [dataclasses.replace(best, **c) for c in bwd_c]
        best = cands[min(((run(c, "fwdbwd"), i) for i, c in enumerate(cands)))[1]]
        fwd, fwdbwd, _ = _ce_jits("pallas", cap, best)
        xf, xb, _ = _ce_jits("xla", cap)
        emit(name=f"cross_entropy_best.{name}", shape=[t, d, v], dtype=jnp.dtype(dtype).name, impl="pallas",
             key=["large" if t >= 1024 else "small", jnp.dtype(dtype).name, d], config=dataclasses.asdict(best),
             fwd_ms=round(device_ms(fwd, h, w, y, runs=iters), 4),
             fwdbwd_ms=round(device_ms(fwdbwd, h, w, y, runs=iters), 4),
             xla_fwd_ms=round(device_ms(xf, h, w, y, runs=iters), 4),
             xla_fwdbwd_ms=round(device_ms(xb, h, w, y, runs=iters), 4))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few shapes (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="sweep block-size configs, print the best per shape")
    ap.add_argument("--only", choices=["lora", "ce"], default=None, help="run one kernel family")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16, as in ANCHORS.md)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-memory", action="store_true", help="skip the per-impl memory subprocesses")
    ap.add_argument("--_memory-child", nargs=3, metavar=("IMPL", "SHAPE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory_child:
        _memory_child(*args._memory_child)
        return
    dtype = jnp.dtype(args.dtype)
    iters = max(20, args.iters)
    lora_shapes = LORA_QUICK if args.quick else LORA_SHAPES
    ce_shapes = CE_QUICK if args.quick else CE_SHAPES
    if args.sweep:
        if args.only in (None, "lora"):
            sweep_lora(lora_shapes, args.rank, dtype, iters)
        if args.only in (None, "ce"):
            sweep_ce(ce_shapes, dtype, iters)
        return
    if args.only in (None, "lora"):
        bench_lora(lora_shapes, args.rank, dtype, iters)
    if args.only in (None, "ce"):
        bench_ce(ce_shapes, dtype, iters, with_head=not args.quick)
        if not args.no_memory:
            memory_ce(CE_SHAPES[0][0], dtype.name,
                      impls=("pallas", "xla_naive") if args.quick else ("pallas", "xla", "xla_naive"))


if __name__ == "__main__":
    main()
