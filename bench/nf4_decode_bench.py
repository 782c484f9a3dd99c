#!/usr/bin/env python
"""Benchmark pallas_kernels.nf4_decode.nf4_decode_linear (decode matmul on one layer of a stacked NF4 weight,
dequantized in registers) against what the engine does without it, and against the bf16 decode kernel, at the
Qwen2-1.5B and Llama-3-8B projection shapes, M in {1, 16, 128}, bf16 rows, LoRA r=16.

Prints one JSON line per measurement: name ("nf4_decode"), model, proj, M, K, N, impl, ms (median),
weight_gbs (the layer's NF4 bytes, codes + 8-bit scales, per ms), rel_err_vs_dequant. Impls:
  pallas        nf4_decode_linear(x, q, layer) with the layer an int32 array (as the engine calls it)
  dequant       the engine's path without it: the layer sliced out of the stack, dequantized to bf16 by the
                Pallas dequantize kernel, multiplied by XLA, LoRA as two XLA GEMMs (pallas_kernels.nf4.qlora_linear)
  bf16_stacked  the same projection with a bf16 base through pallas_kernels.decode_linear.stacked_linear (the
                16-bit engine's decode GEMM; 4x the weight bytes)
Timing: bench/timing.device_ms, a stack of 4 layers, layer 3 read.

  python bench/nf4_decode_bench.py                      # all shapes, M in {1, 16, 128}
  python bench/nf4_decode_bench.py --sweep --m 16       # block_n / block_k2 / num_warps / lut per shape, then "best"
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.decode_linear_bench import SHAPES  # noqa: E402  (model, projection, K, N)
from bench.timing import device_ms, emit  # noqa: E402
from pallas_kernels.decode_linear import stacked_linear  # noqa: E402
from pallas_kernels.nf4 import qlora_linear  # noqa: E402
from pallas_kernels.nf4_decode import NF4DecodeConfig, nf4_decode_linear, pick_config  # noqa: E402
from pallas_kernels.nf4_format import quantize_nf4, stack_nf4  # noqa: E402

L_STACK, LAYER, RANK, SCALE = 4, 3, 16, 2.0
TIMING = dict(runs=10, target_ms=2.0, max_bytes=2 << 30)
SWEEP_TIMING = dict(runs=5, target_ms=1.0, max_bytes=1 << 30)


def _inputs(m, k, n, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4 + L_STACK)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    layers = [(jax.random.normal(ks[4 + i], (n, k), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
              for i in range(L_STACK)]
    q = stack_nf4([quantize_nf4(w) for w in layers])
    w16 = jnp.stack([w.T for w in layers])                                 # [L, K, N] bf16 (the 16-bit base)
    a = (jax.random.normal(ks[2], (k, RANK), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    b = jax.random.normal(ks[3], (RANK, n), jnp.bfloat16)
    return x, q, w16, a, b


def _fns(cfg: NF4DecodeConfig | None = None):
    def pallas(x, q, layer, a, b):
        return nf4_decode_linear(x, q, layer, lora_a=a, lora_b=b, lora_scale=SCALE, config=cfg, interpret=False)

    def dequant(x, q, a, b):
        return qlora_linear(x, jax.tree.map(lambda v: v[LAYER], q), a, b, SCALE, interpret=False)

    def bf16_stacked(x, w16, a, b):
        return stacked_linear(x, w16, jnp.int32(LAYER), lora_a=a, lora_b=b, lora_scale=SCALE, interpret=False)

    return {"pallas": (pallas, lambda x, q, w16, a, b: (x, q, jnp.int32(LAYER), a, b)),
            "dequant": (dequant, lambda x, q, w16, a, b: (x, q, a, b)),
            "bf16_stacked": (bf16_stacked, lambda x, q, w16, a, b: (x, w16, a, b))}


def _record(model, proj, m, k, n, impl, ms, cfg=None, **extra):
    nf4_bytes = k * n // 2 + k * n // 64  # codes + 8-bit block scales of one layer
    rec = dict(name="nf4_decode", model=model, proj=proj, M=m, K=k, N=n, L=L_STACK, r=RANK, impl=impl,
               ms=None if ms is None else round(ms, 5),
               weight_gbs=None if not ms else round(nf4_bytes / (ms * 1e-3) / 1e9, 1))
    if cfg is not None:
        rec["config"] = dataclasses.asdict(cfg)
    rec.update(extra)
    emit(**rec)


def _err(y, ref):
    return float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))


def run_compare(shapes, ms_, impls):
    for (model, proj, k, n), m in itertools.product(shapes, ms_):
        inputs = _inputs(m, k, n)
        ref = jax.jit(_fns()["dequant"][0])(*_fns()["dequant"][1](*inputs))
        for impl in impls:
            fn, make_args = _fns()[impl]
            args = make_args(*inputs)
            try:
                err = _err(jax.jit(fn)(*args), ref)
                ms = device_ms(fn, *args, **TIMING)
            except Exception as e:  # noqa: BLE001 - report and go on
                _record(model, proj, m, k, n, impl, None, error=f"{type(e).__name__}: {str(e)[:300]}")
                continue
            _record(model, proj, m, k, n, impl, ms, pick_config(m, k, n) if impl == "pallas" else None,
                    rel_err_vs_dequant=round(err, 6))


SWEEP = dict(block_n=[32, 64, 128], block_k2=[32, 64, 128], num_warps=[4, 8], lut=["gather", "select"])


def run_sweep(shapes, ms_, budget_s):
    t_end = time.time() + budget_s
    for (model, proj, k, n), m in itertools.product(shapes, ms_):
        inputs = _inputs(m, k, n)
        dq_fn, dq_args = _fns()["dequant"]
        dq_ms = device_ms(dq_fn, *dq_args(*inputs), **SWEEP_TIMING)
        _record(model, proj, m, k, n, "dequant", dq_ms)
        best = None
        for bn, bk2, nw, lut in itertools.product(*SWEEP.values()):
            if time.time() > t_end:
                emit(name="nf4_decode_sweep", note="time budget reached; later configs not timed")
                return
            cfg = NF4DecodeConfig(block_n=bn, block_k2=bk2, num_warps=nw, lut=lut)
            fn, make_args = _fns(cfg)["pallas"]
            try:
                ms = device_ms(fn, *make_args(*inputs), **SWEEP_TIMING)
            except Exception as e:  # noqa: BLE001 - e.g. out of registers / shared memory
                _record(model, proj, m, k, n, "pallas_sweep", None, cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            _record(model, proj, m, k, n, "pallas_sweep", ms, cfg, vs_dequant=round(dq_ms / ms, 3))
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is not None:
            _record(model, proj, m, k, n, "pallas_best", best[0], best[1], vs_dequant=round(dq_ms / best[0], 3))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--models", default="qwen2-1.5b,llama-3-8b")
    p.add_argument("--proj", default="", help="comma list of q_o,k_v,gate_up,down; empty = all")
    p.add_argument("--m", default="1,16,128")
    p.add_argument("--impls", default="pallas,dequant,bf16_stacked")
    p.add_argument("--budget-s", type=float, default=200.0, help="sweep: stop timing configs after this long")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("nf4_decode_bench: needs a GPU", file=sys.stderr)
        return 2
    projs = set(filter(None, args.proj.split(",")))
    shapes = [s for s in SHAPES if s[0] in args.models.split(",") and (not projs or s[1] in projs)]
    ms_ = [int(v) for v in args.m.split(",")]
    if args.sweep:
        run_sweep(shapes, ms_, args.budget_s)
    else:
        run_compare(shapes, ms_, args.impls.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
